"""The warm-start draft's data: prompts, the policy's features over its rollouts, the draft's
vocabulary and padded batches (engine/draft_warm_start.py samples the rollouts and trains).

A quarter of the prompts are the task's: the GRPO main job's (rollout/tasks.py: single-digit
addition under the chat template) or the user's own (--prompts FILE). The rest the policy writes
itself: its chat template up to a user turn, sampled until the turn ends, gives the requests the
policy expects to answer, as many and as varied as asked, with no dataset.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any, NamedTuple

import torch

ADDITION = "What is {a} + {b}? Reply with just the number."  # rollout/tasks.py addition_rows
TASK_SHARE = 0.25
EVAL_SHARE = 0.1
ROWS_PER_BATCH = 4  # more, smaller steps: measured better per minute than 16
_MARKER = "\x00hotswap-draft-prompt\x00"


def full_vocab_lse(features: torch.Tensor, head_weight: torch.Tensor, temperature: float,
                   chunk: int = 1024) -> torch.Tensor:
    """logsumexp over the full vocabulary of (W F) / T for features [N, H], in chunks."""
    w = head_weight.float()
    return torch.cat([(f.float() @ w.T / temperature).logsumexp(-1)
                      for f in features.split(chunk)]) if len(features) else features.new_zeros(0)


class Sample(NamedTuple):
    ids: torch.Tensor  # [L] prompt + response
    prompt_len: int
    features: torch.Tensor  # [L, H] F, after the final norm
    lse: torch.Tensor  # [L] full-vocab logsumexp of logits / T


def task_chats(count: int, seed: int, path: str | None = None) -> list[list[dict[str, str]]]:
    """`count` chats of the task: drawn from FILE's lines (JSON: {"messages": [...]} or
    {"prompt": "a user message"}), else single-digit additions as the GRPO main job asks them."""
    rng = random.Random(seed)
    if path is None:
        return [[{"role": "user", "content": ADDITION.format(a=rng.randint(1, 9),
                                                             b=rng.randint(1, 9))}]
                for _ in range(count)]
    chats = read_prompts(path)
    return [rng.choice(chats) for _ in range(count)]


def read_prompts(path: str) -> list[list[dict[str, str]]]:
    chats = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                chat = (row["messages"] if "messages" in row
                        else [{"role": "user", "content": row["prompt"]}])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: expected a JSON object with 'messages' (a "
                                 f"chat) or 'prompt' (a user message): {e}") from None
            chats.append(chat)
    if not chats:
        raise ValueError(f"{path}: no prompts")
    return chats


def user_turn(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The chat template around one user message: the ids before its text (any default system
    turn, the user header) and the ids that close it (the first is where a written prompt
    stops)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}], tokenize=False)
    if text.count(_MARKER) != 1:
        raise ValueError("the chat template does not render a user message verbatim")
    return tuple([int(t) for t in tokenizer(part, add_special_tokens=False)["input_ids"]]
                 for part in text.split(_MARKER))


def encode_chat(tokenizer: Any, chat: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


def eos_ids(model: Any) -> list[int]:
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return sorted(ids)


@torch.no_grad()
def policy_samples(model: Any, rollouts: list[tuple[list[int], list[int]]], temperature: float,
                   rows: int = 16) -> list[Sample]:
    """F and the full-vocab logsumexp of every sequence (in the rollouts' order), `rows`
    sequences of similar length per forward."""
    decoder, head = model.get_decoder(), model.get_output_embeddings().weight
    order = sorted(range(len(rollouts)), key=lambda i: len(rollouts[i][0]) + len(rollouts[i][1]))
    samples: dict[int, Sample] = {}
    for start in range(0, len(order), rows):
        group = order[start:start + rows]
        seqs = [rollouts[i][0] + rollouts[i][1] for i in group]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        feats = decoder(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        for row, i in enumerate(group):
            n = len(seqs[row])
            samples[i] = Sample(ids[row, :n], len(rollouts[i][0]), feats[row, :n].clone(),
                                full_vocab_lse(feats[row, :n], head, temperature))
    return [samples[i] for i in range(len(rollouts))]


def choose_token_map(rollouts: list[tuple[list[int], list[int]]], vocab_size: int, size: int,
                     eos: list[int]) -> list[int]:
    """The `size` tokens the policy emits most, with every EOS id; filled up from the prompts'
    tokens, then from the lowest ids (a BPE vocabulary's most common pieces come first)."""
    size = min(size, vocab_size)
    emitted = Counter(t for _, r in rollouts for t in r)
    prompted = Counter(t for p, _ in rollouts for t in p)
    chosen = list(dict.fromkeys(eos))
    for counts in (emitted, prompted):
        chosen += [t for t, _ in counts.most_common()]
    chosen = list(dict.fromkeys(chosen))[:size]
    if len(chosen) < size:
        taken = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in taken][:size - len(chosen)]
    return sorted(chosen)


def collate(samples: list[Sample], response_only: bool) -> dict[str, torch.Tensor]:
    """Right-padded batch. The loss covers positions whose next token is known; with
    `response_only`, those where the draft runs at decode time (x_s a generated token)."""
    width = max(len(s.ids) for s in samples)
    rows, hidden = len(samples), samples[0].features.shape[-1]
    batch = {"input_ids": torch.zeros(rows, width, dtype=torch.long),
             "features": torch.zeros(rows, width, hidden), "lse": torch.zeros(rows, width),
             "attention_mask": torch.zeros(rows, width, dtype=torch.long),
             "loss_mask": torch.zeros(rows, width, dtype=torch.bool)}
    for i, s in enumerate(samples):
        n = len(s.ids)
        batch["input_ids"][i, :n] = s.ids
        batch["features"][i, :n] = s.features
        batch["lse"][i, :n] = s.lse
        batch["attention_mask"][i, :n] = 1
        batch["loss_mask"][i, (s.prompt_len if response_only else 0):n - 1] = True
    return batch


def batches(samples: list[Sample], response_only: bool, rng: random.Random | None = None
            ) -> list[dict[str, torch.Tensor]]:
    order = sorted(samples, key=lambda s: len(s.ids))  # similar lengths: little padding
    groups = [order[i:i + ROWS_PER_BATCH] for i in range(0, len(order), ROWS_PER_BATCH)]
    if rng is not None:
        rng.shuffle(groups)
    return [collate(g, response_only) for g in groups]


class DistillationSet(NamedTuple):
    train: list[Sample]
    held_out: list[Sample]  # ~10% of the sequences
    token_map: list[int]
    rollouts: int
    generated: int  # sampled tokens
    coverage: float  # share of sampled tokens inside token_map


def distillation_set(model: Any, rollouts: list[tuple[list[int], list[int]]],
                     temperature: float, vocab: int, seed: int) -> DistillationSet:
    """The policy's features over its rollouts, the draft vocabulary, 10% held out."""
    data = policy_samples(model, rollouts, temperature)
    token_map = choose_token_map(rollouts, model.config.vocab_size, vocab, eos_ids(model))
    kept = set(token_map)
    generated = [t for _, r in rollouts for t in r]
    held = max(1, round(len(data) * EVAL_SHARE))
    order = random.Random(seed).sample(range(len(data)), len(data))
    held_out = [data[i] for i in order[:held]]
    train = [data[i] for i in order[held:]] or held_out
    return DistillationSet(train, held_out, token_map, len(rollouts), len(generated),
                           sum(t in kept for t in generated) / max(len(generated), 1))

"""The warm-start draft's data: prompts, the policy's features over its rollouts, the draft's
vocabulary and padded batches (engine/draft_warm_start.py samples the rollouts and trains).

Prompts follow the GRPO main job (rollout/tasks.py: single-digit addition under the chat
template) with a quarter of generic chat prompts, whose longer answers carry most tokens.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, NamedTuple

import torch

ADDITION = "What is {a} + {b}? Reply with just the number."  # rollout/tasks.py addition_rows
CHAT_PROMPTS = (
    "Write a short poem about the sea.", "Explain what a prime number is.",
    "Give me three tips for learning to cook.", "What is the capital of France?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "How do I reverse a list in Python?", "Why is the sky blue?",
    "Tell me a joke about computers.", "What are the benefits of regular exercise?",
    "Describe a cat to someone who has never seen one.", "What is 12 times 7?",
    "Translate 'good morning' into Spanish and French.", "List four colours of the rainbow.",
    "Write a haiku about autumn.", "What does a CPU do?", "How many days are in a leap year?",
)
CHAT_SHARE = 0.25
EVAL_SHARE = 0.1
ROWS_PER_BATCH = 4  # more, smaller steps: measured better per minute than 16


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


def prompt_chats(count: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        if rng.random() < CHAT_SHARE:
            content = rng.choice(CHAT_PROMPTS)
        else:
            content = ADDITION.format(a=rng.randint(1, 9), b=rng.randint(1, 9))
        chats.append([{"role": "user", "content": content}])
    return chats


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

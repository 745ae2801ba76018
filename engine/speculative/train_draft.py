"""An EAGLE-style learned draft: its reference module, its online trainer and its checkpoint.

The draft is one Llama decoder layer over the policy's own features. For tokens x_0..x_{n-1}
with F_s the policy's last hidden state after its final norm (F_{-1} = 0):
    z_s = fc([E[x_s], F_{s-1}]),  g_s = layer(z_s) (causal, RoPE at s),  G_s = norm(g_s),
    q_s = softmax(G_s @ W[token_map].T / T)
so (F_{s-1}, x_s) -> G_s predicts both F_s and the policy's next-token distribution p_s. E and W
are the policy's (shared, never trained here). At inference step j > 1 of a chain consumes the
draft's own G instead of F; `DraftNet.forward_levels` builds exactly that ("level" j) for every
start position at once, which both trains the chain (training-time test) and measures it.

    python -m hotswap.engine.speculative.train_draft MODEL_PATH [--out DIR] [--minutes M] ...
distils a draft from the policy's own generations (engine/draft_warm_start.py).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hotswap.engine.config.model import ModelConfig
from hotswap.engine.layers.rotary import rope_inv_freq
from hotswap.engine.models.draft import (
    WEIGHTS_FILE,
    as_model_config,
    load_draft_config,
    save_draft,
)

__all__ = ["DraftNet", "DraftTrainer", "EvalResult", "LossConfig", "evaluate", "load_draft",
           "load_draft_config", "policy_weights_sha", "save_draft"]


def policy_weights_sha(policy: nn.Module) -> str:
    """A short hash of the policy's head and final norm: which policy a draft was trained on."""
    digest = hashlib.sha256()
    for t in (policy.get_output_embeddings().weight, policy.get_decoder().norm.weight):
        digest.update(t.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class SequenceLayout(NamedTuple):
    """Where each of [B, L] tokens sits: its position, the index of the token before it in its
    sequence (-1 where the sequence starts), the tokens of the row that precede it there (itself
    included) and whether it is a real token. A row holds one sequence, several packed back to
    back (a sequence starts where the position is 0), or a GRPO unit: a prompt (segment 0)
    that each of the other segments continues, so the prompt is computed once."""

    positions: torch.Tensor
    previous: torch.Tensor  # [B, L] long
    ancestors: torch.Tensor  # [B, L, L] bool: [t, u] u is t or comes before it in its sequence
    valid: torch.Tensor


def sequence_layout(input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                    attention_mask: torch.Tensor | None,
                    segments: torch.Tensor | None = None) -> SequenceLayout:
    """`segments` ([B, L], 0: a shared prompt, k > 0: its k-th continuation, -1: padding) makes
    the rows GRPO units; without it the sequences are told apart by their positions."""
    valid = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
             else attention_mask.bool())
    if position_ids is None:
        position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0)
    t = torch.arange(input_ids.shape[1], device=input_ids.device)
    previous = (t - 1).expand_as(input_ids).clone()
    if segments is None:
        sequence = (position_ids == 0).long().cumsum(-1)
        previous[position_ids == 0] = -1
        ancestors = sequence[:, :, None] == sequence[:, None, :]
    else:
        starts = (segments > 0) & (segments != F.pad(segments, (1, 0), value=-1)[:, :-1])
        last_prompt = torch.where(segments == 0, t, -1).amax(-1, keepdim=True)
        previous = torch.where(starts, last_prompt.expand_as(previous), previous)
        previous[:, 0] = -1
        ancestors = ((segments[:, :, None] == segments[:, None, :])
                     | ((segments[:, None, :] == 0) & (segments[:, :, None] > 0)))
    ancestors = ancestors & (t[None, :] <= t[:, None]) & valid[:, None, :]
    return SequenceLayout(position_ids, previous, ancestors, valid)


def shift_features(features: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """F_{s-1} at s (the feature of the token before it in its sequence); zeros where a
    sequence starts."""
    index = layout.previous.clamp(min=0).unsqueeze(-1).expand_as(features)
    shifted = features.gather(1, index)
    return shifted * (layout.previous >= 0).unsqueeze(-1).to(shifted.dtype)


def back(layout: SequenceLayout, steps: int) -> torch.Tensor:
    """[B, L] the index `steps` tokens before each token in its sequence (-1: before its start)."""
    index = torch.arange(layout.previous.shape[1], device=layout.previous.device)
    index = index.expand_as(layout.previous)
    for _ in range(steps):
        index = torch.where(index >= 0, layout.previous.gather(1, index.clamp(min=0)), index)
    return index


def level_mask(layout: SequenceLayout, level: int) -> torch.Tensor:
    """Which keys a level-`level` query sees, bool [B, 1, L, level * L] over the keys of levels
    1..level side by side. The chain ending at t started `level - 1` tokens before it, at s: it
    sees level 1 (teacher-forced, the verified tokens) up to s, and level i's key i - 1 tokens
    after s, for i >= 2."""
    length = layout.positions.shape[1]
    t = torch.arange(length, device=layout.positions.device)
    start = back(layout, level - 1)
    first = layout.ancestors.gather(1, start.clamp(min=0).unsqueeze(-1).expand(-1, -1, length))
    blocks = [first & (start >= 0).unsqueeze(-1)]
    for i in range(2, level + 1):
        key = back(layout, level - i)
        blocks.append((key[:, :, None] == t[None, None, :]) & (key >= 0).unsqueeze(-1))
    if level == 1:  # a padded query sees itself: no row is empty
        blocks[0] = blocks[0] | torch.eye(length, dtype=torch.bool, device=t.device)
    return torch.cat(blocks, dim=-1).unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, half-rotation layout (HF Llama): x [B, heads, L, D], cos/sin [B, 1, L, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DraftAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=False)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                past: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attend over the keys of earlier levels (`past`) and this level's own; returns the
        output and this level's (k, v)."""
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, *rope), rotate(k, *rope)
        keys = torch.cat([pk for pk, _ in past] + [k], dim=2)
        values = torch.cat([pv for _, pv in past] + [v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1)), (k, v)


class DraftMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """One pre-norm Llama decoder layer (no q/k/v bias, no q/k norm)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                past: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attn, kv = self.self_attn(self.input_layernorm(x), rope, past, mask)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class DraftOutput(NamedTuple):
    features: torch.Tensor  # G [B, L, H], float32
    logits: torch.Tensor  # [B, L, Vd], float32, before the temperature


class DraftNet(nn.Module):
    """The draft over whole sequences (reference for the engine's paged version, and training).
    Parameters are named so that "draft." + name is the checkpoint name."""

    def __init__(self, policy_config: Any, token_map: list[int] | torch.Tensor):
        super().__init__()
        self.config = cfg = as_model_config(policy_config)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DraftLayer(cfg)
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        token_map = torch.as_tensor(token_map, dtype=torch.int64)
        if token_map.numel() == 0 or bool((token_map[1:] <= token_map[:-1]).any()):
            raise ValueError("token_map must be a non-empty, strictly increasing list of ids")
        if int(token_map[-1]) >= cfg.vocab_size or int(token_map[0]) < 0:
            raise ValueError(f"token_map holds ids outside the vocabulary [0, {cfg.vocab_size})")
        self.register_buffer("token_map", token_map, persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta,
                                                       cfg.rope_scaling), persistent=False)

    @torch.no_grad()
    def init_from_policy(self, policy: nn.Module) -> DraftNet:
        """The policy's last decoder layer and final norm, z = E[x] + F_{s-1}: the draft is then
        that layer over the policy's own inputs (a reference for the engine). As a start for
        training it measured worse than the default random init (0.28 against 0.31 one-step
        acceptance after 2 minutes on SmolLM2-135M), so DraftTrainer does not use it."""
        decoder = policy.get_decoder()
        last = decoder.layers[-1]
        own = dict(self.layer.named_parameters())
        for name, p in last.named_parameters():
            if name in own and own[name].shape == p.shape:
                own[name].copy_(p.float())
        self.norm.weight.copy_(decoder.norm.weight.float())
        h = self.config.hidden_size
        eye = torch.eye(h)
        self.fc.weight.copy_(torch.cat([eye, eye], dim=1))
        return self

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, head_weight: torch.Tensor,
                position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, *,
                embed_weight: torch.Tensor | None = None) -> DraftOutput:
        """Teacher-forced: position s consumes (F_{s-1}, x_s). `embed_weight` defaults to
        `head_weight` (tied embeddings)."""
        return self.forward_levels(input_ids, features, head_weight, 1, position_ids,
                                   attention_mask, embed_weight=embed_weight)[0]

    def forward_levels(self, input_ids: torch.Tensor, features: torch.Tensor,
                       head_weight: torch.Tensor, levels: int,
                       position_ids: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, *,
                       embed_weight: torch.Tensor | None = None,
                       with_logits: bool = True,
                       segments: torch.Tensor | None = None) -> list[DraftOutput]:
        """Levels 1..`levels`: level j at token t is step j of the chain that started j - 1
        tokens before it in its sequence (its input feature is level j-1's G at the token before
        t; level 0 is F). A level-j output at t is meaningful only where the position is >= j - 1
        (`chain_valid`). `segments`: rows that are GRPO units (`sequence_layout`). Without
        `with_logits` the logits are left empty (the caller takes `head_logits` where needed)."""
        layout = sequence_layout(input_ids, position_ids, attention_mask, segments)
        embed = head_weight if embed_weight is None else embed_weight
        emb = F.embedding(input_ids, embed).float()
        freqs = layout.positions.unsqueeze(-1).float() * self.inv_freq
        rope = (freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1))
        head = self.map_head(head_weight) if with_logits else None
        prev, past, outs = features.float(), [], []
        for level in range(1, levels + 1):
            z = self.fc(torch.cat([emb, shift_features(prev, layout)], dim=-1))
            g, kv = self.layer(z, rope, past, level_mask(layout, level))
            past.append(kv)
            prev = self.norm(g)
            outs.append(DraftOutput(prev, prev @ head.T if head is not None else prev[..., :0]))
        return outs

    def map_head(self, head_weight: torch.Tensor) -> torch.Tensor:
        """The policy head's rows of the draft vocabulary, float32 [Vd, H]."""
        return head_weight[self.token_map].float()

    def named_tensors(self, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
        return [("draft." + n, p.detach().to(dtype).clone()) for n, p in self.named_parameters()]


def chain_valid(layout: SequenceLayout, level: int) -> torch.Tensor:
    """[B, L] bool: the level-`level` chain ending here started inside this sequence."""
    return layout.valid & (layout.positions >= level - 1)


def target_logprobs(features: torch.Tensor, head_weight: torch.Tensor, token_map: torch.Tensor,
                    temperature: float, lse: torch.Tensor | None = None) -> torch.Tensor:
    """log p over token_map for features [N, H]: exact with `lse` (the full-vocab logsumexp of
    logits / T), else renormalised over token_map (cheap: the map is most of p's mass)."""
    logits = features.float() @ head_weight[token_map].float().T / temperature
    if lse is None:
        return logits.log_softmax(-1)
    return logits - lse.unsqueeze(-1)


def acceptance(p_log: torch.Tensor, q_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """sum_v min(p(v), q(v)) per row: the chance a token drawn from q passes min(1, p/q)."""
    q = (q_logits / temperature).softmax(-1)
    return torch.minimum(p_log.exp(), q).sum(-1)


def soft_cross_entropy(p_log: torch.Tensor, q_logits: torch.Tensor,
                       temperature: float) -> torch.Tensor:
    return -(p_log.exp() * (q_logits / temperature).log_softmax(-1)).sum(-1)


@dataclass(frozen=True)
class LossConfig:
    levels: int = 2  # 2: also train the chained step (training-time test)
    reg_weight: float = 0.2  # smooth-L1(G, F) next to the soft cross-entropy
    max_positions: int = 2048  # loss positions per level and step (a random subset beyond)
    temperature: float = 1.0


def draft_loss(net: DraftNet, batch: dict[str, torch.Tensor], head_weight: torch.Tensor,
               embed_weight: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, one-step acceptance estimate) over `batch`: input_ids, features, loss_mask and
    optionally position_ids, attention_mask, segments (`sequence_layout`), lse ([B, L]) or
    policy_logits ([B, L, V])."""
    ids, feats, segments = batch["input_ids"], batch["features"], batch.get("segments")
    layout = sequence_layout(ids, batch.get("position_ids"), batch.get("attention_mask"),
                             segments)
    outs = net.forward_levels(ids, feats, head_weight, cfg.levels, layout.positions,
                              layout.valid, embed_weight=embed_weight, with_logits=False,
                              segments=segments)
    head = net.map_head(head_weight)
    loss_mask = batch["loss_mask"].bool() & layout.valid
    total, accept = feats.new_zeros(()).float(), feats.new_zeros(()).float()
    for level, out in enumerate(outs, start=1):
        where = (loss_mask & chain_valid(layout, level)).nonzero(as_tuple=True)
        if len(where[0]) > cfg.max_positions:
            keep = torch.randperm(len(where[0]))[:cfg.max_positions]
            where = (where[0][keep], where[1][keep])
        if len(where[0]) == 0:
            continue
        p_log = policy_target(batch, where, head_weight, net.token_map, cfg.temperature)
        q_logits = out.features[where] @ head.T
        ce = soft_cross_entropy(p_log, q_logits, cfg.temperature).mean()
        reg = F.smooth_l1_loss(out.features[where], feats[where].float())
        total = total + ce + cfg.reg_weight * reg
        if level == 1:
            accept = acceptance(p_log, q_logits.detach(), cfg.temperature).mean()
    return total, accept


def policy_target(batch: dict[str, torch.Tensor], where: tuple[torch.Tensor, torch.Tensor],
                  head_weight: torch.Tensor, token_map: torch.Tensor,
                  temperature: float) -> torch.Tensor:
    logits = batch.get("policy_logits")
    if logits is not None:
        return (logits[where].float() / temperature).log_softmax(-1)[:, token_map]
    lse = batch.get("lse")
    return target_logprobs(batch["features"][where], head_weight, token_map, temperature,
                           None if lse is None else lse[where])


class DraftTrainer:
    """Trains a draft online beside the policy: `step` takes the hidden states (F, after the final
    norm) the policy's trainer already computed, and one AdamW step is taken on them."""

    def __init__(self, policy_model: nn.Module, token_map: list[int] | torch.Tensor,
                 lr: float = 3e-4, temperature: float = 1.0, *, net: DraftNet | None = None,
                 levels: int = 2, reg_weight: float = 0.2, max_positions: int = 1024):
        embed = policy_model.get_input_embeddings().weight
        head = policy_model.get_output_embeddings().weight
        self.embed_weight, self.head_weight = embed.detach(), head.detach()
        self.dtype = head.dtype
        self.net = net or DraftNet(policy_model.config, token_map)
        self.loss_cfg = LossConfig(levels, reg_weight, max_positions, temperature)
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=lr, weight_decay=0.0)
        self.trained_tokens = 0

    def step(self, input_ids: torch.Tensor, features: torch.Tensor,
             policy_logits_or_logprobs: torch.Tensor | None = None,
             loss_mask: torch.Tensor | None = None, *, position_ids: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None,
             lse: torch.Tensor | None = None,
             segments: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step. Without policy logits the target p is the policy's distribution
        over token_map, renormalised there unless `lse` (full-vocab logsumexp of logits / T)
        is given. Inputs [B, L] (features [B, L, H]) are detached; `segments` as
        `sequence_layout`'s (rows that are GRPO units)."""
        start = time.perf_counter()
        if loss_mask is None:
            loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
        batch = {"input_ids": input_ids, "features": features.detach(), "loss_mask": loss_mask,
                 "position_ids": position_ids, "attention_mask": attention_mask, "lse": lse,
                 "segments": segments,
                 "policy_logits": (None if policy_logits_or_logprobs is None
                                   else policy_logits_or_logprobs.detach())}
        batch = {k: v for k, v in batch.items() if v is not None}
        self.net.train()
        loss, accept = draft_loss(self.net, batch, self.head_weight, self.embed_weight,
                                  self.loss_cfg)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
        self.optimizer.step()
        self.trained_tokens += int(loss_mask.sum())
        return {"loss": float(loss.detach()), "acceptance_estimate": float(accept),
                "seconds": time.perf_counter() - start}

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint names and tensors, in the policy's dtype, for a weight push."""
        return self.net.named_tensors(self.dtype)


class EvalResult(NamedTuple):
    acceptance: float  # mean sum_v min(p, q) of one drafted token (level 1)
    chained_length: float  # expected accepted tokens of a k-token chain
    level_acceptance: list[float]  # mean acceptance of chain step j, j = 1..k
    positions: int  # chain starts measured


@torch.no_grad()
def evaluate(net: DraftNet, batches: list[dict[str, torch.Tensor]], head_weight: torch.Tensor,
             embed_weight: torch.Tensor | None = None, temperature: float = 1.0,
             k: int = 4, proposal_scale: float = 1.0) -> EvalResult:
    """Acceptance on held-out batches (keys as `draft_loss`; give `lse` or `policy_logits` for
    the exact full-vocab p). The chain starting at s drafts k tokens; step j (j >= 2) consumes
    the draft's own G of step j-1 and the TEACHER token (the sequence's actual next token) as
    its x̂. Its expected accepted length is sum_j prod_{i <= j} a_i, a_i = sum min(p, q) at
    step i, counted over starts whose k positions all lie in the loss mask. p is the policy's
    at `temperature`, q the draft's at temperature * proposal_scale (what it samples from)."""
    net.eval()
    level_sums, chain_sum, count = [0.0] * k, 0.0, 0
    for batch in batches:
        ids = batch["input_ids"]
        layout = sequence_layout(ids, batch.get("position_ids"), batch.get("attention_mask"))
        outs = net.forward_levels(ids, batch["features"], head_weight, k, layout.positions,
                                  layout.valid, embed_weight=embed_weight)
        mask = batch["loss_mask"].bool() & layout.valid
        rows, length = ids.shape
        accept = torch.zeros(k, rows, length)
        for j, out in enumerate(outs):
            where = (mask & chain_valid(layout, j + 1)).nonzero(as_tuple=True)
            p_log = policy_target(batch, where, head_weight, net.token_map, temperature)
            accept[j][where] = acceptance(p_log, out.logits[where],
                                          temperature * proposal_scale)
        # Chain starts s: a_j sits at s + j - 1, all k inside the mask and the same sequence.
        starts = length - k + 1
        if starts <= 0:
            continue
        ok = torch.ones(rows, starts, dtype=torch.bool)
        expected, run = torch.zeros(rows, starts), torch.ones(rows, starts)
        for j in range(k):
            ok &= mask[:, j:j + starts] & chain_valid(layout, j + 1)[:, j:j + starts]
            ok &= back(layout, j)[:, j:j + starts] == torch.arange(starts)
            run = run * accept[j, :, j:j + starts]
            expected += run
        count += int(ok.sum())
        chain_sum += float(expected[ok].sum())
        for j in range(k):
            level_sums[j] += float(accept[j, :, j:j + starts][ok].sum())
    n = max(count, 1)
    levels = [s / n for s in level_sums]
    return EvalResult(levels[0], chain_sum / n, levels, count)


# The draft's proposal temperature, as a share of the request's, that calibrate_proposal tries.
PROPOSAL_SCALES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def calibrate_proposal(net: DraftNet, batches: list[dict[str, torch.Tensor]],
                       head_weight: torch.Tensor, embed_weight: torch.Tensor | None = None,
                       temperature: float = 1.0, k: int = 4) -> tuple[float, EvalResult]:
    """The scale of PROPOSAL_SCALES whose proposal q (the draft's logits at temperature *
    scale) keeps the most tokens of a k-chain on `batches`, and its result. Trained by soft
    cross-entropy, a draft that cannot tell where p peaks spreads q wider than p, so a sharper
    q overlaps p more: on unseen prompts the warm start's SmolLM2 draft kept sum min(p, q)
    0.299 at 1.0 and 0.325 at 0.8 (docs/performance.md). Any q stays exact: the verifier's
    min(1, p/q) uses the q the row drew from."""
    results = {s: evaluate(net, batches, head_weight, embed_weight, temperature, k, s)
               for s in PROPOSAL_SCALES}
    best = max(PROPOSAL_SCALES, key=lambda s: results[s].chained_length)
    return best, results[best]


def load_draft(directory: str, policy_config: Any) -> tuple[DraftNet, dict[str, Any]]:
    """The checked DraftNet (float32) of DIR, and its config."""
    from safetensors.torch import load_file

    config = load_draft_config(directory, policy_config)
    net = DraftNet(policy_config, config["token_map"])
    state = load_file(os.path.join(directory, WEIGHTS_FILE))
    net.load_state_dict({n.removeprefix("draft."): t.float() for n, t in state.items()})
    return net, config


if __name__ == "__main__":
    import runpy

    # The warm start samples with the Engine, which sits above speculative/ in the import order
    # (tests/test_layout.py): it lives in engine/draft_warm_start.py and is handed over by name.
    runpy.run_module("hotswap.engine.draft_warm_start", run_name="__main__", alter_sys=True)

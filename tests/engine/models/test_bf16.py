"""bf16 on CPU: dtype="auto", logprobs against HF bf16 and fp32, the float32 lm_head, packing."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from fixtures import Seq, random_ids, run_step

from hotswap.engine.config import EngineConfig, ModelConfig
from hotswap.engine.cpu_features import auto_dtype
from hotswap.engine.executor.model_runner import ModelRunner
from hotswap.engine.layers.linear import blocks_by_default, can_block, can_pack
from hotswap.engine.layers.norm import rms_norm
from hotswap.engine.models.llama import SMALL_HEAD_ROWS, SPLIT_HEAD_ROWS, invariant_logits


@pytest.mark.parametrize("device,ckpt,flags,expected", [
    ("cpu", "bfloat16", {"avx512f", "avx512_bf16"}, "bfloat16"),
    ("cpu", "bfloat16", {"amx_bf16", "amx_tile"}, "bfloat16"),
    ("cpu", "bfloat16", {"avx2", "fma"}, "float32"),
    ("cpu", "float16", {"avx512_bf16"}, "float32"),
    ("cpu", "float32", {"avx512_bf16"}, "float32"),
    ("cpu", "int8", {"avx512_bf16"}, "float32"),
    ("cuda", "bfloat16", set(), "bfloat16"),
    ("cuda", "float32", set(), "float32"),
])
def test_auto_dtype_takes_the_checkpoint_dtype_only_where_it_is_fast(device, ckpt, flags,
                                                                     expected):
    dtype, why = auto_dtype(device, ckpt, flags)
    assert dtype == expected
    assert why  # the reason is logged


def test_auto_is_the_default_and_logs_its_choice(tiny_llama_path, caplog):
    mcfg = ModelConfig.from_path(tiny_llama_path)
    assert EngineConfig(model_path=tiny_llama_path).dtype == "auto"
    with caplog.at_level(logging.INFO, logger="hotswap.engine.config"):
        cfg = EngineConfig(model_path=tiny_llama_path, device="cpu").resolve(mcfg)
    assert cfg.dtype == "float32"  # the tiny checkpoint is float32
    assert "dtype='auto' -> float32" in caplog.text


def _runner(path: str, dtype: str = "bfloat16", **kw) -> ModelRunner:
    mcfg = ModelConfig.from_path(path)
    cfg = EngineConfig(model_path=path, dtype=dtype, max_total_tokens=4096,
                       max_running_requests=8, attention_backend="torch", **kw).resolve(mcfg)
    return ModelRunner(cfg, mcfg)


def _hf_logprobs(path: str, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _prefill_then_decode(runner: ModelRunner, ids: list[int], prefill: int) -> torch.Tensor:
    seq = Seq(runner, ids)
    (first,) = run_step(runner, [(seq, prefill)])
    rest = [run_step(runner, [(seq, 1)])[0] for _ in range(len(ids) - prefill)]
    return torch.cat([first, *rest]).log_softmax(-1)


def test_bf16_logprobs_match_hf_bf16_and_fp32(tiny_model_path):
    """Prefill and decode in bf16 stay within bf16 rounding of HF (HF bf16 itself is 0.02-0.05
    away from HF fp32 on these models)."""
    ids = random_ids(36, seed=5)
    ours = _prefill_then_decode(_runner(tiny_model_path), ids, 24)
    for dtype in (torch.bfloat16, torch.float32):
        diff = (ours - _hf_logprobs(tiny_model_path, ids, dtype)).abs()
        assert diff.max().item() < 0.1, dtype
        assert diff.mean().item() < 0.015, dtype


def test_fp32_lm_head_gives_float32_logits_in_a_bf16_model(tiny_llama_path):
    """With the float32 head (the default) the logits are not rounded to bf16; with it off they
    are, and they land further from HF fp32."""
    ids = random_ids(20, seed=6)
    on, off = _runner(tiny_llama_path), _runner(tiny_llama_path, fp32_lm_head=False)
    (l_on,) = run_step(on, [(Seq(on, ids), len(ids))])
    (l_off,) = run_step(off, [(Seq(off, ids), len(ids))])
    assert torch.equal(l_off, l_off.bfloat16().float())
    assert not torch.equal(l_on, l_on.bfloat16().float())
    assert on.model.fp32_head is not None and off.model.fp32_head is None


def test_fp32_head_follows_weight_changes(tiny_model_path):
    """The float32 copies are a cache of the bf16 weights: a write drops them and the next
    forward rebuilds them from the new values (a stale head would give the old logprobs)."""
    runner = _runner(tiny_model_path)
    ids = random_ids(12, seed=7)
    before = _hf_logprobs(tiny_model_path, ids, torch.bfloat16)
    with torch.no_grad():
        runner.model.lm_head_weight.mul_(2.0)
    runner.weights_changed()
    assert runner.model.fp32_head is None
    (ours,) = run_step(runner, [(Seq(runner, ids), len(ids))])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_path,
                                                           dtype=torch.bfloat16).eval()
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(2.0)
        ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    ours = ours.log_softmax(-1)
    assert (ours - ref).abs().max().item() < 0.15
    assert (ours - before).abs().max().item() > 0.5


@pytest.mark.skipif(not (can_pack(torch.zeros(2, 2, dtype=torch.bfloat16))
                         or can_block(torch.zeros(32, 2, dtype=torch.bfloat16))),
                    reason="neither oneDNN's bf16 matmul nor the CPU kernels here")
def test_bf16_matmul_weights_are_packed(tiny_llama_path):
    """Every bf16 matmul weight holds the copy its path multiplies: the blocked layout where
    the default takes the blocked matmul, else oneDNN's; the float32 head likewise."""
    runner = _runner(tiny_llama_path)
    layer = runner.model.model.layers[0]
    down, qkv = layer.mlp.down_proj, layer.self_attn.qkv_proj
    if blocks_by_default(down.weight):
        assert down.blocked is not None and down.packed is None
        assert qkv.blocked.dtype == torch.bfloat16
    else:
        assert down.packed is not None and down.blocked is None
        assert qkv.packed.dtype == torch.bfloat16
    head = runner.model.fp32_head  # blocked, float32 copy packed, or (AMX) bf16 packed
    assert head.split is not None or head.packed is not None or head.amx is not None
    if head.split is not None:
        assert head.split.blocked.dtype == torch.bfloat16
        assert head.wide.blocked.dtype == torch.float32
        # The two halves of x on the bf16 weights give the float32 copy's logits to ~2^-17.
        hidden = torch.randn(12, runner.model_config.hidden_size).bfloat16()
        few = invariant_logits(hidden, head.split, 1e-5)
        many = invariant_logits(hidden, head.wide, 1e-5)
        assert few.shape == many.shape == (12, runner.model_config.vocab_size)
        assert (few - many).abs().max().item() < 1e-4 * many.abs().max().item()
    assert runner.model.lm_head_packed is None  # the bf16 lm_head is never multiplied then


def test_fp32_head_is_float32_accurate_at_every_row_count(tiny_llama_path):
    """The float32 head of a bf16 model changes kernels with the row count (models/llama.py:
    small_linear, the split, the float32 copy; on AMX head_logits): at each count every row's
    logits equal the float64 product of its float32-normed state and the bf16 weights."""
    runner = _runner(tiny_llama_path)
    model = runner.model
    hidden = torch.randn(2 * SPLIT_HEAD_ROWS + 1, runner.model_config.hidden_size).bfloat16()
    norm = model.model.norm.weight.float()
    x = rms_norm(hidden.float(), norm, model.cfg.rms_norm_eps).double()
    want = x @ model.lm_head_weight.double().T
    for rows in sorted({1, SMALL_HEAD_ROWS, SMALL_HEAD_ROWS + 1, SPLIT_HEAD_ROWS,
                        SPLIT_HEAD_ROWS + 1, len(hidden)}):
        got = model.logits(hidden[:rows])
        assert got.dtype == torch.float32 and got.shape == want[:rows].shape
        assert (got.double() - want[:rows]).abs().max().item() < 1e-4, rows

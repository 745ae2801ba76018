"""The runtime's logits equal HF transformers' forward: prefill, extend, decode, mixed batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from fixtures import Seq, random_ids, run_step

from hotswap.engine.attention.torch_backend import AMX_EXTEND_MAX_KEYS
from hotswap.engine.config import EngineConfig, ModelConfig
from hotswap.engine.core.forward_batch import ForwardBatch, ForwardMode, flat_ranges
from hotswap.engine.executor.model_runner import ModelRunner
from hotswap.engine.layers import cpu_kernels
from hotswap.engine.layers.linear import can_pack

TOL = 1e-4


def make_runner(path: str, page_size: int = 1, backend: str = "torch") -> ModelRunner:
    mcfg = ModelConfig.from_path(path)
    cfg = EngineConfig(model_path=path, dtype="float32", max_total_tokens=4096, page_size=page_size,
                       max_running_requests=16, attention_backend=backend).resolve(mcfg)
    return ModelRunner(cfg, mcfg)


def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    model = _hf_model(path)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


_HF_CACHE: dict[str, transformers.PreTrainedModel] = {}


def _hf_model(path: str) -> transformers.PreTrainedModel:
    if path not in _HF_CACHE:
        _HF_CACHE[path] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32).eval()
    return _HF_CACHE[path]


def test_prefill_matches_hf(tiny_model_path):
    runner = make_runner(tiny_model_path)
    ids = random_ids(37, seed=1)
    (ours,) = run_step(runner, [(Seq(runner, ids), len(ids))])
    ref = hf_logits(tiny_model_path, ids)
    assert (ours - ref).abs().max().item() < TOL


@pytest.mark.parametrize("split", [1, 7, 16, 29])
def test_extend_over_cached_prefix_matches_hf(tiny_model_path, split):
    runner = make_runner(tiny_model_path)
    ids = random_ids(30, seed=2)
    seq = Seq(runner, ids)
    run_step(runner, [(seq, split)])
    (ours,) = run_step(runner, [(seq, len(ids) - split)])
    ref = hf_logits(tiny_model_path, ids)[split:]
    assert (ours - ref).abs().max().item() < TOL


def test_decode_steps_match_hf(tiny_model_path):
    runner = make_runner(tiny_model_path)
    ids = random_ids(12 + 16, seed=3)
    seq = Seq(runner, ids)
    run_step(runner, [(seq, 12)])
    ours = torch.cat([run_step(runner, [(seq, 1)])[0] for _ in range(16)])
    ref = hf_logits(tiny_model_path, ids)[12:]
    assert (ours - ref).abs().max().item() < TOL


@pytest.mark.parametrize("page_size", [1, 4])
def test_mixed_batch_matches_hf(tiny_model_path, page_size):
    runner = make_runner(tiny_model_path, page_size=page_size)
    seqs = [Seq(runner, random_ids(n, seed=10 + n)) for n in (9, 24, 40, 5)]
    run_step(runner, [(seqs[0], 6), (seqs[1], 23), (seqs[2], 13)])
    # row 0 extends its prefix, row 1 decodes, row 2 takes another chunk, row 3 starts fresh
    outs = run_step(runner, [(seqs[0], 3), (seqs[1], 1), (seqs[2], 20), (seqs[3], 5)])
    spans = [(6, 9), (23, 24), (13, 33), (0, 5)]
    for seq, out, (a, b) in zip(seqs, outs, spans):
        ref = hf_logits(tiny_model_path, seq.tokens[:b])[a:b]
        assert (out - ref).abs().max().item() < TOL


def test_decode_batch_of_different_lengths(tiny_llama_path):
    runner = make_runner(tiny_llama_path)
    seqs = [Seq(runner, random_ids(n + 8, seed=n)) for n in (3, 17, 30, 64)]
    run_step(runner, [(s, len(s.tokens) - 8) for s in seqs])
    outs = [run_step(runner, [(s, 1) for s in seqs]) for _ in range(8)]
    for i, seq in enumerate(seqs):
        ours = torch.cat([step[i] for step in outs])
        ref = hf_logits(tiny_llama_path, seq.tokens)[-8:]
        assert (ours - ref).abs().max().item() < TOL


def test_decode_step_takes_the_general_paths_metadata_without_building_it(tiny_llama_path):
    """A decode step (a token a row) skips the per-row index arithmetic: its positions and the
    fused kernel's inputs equal what the general extend-row path builds for the same rows."""
    runner = make_runner(tiny_llama_path)
    backend = runner.attn_backend
    if not backend.fused_decode:
        pytest.skip("CPU kernels not built here (see the log)")
    seqs = [Seq(runner, random_ids(n + 1, seed=n)) for n in (5, 12, 40)]
    run_step(runner, [(s, len(s.tokens) - 1) for s in seqs])
    ids, slots, rows, prefixes = [], [], [], []
    for seq in seqs:
        i, sl, p, _ = seq.plan(1)
        ids, rows, prefixes = ids + i, rows + [seq.row], prefixes + [p]
        slots.append(sl)
    fb = ForwardBatch.build(ids, torch.cat(slots), rows, prefixes, [1] * len(seqs))
    assert fb.mode is ForwardMode.DECODE
    ones = torch.ones(len(seqs), dtype=torch.int64)
    assert fb.positions.tolist() == flat_ranges(torch.tensor(prefixes), ones).tolist()
    assert fb.positions.tolist() == [5, 12, 40]
    backend.init_forward_metadata(fb)
    quick = fb.attn_metadata
    extend_fb = dataclasses.replace(fb, mode=ForwardMode.EXTEND)
    backend.init_forward_metadata(extend_fb)
    general = extend_fb.attn_metadata
    assert quick.extend == general.extend == []
    assert quick.decode.tokens is None and general.decode.tokens is None
    assert torch.equal(quick.decode.fused.req_idx, general.decode.fused.req_idx)
    assert torch.equal(quick.decode.fused.seq_lens, general.decode.fused.seq_lens)
    assert quick.decode.fused.seq_lens.tolist() == [6, 13, 41]
    ours = runner.forward(fb)
    for seq, row in zip(seqs, ours):
        assert (row - hf_logits(tiny_llama_path, seq.tokens)[-1]).abs().max().item() < TOL


@pytest.mark.parametrize("fused", [False, True], ids=["cascade", "fused-kernel"])
def test_decode_rows_sharing_cached_prefix_slots(tiny_llama_path, monkeypatch, fused):
    """Rows whose table rows start with the same slots (as the radix cache hands them out):
    the cascade attends the shared part once for all rows; the fused CPU kernel reads it per
    row. Logits equal HF's either way."""
    if fused and not cpu_kernels.available():
        pytest.skip("CPU kernels not built here (see the log)")
    runner = make_runner(tiny_llama_path)
    monkeypatch.setattr(runner.attn_backend, "fused_decode", fused)
    prefix = random_ids(80, seed=5)
    owner = Seq(runner, prefix)
    run_step(runner, [(owner, 80)])
    seqs = []
    for i in range(4):
        seq = Seq(runner, prefix + random_ids(6 + 3 * i, seed=20 + i))
        runner.req_to_token_pool.write(seq.row, 0, runner.req_to_token_pool.req_to_token[
            owner.row, :80].clone())
        seq.computed, seq.last_loc = 80, int(runner.req_to_token_pool.req_to_token[owner.row, 79])
        seqs.append(seq)
    run_step(runner, [(s, 3 + 3 * i) for i, s in enumerate(seqs)])
    shared = []
    build = runner.attn_backend.init_forward_metadata

    def record(fb):
        build(fb)
        decode = fb.attn_metadata.decode
        rows = decode.shared_rows
        shared.append("fused" if decode.fused is not None else
                      0 if rows is None else rows.numel() // runner.model_config.num_kv_heads)

    monkeypatch.setattr(runner.attn_backend, "init_forward_metadata", record)
    outs = [run_step(runner, [(s, 1) for s in seqs]) for _ in range(3)]
    assert shared == (["fused"] * 3 if fused else [80, 80, 80])
    for i, seq in enumerate(seqs):
        ours = torch.cat([step[i] for step in outs])
        end = 80 + 3 + 3 * i + 3
        ref = hf_logits(tiny_llama_path, seq.tokens[:end])[end - 3: end]
        assert (ours - ref).abs().max().item() < TOL


@pytest.mark.parametrize("page_size", [1, 4])
def test_row_reading_kv_another_row_computes_in_the_same_forward(tiny_model_path, page_size):
    """Requests admitted in one step share the pages of a common prefix (KVManager.admit): row
    B's table starts with slots row A writes in this very forward. Every layer stores the new
    K/V before attending, so B's logits still equal HF's."""
    runner = make_runner(tiny_model_path, page_size=page_size)
    shared = random_ids(20, seed=6)
    a, b = Seq(runner, shared + random_ids(10, seed=7)), Seq(runner, shared + random_ids(9, 8))
    ids_a, slots_a, _, _ = a.plan(30)
    runner.req_to_token_pool.write(b.row, 0, slots_a[:20])
    b.computed, b.last_loc = 20, int(slots_a[19])
    ids_b, slots_b, prefix_b, n_b = b.plan(9)
    fb = ForwardBatch.build(ids_a + ids_b, torch.cat((slots_a, slots_b)), [a.row, b.row],
                            [0, prefix_b], [30, n_b], list(range(39)))
    out_a, out_b = runner.forward(fb).split([30, 9])
    assert (out_a - hf_logits(tiny_model_path, a.tokens)).abs().max().item() < TOL
    assert (out_b - hf_logits(tiny_model_path, b.tokens)[20:]).abs().max().item() < TOL


def test_long_and_short_extend_rows_run_in_separate_padded_calls(tiny_llama_path):
    """A long prompt and short rows borrowing its prefix in the same step: the torch backend
    splits them into padded calls that do not pad every short row to the long one, and the
    logits still equal HF's. (Where the CPU kernels are built, SDPA takes extend rows past
    128 keys on AMX CPUs only: the backend is told so.)"""
    runner = make_runner(tiny_llama_path)
    runner.attn_backend.extend_max_keys = AMX_EXTEND_MAX_KEYS
    a = Seq(runner, random_ids(300, seed=9))
    i, s, _, _ = a.plan(300)
    ids, slots, prefixes, exts, rows = i, [s], [0], [300], [a.row]
    seqs = []
    for j in range(4):
        seq = Seq(runner, a.tokens[:290] + random_ids(6, seed=30 + j))
        runner.req_to_token_pool.write(seq.row, 0, s[:290])
        seq.computed, seq.last_loc = 290, int(s[289])
        i, sl, p, e = seq.plan(6)
        ids += i
        slots.append(sl)
        prefixes.append(p)
        exts.append(e)
        rows.append(seq.row)
        seqs.append(seq)
    fb = ForwardBatch.build(ids, torch.cat(slots), rows, prefixes, exts, list(range(len(ids))))
    outs = runner.forward(fb).split(exts)
    assert len(fb.attn_metadata.extend) >= 2
    assert max(len(g.q_index) for g in fb.attn_metadata.extend) < 5
    assert (outs[0] - hf_logits(tiny_llama_path, a.tokens)).abs().max().item() < TOL
    for seq, out in zip(seqs, outs[1:]):
        assert (out - hf_logits(tiny_llama_path, seq.tokens)[290:]).abs().max().item() < TOL


@pytest.mark.skipif(not can_pack(torch.zeros(2, 2)), reason="no oneDNN weight packing here")
def test_packed_weights_follow_every_weight_change(tiny_model_path):
    """Packed copies (CPU float32: blocked where the kernels are built, else oneDNN's) are
    dropped when the weights change and rebuilt from the new values before the next forward,
    whose logits equal HF's on the changed weights."""
    runner = make_runner(tiny_model_path)
    model = runner.model
    down = model.model.layers[0].mlp.down_proj

    def packs():
        return [down.packed, down.blocked, model.lm_head_packed, model.blocked_head]

    assert sum(p is not None for p in packs()) == 2
    regions = {dtype: r.data_ptr() for dtype, r in model.pack_regions.items()}
    with torch.no_grad():
        down.weight.mul_(0.5)
    runner.weights_changed()
    assert packs() == [None] * 4
    ids = random_ids(12, seed=4)
    (ours,) = run_step(runner, [(Seq(runner, ids), 12)])
    assert sum(p is not None for p in packs()) == 2
    # the blocked copies were written again into the same memory
    assert {dtype: r.data_ptr() for dtype, r in model.pack_regions.items()} == regions
    assert (down.blocked is None) == (not regions)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_path,
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        hf.model.layers[0].mlp.down_proj.weight.mul_(0.5)
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < TOL

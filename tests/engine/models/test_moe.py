"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against HF transformers' forward: greedy tokens
equal, logprobs within 1e-4 in fp32; both checkpoint namings load and update (tensor, disk,
distributed, staged, two-phase), some experts alone too; LoRA on experts, expert parallelism
refused; TP=2 equals TP=1."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
import transformers
from fixtures import write_moe
from safetensors.torch import load_file, save_file

from hotswap.engine import Engine
from hotswap.engine.config import EngineConfig, ModelConfig
from hotswap.engine.distributed.shard import shard_config, shard_tensor, unshard
from hotswap.weight_sync import WeightSender
from hotswap.weight_sync.group import free_port

ARCHS = ["qwen3_moe", "mixtral"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [40, 41, 5, 6, 7, 30]]
NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
TOL = 1e-4


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[tuple[str, str], str]:
    """(arch, "a" | "a-stacked" | "b" | "b-stacked") -> folder; a and b differ in seed."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for arch in ARCHS:
        for key, seed, stacked in (("a", 0, False), ("a-stacked", 0, True), ("b", 1, False),
                                   ("b-stacked", 1, True)):
            out[arch, key] = write_moe(str(root / f"{arch}-{key}"), arch, seed, stacked)
    return out


def engine(path: str, **kwargs) -> Engine:
    return Engine(path, device="cpu", dtype="float32", max_total_tokens=2048, **kwargs)


def run(eng: Engine) -> list[tuple[list[int], list[float]]]:
    eng.flush_cache()
    outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], [lp for lp, _ in o["meta_info"]["output_token_logprobs"]])
            for o in outs]


def assert_close(got: list, want: list, tol: float = TOL) -> None:
    for (ids, lps), (want_ids, want_lps) in zip(got, want, strict=True):
        assert ids == want_ids
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) <= tol


def broadcast(tensors: dict[str, torch.Tensor], eng: Engine, ranks: int, version: str) -> dict:
    """One update by a trainer's broadcast (rank 0) to the engine's `ranks` - 1 ranks; the
    group is closed whatever happens."""
    sender = WeightSender("127.0.0.1", free_port(), world_size=ranks, backend="gloo",
                          timeout_s=60)
    try:
        return sender.send(tensors, [eng], weight_version=version)[0]
    finally:
        sender.close([eng])


def hf_greedy(path: str) -> list[tuple[list[int], list[float]]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        with torch.no_grad():
            gen = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, eos_token_id=None,
                                 pad_token_id=0)
        ids = gen.sequences[0, len(prompt):].tolist()
        lps = [torch.log_softmax(step[0].float(), -1)[t].item()
               for step, t in zip(gen.logits, ids, strict=True)]
        out.append((ids, lps))
    return out


def test_config_reads_the_moe_fields(moe):
    q = ModelConfig.from_path(moe["qwen3_moe", "a"])
    assert (q.architecture, q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size,
            q.norm_topk_prob, q.qk_norm) == ("Qwen3MoeForCausalLM", 8, 2, 32, True, True)
    assert [q.is_moe_layer(i) for i in range(3)] == [True, False, True]
    with open(f"{moe['qwen3_moe', 'a']}/config.json") as f:
        raw = json.load(f)
    stepped = ModelConfig.from_dict({**raw, "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert [stepped.is_moe_layer(i) for i in range(3)] == [False, True, False]
    m = ModelConfig.from_path(moe["mixtral", "a"])
    assert (m.num_experts, m.moe_intermediate_size, m.norm_topk_prob, m.qk_norm) == (
        6, 32, True, False)
    assert all(m.is_moe_layer(i) for i in range(2)) and not m.has_dense_layers


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_and_logprobs_equal_hf(moe, arch):
    want = hf_greedy(moe[arch, "a"])
    with engine(moe[arch, "a"]) as eng:
        assert_close(run(eng), want)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logprobs_stay_near_hf(moe, arch):
    """bf16 engine, teacher-forced HF on its tokens: within bf16 rounding (a near-tie may route
    one token elsewhere, hence the max bound is looser than the dense models')."""
    with Engine(moe[arch, "a"], device="cpu", dtype="bfloat16", max_total_tokens=2048) as eng:
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    for dtype in (torch.bfloat16, torch.float32):
        hf = transformers.AutoModelForCausalLM.from_pretrained(moe[arch, "a"], dtype=dtype)
        diffs = []
        for prompt, out in zip(PROMPTS, outs, strict=True):
            ids = out["output_ids"]
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1]
            ref = logits.float().log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
            ours = torch.tensor([lp for lp, _ in out["meta_info"]["output_token_logprobs"]])
            diffs.append((ours - ref).abs())
        diff = torch.cat(diffs)
        assert diff.mean().item() < 0.02 and diff.max().item() < 0.2, (dtype, diff)


@pytest.mark.parametrize("arch", ARCHS)
def test_stacked_checkpoint_loads_the_same_model(moe, arch):
    with engine(moe[arch, "a"]) as eng:
        want = run(eng)
    with engine(moe[arch, "a-stacked"]) as eng:
        assert run(eng) == want


@pytest.mark.parametrize("arch", ARCHS)
def test_updates_in_both_namings_equal_a_fresh_engine(moe, arch):
    with engine(moe[arch, "a"]) as eng:
        want_a = run(eng)
    with engine(moe[arch, "b"]) as eng:
        want_b = run(eng)
    stacked_b = load_file(f"{moe[arch, 'b-stacked']}/model.safetensors")
    per_expert_a = load_file(f"{moe[arch, 'a']}/model.safetensors")
    with engine(moe[arch, "a"]) as eng:
        assert eng.update_weights_from_tensor(stacked_b, weight_version="b1")["success"]
        assert run(eng) == want_b
        assert eng.update_weights_from_disk(moe[arch, "a"])["success"]  # per expert
        assert run(eng) == want_a
        assert eng.update_weights_from_disk(moe[arch, "b-stacked"])["success"]
        assert run(eng) == want_b
        # staged: per-expert tensors in two halves, one version at the commit
        names = sorted(per_expert_a)
        for part in (names[: len(names) // 2], names[len(names) // 2:]):
            eng.update_weights_from_tensor({n: per_expert_a[n] for n in part}, commit=False)
        assert eng.commit_weight_update("a2")["success"]
        assert run(eng) == want_a
        # two-phase, from a stacked checkpoint
        assert eng.prepare_weights_from_disk(moe[arch, "b-stacked"])["success"]
        assert eng.commit_weight_update("b2")["success"]
        assert run(eng) == want_b
        # distributed (a trainer's broadcast) in both namings, into the standby and in place,
        # tensor by tensor and in flattened buckets
        sender = WeightSender("127.0.0.1", free_port(), world_size=2, backend="gloo",
                              timeout_s=60)
        try:
            for tensors, staging, load_format, want in (
                    (per_expert_a, "standby", None, want_a),
                    (stacked_b, "none", "flattened_bucket", want_b),
                    (per_expert_a, "none", None, want_a),
                    (stacked_b, "standby", "flattened_bucket", want_b)):
                reply = sender.send(tensors, [eng], weight_version=f"sent-{staging}",
                                    load_format=load_format, staging=staging)[0]
                assert reply["success"], reply
                assert run(eng) == want
        finally:
            sender.close([eng])
        eng.check_integrity()


@pytest.mark.parametrize("arch", ARCHS)
def test_some_experts_alone_update_and_nothing_else_changes(moe, arch, tmp_path):
    a = load_file(f"{moe[arch, 'a']}/model.safetensors")
    b = load_file(f"{moe[arch, 'b']}/model.safetensors")
    expert = "block_sparse_moe.experts" if arch == "mixtral" else "mlp.experts"
    chosen = [n for n in b if f"layers.0.{expert}.1." in n or f"layers.0.{expert}.4." in n]
    assert len(chosen) == 6  # gate, up and down of two experts
    mixed = {**a, **{n: b[n] for n in chosen}}
    ref = str(tmp_path / "mixed")
    shutil.copytree(moe[arch, "a"], ref)
    save_file(mixed, f"{ref}/model.safetensors")
    with engine(ref) as eng:
        want = run(eng)
    with engine(moe[arch, "a"]) as eng:
        before = run(eng)
        assert eng.update_weights_from_tensor({n: b[n] for n in chosen})["success"]
        assert run(eng) == want != before
        for name in (chosen[0], chosen[0].replace(".1.", ".2.").replace(".4.", ".2.")):
            got = torch.tensor(eng.get_weights_by_name(name, 1 << 20))
            assert torch.equal(got, mixed[name]), name
        # One layer's stacked experts alone: that layer's experts all become b's.
        stacked_b = load_file(f"{moe[arch, 'b-stacked']}/model.safetensors")
        down = "model.layers.0.mlp.experts.down_proj"
        assert eng.update_weights_from_tensor({down: stacked_b[down]})["success"]
        down_name = "w2" if arch == "mixtral" else "down_proj"
        got = torch.tensor(eng.get_weights_by_name(
            f"model.layers.0.{expert}.2.{down_name}.weight", 1 << 20))
        assert torch.equal(got, b[f"model.layers.0.{expert}.2.{down_name}.weight"])


@pytest.mark.parametrize("arch", ARCHS)
def test_incomplete_checkpoints_name_the_missing_expert(moe, arch, tmp_path):
    tensors = load_file(f"{moe[arch, 'a']}/model.safetensors")
    up = ("model.layers.0.block_sparse_moe.experts.3.w3.weight" if arch == "mixtral"
          else "model.layers.0.mlp.experts.3.up_proj.weight")
    del tensors[up]
    broken = str(tmp_path / "broken")
    shutil.copytree(moe[arch, "a"], broken)
    save_file(tensors, f"{broken}/model.safetensors")
    with pytest.raises(ValueError, match=rf"missing tensor.*{up.replace('.', '[.]')}"):
        engine(broken)
    with engine(moe[arch, "a"]) as eng:
        with pytest.raises(ValueError, match="missing tensor"):
            eng.update_weights_from_disk(broken)
        bad = {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(3, 64, 64)}
        with pytest.raises(ValueError, match="gate_up_proj.*shape"):
            eng.update_weights_from_tensor(bad)


def test_lora_on_experts_is_refused_and_on_attention_served(moe):
    with engine(moe["qwen3_moe", "a"]) as eng:
        for targets in (["q_proj", "gate_proj"], "all-linear", ["down_proj"]):
            with pytest.raises(ValueError, match="mixture-of-experts.*attention only"):
                eng.load_lora_adapter_from_tensors(
                    "e", {}, {"r": 4, "lora_alpha": 8, "target_modules": targets})
        q = "base_model.model.model.layers.0.self_attn.q_proj"
        tensors = {f"{q}.lora_A.weight": torch.randn(4, 64) * 0.1,
                   f"{q}.lora_B.weight": torch.randn(64, 4) * 0.1}
        assert eng.load_lora_adapter_from_tensors(
            "attn", tensors, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})["success"]
        base = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, return_logprob=True)
        lora = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, return_logprob=True,
                            lora_name="attn")
        assert (base["meta_info"]["output_token_logprobs"]
                != lora["meta_info"]["output_token_logprobs"])


def test_expert_parallelism_is_refused(moe):
    with pytest.raises(ValueError, match="ep_size=2: expert parallelism is not supported"):
        EngineConfig(model_path=moe["mixtral", "a"], ep_size=2).resolve(
            ModelConfig.from_path(moe["mixtral", "a"]))


@pytest.mark.parametrize("arch", ARCHS)
def test_expert_shards_reassemble_in_both_namings(moe, arch):
    cfg = ModelConfig.from_path(moe[arch, "a"])
    local = shard_config(cfg, 2)
    assert local.moe_intermediate_size == cfg.moe_intermediate_size // 2
    tensors = {**load_file(f"{moe[arch, 'a']}/model.safetensors"),
               **load_file(f"{moe[arch, 'a-stacked']}/model.safetensors")}
    inter = cfg.moe_intermediate_size
    for name, full in tensors.items():
        shards = [shard_tensor(name, full, cfg, r, 2) for r in range(2)]
        assert torch.equal(unshard(name, shards, cfg), full), name
    gate_up = tensors["model.layers.0.mlp.experts.gate_up_proj"]
    rank1 = shard_tensor("model.layers.0.mlp.experts.gate_up_proj", gate_up, cfg, 1, 2)
    assert torch.equal(rank1, torch.cat((gate_up[:, inter // 2: inter],
                                         gate_up[:, inter + inter // 2:]), dim=1))
    with pytest.raises(ValueError, match="does not divide the experts' intermediate size 30"):
        shard_config(replace(cfg, moe_intermediate_size=30), 4)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_equals_tp1_and_updates_in_both_namings(moe, arch):
    with engine(moe[arch, "a"]) as one:
        want_a = run(one)
    with engine(moe[arch, "b"]) as one:
        want_b = run(one)
    with engine(moe[arch, "a"], tp_size=2) as two:
        assert_close(run(two), want_a)
        stacked_b = load_file(f"{moe[arch, 'b-stacked']}/model.safetensors")
        assert two.update_weights_from_tensor(stacked_b)["success"]
        assert_close(run(two), want_b)
        assert two.update_weights_from_disk(moe[arch, "a-stacked"])["success"]
        assert_close(run(two), want_a)
        name = "model.layers.0.mlp.experts.gate_up_proj"
        got = torch.tensor(two.get_weights_by_name(name, 1 << 20))
        assert torch.equal(got, load_file(f"{moe[arch, 'a-stacked']}/model.safetensors")[name])
        # a trainer's broadcast: 1 trainer + 2 TP ranks, each rank slicing its experts
        assert broadcast(stacked_b, two, 3, "b2")["success"]
        assert_close(run(two), want_b)


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_experts_serve_close_to_float_and_every_update_requantizes_them(moe, arch,
                                                                              tmp_path):
    """quantization="int8" quantizes the experts too (the routers stay float): logprobs close to
    the float engine's; an update, whole or of some experts, re-quantizes them inside its
    transaction, so the engine then equals a fresh int8 engine loaded with the same weights;
    TP=2 (each rank quantizing its part of every expert) stays close to TP=1."""
    from hotswap.engine.layers.moe import FusedMoE

    with engine(moe[arch, "a"]) as eng:
        want = run(eng)
    with engine(moe[arch, "b"], quantization="int8") as fresh:
        want_b = run(fresh)
    a = load_file(f"{moe[arch, 'a']}/model.safetensors")
    b = load_file(f"{moe[arch, 'b']}/model.safetensors")
    expert = "block_sparse_moe.experts" if arch == "mixtral" else "mlp.experts"
    some = {n: t for n, t in a.items() if f"layers.0.{expert}.1." in n}
    mixed = str(tmp_path / "mixed")  # b, with a's expert 1 of layer 0
    shutil.copytree(moe[arch, "b"], mixed)
    save_file({**b, **some}, f"{mixed}/model.safetensors")
    with engine(mixed, quantization="int8") as fresh:
        want_mixed = run(fresh)
    with engine(moe[arch, "a"], quantization="int8") as eng:
        layers = [m for m in eng.scheduler.runner.model.modules() if isinstance(m, FusedMoE)]
        assert layers and all(m.quant is not None and m.packs is None for m in layers)
        got_a = run(eng)
        for (ids, lps), (want_ids, want_lps) in zip(got_a, want, strict=True):
            same = sum(x == y for x, y in zip(ids, want_ids))
            assert same >= NEW_TOKENS // 2 and abs(lps[0] - want_lps[0]) < 0.05
        stacked_b = load_file(f"{moe[arch, 'b-stacked']}/model.safetensors")
        assert eng.update_weights_from_tensor(stacked_b)["success"]
        assert run(eng) == want_b
        assert eng.update_weights_from_disk(moe[arch, "a"])["success"]
        assert run(eng) == got_a
        assert broadcast(b, eng, 2, "b2")["success"]
        assert run(eng) == want_b
        assert eng.update_weights_from_tensor(some)["success"]
        assert run(eng) == want_mixed
        eng.check_integrity()
    with engine(moe[arch, "a"], quantization="int8", tp_size=2) as two:
        for (_, lps), (_, want_lps) in zip(run(two), got_a, strict=True):
            assert abs(lps[0] - want_lps[0]) < 0.05


def test_released_weights_come_back_with_a_complete_stacked_update(moe):
    with engine(moe["qwen3_moe", "a"]) as eng:
        want = run(eng)
        eng.release_memory_occupation()
        eng.resume_memory_occupation()
        stacked = load_file(f"{moe['qwen3_moe', 'a-stacked']}/model.safetensors")
        assert eng.update_weights_from_tensor(stacked)["success"]
        assert run(eng) == want

"""Tensor parallelism: Engine(tp_size=2) against tp_size=1 (greedy tokens equal, logprobs within
1e-4 in fp32), weight updates under TP against a fresh engine, and a killed worker."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from conftest import write_tiny_model
from fixtures import ServerThread, wait_healthy, write_tiny_chat_model
from safetensors.torch import load_file

from hotswap.engine import Engine, RemoteEngine
from hotswap.engine.config import ModelConfig
from hotswap.engine.distributed.shard import shard_config, shard_tensor, unshard
from hotswap.engine.distributed.vocab_parallel import VocabParallelEmbedding, gather_logits
from hotswap.engine.errors import WorkerDiedError
from hotswap.fleet import Router
from hotswap.fleet.router_app import create_router_app
from hotswap.trainers_adapters import sglang
from hotswap.trainers_adapters.groups import destroy_process_group, init_custom_process_group
from hotswap.weight_sync import WeightSender, WeightSyncError
from hotswap.weight_sync.group import free_port

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [5, 6, 7, 8, 20, 21]]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}


def _cfg(**overrides) -> ModelConfig:
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=64)
    return ModelConfig.from_dict({**base, **overrides})


def _run(engine: Engine) -> list[tuple[list[int], torch.Tensor]]:
    engine.flush_cache()
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    return [(o["output_ids"], torch.tensor([lp for lp, _ in
                                            o["meta_info"]["output_token_logprobs"]]))
            for o in outs]


def _assert_same(got: list, want: list) -> None:
    for (ids, lps), (want_ids, want_lps) in zip(got, want, strict=True):
        assert ids == want_ids
        assert torch.allclose(lps, want_lps, atol=1e-4, rtol=0)


def _engine(path: str, tp_size: int = 1) -> Engine:
    return Engine(path, device="cpu", max_total_tokens=2048, tp_size=tp_size)


def test_sizes_that_do_not_split_are_value_errors_naming_the_numbers():
    with pytest.raises(ValueError, match="tp_size 3 does not divide the 4 attention heads"):
        shard_config(_cfg(), 3)
    with pytest.raises(ValueError, match="tp_size 4 neither divides the 3 KV heads"):
        shard_config(_cfg(num_attention_heads=12, num_key_value_heads=3), 4)
    local = shard_config(_cfg(num_attention_heads=9, num_key_value_heads=3,
                              intermediate_size=1536, hidden_size=576), 3)  # SmolLM2-135M
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 512)


@pytest.mark.parametrize("kv_heads", [2, 1])  # split over 2 ranks, replicated on 2 ranks
def test_shards_reassemble(kv_heads):
    cfg = _cfg(num_key_value_heads=kv_heads, vocab_size=63)  # vocab padded to 64 over 2 ranks
    hd = cfg.head_dim
    full = {"model.embed_tokens.weight": torch.randn(63, 64),
            "lm_head.weight": torch.randn(63, 64),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(4 * hd, 64),
            "model.layers.0.self_attn.k_proj.weight": torch.randn(kv_heads * hd, 64),
            "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 4 * hd),
            "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64),
            "model.layers.0.mlp.down_proj.weight": torch.randn(64, 128),
            "model.norm.weight": torch.randn(64)}
    for name, tensor in full.items():
        shards = [shard_tensor(name, tensor, cfg, r, 2) for r in range(2)]
        assert torch.equal(unshard(name, shards, cfg), tensor), name
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # rows [32r, 32r+32)
        last = shard_tensor(name, full[name], cfg, 1, 2)
        assert last.shape == (32, 64) and torch.equal(last[:31], full[name][32:])
        assert not last[31].any()  # the padding row
    k = "model.layers.0.self_attn.k_proj.weight"
    if kv_heads == 1:  # both ranks' query heads read the one KV head
        assert torch.equal(shard_tensor(k, full[k], cfg, 1, 2), full[k])


class _Blocks:
    """Stands in for the TP group: rank 0's gather returns every simulated rank's block."""

    def __init__(self, blocks: list[torch.Tensor]):
        self.blocks = blocks

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self.blocks

    def all_reduce(self, tensor: torch.Tensor) -> None:
        pass  # each simulated rank's partial embedding is summed by the test


@pytest.mark.parametrize("vocab,tp_size", [(7, 2), (4, 3), (9, 3)])  # (4, 3): rank 2 all padding
def test_vocab_parallel_embedding_and_logits_equal_the_whole_vocabulary(vocab, tp_size):
    cfg = _cfg(vocab_size=vocab)
    weight = torch.randn(vocab, 8)
    shards = [shard_tensor("lm_head.weight", weight, cfg, r, tp_size) for r in range(tp_size)]
    rows = shards[0].shape[0]
    assert all(s.shape[0] == rows for s in shards) and rows * tp_size >= vocab
    ids = torch.arange(vocab).flip(0)
    parts = [VocabParallelEmbedding(torch.nn.Embedding.from_pretrained(s), r * rows, _Blocks([]))
             for r, s in enumerate(shards)]
    assert torch.equal(sum(p(ids) for p in parts), weight[ids])
    hidden = torch.randn(5, 8)
    logits = gather_logits(hidden @ shards[0].T, vocab, _Blocks([hidden @ s.T for s in shards]))
    assert logits.shape == (5, vocab) and logits.is_contiguous()
    assert torch.allclose(logits, hidden @ weight.T, atol=1e-5)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    a = write_tiny_chat_model(str(root / "a"), seed=0)
    b = write_tiny_chat_model(str(root / "b"), seed=1)
    # Qwen2 (q/k/v bias, tied embeddings) with one KV head: replicated on both ranks.
    qwen = write_tiny_model(str(root / "qwen"), "qwen2", seed=3, num_key_value_heads=1,
                            vocab_size=load_file(f"{a}/model.safetensors")[
                                "model.embed_tokens.weight"].shape[0])
    for name in os.listdir(a):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(a, name), os.path.join(qwen, name))
    # A vocabulary that 2 ranks do not divide (padded to an even size), untied lm_head.
    vocab = load_file(f"{a}/model.safetensors")["model.embed_tokens.weight"].shape[0]
    odd = write_tiny_model(str(root / "odd"), "llama", seed=4, num_hidden_layers=2,
                           vocab_size=vocab - 1 + vocab % 2)
    for name in os.listdir(a):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(a, name), os.path.join(odd, name))
    return {"a": a, "b": b, "qwen": qwen, "odd": odd}


@pytest.mark.slow
def test_tp2_equals_tp1_and_updates_equal_a_fresh_engine(models):
    with _engine(models["a"]) as one:
        want_a = _run(one)
        name = "model.layers.1.mlp.down_proj.weight"
        full = torch.tensor(one.get_weights_by_name(name, truncate_size=1 << 20))
    with _engine(models["b"]) as fresh_b:
        want_b = _run(fresh_b)
    with _engine(models["a"], tp_size=2) as two:
        workers = two.runner.workers
        assert len(workers) == 1 and workers[0].is_alive()
        _assert_same(_run(two), want_a)
        # get_weights_by_name gathers the shards
        assert torch.equal(torch.tensor(two.get_weights_by_name(name, 1 << 20)), full)

        assert two.update_weights_from_disk(models["b"])["success"]
        _assert_same(_run(two), want_b)

        tensors = load_file(f"{models['a']}/model.safetensors")
        port = free_port()
        # 1 trainer + 2 TP ranks: each rank joins the trainer's group itself.
        sender = WeightSender("127.0.0.1", port, world_size=3, backend="gloo", timeout_s=60)
        try:
            reply = sender.send(tensors, [two], weight_version="back-to-a")[0]
        finally:
            sender.close([two])
        assert reply["success"] and two.get_weight_version() == "back-to-a"
        _assert_same(_run(two), want_a)

        bad = {"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}
        with pytest.raises(ValueError, match="up_proj"):
            two.update_weights_from_tensor(bad)
        _assert_same(_run(two), want_a)
    assert not any(w.is_alive() for w in workers)  # shutdown leaves no process


@pytest.mark.slow
def test_tp2_equals_tp1_with_replicated_kv_heads_and_bias(models):
    with _engine(models["qwen"]) as one:
        want = _run(one)
    with _engine(models["qwen"], tp_size=2) as two:
        _assert_same(_run(two), want)
        # LoRA deltas are not sharded: refused with a clear error, and the engine serves on
        with pytest.raises(ValueError, match="tp_size=2"):
            two.load_lora_adapter_from_tensors("a", {}, {"r": 4, "lora_alpha": 8,
                                                         "target_modules": ["q_proj"]})
        _assert_same(_run(two), want)


@pytest.mark.slow
def test_tp2_with_a_vocab_it_does_not_divide_equals_tp1_and_splits_the_vocab(models):
    vocab = ModelConfig.from_path(models["odd"]).vocab_size
    assert vocab % 2
    with _engine(models["odd"]) as one:
        want = _run(one)
        one_bytes = sum(p.numel() * p.element_size() for p in one.runner.model.parameters())
        head = torch.tensor(one.get_weights_by_name("lm_head.weight", 1 << 30))
    with _engine(models["odd"], tp_size=2) as two:
        _assert_same(_run(two), want)
        ranks = two.runner.memory_per_rank()
        assert torch.equal(torch.tensor(two.get_weights_by_name("lm_head.weight", 1 << 30)), head)
    rows = (vocab + 1) // 2
    assert [(r["embed_rows"], r["lm_head_rows"]) for r in ranks] == [(rows, rows)] * 2
    # Replicated embedding and lm_head would keep each rank above 70% of the whole model.
    assert all(r["param_bytes"] < 0.55 * one_bytes for r in ranks), (ranks, one_bytes)


@pytest.mark.slow
def test_bf16_tp2_keeps_the_fp32_lm_head_on_its_vocab_rows(models):
    def run(tp_size: int) -> tuple[list, tuple[int, ...]]:
        with Engine(models["a"], device="cpu", dtype="bfloat16", max_total_tokens=2048,
                    tp_size=tp_size) as engine:
            model = engine.runner.model
            head = model.fp32_head
            assert head is not None and head.norm_weight.dtype == torch.float32
            return _run(engine), tuple(head.norm_weight.shape) + (model.lm_head_weight.shape[0],)

    (want, (_, rows_one)), (got, (_, rows_two)) = run(1), run(2)
    assert rows_two == rows_one // 2 or rows_two == (rows_one + 1) // 2
    # bf16 hidden states summed in another order: same tokens, logprobs within bf16 noise.
    for (ids, lps), (want_ids, want_lps) in zip(got, want, strict=True):
        assert ids == want_ids
        assert torch.allclose(lps, want_lps, atol=5e-2, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_deterministic_is_batch_invariant(models, dtype):
    """deterministic=True under tp_size=2: a seeded request's bits alone equal its bits among
    batch-mates (each rank's blocked matmuls per row, a 2-way all-reduce is order-free); TP 1
    and TP 2 differ in the last bits (the row-parallel sums split k), not in greedy tokens."""
    rng = random.Random(0)
    reqs = [([rng.randrange(3, 400) for _ in range(rng.randint(10, 60))],
             {"max_new_tokens": 10, "temperature": 1.0, "seed": i, "ignore_eos": True})
            for i in range(12)]
    with Engine(models["qwen"], device="cpu", dtype=dtype, max_total_tokens=4096, tp_size=2,
                deterministic=True) as engine:
        assert engine.runner.batch_invariant
        alone = [engine.generate(input_ids=ids, sampling_params=p, return_logprob=True)
                 for ids, p in reqs[:4]]
        engine.flush_cache()
        batch = engine.generate(input_ids=[ids for ids, _ in reqs],
                                sampling_params=[p for _, p in reqs], return_logprob=True)
    for a, b in zip(alone, batch, strict=False):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


@pytest.mark.slow
def test_distributed_updates_under_tp2_land_on_every_rank_or_on_none(models):
    down = "model.layers.1.mlp.down_proj.weight"
    with _engine(models["a"]) as fresh_a:
        want_a = _run(fresh_a)
    with _engine(models["b"]) as fresh_b:
        want_b = _run(fresh_b)
        down_b = torch.tensor(fresh_b.get_weights_by_name(down, 1 << 20))
    tensors_a = load_file(f"{models['a']}/model.safetensors")
    tensors_b = load_file(f"{models['b']}/model.safetensors")
    with _engine(models["a"], tp_size=2) as two:
        assert two.weight_sync_ranks == 2
        sender = WeightSender("127.0.0.1", free_port(), world_size=3, group_name="direct",
                              backend="gloo", timeout_s=60)
        try:
            assert sender.send(tensors_b, [two], weight_version="b")[0]["success"]
            _assert_same(_run(two), want_b)

            # A NaN in the last column of down_proj: only rank 1's shard holds it, so only
            # rank 1 refuses; rank 0 must not write its (finite) shard either.
            nan = {**tensors_a, down: tensors_a[down].clone()}
            nan[down][:, -1] = float("nan")
            with pytest.raises(WeightSyncError, match="rank 1: .*non-finite") as refused:
                sender.send(nan, [two], weight_version="nan")
            assert "rank 0" not in str(refused.value)
            shape = {"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}
            with pytest.raises(WeightSyncError, match="up_proj"):
                sender.send(shape, [two], weight_version="shape")
            # The ranks always receive beside their shards (all or none): "none" is refused.
            with pytest.raises(WeightSyncError, match="staging='none'.*tensor parallel"):
                sender.send(tensors_a, [two], weight_version="none", staging="none")
            assert two.get_weight_version() == "b"
            assert torch.equal(torch.tensor(two.get_weights_by_name(down, 1 << 20)), down_b)
            _assert_same(_run(two), want_b)
        finally:
            sender.close([two])

        # Two targets update in two phases (prepare on every rank of each, then commit).
        with _engine(models["b"]) as one:
            sender = WeightSender("127.0.0.1", free_port(), world_size=4,
                                  group_name="two-phase", backend="gloo", timeout_s=60)
            try:
                with pytest.raises(WeightSyncError, match="no target committed"):
                    sender.send(nan, [two, one], weight_version="nan")
                assert [e.get_weight_version() for e in (two, one)] == ["b", "0"]
                replies = sender.send(tensors_a, [two, one], weight_version="a")
                assert [r["weight_version"] for r in replies] == ["a", "a"]
            finally:
                sender.close([two, one])
            _assert_same(_run(one), want_a)
        _assert_same(_run(two), want_a)


@pytest.mark.slow
def test_sglang_style_trainer_with_rank_offset_per_tp_rank_updates_a_tp2_engine(models):
    """A trainer that computes the ranks itself, as verl and slime do with SGLang: world size
    1 + tp_size, the engine at rank_offset 1 (its ranks 1 and 2); buckets with flush_cache=False
    commit as one version at the last one."""
    with _engine(models["b"]) as fresh_b:
        want_b = _run(fresh_b)
    weights = load_file(f"{models['b']}/model.safetensors")
    names = list(weights)
    port, name = free_port(), "sglang-tp"
    with _engine(models["a"], tp_size=2) as two, ThreadPoolExecutor(1) as pool:
        adapter = sglang.Engine(engine=two)
        joined = pool.submit(adapter.init_weights_update_group, "127.0.0.1", port, 1, 3, name,
                             "gloo")
        group = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                          world_size=3, rank=0, group_name=name)
        assert joined.result()[0]
        buckets = [names[i:i + 5] for i in range(0, len(names), 5)]
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            reply = pool.submit(adapter.update_weights_from_distributed, bucket,
                                [weights[n].dtype for n in bucket],
                                [list(weights[n].shape) for n in bucket], name, last)
            for n in bucket:
                dist.broadcast(weights[n], 0, group=group)
            assert reply.result()[0]
            assert two.get_weight_version() == ("1" if last else "0")
        _assert_same(_run(two), want_b)
        assert adapter.destroy_weights_update_group(name)[0]
        destroy_process_group(group)


@pytest.mark.slow
def test_killed_worker_fails_every_request_clearly_and_shutdown_leaves_no_process(models):
    engine = _engine(models["a"], tp_size=2)
    worker = engine.runner.workers[0]
    try:
        assert len(_run(engine)) == 3
        long = engine.generate(input_ids=PROMPTS[0], stream=True,
                               sampling_params={"max_new_tokens": 400, "temperature": 0.0,
                                                "ignore_eos": True})
        next(long)
        os.kill(worker.pid, 9)
        start = time.monotonic()
        last = list(long)[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert "tensor-parallel" in last["meta_info"]["finish_reason"]["message"]
        assert time.monotonic() - start < 10
        deadline = time.monotonic() + 5
        while engine.runner.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(WorkerDiedError, match="worker 1 of 2 exited"):
            engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
    finally:
        engine.shutdown()
    assert not worker.is_alive()


def _serve(model: str, tp_size: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "HOTSWAP_API_KEY": "", "HOTSWAP_ADMIN_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-m", "hotswap.engine.server", "--model-path", model,
                             "--port", str(port), "--device", "cpu", "--max-total-tokens", "2048",
                             "--tp-size", str(tp_size), "--log-level", "error"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.slow
def test_http_server_with_tp_size_behind_a_router_counts_every_rank(models):
    """`python -m hotswap.engine.server --tp-size 2` beside a TP=1 server, behind a router app:
    a RemoteEngine of the router counts 3 weight-sync ranks, a WeightSender of world size 4
    moves both servers to one version, and both serve what fresh TP=1 engines serve."""
    with _engine(models["a"]) as fresh_a:
        want_a = _run(fresh_a)
    with _engine(models["b"]) as fresh_b:
        want_b = _run(fresh_b)
    servers = [_serve(models["a"], tp) for tp in (2, 1)]
    try:
        for proc, url in servers:
            wait_healthy([proc], url, 120)
        tp2, tp1 = (RemoteEngine(url) for _, url in servers)
        assert (tp2.weight_sync_ranks, tp1.weight_sync_ranks) == (2, 1)
        _assert_same(_run(tp2), want_a)
        with ServerThread(create_router_app(Router([url for _, url in servers]))) as app:
            routed = RemoteEngine(app.url)
            assert routed.weight_sync_ranks == 3
            sender = WeightSender("127.0.0.1", free_port(), world_size=4, group_name="http-tp",
                                  backend="gloo", timeout_s=60)
            try:
                tensors = load_file(f"{models['b']}/model.safetensors")
                assert sender.send(tensors, [routed], weight_version="b")[0]["success"]
            finally:
                sender.close([routed])
        assert [e.get_weight_version() for e in (tp2, tp1)] == ["b", "b"]
        _assert_same(_run(tp2), want_b)
        _assert_same(_run(tp1), want_b)
    finally:
        for proc, _ in servers:
            proc.terminate()
        for proc, _ in servers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_tp3_equals_tp1(real_model_path):
    """SmolLM2-135M: 9 heads and 3 KV heads, one KV head per rank."""
    messages = [[{"role": "user", "content": q}] for q in
                ("What is the capital of France?", "List three prime numbers.")]

    def run(tp_size: int) -> list:
        with Engine(real_model_path, device="cpu", max_total_tokens=4096,
                    tp_size=tp_size) as engine:
            outs = engine.generate(messages=messages, sampling_params=GREEDY,
                                   return_logprob=True)
        return [(o["output_ids"], torch.tensor([lp for lp, _ in
                                                o["meta_info"]["output_token_logprobs"]]))
                for o in outs]

    _assert_same(run(3), run(1))

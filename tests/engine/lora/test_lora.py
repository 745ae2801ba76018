"""LoRA adapters: outputs equal HF + PEFT, mixed batches, the adapter pool, adapter versions and
their cache namespaces, bad input.

Adapters are built with the `peft` library on the model under test, with random non-zero B (a
freshly initialised LoRA has B = 0 and would not change anything). The references are PEFT's
own forward and a fresh engine loaded with the same adapter.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch
import transformers
from fixtures import serve, write_tiny_chat_model

from hotswap.engine import Engine, RemoteEngine

peft = pytest.importorskip("peft", reason="LoRA tests build adapters with the peft library")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 33, 99, 4, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [7, 300]]


def greedy(n: int = 8) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def base_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("lora-base")))


def make_peft(base: str, seed: int, r: int = 4, targets: list[str] | None = None,
              alpha: float = 8, rslora: bool = False):
    """A PeftModel over the base checkpoint whose A and B are random (seeded)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS,
                          lora_dropout=0.0, use_rslora=rslora)
    pm = peft.get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return pm.eval()


def save_peft(pm, path: str) -> str:
    pm.save_pretrained(path)
    return path


def adapter_tensors(pm) -> tuple[dict[str, torch.Tensor], dict]:
    """(PEFT state dict, adapter_config.json dict): what a trainer pushes."""
    state = peft.get_peft_model_state_dict(pm)
    return {k: v.detach().clone() for k, v in state.items()}, pm.peft_config["default"].to_dict()


def hf_greedy(pm, ids: list[int], out_ids: list[int]) -> tuple[list[int], list[float]]:
    """PEFT's greedy choice and logprob at every position of prompt + the engine's tokens.

    One teacher-forced forward: HF's greedy continuation equals `out_ids` exactly when every
    argmax here equals the engine's token there.
    """
    with torch.no_grad():
        logits = pm(input_ids=torch.tensor([ids + out_ids])).logits[0, len(ids) - 1: -1].float()
    lps = torch.log_softmax(logits, -1)
    return logits.argmax(-1).tolist(), lps.gather(1, torch.tensor(out_ids)[:, None])[:, 0].tolist()


def engine_lps(out: dict) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


@contextlib.contextmanager
def make_engine(path: str, **kwargs) -> Iterator[Engine]:
    kwargs = {"max_total_tokens": 4096, "dtype": "float32", **kwargs}
    with Engine(path, **kwargs) as engine:
        yield engine
        engine.check_integrity()


@pytest.mark.parametrize("spec", [dict(r=4, targets=ALL_TARGETS),
                                  dict(r=8, targets=["q_proj", "v_proj"], alpha=16, rslora=True),
                                  dict(r=2, targets=["gate_proj", "down_proj", "o_proj"])],
                         ids=["all-targets", "qv-rslora", "mlp-o"])
def test_greedy_and_logprobs_equal_hf_peft(base_path, tmp_path, spec):
    pm = make_peft(base_path, seed=1, **spec)
    path = save_peft(pm, str(tmp_path / "adapter"))
    with make_engine(base_path) as engine:
        assert engine.load_lora_adapter("a", path)["adapter_version"] == 1
        outs = engine.generate(input_ids=PROMPTS, sampling_params=greedy(), lora_name="a",
                               return_logprob=True)
        base = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy())
    for ids, out in zip(PROMPTS, outs):
        ref_ids, ref_lps = hf_greedy(pm, ids, out["output_ids"])
        assert out["output_ids"] == ref_ids
        assert max(abs(a - b) for a, b in zip(engine_lps(out), ref_lps)) < 1e-4
        assert out["meta_info"]["lora_name"] == "a"
        assert out["meta_info"]["weight_versions"] == [
            {"version": "0", "start": 0, "end": 8, "adapter_version": 1}]
    assert base["output_ids"] != outs[0]["output_ids"]  # the adapter changes the model
    assert "adapter_version" not in base["meta_info"]["weight_versions"][0]


def test_mixed_batch_rows_equal_alone(base_path, tmp_path):
    """Two adapters and the base model in one batch: each row gets what it gets alone."""
    paths = [save_peft(make_peft(base_path, seed=s, r=r), str(tmp_path / f"a{s}"))
             for s, r in ((1, 4), (2, 8))]
    loras = ["a", "b", None, "a", None, "b"]
    prompts = [PROMPTS[i % 3] for i in range(len(loras))]
    with make_engine(base_path) as engine:
        engine.load_lora_adapter("a", paths[0])
        engine.load_lora_adapter("b", paths[1])
        steps = engine.scheduler.stats["steps"]
        mixed = engine.generate(input_ids=prompts, sampling_params=greedy(), lora_name=loras,
                                return_logprob=True)
        assert engine.scheduler.stats["steps"] - steps == 8  # one batch: all rows together
        alone = [engine.generate(input_ids=p, sampling_params=greedy(), lora_name=lo,
                                 return_logprob=True, cache_salt=f"alone{i}")
                 for i, (p, lo) in enumerate(zip(prompts, loras))]
    for m, a in zip(mixed, alone):
        assert m["output_ids"] == a["output_ids"]
        assert max(abs(x - y) for x, y in zip(engine_lps(m), engine_lps(a))) < 1e-5
    assert mixed[0]["output_ids"] != mixed[1]["output_ids"] != mixed[2]["output_ids"]


def test_pool_evicts_least_recently_used(base_path, tmp_path):
    """Three adapters, two pool slots: a step never holds more than two; the LRU one goes."""
    tensors = {n: adapter_tensors(make_peft(base_path, seed=s)) for n, s in zip("abc", (1, 2, 3))}
    with make_engine(base_path, max_loras_per_batch=2) as engine:
        for name, (t, cfg) in tensors.items():
            engine.load_lora_adapter_from_tensors(name, t, cfg)
        pool = engine.loras.pool
        alone = {n: engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(), lora_name=n,
                                    cache_salt=f"alone-{n}")["output_ids"] for n in "abc"}
        assert pool.uploads == 3  # a, b, then c over a (the least recently used)
        engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(), lora_name="c",
                        cache_salt="c-again")
        assert pool.uploads == 3  # c is resident
        engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(), lora_name="a",
                        cache_salt="a-again")
        assert pool.uploads == 4  # a was evicted
        # six rows over three adapters with two slots: admission keeps each step to two
        mixed = engine.generate(input_ids=[PROMPTS[0]] * 6, sampling_params=greedy(),
                                lora_name=list("abcabc"), cache_salt=[f"m{i}" for i in range(6)])
    assert [o["output_ids"] for o in mixed] == [alone[n] for n in "abcabc"]


def test_batch_over_scattered_pool_slots(base_path):
    """A step whose adapters sit in pool slots 0 and 2 (not a contiguous range)."""
    tensors = {n: adapter_tensors(make_peft(base_path, seed=s)) for n, s in zip("abc", (1, 2, 3))}
    with make_engine(base_path, max_loras_per_batch=3) as engine:
        for name, (t, cfg) in tensors.items():
            engine.load_lora_adapter_from_tensors(name, t, cfg)
        alone = {n: engine.generate(input_ids=PROMPTS[2], sampling_params=greedy(), lora_name=n,
                                    cache_salt=f"alone-{n}")["output_ids"] for n in "abc"}
        mixed = engine.generate(input_ids=[PROMPTS[2]] * 4, sampling_params=greedy(),
                                lora_name=["c", None, "a", "c"],
                                cache_salt=[f"m{i}" for i in range(4)])
        base = engine.generate(input_ids=PROMPTS[2], sampling_params=greedy())
    assert [o["output_ids"] for o in mixed] == [alone["c"], base["output_ids"], alone["a"],
                                                alone["c"]]


def test_adapter_update_reuses_no_old_kv_and_keeps_others(base_path, tmp_path):
    long_prompt = list(range(10, 90))
    old, other = make_peft(base_path, seed=1), make_peft(base_path, seed=5)
    new_t, new_cfg = adapter_tensors(make_peft(base_path, seed=2))
    with make_engine(base_path) as engine:
        engine.load_lora_adapter_from_tensors("a", *adapter_tensors(old))
        engine.load_lora_adapter_from_tensors("b", *adapter_tensors(other))
        for lora in ("a", "b", None):  # cache the prompt under each namespace
            engine.generate(input_ids=long_prompt, sampling_params=greedy(), lora_name=lora)
        again = engine.generate(input_ids=long_prompt, sampling_params=greedy(), lora_name="a")
        assert again["meta_info"]["cached_tokens"] == len(long_prompt) - 1
        res = engine.load_lora_adapter_from_tensors("a", new_t, new_cfg)
        assert res["adapter_version"] == 2
        after = engine.generate(input_ids=long_prompt, sampling_params=greedy(), lora_name="a",
                                return_logprob=True)
        base = engine.generate(input_ids=long_prompt, sampling_params=greedy())
        b = engine.generate(input_ids=long_prompt, sampling_params=greedy(), lora_name="b")
    assert after["meta_info"]["cached_tokens"] == 0  # nothing computed under version 1
    assert after["meta_info"]["weight_versions"][0]["adapter_version"] == 2
    assert base["meta_info"]["cached_tokens"] == len(long_prompt) - 1  # base KV still cached
    assert b["meta_info"]["cached_tokens"] == len(long_prompt) - 1  # so is the other adapter's
    with make_engine(base_path) as fresh:
        fresh.load_lora_adapter_from_tensors("a", new_t, new_cfg)
        ref = fresh.generate(input_ids=long_prompt, sampling_params=greedy(), lora_name="a",
                             return_logprob=True)
    assert after["output_ids"] == ref["output_ids"]
    assert max(abs(x - y) for x, y in zip(engine_lps(after), engine_lps(ref))) < 1e-5


def _start_long(engine: Engine, lora: str | None, results: list) -> threading.Thread:
    def run() -> None:
        results.append(engine.generate(input_ids=PROMPTS[1], lora_name=lora,
                                       sampling_params=greedy(150)))
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_decoding(engine: Engine, count: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = engine.scheduler.running
        if len(running) >= count and all(len(r.output_ids) > 3 for r in list(running)):
            return
        time.sleep(0.005)
    raise AssertionError("requests did not start decoding")


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_update_mid_generation_follows_pause_mode(base_path, mode):
    """Only the updated adapter's requests are paused; their spans name both versions."""
    v1, v2 = (adapter_tensors(make_peft(base_path, seed=s)) for s in (1, 2))
    with make_engine(base_path, chunked_prefill_size=64) as engine:
        engine.load_lora_adapter_from_tensors("a", *v1)
        results: dict[str | None, list] = {"a": [], None: []}
        threads = [_start_long(engine, lo, results[lo]) for lo in ("a", None)]
        _wait_decoding(engine, 2)
        engine.load_lora_adapter_from_tensors("a", *v2, pause_mode=mode)
        for t in threads:
            t.join(60)
    lora_out, base_out = results["a"][0], results[None][0]
    assert base_out["meta_info"]["num_retractions"] == 0  # the base request was not touched
    assert base_out["meta_info"]["finish_reason"]["type"] == "length"
    spans = lora_out["meta_info"]["weight_versions"]
    if mode == "abort":
        assert lora_out["meta_info"]["finish_reason"]["type"] == "abort"
        assert [s["adapter_version"] for s in spans] == [1]
        return
    assert [s["adapter_version"] for s in spans] == [1, 2]
    assert spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 150
    assert lora_out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)


def test_unload_ends_the_adapters_requests_wherever_they_are(base_path):
    """Running, queued and forked requests of the unloaded adapter end with an abort that says
    so; the base model's requests and the cache of other namespaces are untouched."""
    with make_engine(base_path) as engine:
        engine.load_lora_adapter_from_tensors("a", *adapter_tensors(make_peft(base_path, 1)))
        engine.generate(input_ids=PROMPTS[2] * 8, sampling_params=greedy())  # base KV cached
        sched = engine.scheduler
        results: dict[str, list] = {k: [] for k in ("run", "queued", "group", "base")}

        def start(key: str, lora: str | None, n: int = 1, tokens: int = 150) -> threading.Thread:
            ids = PROMPTS[1] if key == "run" else PROMPTS[0]
            thread = threading.Thread(target=lambda: results[key].append(engine.generate(
                input_ids=ids, lora_name=lora, sampling_params={**greedy(tokens), "n": n})))
            thread.start()
            return thread

        threads = [start("run", "a")]
        _wait_decoding(engine, 1)
        sched.hold_admission(True)
        threads += [start("queued", "a"), start("group", "a", n=2), start("base", None)]
        deadline = time.monotonic() + 30
        while sched.load().unfinished < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert engine.unload_lora_adapter("a")["success"]
        assert sched.load().unfinished == 1  # the base request waits on
        sched.hold_admission(False)
        for thread in threads:
            thread.join(60)
        again = engine.generate(input_ids=PROMPTS[2] * 8, sampling_params=greedy())
    assert again["meta_info"]["cached_tokens"] == len(PROMPTS[2]) * 8 - 1  # base KV kept
    ended = results["run"] + results["queued"] + results["group"][0]
    assert len(ended) == 4
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" and "unloaded" in
               o["meta_info"]["finish_reason"]["message"] for o in ended)
    assert results["base"][0]["meta_info"]["finish_reason"]["type"] == "length"


class _CompilingGrammar:
    """A grammar whose compile job finishes when the test says so."""

    def __init__(self) -> None:
        self.job: Future = Future()

    @property
    def ready(self) -> bool:
        return self.job.done()

    def error(self) -> str | None:
        return None


def test_unload_ends_a_request_still_compiling_its_grammar(base_path):
    """A request of the adapter that waits for its grammar ends at unload; it must not reach a
    forward step later, where its adapter is gone."""
    from hotswap.engine.core.request import Req
    from hotswap.engine.core.sampling_params import SamplingParams

    with make_engine(base_path) as engine:
        engine.load_lora_adapter_from_tensors("a", *adapter_tensors(make_peft(base_path, 1)))
        events: list[dict] = []
        grammar = _CompilingGrammar()
        engine.scheduler.submit([Req(rid="g", prompt_ids=PROMPTS[0], lora_name="a",
                                     params=SamplingParams.from_dict(greedy()),
                                     sink=events.append, grammar=grammar)])
        deadline = time.monotonic() + 10
        while engine.scheduler.load().compiling == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        engine.unload_lora_adapter("a")
        assert events and "unloaded" in events[-1]["meta_info"]["finish_reason"]["message"]
        grammar.job.set_result(None)
        out = engine.generate(input_ids=PROMPTS[2], sampling_params=greedy())
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert len(events) == 1


def test_bad_adapter_input_is_refused_and_engine_serves(base_path, tmp_path):
    good_t, good_cfg = adapter_tensors(make_peft(base_path, seed=1))
    name = next(n for n in good_t if "q_proj.lora_B" in n)
    cases = [
        ({**good_cfg, "r": 128}, good_t, "max_lora_rank"),
        ({**good_cfg, "target_modules": ["q_proj", "lm_head"]}, good_t, "lm_head"),
        (good_cfg, {**good_t, name: torch.zeros(3, 3)}, "shape"),
        (good_cfg, {k: v for k, v in good_t.items() if k != name}, "missing lora_B"),
        (good_cfg, {**good_t, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)},
         "lm_head"),
        ({**good_cfg, "use_dora": True}, good_t, "DoRA"),
    ]
    with make_engine(base_path, max_lora_rank=16) as engine:
        for cfg, tensors, words in cases:
            with pytest.raises(ValueError, match=words):
                engine.load_lora_adapter_from_tensors("bad", tensors, cfg)
        with pytest.raises(ValueError, match="not a directory"):
            engine.load_lora_adapter("bad", str(tmp_path / "missing"))
        with pytest.raises(ValueError, match="lora_name 'nope' is not a loaded LoRA adapter"):
            engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(), lora_name="nope")
        with pytest.raises(ValueError, match="not a loaded"):
            engine.unload_lora_adapter("nope")
        engine.load_lora_adapter_from_tensors("good", good_t, good_cfg)
        out = engine.generate(input_ids=PROMPTS[:2], sampling_params=greedy(),
                              lora_name=["good", None])
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in out)
        assert engine.unload_lora_adapter("good")["success"]
        with pytest.raises(ValueError, match="not a loaded"):
            engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(), lora_name="good")
        engine.load_lora_adapter_from_tensors("good", good_t, good_cfg)  # reload: a new version
        again = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(),
                                lora_name="good")
    assert again["meta_info"]["adapter_version"] == 2
    assert again["output_ids"] == out[0]["output_ids"]


def test_http_generate_and_openai_model_field(base_path, tmp_path):
    """/generate takes lora_name; OpenAI's `model` names an adapter as "base:adapter" or by
    its name, and any other name means the base model."""
    import httpx

    path = save_peft(make_peft(base_path, seed=1), str(tmp_path / "adapter"))
    prompt = "The quick brown fox"
    with make_engine(base_path, served_model_name="tiny") as engine, serve(engine) as server:
        remote = RemoteEngine(server.url)
        assert remote.load_lora_adapter("a", path)["adapter_version"] == 1
        want = {lo: engine.generate(prompt=prompt, sampling_params=greedy(), lora_name=lo)["text"]
                for lo in ("a", None)}
        assert want["a"] != want[None]
        got = remote.generate(prompt=prompt, sampling_params=greedy(), lora_name="a")
        assert got["text"] == want["a"] and got["meta_info"]["adapter_version"] == 1
        with httpx.Client(base_url=server.url, timeout=30) as http:
            models = [m["id"] for m in http.get("/v1/models").json()["data"]]
            assert models == ["tiny", "tiny:a"]
            for model, lora in (("tiny:a", "a"), ("a", "a"), ("tiny", None), ("gpt-x", None)):
                body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                        "ignore_eos": True}
                text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
                assert text == want[lora], model
            bad = http.post("/v1/completions", json={**body, "model": "tiny:nope"})
            assert bad.status_code == 400 and "nope" in bad.json()["error"]["message"]
            bad = http.post("/generate", json={"text": prompt, "lora_name": "nope"})
            assert bad.status_code == 400
        assert remote.unload_lora_adapter("a")["success"]


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_adapter_equals_hf_peft(real_model_path, tmp_path):
    pm = make_peft(real_model_path, seed=3, r=8, alpha=16)
    path = save_peft(pm, str(tmp_path / "adapter"))
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2],
               [1, 4093, 198, 20555, 346, 1463, 12257]]  # one HF forward each
    with make_engine(real_model_path, max_total_tokens=2048, max_lora_rank=8) as engine:
        engine.load_lora_adapter("smol", path)
        outs = engine.generate(input_ids=prompts, sampling_params=greedy(6), lora_name="smol",
                               return_logprob=True)
    for ids, out in zip(prompts, outs):
        ref_ids, ref_lps = hf_greedy(pm, ids, out["output_ids"])
        assert out["output_ids"] == ref_ids
        # As test_real_model: 30 float32 layers through oneDNN and through HF's BLAS round
        # apart by up to ~2e-4 on some CPUs (1.5e-4 measured on an AMD EPYC).
        assert max(abs(a - b) for a, b in zip(engine_lps(out), ref_lps)) < 1e-3


def test_release_memory_frees_the_adapter_pool_and_resume_refills_it(base_path, tmp_path):
    """release_memory_occupation(["weights"]) frees the LoRA pool's buffers with the weights;
    after resume and a weight push the adapter serves exactly what it served before."""
    path = save_peft(make_peft(base_path, seed=5), str(tmp_path / "adapter"))
    with make_engine(base_path) as engine:
        engine.load_lora_adapter("a", path)
        before = engine.generate(input_ids=PROMPTS, sampling_params=greedy(), lora_name="a",
                                 return_logprob=True)
        pool = engine.loras.pool
        held = pool.nbytes
        assert held > 0
        assert engine.release_memory_occupation(["weights"])["success"]
        assert pool.nbytes == 0
        assert engine.resume_memory_occupation(["weights"])["success"]
        assert pool.nbytes == held
        assert engine.update_weights_from_disk(base_path)["success"]
        uploads = pool.uploads
        after = engine.generate(input_ids=PROMPTS, sampling_params=greedy(), lora_name="a",
                                return_logprob=True)
        assert pool.uploads == uploads + 1  # refilled from the host copy
    for got, want in zip(after, before):
        assert got["output_ids"] == want["output_ids"]
        assert engine_lps(got) == pytest.approx(engine_lps(want), abs=1e-6)


def _trainer_logprobs(pm, outs: list[dict], prompts: list[list[int]]) -> list[list[float]]:
    """The trainer's own logprob of every token the engine sampled (teacher-forced)."""
    result = []
    for out, ids in zip(outs, prompts):
        new = out["output_ids"]
        logits = pm(input_ids=torch.tensor([ids + new])).logits[0, len(ids) - 1: -1].float()
        lps = torch.log_softmax(logits, -1).gather(1, torch.tensor(new)[:, None])[:, 0]
        result.append(lps)
    return result


@pytest.mark.slow
def test_lora_rl_loop_engine_follows_trainer(base_path, capsys):
    """PEFT trains only the adapter and pushes it (PEFT names) over a gloo group every step;
    the engine's sampled-token logprobs equal the trainer's adapter each step."""
    from hotswap.weight_sync import WeightSender
    from hotswap.weight_sync.group import free_port

    torch.manual_seed(0)
    pm = make_peft(base_path, seed=7, r=4)
    pm.train()
    base_before = {n: p.detach().clone() for n, p in pm.named_parameters() if "lora_" not in n}
    trainable = [p for p in pm.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in pm.named_parameters() if p.requires_grad)
    optim = torch.optim.Adam(trainable, lr=1e-2)
    full_bytes = sum(t.nbytes for t in pm.get_base_model().state_dict().values())
    prompts = [PROMPTS[0], PROMPTS[1]]
    sender = WeightSender("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=60)
    with make_engine(base_path) as engine:
        tensors, cfg = adapter_tensors(pm)
        engine.load_lora_adapter_from_tensors("policy", tensors, cfg)
        base_ref = engine.generate(input_ids=prompts[0], sampling_params=greedy(),
                                   return_logprob=True)
        gaps, prev = [], None
        for step in range(3):
            outs = engine.generate(input_ids=prompts, lora_name="policy", return_logprob=True,
                                   sampling_params={"max_new_tokens": 8, "temperature": 1.0,
                                                    "n": 2, "seed": step, "ignore_eos": True})
            assert {o["meta_info"]["adapter_version"] for o in outs} == {step + 1}
            mine = _trainer_logprobs(pm, outs, [p for p in prompts for _ in range(2)])
            gaps.append(max(float((lp.detach() - torch.tensor(engine_lps(o))).abs().max())
                            for lp, o in zip(mine, outs)))
            # reward: how often a token is even; REINFORCE with a mean baseline
            rewards = torch.tensor([sum(t % 2 == 0 for t in o["output_ids"]) / 8 for o in outs])
            loss = -sum((r - rewards.mean()) * lp.sum() for r, lp in zip(rewards, mine))
            optim.zero_grad()
            loss.backward()
            optim.step()
            named = list(peft.get_peft_model_state_dict(pm).items())
            push_bytes = sum(t.nbytes for _, t in named)
            replies = sender.send([(n, t.detach()) for n, t in named], [engine],
                                  lora_name="policy")
            assert replies[0]["adapter_version"] == step + 2
            if prev is not None:
                assert engine_lps(outs[0]) != prev  # the pushed adapter changed the policy
            prev = engine_lps(outs[0])
        base_after = engine.generate(input_ids=prompts[0], sampling_params=greedy(),
                                     return_logprob=True)
        sender.close([engine])
    with capsys.disabled():
        print(f"\nLoRA RL loop: |engine - trainer logprob| per step "
              f"{[f'{g:.1e}' for g in gaps]}; bytes per push: adapter {push_bytes:,} vs "
              f"full weights {full_bytes:,} ({full_bytes / push_bytes:.0f}x)")
    assert max(gaps) < 1e-4
    assert all(torch.equal(p, base_before[n]) for n, p in pm.named_parameters()
               if "lora_" not in n)
    assert base_after["output_ids"] == base_ref["output_ids"]  # the base model is untouched
    assert base_after["meta_info"]["cached_tokens"] == len(prompts[0]) - 1
    assert max(abs(a - b) for a, b in zip(engine_lps(base_after), engine_lps(base_ref))) < 1e-5

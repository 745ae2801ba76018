"""The learned draft (speculative="draft"): what it proposes is the reference draft's
(engine/speculative/train_draft.py's DraftNet on HF's states), what is emitted is the target's
(greedy token for token; sampled drafts by a chi-square test that a wrong rule fails), and its
version follows the policy's through every kind of update.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import transformers
from conftest import write_tiny_chat_model
from test_speculative import chi_square_p, generate, greedy, logprobs, make_engine, pin_length

from hotswap.engine import Engine
from hotswap.engine.config import ModelConfig
from hotswap.engine.models.draft import save_draft
from hotswap.engine.speculative import draft as draft_module
from hotswap.engine.speculative.train_draft import DraftNet
from hotswap.weight_sync import DeltaTracker, WeightSender
from hotswap.weight_sync.group import free_port

PROMPTS = [[51, 210, 33, 91, 77] * 4, list(range(300, 340)), [12, 13, 14, 15, 16, 12, 13, 14]]


def policy(path: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def draft_net(path: str, token_map: list[int], seed: int = 0) -> DraftNet:
    """A draft started from the policy's last layer (fc: E[x] + F), then moved at random."""
    torch.manual_seed(seed)
    net = DraftNet(ModelConfig.from_path(path), token_map).init_from_policy(policy(path))
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return net


def write_draft(path: str, token_map: list[int], seed: int = 0, out: str | None = None,
                **meta) -> DraftNet:
    net = draft_net(path, token_map, seed)
    save_draft(out or os.path.join(path, "draft"), net.named_tensors(), token_map,
               ModelConfig.from_path(path), **meta)
    return net


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = write_tiny_chat_model(str(tmp_path_factory.mktemp("draft")), num_hidden_layers=3)
    write_draft(path, list(range(0, 400, 2)))  # half the vocabulary, the EOS (2) among it
    return path


def draft_engine(path: str, **kwargs) -> Engine:
    return make_engine(path, speculative="draft", **kwargs)


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_equals_plain(model_path, page_size):
    with make_engine(model_path) as engine:
        plain = generate(engine, PROMPTS, greedy(40))
    with draft_engine(model_path, page_size=page_size) as engine:
        pin_length(engine, 3)
        got = generate(engine, PROMPTS, greedy(40))
        totals = engine.get_load()["totals"]
    assert totals["spec_draft_tokens"] > 0
    for a, b in zip(plain, got):
        assert a["output_ids"] == b["output_ids"]
        assert max(abs(x - y) for x, y in zip(logprobs(a), logprobs(b))) < 1e-5


def test_seeded_sampling_equals_plain(model_path):
    """Seeded rows draft with their own uniforms (the inverse CDF of q) under the point-mass
    rule: the same tokens as without speculation."""
    params = [{"max_new_tokens": 32, "temperature": t, "ignore_eos": True, "seed": 7 + i}
              for i, t in enumerate((1.0, 0.7, 1.3))]
    with make_engine(model_path) as engine:
        plain = generate(engine, PROMPTS, params)
    with draft_engine(model_path) as engine:
        pin_length(engine, 3)
        got = generate(engine, PROMPTS, params)
        totals = engine.get_load()["totals"]
    assert totals["spec_draft_tokens"] > 0
    for a, b in zip(plain, got):
        assert a["output_ids"] == b["output_ids"]
        assert max(abs(x - y) for x, y in zip(logprobs(a), logprobs(b))) < 1e-5


def test_a_coupled_draft_covers_most_of_the_window_around_the_targets_uniform():
    """A seeded row drafts the token whose interval of q's CDF covers most of u +- the window
    (u: the uniform the target draws that position with): q's inverse CDF at u for a narrow
    window, q's argmax for a wide one."""
    from types import SimpleNamespace

    from hotswap.engine.core.sampling_params import SamplingParams, seeded_uniform

    q = torch.tensor([0.1, 0.05, 0.4, 0.05, 0.3, 0.1])
    assert int(draft_module.coupled_pick(q, 0.12, window=1e-9)) == 1  # [0.10, 0.15)
    assert int(draft_module.coupled_pick(q, 0.97, window=1e-9)) == 5
    assert int(draft_module.coupled_pick(q, 0.97, window=1.0)) == 2
    assert int(draft_module.coupled_pick(q, 0.97)) == 4  # [0.6, 0.9) covers most of [0.67, 1]
    assert int(draft_module.coupled_pick(q * 3, 0.97)) == 4  # unnormalised q alike
    for seed in range(20):  # the draw: at the row's own uniform for that position
        logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(seed)) * 3
        params = SamplingParams(temperature=0.8, seed=seed)
        req = SimpleNamespace(params=params, output_ids=[5, 6, 7])
        # A seeded row's q is the draft's own: the proposal scale is for sampled rows only.
        draft = SimpleNamespace(model=SimpleNamespace(proposal_scale=0.5))
        drafted = draft_module.LearnedDraft._draw(draft, logits, [req], [draft_module.COUPLED],
                                                  2, [[]], [0], None)
        want = draft_module.coupled_pick((logits[0] / 0.8).softmax(-1), seeded_uniform(seed, 5))
        assert int(drafted) == int(want)


@pytest.mark.parametrize("scale", [1.0, 0.6])
def test_drafts_are_the_reference_drafts(model_path, tmp_path, monkeypatch, scale):
    """Each step's q (sampled rows) equals DraftNet's chain over HF's states: the teacher-forced
    level at the request's last token, then level j + 1 over the drafted tokens, at the
    request's temperature times the config's proposal_scale."""
    seen = []
    propose = draft_module.LearnedDraft.propose

    def spy(self, reqs, lengths, generator):
        fills = [list(r.fill_ids) for r in reqs]
        drafts, sampled = propose(self, reqs, lengths, generator)
        seen.extend(zip(fills, drafts, sampled))
        return drafts, sampled

    monkeypatch.setattr(draft_module.LearnedDraft, "propose", spy)
    folder = str(tmp_path / "draft")
    write_draft(model_path, list(range(0, 400, 2)), out=folder, proposal_scale=scale)
    with draft_engine(model_path, speculative_draft_path=folder) as engine:
        assert engine.get_load()["speculative"]["proposal_scale"] == scale
        pin_length(engine, 3)
        engine.generate(input_ids=PROMPTS[:2], sampling_params={
            "max_new_tokens": 12, "temperature": 0.8, "ignore_eos": True})
    hf = policy(model_path)
    net = draft_net(model_path, list(range(0, 400, 2)))
    head = hf.get_output_embeddings().weight
    checked = 0
    for fill, drafts, sampled in seen[:8]:
        assert sampled is not None and len(drafts) == 3
        ids = torch.tensor([fill + drafts[:-1]])
        with torch.no_grad():
            states = hf.get_decoder()(input_ids=ids).last_hidden_state
            levels = net.forward_levels(ids, states, head, 3,
                                        embed_weight=hf.get_input_embeddings().weight)
        n = len(fill)
        for j in range(3):
            want = torch.softmax(levels[j].logits[0, n - 1 + j] / (0.8 * scale), -1)
            assert torch.allclose(sampled.q[j], want, atol=1e-4), (j, fill[-3:])
            checked += 1
    assert checked == 24


# The emitted distribution with sampled drafts: the min(1, p/q) rule against plain sampling,
# unseeded, over the third token of many samples of one prompt (a 64-token vocabulary).

SAMPLES = 3000


@pytest.fixture(scope="module")
def small_vocab_path(tmp_path_factory) -> str:
    path = write_tiny_chat_model(str(tmp_path_factory.mktemp("draft64")), num_hidden_layers=2,
                                 vocab_size=64)
    write_draft(path, list(range(8, 56)))  # tokens outside the map too: the residual covers them
    return path


def third_tokens(engine: Engine) -> dict[int, int]:
    outs = engine.generate(input_ids=[[40, 41, 42] * 5] * SAMPLES, sampling_params={
        "max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True})
    counts: dict[int, int] = {}
    for o in outs:
        counts[o["output_ids"][2]] = counts.get(o["output_ids"][2], 0) + 1
    return counts


def keep_every_draft(x, checks, generator):
    """A wrong rule: every sampled draft is emitted as drawn from q."""
    return checks.tokens


@pytest.mark.parametrize(("rule", "scale"), [(None, 1.0), (keep_every_draft, 1.0), (None, 0.5)])
def test_sampled_drafts_emit_the_targets_distribution(small_vocab_path, monkeypatch, rule,
                                                      scale):
    """The min(1, p/q) rule keeps the third token within p = 1e-3 of plain sampling, with the
    draft's own q or a sharper one (proposal_scale 0.5); keeping every draft (q's law) moves it
    far past."""
    from collections import Counter

    with make_engine(small_vocab_path, max_running_requests=256, seed=1) as engine:
        plain = Counter(third_tokens(engine))
    if rule is not None:
        monkeypatch.setattr("hotswap.engine.executor.sampling.check_sampled", rule)
    with draft_engine(small_vocab_path, max_running_requests=256, seed=2) as engine:
        engine.runner.model.draft.proposal_scale = scale
        pin_length(engine, 2)
        got = Counter(third_tokens(engine))
        totals = engine.get_load()["totals"]
    p = chi_square_p(got, plain)
    assert totals["spec_draft_tokens"] >= SAMPLES
    if rule is None:
        assert 0 < totals["spec_accepted_tokens"] < totals["spec_draft_tokens"]
        assert p > 1e-3
    else:
        assert p < 1e-3


# Versions: the draft's follows the policy's through every route, or stays behind (stale).

def moved_policy(path: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + torch.randn(p.shape, generator=gen) * 0.05)
            for n, p in policy(path).named_parameters()]


def draft_state(engine: Engine) -> tuple[str, str, bool]:
    spec = engine.get_load()["speculative"]
    return engine.get_weight_version(), spec["draft_version"], spec["stale"]


def assert_exact(engine: Engine, weights: list[tuple[str, torch.Tensor]], path: str) -> None:
    """Greedy tokens and logprobs equal a fresh engine (no speculation) on `weights`."""
    pin_length(engine, 3)
    got = generate(engine, PROMPTS[:2], greedy(24))
    with make_engine(path) as fresh:
        fresh.update_weights_from_tensor(weights)
        want = generate(fresh, PROMPTS[:2], greedy(24))
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        assert max(abs(x - y) for x, y in zip(logprobs(a), logprobs(b))) < 1e-5


def test_versions_through_updates(model_path):
    new_draft = draft_net(model_path, [0], seed=5).named_tensors()  # values only: any map
    with draft_engine(model_path) as engine:
        assert draft_state(engine) == ("0", "0", False)
        # policy only: the draft is stale, outputs stay exact
        policy1 = moved_policy(model_path, 1)
        engine.update_weights_from_tensor(policy1, weight_version="1")
        assert draft_state(engine) == ("1", "0", True)
        assert_exact(engine, policy1, model_path)
        # policy and draft in one update: one version covers both
        policy2 = moved_policy(model_path, 2)
        engine.update_weights_from_tensor(policy2 + new_draft, weight_version="2")
        assert draft_state(engine) == ("2", "2", False)
        name, value = new_draft[0]
        assert torch.equal(engine.runner.weight_map[name].view, value)
        assert_exact(engine, policy2, model_path)
        # refused (a draft tensor of the wrong shape): neither moves
        bad = [(n, t[:-1]) if n == "draft.fc.weight" else (n, t) for n, t in new_draft]
        with pytest.raises(ValueError, match="draft.fc.weight"):
            engine.update_weights_from_tensor(moved_policy(model_path, 3) + bad,
                                              weight_version="3")
        assert draft_state(engine) == ("2", "2", False)
        # aborted two-phase update: neither moves, the weights are the old ones
        engine.prepare_weights_from_tensor(moved_policy(model_path, 4) + new_draft)
        engine.abort_weight_update()
        assert draft_state(engine) == ("2", "2", False)
        assert_exact(engine, policy2, model_path)
        # committed two-phase update of the draft only
        engine.prepare_weights_from_tensor(new_draft)
        engine.commit_weight_update(weight_version="5")
        assert draft_state(engine) == ("5", "5", False)


def test_versions_through_delta_and_distributed_pushes(model_path):
    named_draft = draft_net(model_path, [0], seed=6).named_tensors()
    with draft_engine(model_path) as engine:
        tracker = DeltaTracker(torch.float32)
        tracker.committed_full("0", [(n, s.view) for n, s in engine.runner.weight_map.items()])
        delta, _ = tracker.encode([(n, t + 0.01) for n, t in named_draft[:2]])
        engine.update_weights_from_tensor(delta, load_format="delta", weight_version="1")
        assert draft_state(engine) == ("1", "1", False)
        push = WeightSender("127.0.0.1", free_port(), world_size=2, group_name="draft",
                            backend="gloo", timeout_s=60)
        push.send(moved_policy(model_path, 7), [engine], weight_version="2")
        assert draft_state(engine) == ("2", "1", True)
        push.send(moved_policy(model_path, 8) + named_draft, [engine], weight_version="3")
        assert draft_state(engine) == ("3", "3", False)
        push.close([engine])
        assert torch.equal(engine.runner.weight_map[named_draft[-1][0]].view, named_draft[-1][1])


def test_draft_below_the_floor_switches_off_and_a_new_draft_switches_on(model_path, caplog,
                                                                      monkeypatch):
    """A draft that proposes nothing the policy emits (its token map: one token) falls under
    the floor and stops drafting with a warning and a metric; drafts pushed with the next update
    start it again."""
    monkeypatch.setattr(draft_module, "FLOOR_TOKENS", 64)
    path = write_tiny_chat_model(str(model_path) + "-floor", num_hidden_layers=2)
    write_draft(path, [5])
    caplog.set_level(logging.WARNING, logger="hotswap.engine.speculative.draft")
    with draft_engine(path) as engine:
        pin_length(engine, 4)
        engine.generate(input_ids=PROMPTS, sampling_params=greedy(40))
        spec = engine.get_load()["speculative"]
        assert not spec["active"] and "below the floor" in spec["off_reason"]
        assert any("switched off" in r.message for r in caplog.records)
        drafted = engine.get_load()["totals"]["spec_draft_tokens"]
        engine.generate(input_ids=PROMPTS, sampling_params=greedy(20))
        assert engine.get_load()["totals"]["spec_draft_tokens"] == drafted  # off: no drafts
        from hotswap.engine.server.metrics import EngineCollector

        gauges = {m.name: m.samples[0].value for m in EngineCollector(engine).collect()
                  if m.name.startswith("hotswap_spec_draft")}
        assert gauges["hotswap_spec_draft_active"] == 0.0
        engine.update_weights_from_tensor(draft_net(path, [5], seed=9).named_tensors())
        assert engine.get_load()["speculative"]["active"]
        engine.generate(input_ids=PROMPTS[:1], sampling_params=greedy(8))
        assert engine.get_load()["totals"]["spec_draft_tokens"] > drafted


def test_bad_drafts_refused(model_path, tmp_path):
    path = write_tiny_chat_model(str(tmp_path / "m"), num_hidden_layers=2)
    with pytest.raises(ValueError, match="missing file"):
        draft_engine(path)
    other = write_tiny_chat_model(str(tmp_path / "wide"), num_hidden_layers=2, hidden_size=96)
    write_draft(other, [1, 2])
    with pytest.raises(ValueError, match="hidden_size"):
        draft_engine(path, speculative_draft_path=os.path.join(other, "draft"))
    with pytest.raises(ValueError, match="speculative_draft_path needs"):
        make_engine(path, speculative_draft_path=os.path.join(other, "draft"))
    sharp = str(tmp_path / "sharp")
    for bad in (0, -1, "0.5", True):
        write_draft(path, [1, 2], out=sharp, proposal_scale=bad)
        with pytest.raises(ValueError, match="proposal_scale"):
            draft_engine(path, speculative_draft_path=sharp)


def test_memory_release_takes_the_drafts_kv_and_states(model_path):
    with make_engine(model_path) as engine:
        plain = generate(engine, PROMPTS[:2], greedy(24))
    with draft_engine(model_path) as engine:
        pin_length(engine, 3)
        features = engine.runner.features.numel()
        assert engine.release_memory_occupation(["kv_cache"])["success"]
        assert engine.runner.features.numel() == 0
        assert not engine.scheduler.spec.learned.kv.allocated
        assert engine.resume_memory_occupation(["kv_cache"])["success"]
        assert engine.runner.features.numel() == features
        got = generate(engine, PROMPTS[:2], greedy(24))
        assert engine.get_load()["totals"]["spec_draft_tokens"] > 0
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in plain]

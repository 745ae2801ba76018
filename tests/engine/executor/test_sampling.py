from __future__ import annotations

import math

import pytest
import torch

from hotswap.engine.core.sampling_params import MAX_N, SamplingParams, seeded_uniform
from hotswap.engine.executor.sampling import Sampler
from hotswap.engine.executor.sampling_batch_info import SamplingBatchInfo, process_logits

EOS = 0


def build(params, vocab, outputs=None, prompts=None, steps=None, eos=(EOS,)):
    bsz = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(bsz)]
    prompts = prompts if prompts is not None else [[1] for _ in range(bsz)]
    steps = steps if steps is not None else [len(o) for o in outputs]
    return SamplingBatchInfo.build(params, outputs, prompts, steps, list(eos), vocab, "cpu")


def sample(logits, params, return_logprob=True, top=0, generator=None, grammar=None, **kw):
    """`grammar` [B, V] bool, True = allowed: every row is a grammar row with that mask."""
    info = build(params, logits.shape[1], **kw)
    if grammar is not None:
        info.grammar_rows = torch.arange(len(params))
        info.grammar_bitmask = torch.zeros(grammar.shape).masked_fill_(~grammar, -math.inf)
    return Sampler().sample(logits, info, return_logprob, top, generator)


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """docs/api.md#sampling-parameters's distribution, the slow, obvious way, in float64."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if p.top_k > 0:
        keep[p.top_k:] = False
    renorm = sorted_p * keep / (sorted_p * keep).sum()
    if p.top_p < 1.0:
        keep &= (renorm.cumsum(0) - renorm) < p.top_p
    if p.min_p > 0.0:
        keep &= sorted_p >= p.min_p * sorted_p[0]
    out = torch.zeros_like(probs)
    out[order] = sorted_p * keep
    return out / out.sum()


def test_greedy_is_argmax_with_untruncated_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(8, 50) * 3
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 8
    out = sample(logits, params, top=4)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    logp = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(out.logprobs.double(), logp.max(-1).values, atol=1e-5, rtol=0)
    ref_values, ref_ids = logp.topk(4, -1)
    assert torch.equal(out.top_logprob_ids, ref_ids)
    torch.testing.assert_close(out.top_logprob_values.double(), ref_values, atol=1e-5, rtol=0)


def test_greedy_without_logprobs_and_tiny_temperature():
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    out = sample(logits, [SamplingParams(temperature=1e-7)] * 4, return_logprob=False)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_logprob_ids is None


def test_top_k_one_is_greedy():
    torch.manual_seed(2)
    logits = torch.randn(16, 100)
    out = sample(logits, [SamplingParams(temperature=0.8, top_k=1)] * 16)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert torch.all(out.logprobs == 0.0)


def test_logits_are_not_modified():
    torch.manual_seed(3)
    logits = torch.randn(3, 40)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, repetition_penalty=1.3, frequency_penalty=0.5,
                             logit_bias={2: 1.0}, min_new_tokens=4, top_p=0.9)] * 3
    sample(logits, params, outputs=[[5, 6]] * 3, top=3)
    assert torch.equal(logits, before)


def random_params(rng: torch.Generator, seed: int | None) -> SamplingParams:
    kind = int(torch.randint(0, 5, (1,), generator=rng))
    kinds = [
        {"temperature": 0.0},
        {"temperature": 0.9},
        {"temperature": 1.1, "top_p": 0.9},
        {"temperature": 0.7, "top_k": 40, "min_p": 0.02},
        {"top_k": 200, "top_p": 0.95, "repetition_penalty": 1.2, "presence_penalty": 0.3},
    ]
    return SamplingParams(seed=seed, **kinds[kind])


@pytest.mark.parametrize("vocab", [49152, 1003])
@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.8, top_p=0.9, seed=12),
        SamplingParams(top_k=50, min_p=0.01, seed=13, frequency_penalty=0.4),
        SamplingParams(top_p=0.97, seed=14),  # high entropy: the topk slice has to grow
    ],
)
def test_seeded_row_is_batch_invariant(vocab, target):
    rng = torch.Generator().manual_seed(vocab)
    bsz = 64
    batch_logits = torch.randn(2, bsz, vocab, generator=rng) * 2.5
    others = [random_params(rng, None if i % 2 else 1000 + i) for i in range(bsz)]
    outputs = [[int(t) for t in torch.randint(0, vocab, (5,), generator=rng)] for _ in range(bsz)]
    for step in range(2):
        row_logits = batch_logits[step, 0:1]
        alone = sample(row_logits, [target], top=5, outputs=[outputs[0]], steps=[step])
        for pos in (0, 17, 63):
            logits = batch_logits[step].clone()
            logits[pos] = row_logits[0]
            params = list(others)
            params[pos] = target
            outs = list(outputs)
            outs[pos] = outputs[0]
            steps = [step] * bsz
            batch = sample(logits, params, top=5, outputs=outs, steps=steps,
                           generator=torch.Generator().manual_seed(pos))
            assert batch.next_token_ids[pos] == alone.next_token_ids[0]
            assert batch.logprobs[pos] == alone.logprobs[0]
            assert torch.equal(batch.top_logprob_ids[pos], alone.top_logprob_ids[0])
            assert torch.equal(batch.top_logprob_values[pos], alone.top_logprob_values[0])


def test_seeded_draws_depend_on_seed_and_step_only():
    assert seeded_uniform(5, 3) == seeded_uniform(5, 3)
    draws = {seeded_uniform(5, step) for step in range(100)} | {seeded_uniform(s, 3)
                                                                for s in range(100)}
    assert len(draws) == 199 and all(0.0 <= u < 1.0 for u in draws)
    logits = torch.randn(1, 1000)
    tokens = {int(sample(logits, [SamplingParams(seed=7)], steps=[s]).next_token_ids)
              for s in range(20)}
    assert len(tokens) > 5  # the step advances the stream


def test_n_samples_get_distinct_seeds():
    p = SamplingParams(seed=3, n=4)
    seeds = [p.for_sample(i).seed for i in range(4)]
    assert seeds[0] == 3 and len(set(seeds)) == 4
    assert all(p.for_sample(i).n == 1 for i in range(4))
    assert SamplingParams(n=2).for_sample(1).seed is None


def test_unseeded_rows_follow_the_generator():
    logits = torch.randn(32, 500)
    params = [SamplingParams()] * 32

    def draw(seed):
        return sample(logits, params, generator=torch.Generator().manual_seed(seed)).next_token_ids

    assert torch.equal(draw(1), draw(1))
    assert not torch.equal(draw(1), draw(2))


DISTRIBUTION_CASES = [
    {"temperature": 0.7},
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 1.0, "top_p": 0.6},
    {"temperature": 1.3, "min_p": 0.15},
    {"temperature": 1.3, "top_k": 8, "top_p": 0.8, "min_p": 0.05},
    {"temperature": 0.5, "top_p": 0.999},
]


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("case", DISTRIBUTION_CASES)
def test_empirical_distribution_matches_reference(case, seeded):
    draws, vocab = 20000, 20
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 1.5
    logits = row.expand(draws, vocab).contiguous()
    p = SamplingParams(**case)
    params = [SamplingParams(**case, seed=i) for i in range(draws)] if seeded else [p] * draws
    out = sample(logits, params, generator=torch.Generator().manual_seed(0))
    ref = reference_probs(row, p)
    counts = torch.bincount(out.next_token_ids, minlength=vocab).double()
    support = ref > 0
    assert counts[~support].sum() == 0, "sampled a token the truncation removes"
    expected = ref[support] * draws
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * max(dof, 1)) + 6, (chi2, dof)
    # the logprob reported with each draw is that of the distribution it was drawn from
    torch.testing.assert_close(out.logprobs.double(), ref.log()[out.next_token_ids],
                               atol=2e-6, rtol=0)


def test_top_p_support_on_a_large_flat_vocabulary():
    vocab = 5000  # nearly flat: the nucleus holds thousands of tokens
    rng = torch.Generator().manual_seed(4)
    logits = torch.randn(64, vocab, generator=rng) * 0.3
    p = SamplingParams(top_p=0.9)
    out = sample(logits, [p] * 64, top=3, generator=rng)
    for i in range(64):
        ref = reference_probs(logits[i], p)
        tok = int(out.next_token_ids[i])
        assert ref[tok] > 0
        assert abs(float(out.logprobs[i]) - math.log(ref[tok])) < 1e-5


def test_top_logprobs_sorted_and_consistent_with_the_token():
    torch.manual_seed(5)
    vocab = 30
    logits = torch.randn(6, vocab) * 2
    params = [SamplingParams(temperature=0.9, top_k=4), SamplingParams(temperature=0.6),
              SamplingParams(top_p=0.7), SamplingParams(min_p=0.3),
              SamplingParams(temperature=0.0), SamplingParams(top_k=2, seed=3)]
    out = sample(logits, params, top=6)
    for i, p in enumerate(params):
        values, ids = out.top_logprob_values[i], out.top_logprob_ids[i]
        assert torch.all(values[:-1] >= values[1:])
        ref_p = reference_probs(logits[i], p) if not p.is_greedy else torch.softmax(
            logits[i].double(), -1)
        finite = torch.isfinite(values)
        torch.testing.assert_close(values[finite].double(), ref_p[ids[finite]].log(),
                                   atol=2e-6, rtol=0)
        assert torch.all(ref_p[ids[~finite]] == 0)
        assert int(finite.sum()) == min(6, int((ref_p > 0).sum()))
        tok = int(out.next_token_ids[i])
        if tok in ids.tolist():
            assert values[ids.tolist().index(tok)] == out.logprobs[i]


def test_raw_logprob_mode():
    torch.manual_seed(6)
    logits = torch.randn(4, 40) * 2
    params = [SamplingParams(temperature=0.5, top_k=3, logprob_mode="raw"),
              SamplingParams(temperature=0.5, top_k=3),
              SamplingParams(temperature=0.0, repetition_penalty=2.0, logprob_mode="raw"),
              SamplingParams(logit_bias={1: 5.0}, logprob_mode="raw")]
    out = sample(logits, params, top=3, outputs=[[1, 2]] * 4)
    raw = torch.log_softmax(logits.double(), -1)
    for i in (0, 2, 3):
        tok = out.next_token_ids[i]
        assert abs(float(out.logprobs[i]) - float(raw[i, tok])) < 1e-5
        values, ids = raw[i].topk(3)
        assert torch.equal(out.top_logprob_ids[i], ids)
        torch.testing.assert_close(out.top_logprob_values[i].double(), values, atol=1e-5, rtol=0)
    processed = reference_probs(logits[1], params[1]).log()
    assert abs(float(out.logprobs[1]) - float(processed[out.next_token_ids[1]])) < 1e-5


def test_penalties_change_logits_exactly_as_defined():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 4.0]])
    # prompt [1, 2], output [2, 3, 3]: repetition covers 1, 2, 3; counts {2: 1, 3: 2}
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    info = build([p], 6, outputs=[[2, 3, 3]], prompts=[[1, 2]])
    x = process_logits(logits, info)
    # token 1: -1 * 2 (no output occurrences); token 2: 0.5 / 2 - 0.5 - 0.25;
    # token 3: -3 * 2 - 2 * 0.5 - 0.25
    expected = torch.tensor([[2.0, -2.0, -0.5, -7.25, 1.0, 4.0]])
    torch.testing.assert_close(x, expected, atol=0, rtol=0)


def test_frequency_and_presence_only_count_output_tokens():
    logits = torch.zeros(1, 5)
    p = SamplingParams(frequency_penalty=-1.0, presence_penalty=2.0)
    x = process_logits(logits, build([p], 5, outputs=[[4, 4, 4]], prompts=[[1, 2, 3]]))
    torch.testing.assert_close(x, torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]]), atol=0, rtol=0)


def test_temperature_applies_after_penalties():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    p = SamplingParams(temperature=0.5, repetition_penalty=4.0, logit_bias={"2": 1.0})
    x = process_logits(logits, build([p], 3, prompts=[[0]]))
    torch.testing.assert_close(x, torch.tensor([[1.0, 2.0, 2.0]]), atol=0, rtol=0)


def test_logit_bias_forces_and_forbids_tokens():
    torch.manual_seed(8)
    logits = torch.randn(200, 10)
    forced = sample(logits, [SamplingParams(logit_bias={"7": 100.0})] * 200)
    assert torch.all(forced.next_token_ids == 7)
    banned = sample(logits, [SamplingParams(logit_bias={3: -100, 5: -100})] * 200)
    assert not torch.isin(banned.next_token_ids, torch.tensor([3, 5])).any()


def test_min_new_tokens_bans_eos_and_stop_token_ids():
    logits = torch.zeros(300, 8)
    logits[:, EOS] = 10.0
    logits[:, 3] = 9.0
    p = SamplingParams(min_new_tokens=2, stop_token_ids=[3])
    early = sample(logits, [p] * 300, outputs=[[5]] * 300)
    assert not torch.isin(early.next_token_ids, torch.tensor([EOS, 3])).any()
    assert torch.all(early.logprobs > math.log(1 / 6) - 1e-5)  # renormalised over the rest
    done = sample(logits, [p] * 300, outputs=[[5, 6]] * 300)
    assert (done.next_token_ids == EOS).sum() > 200
    free_eos = sample(logits, [SamplingParams(min_new_tokens=2, ignore_eos=True)] * 300,
                      outputs=[[5]] * 300)
    assert (free_eos.next_token_ids == EOS).sum() > 200


def test_grammar_mask_and_its_precedence_over_the_eos_ban():
    torch.manual_seed(9)
    logits = torch.randn(3, 12)
    mask = torch.zeros(3, 12, dtype=torch.bool)
    mask[0, [4, 9]] = True
    mask[1, [EOS]] = True  # the grammar can only end: the min_new_tokens ban yields
    mask[2, [EOS, 6]] = True
    p = SamplingParams(temperature=0.0, min_new_tokens=5)
    out = sample(logits, [p] * 3, grammar=mask)
    assert int(out.next_token_ids[0]) == [4, 9][int(logits[0, [4, 9]].argmax())]
    assert out.next_token_ids[1:].tolist() == [EOS, 6]
    assert float(out.logprobs[1]) == 0.0
    sampled = sample(logits[:1].expand(500, 12), [SamplingParams()] * 500,
                     grammar=mask[:1].expand(500, 12))
    assert set(sampled.next_token_ids.tolist()) == {4, 9}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_new_tokens", -1), ("max_new_tokens", 1.5), ("max_new_tokens", True),
        ("min_new_tokens", -2), ("temperature", -0.1), ("temperature", "hot"),
        ("temperature", math.inf), ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2),
        ("min_p", 1.5), ("min_p", -0.1), ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.5), ("presence_penalty", -3), ("n", 0), ("n", MAX_N + 1),
        ("stop", 3), ("stop", ["ok", 4]), ("stop", [""]), ("stop_token_ids", [1, -1]),
        ("stop_token_ids", 5), ("ignore_eos", "yes"), ("skip_special_tokens", 1),
        ("seed", 1.0), ("seed", "7"), ("json_schema", 3), ("regex", ["a"]), ("ebnf", 1),
        ("choices", []), ("choices", "abc"), ("logit_bias", [1, 2]), ("logit_bias", {"x": 1}),
        ("logit_bias", {"-1": 1}), ("logit_bias", {1: "high"}), ("logit_bias", {1: math.nan}),
        ("logit_bias", {"1": 1, 1: 2}), ("logprob_mode", "logits"),
    ],
)
def test_validation_errors_name_the_field(key, value):
    with pytest.raises(ValueError, match=key):
        SamplingParams.from_dict({key: value})


def test_validation_of_combinations_and_unknown_keys():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match="regex"):
        SamplingParams.from_dict({"regex": "a+", "choices": ["a"]})
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams.from_dict({"min_new_tokens": 10, "max_new_tokens": 5})
    with pytest.raises(ValueError, match="sampling_params"):
        SamplingParams.from_dict([("temperature", 1.0)])
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={70000: 1.0}).check_vocab(49152)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[49152]).check_vocab(49152)


def test_defaults_and_normal_forms():
    assert SamplingParams.from_dict(None) == SamplingParams()
    d = SamplingParams.from_dict({"max_new_tokens": 128, "temperature": 1, "stop": "\n\n",
                                  "logit_bias": {"5": -2}, "json_schema": {"type": "object"},
                                  "top_p": None, "stop_token_ids": [2]})
    assert d.temperature == 1.0 and isinstance(d.temperature, float)
    assert d.stop == ("\n\n",) and d.stop_token_ids == (2,) and d.top_p == 1.0
    assert d.logit_bias == {5: -2.0}
    assert d.grammar == ("json_schema", '{"type": "object"}')
    assert SamplingParams().grammar is None
    assert SamplingParams.from_dict(d.to_dict()) == d


@pytest.mark.parametrize("seeded", [False, True])
def test_whole_vocabulary_draws_cross_blocks_correctly(seeded):
    # mass on tokens at block edges and in distant blocks (the two-level CDF uses 128-token
    # blocks), on a vocabulary that is not a multiple of the block size
    vocab, draws = 1003, 20000
    hot = torch.tensor([0, 5, 127, 128, 129, 255, 256, 511, 640, 767, 768, 1000, 1002])
    row = torch.full((vocab,), -40.0)
    row[hot] = torch.linspace(0.0, 2.0, len(hot))
    logits = row.expand(draws, vocab).contiguous()
    params = [SamplingParams(seed=i if seeded else None) for i in range(draws)]
    out = sample(logits, params, return_logprob=False,
                 generator=torch.Generator().manual_seed(3))
    ref = torch.softmax(row.double(), -1)[hot]
    counts = torch.bincount(out.next_token_ids, minlength=vocab).double()
    assert counts.sum() - counts[hot].sum() <= 1  # the cold tokens hold ~1e-16 of the mass
    expected = ref * draws
    chi2 = float(((counts[hot] - expected) ** 2 / expected).sum())
    assert chi2 < 12 + 6 * math.sqrt(24) + 6, chi2


def test_top_k_zero_means_off_as_in_vllm_and_trl():
    assert SamplingParams.from_dict({"top_k": 0}) == SamplingParams.from_dict({"top_k": -1})
    assert SamplingParams(top_k=0).top_k == -1

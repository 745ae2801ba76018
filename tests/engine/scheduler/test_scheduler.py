"""The scheduler under KV pressure (chunking, eviction and retraction change nothing visible),
and what others may do to it: the control methods and the load report."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest

from hotswap.engine import Engine
from hotswap.engine.core.namespace import Namespace
from hotswap.engine.scheduler.kv_manager import StepPeers, common_prefix_len

GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


def prompts(engine: Engine, count: int = 12) -> list[list[int]]:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
             "kappa", "lambda", "mu"]
    shared = engine.tokenizer.encode("A shared preamble that several requests begin with. " * 3)
    out = []
    for i in range(count):
        body = engine.tokenizer.encode(" ".join(words[(i + j) % 12] for j in range(4 + 7 * i)))
        out.append((shared if i % 2 else []) + body)
    return out


@pytest.fixture(scope="module")
def reference(tiny_chat_model_path):
    with Engine(tiny_chat_model_path, max_total_tokens=16384) as eng:
        ps = prompts(eng)
        return ps, [o["output_ids"] for o in eng.generate(input_ids=ps, sampling_params=GREEDY)]


@pytest.mark.parametrize("page_size, policy", [(1, "lpm"), (4, "lpm"), (1, "fcfs")])
def test_small_pool_finishes_everything_with_identical_outputs(tiny_chat_model_path, reference,
                                                               page_size, policy):
    ps, expected = reference
    longest = max(len(p) for p in ps) + GREEDY["max_new_tokens"]
    with Engine(tiny_chat_model_path, max_total_tokens=2 * longest + 8, page_size=page_size,
                chunked_prefill_size=32, schedule_policy=policy,
                max_running_requests=6) as eng:
        outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
        eng.check_integrity()
        stats = dict(eng.scheduler.stats)
    assert [o["output_ids"] for o in outs] == expected
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0
    assert max(len(p) for p in ps) > 32  # prompts longer than a chunk were chunked
    assert stats["prefill_tokens"] >= sum(len(p) for p in ps) - stats["cached_tokens"]


def test_threads_share_one_batch(tiny_chat_model_path, reference):
    ps, expected = reference
    results: dict[int, list[int]] = {}
    with Engine(tiny_chat_model_path, max_total_tokens=16384) as eng:
        def worker(i: int) -> None:
            results[i] = eng.generate(input_ids=ps[i], sampling_params=GREEDY)["output_ids"]

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(ps))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        steps = eng.scheduler.stats["steps"]
        eng.check_integrity()
    assert [results[i] for i in range(len(ps))] == expected
    # interleaved into shared steps: far fewer steps than requests x tokens
    assert steps < len(ps) * GREEDY["max_new_tokens"] / 2


def test_shared_prefix_is_computed_once(tiny_chat_model_path):
    with Engine(tiny_chat_model_path, max_total_tokens=16384) as eng:
        system = eng.tokenizer.encode("You are a helpful assistant. " * 40)
        qs = [system + eng.tokenizer.encode(f" Question {i}: what is {i} + {i}?")
              for i in range(16)]
        outs = eng.generate(input_ids=qs, sampling_params={"max_new_tokens": 4})
        computed = eng.scheduler.stats["prefill_tokens"]
    unique = len(system) + sum(len(q) - len(system) for q in qs)
    assert computed <= unique * 1.05
    assert sum(o["meta_info"]["cached_tokens"] > 0 for o in outs) == 15


def trie_size(seqs: list[list[int]]) -> int:
    """Tokens a perfect prefix cache computes for `seqs`: the nodes of their trie."""
    return len({tuple(s[:i + 1]) for s in seqs for i in range(len(s))})


def test_step_peers_find_the_longest_shared_prefix_of_all_peers():
    """A request admitted in a step borrows from the peer sharing its longest prefix. StepPeers
    compares it with its two neighbours in sorted order only; a scan of every peer of its
    namespace (what admission did before) finds no longer prefix, and no other namespace's
    peer is offered."""
    rng = random.Random(3)
    stems = [[rng.randrange(4) for _ in range(rng.randrange(0, 12))] for _ in range(6)]
    spaces = [Namespace("v1"), Namespace("v2"), Namespace("v1", cache_salt="s")]
    peers, everyone = StepPeers(), []
    for _ in range(300):
        ids = rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randrange(0, 10))]
        ns = rng.choice(spaces)
        scan = max((common_prefix_len(ids, tokens) for space, tokens in everyone
                    if space == ns), default=0)
        found = peers.neighbours(ns, ids)
        assert all(peer.namespace == ns for peer, _ in found)
        assert max((common_prefix_len(ids, tokens) for _, tokens in found), default=0) == scan
        computed = rng.randrange(0, len(ids) + 1)  # a chunk may compute part of its tokens
        peers.add(SimpleNamespace(cache_ids=ids, kv_len=computed, namespace=ns))
        everyone.append((ns, ids[:computed]))


@pytest.mark.parametrize("page_size, chunk", [(1, -1), (4, -1), (1, 16)])
def test_prompts_admitted_together_compute_a_shared_prefix_once(tiny_chat_model_path,
                                                                page_size, chunk):
    """Prompts that arrive together and share prefixes of different depths (as a chat template
    and GRPO prompts do): the shared part is computed once even within one step, and greedy
    outputs equal those of an engine without a prefix cache."""
    rng = random.Random(7)

    def words(n: int) -> list[int]:
        return [rng.randrange(3, 400) for _ in range(n)]

    base, left, right = words(23), words(9), words(14)
    ps = [base + left + words(5), base + left + words(11), base + right + words(3),
          base + right + words(8), base + words(6), words(12), base + left + words(2)]
    with Engine(tiny_chat_model_path, max_total_tokens=16384, enable_prefix_cache=False) as eng:
        expected = [o["output_ids"] for o in eng.generate(input_ids=ps, sampling_params=GREEDY)]
    with Engine(tiny_chat_model_path, max_total_tokens=16384, page_size=page_size,
                chunked_prefill_size=chunk) as eng:
        outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
        eng.check_integrity()
        stats = dict(eng.scheduler.stats)
    assert [o["output_ids"] for o in outs] == expected
    # whole pages only are shared: each prompt may recompute part of one page
    assert trie_size(ps) <= stats["prefill_tokens"] <= trie_size(ps) + (page_size - 1) * len(ps)
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert sum(cached) == stats["cached_tokens"] == sum(map(len, ps)) - stats["prefill_tokens"]
    assert all(c >= 23 - 23 % page_size for c in cached[1:5])


@pytest.mark.parametrize("page_size, pool, chunk, policy", [
    (1, 170, 16, "lpm"), (8, 256, 24, "fcfs"), (4, 200, -1, "lpm")])
def test_random_load_with_aborts_on_a_tiny_pool(tiny_chat_model_path, page_size, pool, chunk,
                                                policy):
    """Seeded mix of lengths, n, temperatures, seeds, streams and aborts from 24 threads."""
    results: list[str] = []
    errors: list[str] = []
    with Engine(tiny_chat_model_path, max_total_tokens=pool, page_size=page_size,
                chunked_prefill_size=chunk, schedule_policy=policy,
                max_running_requests=8) as eng:
        def worker(i: int) -> None:
            rng = random.Random(i)
            ids = [5, 6, 7, 8] * rng.randrange(0, 10) + [
                rng.randrange(3, 400) for _ in range(rng.randrange(1, 60))]
            params = {"max_new_tokens": rng.randrange(1, 50), "n": rng.choice([1, 1, 2, 3]),
                      "temperature": rng.choice([0, 0.7, 1.0]),
                      "seed": rng.choice([None, i]), "ignore_eos": True}
            try:
                if rng.random() < 0.25:
                    last = None
                    for k, event in enumerate(eng.generate(input_ids=ids, sampling_params=params,
                                                           stream=True, rid=f"s{i}")):
                        last = event
                        if k == 2:
                            eng.abort_request(f"s{i}")
                    results.append(last["meta_info"]["finish_reason"]["type"])
                    return
                outs = eng.generate(input_ids=ids, sampling_params=params)
                for out in outs if isinstance(outs, list) else [outs]:
                    assert len(out["output_ids"]) == params["max_new_tokens"]
                    results.append(out["meta_info"]["finish_reason"]["type"])
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(repr(exc))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        eng.check_integrity()
    assert errors == []
    assert len(results) >= 24 and set(results) <= {"length", "abort"}


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_waiting_requests_are_matched_only_where_the_policy_orders_by_prefix(
        tiny_chat_model_path, reference, monkeypatch, policy):
    """fcfs never walks the tree to order the queue, and lpm stops past its queue cap."""
    from hotswap.engine.scheduler import schedule_policy

    cap = 4
    monkeypatch.setattr(schedule_policy, "LPM_MAX_QUEUE", cap)
    ps, expected = reference
    with Engine(tiny_chat_model_path, max_total_tokens=16384, schedule_policy=policy,
                max_running_requests=2) as eng:
        sched = eng.scheduler
        queue_at_match: list[int] = []
        match_len = sched.kv.match_len

        def counted(ns, req):
            queue_at_match.append(len(sched.waiting))
            return match_len(ns, req)

        monkeypatch.setattr(sched.kv, "match_len", counted)
        outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == expected
    if policy == "fcfs":
        assert queue_at_match == []
    else:
        assert queue_at_match and max(queue_at_match) <= cap


# The scheduler thread never dies and never spins.

def within(seconds: float, fn, *args, **kwargs):
    """fn's result, or a failed test when it has not returned in `seconds` (a dead scheduler
    thread would leave it blocked forever)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn(*args, **kwargs)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"no answer in {seconds}s: the scheduler thread is stuck or dead"
    return result[0]


def wait_until(cond, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def make_req(rid: str, ids: list[int], sink, max_new_tokens: int = 8, stream: bool = True):
    from hotswap.engine.core.request import Req
    from hotswap.engine.core.sampling_params import SamplingParams

    params = SamplingParams.from_dict({"max_new_tokens": max_new_tokens, "temperature": 0,
                                       "ignore_eos": True})
    return Req(rid=rid, prompt_ids=ids, params=params, stream=stream, sink=sink)


def test_a_failed_idle_integrity_check_does_not_stop_the_engine(tiny_chat_model_path,
                                                                 monkeypatch):
    with Engine(tiny_chat_model_path, max_total_tokens=4096) as eng:
        check = eng.scheduler.kv.check_integrity
        calls: list[int] = []

        def fails_once(reqs):
            calls.append(len(reqs))
            if len(calls) == 1:
                raise AssertionError("conservation broken (simulated)")
            check(reqs)

        monkeypatch.setattr(eng.scheduler.kv, "check_integrity", fails_once)
        outs = [within(60, eng.generate, prompt=p, sampling_params=GREEDY)
                for p in ("Hello", "Hello there")]
        assert calls and all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        eng.check_integrity()


def test_a_failing_output_sink_fails_only_its_request(tiny_chat_model_path):
    """A consumer that is gone (an asyncio loop closed under a stream) ends its own request; the
    request beside it in the same batch finishes normally."""
    events: list[dict] = []
    delivered: list[int] = []

    def closed_loop(event: dict) -> None:
        delivered.append(len(event["output_ids"]))
        if len(delivered) >= 3:
            raise RuntimeError("Event loop is closed")

    with Engine(tiny_chat_model_path, max_total_tokens=4096) as eng:
        ids = eng.tokenizer.encode("Once upon a time")
        bad = make_req("bad", ids, closed_loop, max_new_tokens=30)
        good = make_req("good", ids + [5], events.append, max_new_tokens=30, stream=False)
        eng.scheduler.submit([bad, good])
        wait_until(lambda: events, 60)
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert len(events[-1]["output_ids"]) == 30
        assert bad.finish_reason.type == "abort" and "delivered" in bad.finish_reason.message
        assert len(delivered) == 3  # nothing more was pushed at the dead consumer
        eng.check_integrity()
        assert within(60, eng.generate, prompt="Hello", sampling_params=GREEDY)["output_ids"]


def test_a_request_failing_in_the_inbox_does_not_stop_the_engine(tiny_chat_model_path):
    def gone(event: dict) -> None:
        raise RuntimeError("Event loop is closed")

    with Engine(tiny_chat_model_path, max_total_tokens=4096) as eng:
        # max_new_tokens=0 finishes while the inbox is read: its sink fails right there.
        eng.scheduler.submit([make_req("gone", [5, 6, 7], gone, max_new_tokens=0)])
        out = within(60, eng.generate, prompt="Hello", sampling_params=GREEDY)
        assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_the_scheduler_sleeps_when_the_work_it_could_not_schedule_goes_away(
        tiny_chat_model_path, monkeypatch):
    with Engine(tiny_chat_model_path, max_total_tokens=4096) as eng:
        sched = eng.scheduler
        sched.hold_admission(True)
        waiter = threading.Thread(target=eng.generate, kwargs=dict(
            prompt="Hello", sampling_params=GREEDY, rid="held"), daemon=True)
        waiter.start()
        wait_until(lambda: sched.waiting, 10)
        time.sleep(0.1)  # steps find nothing they may run: the loop retries every 10 ms
        eng.abort_request("held")
        waiter.join(10)
        wakeups: list[float] = []
        drain = sched._drain_inbox
        monkeypatch.setattr(sched, "_drain_inbox", lambda *a, **k: (
            wakeups.append(time.monotonic()), drain(*a, **k)))
        time.sleep(0.5)
        assert len(wakeups) <= 2, f"{len(wakeups)} wake-ups in 0.5 s with nothing to do"
        sched.hold_admission(False)


# Others act on scheduling state only through the control methods, and read it through load().

def _start(eng: Engine, **kwargs) -> tuple[threading.Thread, list]:
    results: list = []
    thread = threading.Thread(target=lambda: results.append(eng.generate(**kwargs)), daemon=True)
    thread.start()
    return thread, results


def test_load_counts_queued_forked_and_running_requests_and_kv(tiny_chat_model_path):
    with Engine(tiny_chat_model_path, max_total_tokens=4096, page_size=4) as eng:
        sched = eng.scheduler
        idle = eng.get_load()
        assert (idle["running"], idle["waiting"], idle["forked"]) == (0, 0, 0)
        assert idle["kv_used_tokens"] == 0 and idle["kv_pool_tokens"] == 4096
        sched.hold_admission(True)
        thread, results = _start(eng, prompt="Hello there, how are you", rid="g",
                                 sampling_params={**GREEDY, "n": 3})
        wait_until(lambda: sched.load().waiting == 1 and sched.load().forked == 2, 10)
        assert sched.load().unfinished == 3 and sched.load().running == 0
        sched.hold_admission(False)
        thread.join(60)
        done = eng.get_load()
    assert len(results[0]) == 3
    assert (done["running"], done["waiting"], done["forked"], done["compiling"]) == (0, 0, 0, 0)
    assert done["kv_cached_tokens"] == done["kv_used_tokens"] > 0  # only the tree holds KV now
    assert done["totals"]["generated_tokens"] == 3 * GREEDY["max_new_tokens"]


def test_finish_where_ends_the_picked_requests_wherever_they_wait(tiny_chat_model_path):
    from hotswap.engine.core.request import FinishReason

    with Engine(tiny_chat_model_path, max_total_tokens=4096) as eng:
        sched = eng.scheduler
        long = {**GREEDY, "max_new_tokens": 200}
        running, running_out = _start(eng, prompt="Once upon a time", rid="x-run",
                                      sampling_params=long)
        wait_until(lambda: sched.load().running == 1, 30)
        sched.hold_admission(True)
        started = [_start(eng, prompt=f"Hello {w}", rid=r, sampling_params={**GREEDY, "n": n})
                   for w, r, n in (("a", "x-wait", 1), ("b", "x-group", 2), ("c", "keep", 1))]
        wait_until(lambda: sched.load().unfinished == 5, 10)
        reason = FinishReason("abort", message="picked")
        assert sched.finish_where(lambda r: r.rid.startswith("x-"), reason, queued=False) == 1
        assert sched.load().running == 0 and sched.load().unfinished == 4
        assert sched.finish_where(lambda r: r.rid.startswith("x-"), reason) == 3
        assert sched.load().unfinished == 1
        sched.hold_admission(False)
        for thread, _ in [(running, running_out), *started]:
            thread.join(60)
        eng.check_integrity()
    ended = [running_out[0]] + [o for _, res in started[:2] for o in (
        res[0] if isinstance(res[0], list) else [res[0]])]
    assert len(ended) == 4
    assert all(o["meta_info"]["finish_reason"]["message"] == "picked" for o in ended)
    assert started[2][1][0]["meta_info"]["finish_reason"]["type"] == "length"


def test_aborts_carry_a_reason_that_clients_read(tiny_chat_model_path):
    """finish_reason["reason"] says why (clients key on it; the message is for people)."""
    from hotswap.engine.core.request import FinishReason

    long = {**GREEDY, "max_new_tokens": 400}
    with Engine(tiny_chat_model_path, max_total_tokens=4096) as eng:
        reasons = {}
        for why, stop in (("user", lambda: eng.abort_request("r")),
                          ("paused", lambda: eng.pause_generation("abort"))):
            thread, out = _start(eng, prompt="Once upon a time", rid="r", sampling_params=long)
            wait_until(lambda: eng.scheduler.load().running == 1, 30)
            stop()
            thread.join(60)
            eng.continue_generation()
            reasons[why] = out[0]["meta_info"]["finish_reason"]
    assert {why: r["reason"] for why, r in reasons.items()} == {"user": "user",
                                                                 "paused": "paused"}
    assert all(r["type"] == "abort" and r["message"] for r in reasons.values())
    with pytest.raises(ValueError, match="abort reason"):
        FinishReason.aborted("generation paused", "a message is not a reason")


def test_retract_where_recomputes_only_the_picked_requests(tiny_chat_model_path, reference):
    ps, expected = reference
    long = {**GREEDY, "max_new_tokens": 120}
    with Engine(tiny_chat_model_path, max_total_tokens=16384) as eng:
        sched = eng.scheduler
        alone = eng.generate(input_ids=ps[:2], sampling_params=long)
        eng.flush_cache()
        threads = [_start(eng, input_ids=ps[i], rid=f"r{i}", sampling_params=long)
                   for i in range(2)]
        wait_until(lambda: sched.run(lambda: len(sched.running) == 2 and all(
            len(r.output_ids) > 3 for r in sched.running)), 30)
        assert sched.retract_where(lambda r: r.rid == "r1") == 1
        for thread, _ in threads:
            thread.join(60)
        eng.check_integrity()
    outs = [res[0] for _, res in threads]
    assert [o["meta_info"]["num_retractions"] for o in outs] == [0, 1]
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in alone]


def test_a_retired_namespace_of_a_running_request_never_reaches_the_tree(tiny_chat_model_path):
    """An in_place update retires the namespace the running request computes under, though no
    prefix of it is in the tree yet: its KV is freed at finish, not cached for nobody."""
    with Engine(tiny_chat_model_path, max_total_tokens=4096, page_size=16) as eng:
        sched = eng.scheduler
        ids = eng.tokenizer.encode("Hi")[:5]  # shorter than a page: nothing cached at prefill
        thread, results = _start(eng, input_ids=ids, sampling_params={**GREEDY,
                                                                      "max_new_tokens": 80})
        wait_until(lambda: sched.run(lambda: bool(sched.running) and len(
            sched.running[0].output_ids) > 3), 30)
        assert sched.load().kv_cached_tokens == 0
        retired = sched.run(lambda: sched.running[0].namespace)
        sched.retire_namespaces(lambda ns: ns == retired)
        thread.join(60)
        assert results[0]["meta_info"]["finish_reason"]["type"] == "length"
        assert sched.load().kv_cached_tokens == 0 and sched.load().kv_used_tokens == 0
        eng.check_integrity()

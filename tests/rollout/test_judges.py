"""Model rewards (rollout/judges.py): a generative judge with a grammar-forced verdict, a reward
model's classify scores, timeouts and retries against slow or broken scorers, a frozen scorer
beside a trained policy, and the GRPO job with --judge and --reward-model."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from fixtures import write_reward_model, write_tiny_chat_model

from hotswap.engine import Engine
from hotswap.rollout import SingleTurn, TokenClient, collect
from hotswap.rollout.engines import start_in_process, start_scorer
from hotswap.rollout.grpo import parse_args, run
from hotswap.rollout.judges import Combined, conversation, judge_reward, model_reward
from hotswap.rollout.rewards import exact_match, score_group
from hotswap.rollout.trajectory import Trajectory

KW = {"device": "cpu", "dtype": "float32", "max_total_tokens": 2048}
ROW = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": 5}
SCHEMA = {"type": "object", "properties": {"score": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}}, "required": ["score"]}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("judges")
    rm = str(root / "rm")
    write_reward_model(rm, "llama", num_labels=3, pad=0)
    return {"chat": write_tiny_chat_model(str(root / "chat")), "rm": rm}


@pytest.fixture(scope="module")
def judge(paths):
    with Engine(paths["chat"], **KW) as engine:
        yield engine


@pytest.fixture(scope="module")
def scorer(paths):
    with Engine(paths["rm"], **KW) as engine:
        yield engine


def group(*texts: str) -> list[Trajectory]:
    return [Trajectory([1, 2, 3], [4, 5], [1, 1], [0.0, 0.0], ["0", "0"], text=t, row=ROW,
                       sample_idx=i) for i, t in enumerate(texts)]


class Recording:
    """A judge client that records its calls and answers from `answer(call_index, count)`."""

    def __init__(self, answer, engine=None):
        self.answer, self.engine, self.calls, self.aborted = answer, engine, [], []

    def generate(self, **kwargs):
        self.calls.append(kwargs)
        return self.answer(len(self.calls) - 1, kwargs)

    def abort_request(self, rid=None, abort_all=False):
        self.aborted.append(rid)


def test_choices_verdict_is_one_call_per_group_greedy_and_scored_from_the_choices(judge):
    client = Recording(lambda _, kw: judge.generate(**kw))
    trajs = group("5", "six", "The answer is 5")
    score_group(trajs, judge_reward(client, verdict={"yes": 1.0, "no": -1.0}))
    (call,) = client.calls  # the whole group in one batched request
    assert len(call["messages"]) == 3 and call["sampling_params"]["temperature"] == 0.0
    assert call["sampling_params"]["choices"] == ["yes", "no"]
    assert "What is 2 + 3?" in call["messages"][0][0]["content"]
    for traj in trajs:
        assert traj.reward_info["verdict"] in ("yes", "no")
        assert traj.reward == {"yes": 1.0, "no": -1.0}[traj.reward_info["verdict"]]
        assert "failure" not in traj.reward_info


def test_json_schema_verdict_reads_the_score_field(judge):
    trajs = group("5", "7")
    score_group(trajs, judge_reward(judge, "Rate 0-9: {question} -> {response}",
                                    verdict=SCHEMA))
    for traj in trajs:
        assert traj.reward_info["verdict"].startswith('{"score":')
        assert 0 <= traj.reward <= 9 and traj.reward == int(traj.reward)


def test_bad_verdict_text_and_template_fields_fail_per_trajectory(judge):
    texts = iter(['{"score": 2}', "not json"])
    fake = Recording(lambda _, kw: [{"text": next(texts), "meta_info": {}}
                                    for _ in kw["messages"]])
    trajs = group("a", "b")
    score_group(trajs, judge_reward(fake, "{response}", verdict=SCHEMA, failure_reward=-1.0))
    assert trajs[0].reward == 2.0
    assert trajs[1].reward == -1.0 and "unparsed verdict" in trajs[1].reward_info["failure"]
    trajs = group("a")
    score_group(trajs, judge_reward(judge, "{missing} {response}", failure_reward=-1.0))
    assert trajs[0].reward == -1.0 and "missing" in trajs[0].reward_info["failure"]


def test_slow_judge_times_out_retries_aborts_and_returns_the_failure_value():
    release = threading.Event()

    def hang(_, kw):
        release.wait(30)
        return [{"text": "correct"} for _ in kw["messages"]]

    fake = Recording(hang)
    reward = judge_reward(fake, timeout_s=0.3, retries=2, backoff_s=0.05, failure_reward=-0.5)
    trajs = group("5", "6")
    start = time.perf_counter()
    score_group(trajs, reward, timeout_s=0.1)  # the judge's own budget bounds the wait
    took = time.perf_counter() - start
    release.set()
    assert len(fake.calls) == 3 and took < 3.0
    assert len(fake.aborted) == 3 * 2  # every attempt's requests were aborted
    for traj in trajs:
        assert traj.reward == -0.5
        assert traj.reward_info["failure"] == "timeout after 0.3s (3 attempts)"


def test_a_retry_after_an_error_succeeds():
    def flaky(i, kw):
        if i == 0:
            raise ConnectionError("judge restarting")
        return [{"text": "correct", "meta_info": {}} for _ in kw["messages"]]

    fake = Recording(flaky)
    trajs = group("5")
    score_group(trajs, judge_reward(fake, backoff_s=0.0))
    assert trajs[0].reward == 1.0 and trajs[0].reward_info["judge_attempts"] == 2


def test_model_reward_equals_classify_scores(scorer):
    trajs = group("5", "six")
    score_group(trajs, model_reward(scorer, label=2, activation=True))
    want = scorer.classify(messages=[conversation(t) for t in trajs], activation=True)
    assert [t.reward for t in trajs] == [w["scores"][2] for w in want]
    assert [t.reward_info["scores"] for t in trajs] == [w["scores"] for w in want]
    ids = group("x")
    score_group(ids, model_reward(scorer, input="ids"))
    assert ids[0].reward == scorer.classify(input_ids=[1, 2, 3, 4, 5])["scores"][0]
    bad = group("x")
    score_group(bad, model_reward(scorer, label=3))
    assert math.isnan(bad[0].reward) and "label 3" in bad[0].reward_info["failure"]


def test_combined_sums_the_scorers_and_keeps_the_task_reward(judge, scorer):
    trajs = group("5", "no idea")
    reward = Combined({"judge": judge_reward(judge), "reward_model": model_reward(scorer)},
                      exact_match())
    score_group(trajs, reward)
    for traj in trajs:
        info = traj.reward_info
        assert traj.reward == pytest.approx(info["judge"] + info["reward_model"])
    assert [t.reward_info["task_reward"] for t in trajs] == [1.0, 0.0]


def test_collect_scores_each_group_with_the_judge_and_times_it(paths, judge):
    with Engine(paths["chat"], **KW) as policy:
        client = TokenClient(policy, sampling={"max_new_tokens": 4})
        batch = collect(client, SingleTurn(), [ROW, ROW], group_size=3,
                        reward=judge_reward(judge))
    assert batch.meta["reward_s"] > 0
    assert all(info["verdict"] in ("correct", "incorrect") for info in batch.reward_info)


def test_a_policy_push_leaves_the_scorers_versions_and_scores_unchanged(paths):
    args = parse_args(["--model-path", paths["chat"], "--max-total-tokens", "2048"])
    policy = start_in_process(paths["chat"], "float32", 0, 2048, {})
    judge, rm = start_scorer(paths["chat"], args), start_scorer(paths["rm"], args)
    try:
        rewards = [judge_reward(judge, verdict=SCHEMA), model_reward(rm)]
        prompt = {"input_ids": [1, 5, 6, 7], "sampling_params": {"max_new_tokens": 4,
                                                                 "temperature": 0.0}}

        def scores() -> list[list[float]]:
            out = []
            for reward in rewards:
                trajs = group("5", "seven")
                score_group(trajs, reward)
                out.append([t.reward for t in trajs])
            return out

        before, policy_before = scores(), policy.backend.generate(**prompt)["output_ids"]
        named = [(n, p * 1.5 + 0.1) for n, p in policy_weights(paths["chat"])]
        policy.push(named, "1")
        assert policy.backend.get_weight_version() == "1"
        assert policy.backend.generate(**prompt)["output_ids"] != policy_before  # it moved
        assert judge.get_weight_version() == rm.get_weight_version() == "0"
        assert scores() == before
    finally:
        for engine in (judge, rm):
            engine.shutdown()
        policy.close()


def policy_weights(path: str) -> list[tuple[str, torch.Tensor]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return list(model.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["sync", "async"])
def test_grpo_with_a_judge_and_a_reward_model_runs_and_shows_reward_seconds(paths, tmp_path,
                                                                           capsys, mode):
    args = parse_args(["--model-path", paths["chat"], "--judge", paths["chat"],
                       "--reward-model", paths["rm"], "--steps", "2", "--prompts", "2",
                       "--group-size", "3", "--over-sample", "0", "--filter", "none",
                       "--max-new-tokens", "4", "--max-total-tokens", "2048",
                       "--wandb-dir", str(tmp_path), *mode])
    out = run(args)
    assert [h["weight_version"] for h in out["history"]] == [0, 1]
    for h in out["history"]:
        assert h["time/reward_s"] > 0 and h["reward/failures"] == 0
        assert 0 <= h["reward/task_mean"] <= 1
    header = capsys.readouterr().out.splitlines()
    assert any("rew s" in line and "task r" in line for line in header)

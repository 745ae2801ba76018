"""The main job (`python -m hotswap.rollout.grpo`) for 3 steps on a tiny random model, and its
trainer step (rollout/trainer.py) against the padded step that packing replaced."""

from __future__ import annotations

import glob
import json
import math
import os
import struct
from contextlib import nullcontext

import pytest
import torch
from fixtures import write_moe, write_tiny_chat_model

from hotswap.rollout.grpo import parse_args, run
from hotswap.rollout.importance import importance_weights
from hotswap.rollout.routing_replay import moe_routers, record_routes, replay_routes
from hotswap.rollout.trainer import Trainer, micro_batches, prompt_units, split_unit, unit_length
from hotswap.rollout.trajectory import RolloutBatch, Trajectory


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("grpo-chat")))


def wandb_history(run_dir: str) -> list[dict]:
    """History rows from an offline run file (LevelDB-style log of wandb Record protos)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:4] == b":W&B"
    block, pos, buf, rows = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos: pos + 7])
        buf, pos = buf + raw[pos + 7: pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record or the last fragment of one
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in rec.history.item})
            buf = b""
    return rows


def varied_reward(traj) -> float:
    """Something a random model's samples differ in, so every step has a gradient."""
    return sum(t % 2 for t in traj.response_ids) / max(1, len(traj.response_ids))


@pytest.mark.slow
def test_three_grpo_steps_push_live_weights_and_write_wandb_offline(model_path, tmp_path,
                                                                    monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    args = parse_args(["--model-path", model_path, "--steps", "3", "--prompts", "2",
                       "--group-size", "4", "--over-sample", "0", "--max-new-tokens", "6",
                       "--lr", "1e-3", "--wandb-dir", str(tmp_path), "--quiet"])
    out = run(args, reward=varied_reward)
    history = out["history"]
    assert [h["weight_version"] for h in history] == [0, 1, 2]  # one push per step
    for h in history:
        assert h["batch/trajectories"] == 8
        assert h["train/grad_norm"] > 0  # the step did move the weights
        # the engine's logprobs are the trainer's own: the push served exactly its weights
        assert h["mismatch/abs_diff"] < 1e-4 and h["mismatch/kl"] < 1e-6
        assert h["staleness/version_lag_max"] == 0
    assert out["run_dir"].startswith(str(tmp_path)) and "offline-run" in out["run_dir"]
    rows = wandb_history(out["run_dir"])
    assert [r["_step"] for r in rows] == [0, 1, 2]
    for key in ("reward/mean", "reward/std", "response/length", "rollout/tokens_per_s",
                "rollout/cache_hit_rate", "time/weight_sync_s", "staleness/version_lag_max",
                "mismatch/abs_diff", "mismatch/kl", "samples/_type"):
        assert all(key in r for r in rows), key
    for r, h in zip(rows, history):
        assert math.isclose(r["reward/mean"], h["reward/mean"], rel_tol=1e-9)
    assert rows[0]["samples/_type"] == "table-file"
    assert glob.glob(os.path.join(out["run_dir"], "files", "media", "table", "samples_*.json"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_int8_rollouts_with_importance_sampling(model_path, tmp_path, mode):
    """An int8 engine's logprobs differ from the float32 trainer's; --tis weights the loss and
    the share of truncated tokens is logged."""
    args = parse_args(["--model-path", model_path, "--steps", "2", "--prompts", "2",
                       "--group-size", "4", "--over-sample", "0", "--max-new-tokens", "6",
                       "--lr", "1e-3", "--wandb-dir", str(tmp_path), "--quiet",
                       "--quantization", "int8", "--tis", "2", "--tis-mode", mode])
    history = run(args, reward=varied_reward)["history"]
    assert [h["weight_version"] for h in history] == [0, 1]
    for h in history:
        assert h["mismatch/abs_diff"] > 1e-4  # int8 rollouts: a real mismatch, measured
        assert 0.0 <= h["mismatch/tis_truncated"] <= 1.0
        assert h["train/grad_norm"] > 0


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    for option in ("--steps", "--transport", "--async", "--max-staleness", "--wandb-dir",
                   "--group-size", "--lr", "--filter", "--quantization", "--tis",
                   "--routing-replay", "--exact-logprobs", "--model"):
        assert option in text


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["--async"]])
def test_async_mode(model_path, tmp_path, mode):
    args = parse_args(["--model-path", model_path, "--steps", "2", "--prompts", "2",
                       "--group-size", "2", "--over-sample", "0", "--max-new-tokens", "4",
                       "--lr", "1e-3", "--wandb-dir", str(tmp_path), "--quiet", *mode])
    history = run(args, reward=varied_reward)["history"]
    assert [h["weight_version"] for h in history] == [0, 1]
    # step 0 trains on version-0 samples with version-0 weights: the logprobs agree; later
    # batches may hold tokens one version old (off-policy, corrected by the ratio)
    assert history[0]["mismatch/abs_diff"] < 1e-4
    for h in history:
        assert h["time/weight_sync_s"] > 0 and h["batch/trajectories"] == 4
        assert h["staleness/version_lag_max"] <= args.max_staleness


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tensor", "gloo"])
def test_the_job_on_a_ray_fleet_of_two_replicas(model_path, tmp_path, transport):
    pytest.importorskip("ray")
    args = parse_args(["--model-path", model_path, "--steps", "2", "--prompts", "4",
                       "--group-size", "2", "--over-sample", "0", "--max-new-tokens", "4",
                       "--lr", "1e-3", "--wandb-dir", str(tmp_path), "--quiet",
                       "--fleet", "ray", "--replicas", "2", "--transport", transport])
    history = run(args, reward=varied_reward)["history"]
    assert [h["weight_version"] for h in history] == [0, 1]
    for step, h in enumerate(history):
        # both replicas serve the trainer's weights exactly, at the step's version
        assert h["mismatch/abs_diff"] < 1e-4
        cells = h["fleet/replicas"].split(" | ")
        assert len(cells) == 2 and all(f" v{step + 1} s" in c for c in cells), cells
    assert sum(h["replica/0/requests"] + h["replica/1/requests"] for h in history) == 16


@pytest.mark.real_model
@pytest.mark.slow
def test_routing_replay_on_the_tiny_moe_the_repository_writes(tmp_path):
    """examples/make_tiny_moe.py's folder, --routing-replay: the engine's routes replayed in the
    trainer's forward (same weights, fp32), so the rollout-vs-trainer gap stays at fp32 noise."""
    import subprocess
    import sys

    from fixtures import TESTS_DIR

    folder = str(tmp_path / "tiny-moe")
    script = os.path.join(TESTS_DIR, "..", "examples", "make_tiny_moe.py")
    subprocess.run([sys.executable, script, "--out", folder], check=True)
    args = parse_args(["--model", folder, "--routing-replay", "--steps", "3", "--prompts", "2",
                       "--group-size", "4", "--over-sample", "0", "--max-new-tokens", "8",
                       "--filter", "none", "--lr", "1e-3", "--wandb-dir", str(tmp_path),
                       "--quiet"])
    history = run(args, reward=varied_reward)["history"]
    assert [h["weight_version"] for h in history] == [0, 1, 2]
    for h in history:
        assert h["mismatch/abs_diff"] < 1e-4
        assert 0 <= h["mismatch/routes_differ"] < 0.05


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_logprobs_make_the_mismatch_zero(model_path, tmp_path, dtype):
    """--exact-logprobs: a deterministic engine and the trainer's exact forward, so every
    step's |dlogp| is exactly 0 (the weights change every step: each push is checked)."""
    args = parse_args(["--model-path", model_path, "--steps", "3", "--prompts", "2",
                       "--group-size", "4", "--over-sample", "0", "--max-new-tokens", "8",
                       "--filter", "none", "--lr", "1e-3", "--wandb-dir", str(tmp_path),
                       "--quiet", "--exact-logprobs", "--dtype", dtype, "--temperature", "0.8"])
    history = run(args, reward=varied_reward)["history"]
    assert [h["weight_version"] for h in history] == [0, 1, 2]
    for h in history:
        assert h["mismatch/abs_diff"] == 0.0 and h["mismatch/kl"] == 0.0
        assert h["train/clip_fraction"] == 0.0 and h["train/grad_norm"] > 0


def test_exact_logprobs_on_the_tiny_moe_need_no_routing_replay(tmp_path):
    """The same on an MoE: the trainer routes every token as the engine did, by construction."""
    folder = write_moe(str(tmp_path / "moe"), "qwen3_moe", seed=2)
    args = parse_args(["--model", folder, "--exact-logprobs", "--steps", "2", "--prompts", "2",
                       "--group-size", "4", "--over-sample", "0", "--max-new-tokens", "8",
                       "--filter", "none", "--lr", "1e-3", "--wandb-dir", str(tmp_path),
                       "--quiet"])
    for h in run(args, reward=varied_reward)["history"]:
        assert h["mismatch/abs_diff"] == 0.0 and h["train/grad_norm"] > 0
    with pytest.raises(SystemExit, match="routing-replay"):
        parse_args(["--exact-logprobs", "--routing-replay"])


def padded_logprobs(model, t: dict, temperature: float, route_stats: dict) -> torch.Tensor:
    """The trainer step's forward before packing (the reference): one left-padded row per
    sample, logits at every position, then the response slice."""
    ids = torch.cat([t["prompt_ids"], t["response_ids"]], dim=1)
    attn = t["attention_mask"]
    positions = (attn.cumsum(1) - 1).clamp(min=0)
    routes = t.get("routed_experts")
    with replay_routes(model, routes, route_stats) if routes is not None else nullcontext():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits
    p_len, r_len = t["prompt_ids"].shape[1], t["response_ids"].shape[1]
    logits = logits[:, p_len - 1: p_len + r_len - 1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(2, t["response_ids"][..., None])[..., 0]


def padded_step(trainer: Trainer, batch: RolloutBatch) -> dict[str, float]:
    """The reference step's gradients (clipped to norm 1, left in .grad) and metrics."""
    t = batch.to_tensors(trainer.pad_id)
    total = t["loss_mask"].sum().clamp(min=1)
    trainer.model.zero_grad()
    sums = {"abs_diff": 0.0, "kl": 0.0, "clipped": 0.0, "loss": 0.0, "truncated": 0.0}
    for lo in range(0, len(batch), trainer.micro_batch):
        part = {k: v[lo: lo + trainer.micro_batch] for k, v in t.items()}
        logp = padded_logprobs(trainer.model, part, trainer.temperature, {})
        mask, behavior = part["loss_mask"], part["behavior_logprobs"]
        old, weights = behavior, mask
        if trainer.tis is not None:
            old = logp.detach()
            iw = importance_weights(old, behavior, mask, trainer.tis, trainer.tis_mode)
            weights = iw.weights
            sums["truncated"] += iw.truncated.sum().item()
        ratio = torch.exp(logp - old)
        adv = part["advantages"][:, None]
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - trainer.clip, 1 + trainer.clip)
                                  * adv)
        loss = -(surrogate * weights).sum() / total
        loss.backward()
        diff = (logp.detach() - behavior) * mask
        sums["abs_diff"] += diff.abs().sum().item()
        sums["kl"] += ((torch.exp(-diff) - 1 + diff) * mask).sum().item()
        sums["clipped"] += (((ratio - 1).abs() > trainer.clip).float() * mask).sum().item()
        sums["loss"] += loss.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0).item()
    n = total.item()
    metrics = {"mismatch/abs_diff": sums["abs_diff"] / n, "mismatch/kl": sums["kl"] / n,
               "train/clip_fraction": sums["clipped"] / n, "train/loss": sums["loss"],
               "train/grad_norm": grad_norm}
    if trainer.tis is not None:
        metrics["mismatch/tis_truncated"] = sums["truncated"] / n
    return metrics


def grpo_batch(model, seed: int, routes: bool = False) -> RolloutBatch:
    """Groups of 1-5 samples over prompts of 3-9 tokens (two groups share one prompt), responses
    of 1-9 tokens with masked context tokens in some, behaviour logprobs near the model's own
    (and, with `routes`, the model's routes as the engine records them)."""
    g = torch.Generator().manual_seed(seed)
    rand = (lambda hi, n=1: torch.randint(3, hi, (n,), generator=g).tolist())
    vocab = model.config.vocab_size
    prompts = [rand(vocab, n) for n in (5, 9, 3, 7)]
    prompts.append(prompts[0])
    trajs = []
    for group, (prompt, size) in enumerate(zip(prompts, (4, 5, 1, 3, 2))):
        for s in range(size):
            resp = rand(vocab, rand(10)[0] - 2)
            mask = [0 if 2 <= i <= 3 and s % 2 else 1 for i in range(len(resp))]
            traj = Trajectory(prompt_ids=prompt, response_ids=resp, loss_mask=mask,
                              logprobs=[0.0] * len(resp), group_id=group,
                              versions=[str(group) if m else None for m in mask],
                              reward=float(s % 2), sample_idx=s)
            if routes:
                ids = torch.tensor([prompt + resp[:-1]])
                traj.routed_experts = record_routes(model, ids)[0].to(torch.int16).numpy()
            trajs.append(traj)
    batch = RolloutBatch.from_trajectories(trajs, torch.randn(len(trajs), generator=g).tolist())
    with torch.no_grad():
        own = padded_logprobs(model, batch.to_tensors(2), 1.0, {})
    noise = torch.randn(own.shape, generator=g) * 0.2
    batch.behavior_logprobs = [[(own[i, j] + noise[i, j]).item() * m for j, m in enumerate(mask)]
                               for i, mask in enumerate(batch.loss_mask)]
    return batch


def test_packing_keeps_groups_whole_and_splits_only_what_is_too_large(model_path) -> None:
    import transformers

    batch = grpo_batch(transformers.AutoModelForCausalLM.from_pretrained(model_path), seed=0)
    units = prompt_units(batch)
    assert [len(u) for u in units] == [6, 5, 1, 3]  # groups 0 and 4 share their prompt
    assert micro_batches(units, 4) == [[units[0][:4]], [units[0][4:]], [units[1][:4]],
                                       [units[1][4:], units[2]], [units[3]]]
    assert micro_batches(units, 16) == [units]
    budget = 2 * max(unit_length(batch, u) for u in units)
    parts = micro_batches(units, 16, lambda u: unit_length(batch, u), budget)
    assert [u for part in parts for u in part] == units and len(parts) > 1
    assert all(len(part) * max(unit_length(batch, u) for u in part) <= budget for part in parts)


def test_a_group_of_long_responses_is_split_where_attention_would_cost_more() -> None:
    """Responses join their group's packed sequence until its quadratic attention would cost
    more than computing the prompt again."""
    def group(prompt: int, responses: list[int]) -> RolloutBatch:
        trajs = [Trajectory(prompt_ids=[5] * prompt, response_ids=[7] * n, loss_mask=[1] * n,
                            logprobs=[0.0] * n, versions=["0"] * n) for n in responses]
        return RolloutBatch.from_trajectories(trajs, [0.0] * len(trajs))

    rows = list(range(6))
    assert split_unit(group(45, [16] * 6), rows, width=3456) == [rows]  # the demo: one sequence
    assert split_unit(group(45, [1024] * 6), rows, width=3456) == [[i] for i in rows]
    assert split_unit(group(45, [257] * 6), rows, width=3456) == [[0, 1], [2, 3], [4, 5]]
    assert split_unit(group(2000, [257] * 6), rows, width=3456) == [rows]  # long shared prompt


def compare_steps(trainer: Trainer, batch: RolloutBatch) -> None:
    want = padded_step(trainer, batch)
    ref = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    got = trainer.step(batch)  # lr 0: the weights stay, the clipped gradients are compared
    for name, p in trainer.model.named_parameters():
        scale = ref[name].abs().max().item()
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-5 * scale, msg=name)
        assert (p.grad - ref[name]).norm() <= 1e-5 * ref[name].norm(), name
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
    assert want["train/grad_norm"] > 0
    assert trainer.tis is not None or 0 < want["train/clip_fraction"] < 1  # TIS: ratio 1


@pytest.mark.parametrize("micro_batch,tis,layout", [
    (16, None, None), (4, None, None), (3, ("token", 2.0), None), (16, ("sequence", 1.5), None),
    (16, None, "split"), (16, None, "alone")])
def test_the_packed_step_gives_the_padded_steps_gradients(model_path, micro_batch, tis,
                                                          layout) -> None:
    """Same batch, fp32: the packed step's gradients and metrics are the padded ones, also with
    groups split into several packed sequences, and with every sequence its own micro-batch."""
    mode, cap = tis or ("token", None)
    trainer = Trainer(model_path, lr=0.0, clip=0.2, temperature=0.9, micro_batch=micro_batch,
                      dtype="float32", pad_id=2, tis=cap, tis_mode=mode,
                      micro_positions=1 if layout == "alone" else 4096)
    if layout == "split":
        trainer.pack_width = 12
        batch = grpo_batch(trainer.model, seed=1)
        assert len(trainer.units(batch)) > len(prompt_units(batch))
    compare_steps(trainer, grpo_batch(trainer.model, seed=1))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_packed_step_under_routing_replay(tmp_path, arch) -> None:
    """Routes recorded on the model, then its routers perturbed: the replayed experts are not the
    model's own choice, and both steps replay them alike."""
    trainer = Trainer(write_moe(str(tmp_path), arch, seed=0), lr=0.0, clip=0.2, temperature=1.0,
                      micro_batch=4, dtype="float32", pad_id=2)
    batch = grpo_batch(trainer.model, seed=2, routes=True)
    with torch.no_grad():
        for router in moe_routers(trainer.model):
            router.weight.add_(torch.randn_like(router.weight) * 0.05)
    compare_steps(trainer, batch)
    assert trainer.step(batch)["mismatch/routes_differ"] > 0


def test_the_calculator_evaluates_arithmetic_and_refuses_anything_else():
    from hotswap.rollout.tasks import calculator

    assert calculator("4821 * 397") == "1913937"
    assert calculator(" (12 + 30) * -4 / 8 ") == "-21"
    assert calculator("7 / 2") == "3.5" and calculator("0.1 + 0.2") == "0.3"
    assert calculator("123456789 * 987654321") == str(123456789 * 987654321)  # exact
    for bad in ("__import__('os').system('true')", "2 ** 10", "x + 1", "1; 2", "[1, 2]",
                "abs(-3)", "True + 1", "'1' + '2'", "1 if 1 else 2", "1 // 2", "5 % 3", "1e400",
                "1 / 0", "(" * 300 + "1" + ")" * 300, "", "1 +"):
        with pytest.raises(ValueError):
            calculator(bad)


def tool_traj(reply: str, answer: int, calls: int = 1, errors: int = 0,
              finish: str = "stop") -> Trajectory:
    """A trajectory of the tools task: `calls` calculator calls (and `errors` malformed ones),
    their results, then `reply` as the final turn."""
    from hotswap.rollout.tasks import tool_rows

    row = {**tool_rows(1, 0)[0], "answer": answer}
    messages = list(row["messages"])
    for _ in range(calls):
        messages += [{"role": "assistant", "content": '<tool_call>{"name": "calculator", '
                      '"arguments": {"expression": "2 * 3"}}</tool_call>'},
                     {"role": "tool", "content": "6"}]
    for _ in range(errors):
        messages += [{"role": "assistant", "content": "<tool_call>{oops</tool_call>"},
                     {"role": "tool", "content": "Error: could not parse"}]
    messages.append({"role": "assistant", "content": reply})
    return Trajectory(prompt_ids=[1], row=row, text=reply, finish_reason=finish,
                      num_turns=calls + errors + 1, messages=messages, tool_calls=calls,
                      parse_errors=errors)


def test_the_tools_reward_checks_the_final_answer_exactly():
    from hotswap.rollout.tasks import ToolReward, answer_in

    reward = ToolReward(format_reward=0.1)
    assert reward(tool_traj("2 * 3 = 1913937", 1913937))["reward"] == 1.0
    assert reward(tool_traj("The sum is 1,913,937.", 1913937))["reward"] == 1.0
    assert reward(tool_traj("1913937", 1913937, calls=0))["reward"] == 1.0  # right is right
    assert reward(tool_traj("It is 191393", 1913937))["reward"] == 0.1  # a call, wrong answer
    assert reward(tool_traj("It is 191393", 1913937, errors=1))["reward"] == 0.0  # malformed
    assert reward(tool_traj("It is 191393", 1913937, calls=0))["reward"] == 0.0
    assert reward(tool_traj("1913937", 1913937, finish="length"))["reward"] == 0.1  # cut off
    assert ToolReward()(tool_traj("no", 1913937))["reward"] == 0.0  # format reward off
    assert not answer_in("x 21913937 and 1913937.5", 1913937)  # a number, not a substring
    assert not answer_in('<tool_call>{"expression": "1913937"}</tool_call>', 1913937)
    assert answer_in("-42 is it", -42)
    scores = reward.take()
    assert len(scores) == 7 and reward.take() == []
    assert [s["correct"] for s in scores[:3]] == [1.0, 1.0, 1.0]


def test_tool_metrics():
    from hotswap.rollout.tasks import tool_score
    from hotswap.rollout.tracking import tool_metrics

    trajs = [tool_traj("6", 6), tool_traj("6", 6, calls=2, errors=1), tool_traj("7", 6, 0)]
    m = tool_metrics([tool_score(t) for t in trajs])
    assert m["tools/call_rate"] == pytest.approx(2 / 3)
    assert m["tools/parse_fail_rate"] == pytest.approx(1 / 4)
    assert m["tools/turns"] == pytest.approx((2 + 4 + 1) / 3)
    assert m["tools/correct"] == pytest.approx(2 / 3)
    assert math.isnan(tool_metrics([tool_score(trajs[2])])["tools/parse_fail_rate"])


def every_other_turn_calls(text: str):
    """A random model writes no tool calls: this parser sees a calculator call in every turn
    of even length, a malformed one in some others."""
    if len(text) % 2 == 0:
        return [("calculator", {"expression": "(2 + 4) * 7"})]
    return [("", "could not parse tool call")] if len(text) % 3 == 0 else []


@pytest.fixture(scope="module")
def long_model_path(tmp_path_factory) -> str:
    """The tiny chat model with room for the tools task's prompt (its tokenizer is byte-level)."""
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("grpo-tools")),
                                 max_position_embeddings=2048)


def test_the_tools_task_runs_the_calculator_in_context_masked(long_model_path, monkeypatch):
    """Tool results enter the sequence as template tokens with loss mask 0, and are the
    calculator's."""
    from hotswap.engine import Engine
    from hotswap.rollout import TokenClient, tasks

    monkeypatch.setattr(tasks, "hermes_tool_calls", every_other_turn_calls)
    task = tasks.make_task("tools", max_new_tokens=6, max_turns=3)
    with Engine(long_model_path, dtype="float32", max_total_tokens=16384) as engine:
        client = TokenClient(engine, sampling={"temperature": 1.0, "max_new_tokens": 6})
        trajs = task.loop.run_group(client, task.rows(1, 0)[0], 8, group_id=0, seed=3)
    tool_ids = task.loop.deltas(client.tokenizer).messages([{"role": "tool", "content": "42"}])
    called = [t for t in trajs if t.tool_calls]
    assert called  # the parser above makes some turns call
    for traj in trajs:
        traj.check()
        results = [m["content"] for m in traj.messages[len(traj.row["messages"]):]
                   if m["role"] == "tool"]
        assert results.count("42") == traj.tool_calls
        assert sum(r.startswith("Error") for r in results) == traj.parse_errors
        ids = traj.response_ids
        hits = [i for i in range(len(ids)) if ids[i: i + len(tool_ids)] == tool_ids]
        assert len(hits) == results.count("42")
        for i in hits:
            assert traj.loss_mask[i: i + len(tool_ids)] == [0] * len(tool_ids)
        assert traj.num_turns == 1 + len(results)


def test_the_tools_task_logs_its_agent_columns(long_model_path, tmp_path, monkeypatch, capsys):
    from hotswap.rollout import tasks

    monkeypatch.setattr(tasks, "hermes_tool_calls", every_other_turn_calls)
    args = parse_args(["--model-path", long_model_path, "--task", "tools", "--steps", "2",
                       "--prompts", "2", "--group-size", "4", "--over-sample", "0",
                       "--max-new-tokens", "6", "--filter", "none", "--lr", "1e-3",
                       "--wandb-dir", str(tmp_path)])
    out = run(args)
    history = out["history"]
    assert [h["weight_version"] for h in history] == [0, 1]
    for h in history:
        assert h["tools/trajectories"] == 8 and h["batch/trajectories"] == 8
        assert 0 < h["tools/call_rate"] <= 1  # the parser above makes some turns call
        assert 0 <= h["tools/parse_fail_rate"] <= 1 and 0 <= h["tools/correct"] <= 1
        turns = h["tools/turns"] * 8  # the mean of 8 trajectories' whole turn counts
        assert 8 <= turns <= 24 and abs(turns - round(turns)) < 1e-9
        assert 0 <= h["reward/mean"] <= 1
    rows = wandb_history(out["run_dir"])
    for key in ("tools/call_rate", "tools/parse_fail_rate", "tools/turns", "tools/correct"):
        assert all(key in r for r in rows), key
    header = capsys.readouterr().out.splitlines()
    assert any(all(c in line for c in ("right", "calls", "bad call", "turns"))
               for line in header)

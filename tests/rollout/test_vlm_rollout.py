"""Vision-language rollouts: the `shapes` task's rows, and the GRPO job's path (collect with the
task's loop, the Trainer, the in-process push) on tiny random Qwen2.5-VL and Qwen3-VL
checkpoints in float32: the trainer's logprobs of the engine's image rollouts are the engine's,
before and after a step whose weights (vision tower included) are pushed back."""

from __future__ import annotations

import os
import random
import shutil
from collections import deque

import numpy as np
import pytest
import torch
from fixtures import write_tiny_vl_model

from hotswap.engine import Engine
from hotswap.rollout.client import TokenClient, row_images
from hotswap.rollout.collect import collect
from hotswap.rollout.engines import start_in_process
from hotswap.rollout.tasks import SHAPES_QUESTION, draw_shapes, make_task, shapes_rows
from hotswap.rollout.tool_loop import ToolLoop, ToolResult
from hotswap.rollout.trainer import Trainer
from hotswap.rollout.trajectory import RolloutBatch

TOL = 1e-4


def components(image) -> int:
    """Connected regions (4-neighbour) of pixels that differ from the top-left background."""
    pixels = np.asarray(image)
    ink = (pixels != pixels[0, 0]).any(-1)
    seen = np.zeros_like(ink)
    count = 0
    for y, x in zip(*np.nonzero(ink)):
        if seen[y, x]:
            continue
        count += 1
        queue = deque([(y, x)])
        seen[y, x] = True
        while queue:
            cy, cx = queue.popleft()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < ink.shape[0] and 0 <= nx < ink.shape[1] and ink[ny, nx] \
                        and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
    return count


def test_shapes_rows_are_deterministic_per_seed_and_their_counts_are_right():
    rows, again, other = shapes_rows(12, 7), shapes_rows(12, 7), shapes_rows(12, 8)
    images = [row_images(r)[0] for r in rows]
    assert [im.tobytes() for im in images] == [row_images(r)[0].tobytes() for r in again]
    assert [r["answer"] for r in rows] == [r["answer"] for r in again]
    assert [im.tobytes() for im in images] != [row_images(r)[0].tobytes() for r in other]
    assert {r["answer"] for r in rows} <= {1, 2, 3, 4} and len({r["answer"] for r in rows}) > 1
    for row, image in zip(rows, images):
        assert components(image) == row["answer"]
        assert 56 <= image.width == image.height <= 112
        (message,) = row["messages"]
        assert [p["type"] for p in message["content"]] == ["image", "text"]
        assert message["content"][1]["text"] == SHAPES_QUESTION


class PausedFirst:
    """A backend that records each call's image_data; its first answer is an abort for a
    pause after two tokens, the resubmission runs to its length."""

    def __init__(self):
        self.images: list = []

    def get_weight_version(self) -> str:
        return "0"

    def generate(self, input_ids, sampling_params, return_logprob, rid, image_data=None, **_):
        self.images.append(image_data)
        first = len(self.images) == 1
        count = 2 if first else sampling_params["max_new_tokens"]
        finish = {"type": "abort", "reason": "paused"} if first else {"type": "length"}
        return [{"text": "", "output_ids": [7] * count, "meta_info": {
            "finish_reason": finish, "output_token_logprobs": [[-1.0, 7]] * count,
            "weight_versions": [{"version": "0", "start": 0, "end": count}],
            "prompt_ids": [1, 5, 5, 2], "images": [{"offset": 1, "tokens": 2}]}}]


def test_a_sample_resubmitted_after_a_pause_goes_with_its_images():
    backend, image = PausedFirst(), draw_shapes(1, 56, random.Random(0))
    (comp,) = TokenClient(backend, sampling={"max_new_tokens": 6}).generate(
        [1, 5, 2], image_data=[image])
    assert comp.resubmits == 1 and len(comp.output_ids) == 6
    assert backend.images == [[[image]], [[image]]]  # per prompt: its list of images
    assert comp.prompt_ids == [1, 5, 5, 2] and comp.image_meta == [{"offset": 1, "tokens": 2}]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def job(request, tmp_path_factory):
    """The GRPO job's pieces on a tiny VL checkpoint: engine (in process), client, trainer,
    and the checkpoint's folder."""
    path = str(tmp_path_factory.mktemp(request.param))
    write_tiny_vl_model(path, request.param)
    handle = start_in_process(path, "float32", 0, 8192, {})
    client = TokenClient(handle.backend, tokenizer=path,
                         sampling={"temperature": 1.0, "max_new_tokens": 8})
    trainer = Trainer(path, lr=1e-2, clip=0.2, temperature=1.0, micro_batch=64,
                      dtype="float32", pad_id=client.tokenizer.pad_token_id or 0)
    yield handle, client, trainer, path
    handle.close()


def saved_checkpoint(trainer: Trainer, path: str, out: str) -> str:
    """The trainer's weights with the other files of the checkpoint at `path`, as a folder."""
    for name in os.listdir(path):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(path, name), out)
    trainer.model.save_pretrained(out)
    return out


def varied_reward(traj) -> float:
    """Something a random model's samples differ in (the count they never get right), so the
    step has a gradient."""
    return sum(t % 2 for t in traj.response_ids) / max(1, len(traj.response_ids))


def rollouts(client: TokenClient, seed: int) -> RolloutBatch:
    task = make_task("shapes", max_new_tokens=8)
    return collect(client, task.loop, task.rows(3, seed), group_size=3, reward=varied_reward,
                   seed=seed)


def by_sample(batch: RolloutBatch) -> dict[tuple[int, int], tuple[list[int], list[float]]]:
    """(row, sample) -> (response ids, engine logprobs): groups join a batch as they finish."""
    return {(g, k): (ids, lps) for g, k, ids, lps in zip(
        batch.group_ids, batch.sample_idx, batch.response_ids, batch.behavior_logprobs)}


def max_dlogp(trainer: Trainer, batch: RolloutBatch) -> float:
    """The largest |trainer - engine| logprob over every response token of the batch."""
    units = trainer.units(batch)
    order = [i for unit in units for i in unit]
    with torch.no_grad():
        logp = trainer.response_logprobs(batch, units, max(map(len, batch.response_ids)), {})
    worst = 0.0
    for k, i in enumerate(order):
        n = len(batch.response_ids[i])
        engine = torch.tensor(batch.behavior_logprobs[i])
        worst = max(worst, (logp[k, :n] - engine).abs().max().item())
    return worst


def test_the_trainer_scores_the_engines_image_rollouts_as_the_engine_did(job):
    _, client, trainer, _ = job
    batch = rollouts(client, seed=0)
    assert len(batch) == 9 and all(len(r) == 8 for r in batch.response_ids)
    for prompt, images, meta in zip(batch.prompt_ids, batch.images, batch.image_meta):
        (image,) = meta  # one image per row, expanded in the prompt the trainer scores
        assert len(images) == 1 and image["tokens"] >= 4
        run = prompt[image["offset"]: image["offset"] + image["tokens"]]
        assert set(run) == {client.backend.model_config.image_token_id}
    assert max_dlogp(trainer, batch) <= TOL
    batch.images[0] = [draw_shapes(1, 56, random.Random(9))]  # not the pixels the engine saw
    with pytest.raises(ValueError, match="differs from the engine's"):
        max_dlogp(trainer, batch)


def test_a_step_and_a_push_keep_the_trainer_and_the_engine_equal(job, tmp_path):
    """One step, pushed: the engine samples from the trainer's weights, as a fresh engine
    loaded from them does. Then the vision tower
    alone is perturbed: the trainer then disagrees with the engine's last batch, and agrees
    with the engine again once pushed (the push carries the tower's tensors)."""
    handle, client, trainer, path = job
    before = rollouts(client, seed=1)
    metrics = trainer.step(before)
    assert metrics["mismatch/abs_diff"] <= TOL and metrics["train/grad_norm"] > 0
    named = trainer.named_weights()
    assert any(".visual." in name for name, _ in named)
    handle.push(named, "1")
    after = rollouts(client, seed=1)
    assert after.behavior_logprobs != before.behavior_logprobs
    assert max_dlogp(trainer, after) <= TOL
    fresh = Engine(saved_checkpoint(trainer, path, str(tmp_path)), dtype="float32", seed=0,
                   max_total_tokens=4096)
    try:  # the pushed engine samples as one loaded from the trainer's weights does
        again = rollouts(TokenClient(fresh, tokenizer=client.tokenizer,
                                     sampling=dict(client.sampling)), seed=1)
    finally:
        fresh.shutdown()
    fresh_samples, live_samples = by_sample(again), by_sample(after)
    assert fresh_samples.keys() == live_samples.keys()
    for key, (ids, logprobs) in fresh_samples.items():
        assert ids == live_samples[key][0]
        assert max(abs(a - b) for a, b in zip(logprobs, live_samples[key][1])) <= TOL
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".visual." in name and p.dim() >= 2:
                p.add_(torch.randn_like(p) * 0.05)
    assert max_dlogp(trainer, after) > 1e-3
    handle.push(trainer.named_weights(), "2")
    assert max_dlogp(trainer, rollouts(client, seed=1)) <= TOL


def test_a_tools_images_reach_the_next_turn_and_the_trainer(job):
    """A tool that returns an image (ToolResult): the tool message holds it, the next turn's
    request carries it, the trajectory keeps the engine's expanded run (loss mask 0) and both
    images, and the trainer scores the whole conversation as the engine did."""
    _, client, trainer, _ = job
    picture = draw_shapes(3, 84, random.Random(5))
    loop = ToolLoop({"look": lambda: ToolResult("a picture", [picture])}, max_turns=2,
                    parse=lambda text: [("look", {})], max_new_tokens=5)
    row = shapes_rows(1, seed=4)[0]
    client.cancelled.clear()  # the last collect called its rollout off when it had its groups
    trajs = loop.run_group(client, row, 2, 0, seed=3)
    image_id = client.backend.model_config.image_token_id
    for traj in trajs:
        assert traj.num_turns == 2 and traj.finish_reason == "max_turns"
        assert traj.images == [row_images(row)[0], picture]
        assert traj.messages[2]["content"][0] == {"type": "image", "image": picture}
        first, second = traj.image_meta
        assert first["offset"] + first["tokens"] <= len(traj.prompt_ids) < second["offset"]
        start = second["offset"] - len(traj.prompt_ids)
        run = range(start, start + second["tokens"])
        assert {traj.response_ids[i] for i in run} == {image_id}
        assert {traj.loss_mask[i] for i in run} == {0} and traj.num_trainable == 10
    batch = RolloutBatch.from_trajectories(trajs, [0.0, 0.0])
    assert max_dlogp(trainer, batch) <= TOL


def test_the_grpo_job_runs_the_shapes_task_on_a_vl_checkpoint(tmp_path):
    from hotswap.rollout.grpo import parse_args, run

    path = str(tmp_path / "model")
    write_tiny_vl_model(path, "qwen2_5_vl")
    out = run(parse_args(["--model", path, "--task", "shapes", "--steps", "2", "--prompts", "2",
                          "--group-size", "3", "--filter", "none", "--max-new-tokens", "6",
                          "--wandb-dir", str(tmp_path / "runs"), "--quiet"]))
    assert [h["weight_version"] for h in out["history"]] == [0, 1]
    for metrics in out["history"]:
        assert metrics["mismatch/abs_diff"] <= TOL and metrics["sync/sent_mb"] > 0

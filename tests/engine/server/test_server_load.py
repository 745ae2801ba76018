"""Load during weight updates: 64 streaming clients while a trainer process pushes weights."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import httpx
import openai
from fixtures import ADMIN_KEY, API_KEY, PROMPT, TESTS_DIR, write_tiny_chat_model

from hotswap.engine import RemoteEngine
from hotswap.weight_sync.group import free_port


def _length(client: int, request: int) -> int:
    # Staggered lengths keep requests at every stage of generation when an update lands.
    return 12 + (7 * client + 5 * request) % 25


async def _native_client(remote: RemoteEngine, i: int, stop: asyncio.Event,
                         finals: list, errors: list) -> None:
    j = 0
    while not stop.is_set() or j == 0:
        length = _length(i, j)
        try:
            events = await remote.async_generate(
                prompt=f"{PROMPT} {i} {j}", stream=True,
                sampling_params={"max_new_tokens": length, "ignore_eos": True,
                                 "seed": i * 997 + j})
            last = None
            async for event in events:
                last = event
            finals.append(("native", {**last["meta_info"], "max_new_tokens": length}))
        except Exception as exc:  # noqa: BLE001 - counted and reported by the test
            errors.append(repr(exc))
        j += 1


async def _openai_client(url: str, i: int, stop: asyncio.Event, finals: list,
                         errors: list) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    j = 0
    while not stop.is_set() or j == 0:
        try:
            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"count {i} {j}"}],
                max_tokens=_length(i, j), stream=True, extra_body={"ignore_eos": True})
            reason = None
            async for chunk in stream:
                for c in chunk.choices:
                    reason = c.finish_reason or reason
            finals.append(("openai", {"finish_reason": {"type": reason}}))
        except Exception as exc:  # noqa: BLE001 - counted and reported by the test
            errors.append(repr(exc))
        j += 1
    await client.close()


async def _load_during_updates(url: str, ckpt: str) -> tuple[dict, list, list, float]:
    stop = asyncio.Event()
    finals: list = []
    errors: list = []
    remote = RemoteEngine(url, api_key=API_KEY)
    start = time.perf_counter()
    clients = [asyncio.create_task(_native_client(remote, i, stop, finals, errors))
               for i in range(48)]
    clients += [asyncio.create_task(_openai_client(url, i, stop, finals, errors))
                for i in range(16)]
    trainer = subprocess.Popen(
        [sys.executable, "-c", "import fixtures; fixtures.trainer_main()", url, ADMIN_KEY,
         str(free_port()), ckpt], cwd=TESTS_DIR, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        out, err = await asyncio.to_thread(trainer.communicate, timeout=120)
    finally:
        stop.set()
    await asyncio.wait_for(asyncio.gather(*clients), timeout=60)  # none hangs
    duration = time.perf_counter() - start
    assert trainer.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), finals, errors, duration


def test_64_streams_while_a_trainer_updates_weights(api_engine, api_server, tmp_path):
    ckpt = write_tiny_chat_model(str(tmp_path / "trained"), seed=2)
    before = api_engine.get_weight_version()
    trainer, finals, errors, duration = asyncio.run(_load_during_updates(api_server.url, ckpt))
    assert errors == []
    assert len(finals) >= 64
    assert trainer["version"] == "v2" == api_engine.get_weight_version()
    natives = [m for kind, m in finals if kind == "native"]
    for meta in natives:
        reason = meta["finish_reason"]
        versions = [s["version"] for s in meta["weight_versions"]]
        if reason["type"] == "abort":
            # Only the v2 update aborts: what it caught was running under v1 (over HTTP too,
            # the abort says why in a field, not only in its message).
            assert versions[-1:] in ([], ["v1"]) and reason["reason"] == "paused", meta
        else:
            assert reason["type"] == "length", meta
            assert meta["completion_tokens"] == meta["max_new_tokens"], meta
        assert "v2" not in versions or "v1" not in versions, meta  # abort mode: no v1->v2
    reasons = [m["finish_reason"]["type"] for _, m in finals]
    assert set(reasons) <= {"length", "abort"}
    assert "abort" in reasons
    # Retract mode: requests caught by the v1 update were recomputed and went on under v1, to
    # their length or until the v2 update (abort mode) caught them too.
    split = [m for m in natives
             if [s["version"] for s in m["weight_versions"]] == [before, "v1"]]
    print(f"\n64 streaming clients: {len(finals)} requests in {duration:.1f}s, "
          f"{len(errors)} errors, {reasons.count('abort')} aborted by the v2 update, "
          f"{len(split)} recomputed across v1; update calls took {trainer['timings']}")
    assert split and all(m["num_retractions"] >= 1 for m in split)
    assert all(m["finish_reason"]["type"] == "length"
               or "paused (mode abort)" in m["finish_reason"]["message"] for m in split)
    assert any(m["finish_reason"]["type"] == "length" for m in split)
    text = httpx.get(f"{api_server.url}/metrics",
                     headers={"Authorization": f"Bearer {API_KEY}"}).text
    assert 'hotswap_weight_version_info{version="v2"} 1.0' in text
    assert 'hotswap_weight_update_seconds_count{source="distributed"}' in text
    assert re.search(r'hotswap_weight_updates_total\{result="success",source="distributed"\} 2',
                     text)
    api_engine.check_integrity()

"""The command line: argument defaults and `python -m hotswap.engine.server` serving."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from fixtures import PROMPT, wait_until

from hotswap.engine import Engine
from hotswap.engine.server.app import build_parser, engine_kwargs
from hotswap.weight_sync.group import free_port


def test_cli_defaults_to_localhost():
    args = build_parser().parse_args(["--model-path", "m"])
    assert args.host == "127.0.0.1" and args.api_key is None and args.admin_key is None


def test_weight_staging_flag_sets_the_engine_default(api_model_path):
    parse = build_parser().parse_args
    assert engine_kwargs(parse(["--model-path", "m"]))["weight_staging"] == "standby"
    args = parse(["--model-path", api_model_path, "--device", "cpu", "--max-total-tokens",
                  "1024", "--weight-staging", "none"])
    with Engine(**engine_kwargs(args)) as engine:
        assert engine.config.weight_staging == "none"
    with pytest.raises(SystemExit):
        parse(["--model-path", "m", "--weight-staging", "copy"])


def test_cli_serves_and_logs_open_access(api_model_path):
    port = free_port()
    env = {**os.environ, "HOTSWAP_API_KEY": "", "HOTSWAP_ADMIN_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-m", "hotswap.engine.server", "--model-path",
                             api_model_path, "--port", str(port), "--device", "cpu",
                             "--max-total-tokens", "4096", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, "the server exited"
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(up, 60)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert httpx.post(f"{url}/flush_cache", json={}).json()["success"]  # no keys: open
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "no --api-key or --admin-key" in out and "127.0.0.1" in out

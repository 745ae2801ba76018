"""The command line: argument defaults and `python -m hotswap.engine.server` serving."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import typing
from typing import Any

import httpx
import pytest
from fixtures import PROMPT, wait_until

from hotswap.engine import Engine
from hotswap.engine.config import EngineConfig
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


def other_value(action: argparse.Action, default: Any, kind: type) -> Any:
    """A value of the flag's type that is not its default."""
    if action.choices:
        return next(c for c in action.choices if c != default)
    if kind is int:
        return 3 if default is None else default + 3
    if kind is float:
        return 0.125 if default is None else default / 2
    return "a-value"


def test_every_engine_config_field_has_a_flag_that_reaches_the_config():
    parser = build_parser()
    actions = parser._option_string_actions
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in actions, f"EngineConfig.{f.name} has no flag {flag}"
        if f.name == "model_path":
            continue
        kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],)
                    if t is not type(None))
        if kind is bool:
            value, argv = not f.default, [flag if not f.default else "--no-" + flag[2:]]
        else:
            value = other_value(actions[flag], f.default, kind)
            argv = [flag, str(value)]
        kwargs = engine_kwargs(parser.parse_args(["--model-path", "m", *argv]))
        assert kwargs[f.name] == value, f.name
        assert getattr(EngineConfig(**kwargs), f.name) == value, f.name
    defaults = engine_kwargs(parser.parse_args(["--model-path", "m"]))
    assert EngineConfig(**defaults) == EngineConfig("m")  # no flag moves a default


@pytest.mark.parametrize("argv, field, value", [
    (["--disable-prefix-cache"], "enable_prefix_cache", False),
    (["--no-pack-weights"], "pack_weights", False),
    (["--no-check-weights-finite"], "check_weights_finite", False),
    (["--deterministic"], "deterministic", True),
    (["--enable-weights-cpu-backup"], "enable_weights_cpu_backup", True),
    (["--quantization", "int8", "--quantize-lm-head"], "quantize_lm_head", True),
])
def test_the_flags_spelled_before_still_work(argv, field, value):
    assert engine_kwargs(build_parser().parse_args(["--model-path", "m", *argv]))[field] == value


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

"""Shared fixtures: tiny random HF checkpoints (Llama, Qwen2, Qwen3) written to disk."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

if not torch.cuda.is_available():
    # Triton kernels run under its interpreter without CUDA. Triton reads the flag when it is
    # first imported, and other test modules import it early (peft does), so set it here.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `gpu` marker (pyproject.toml) means "needs CUDA": without it those tests skip here,
    so no test repeats the check."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# Ray (tests/fleet): 127.0.0.1 only, no usage reports, no dashboard.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    eos_token_id=2,
    bos_token_id=1,
)


def make_hf_config(arch: str, **overrides):
    import transformers

    if arch == "llama":
        cfg = transformers.LlamaConfig(**TINY_COMMON, tie_word_embeddings=False,
                                       rope_theta=10000.0)
    elif arch == "llama3-rope":
        cfg = transformers.LlamaConfig(
            **TINY_COMMON, tie_word_embeddings=True, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**TINY_COMMON, tie_word_embeddings=True)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=False)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def write_tiny_model(path: str, arch: str, seed: int = 0, **overrides) -> str:
    """Write a random HF model of the given family to `path`; returns the path."""
    import transformers

    cfg = make_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights give logits with real spread
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session", params=["llama", "llama3-rope", "qwen2", "qwen3"])
def tiny_model_path(request, tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp(request.param)), request.param)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("llama")), "llama")


REAL_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "models", "smollm2-135m-instruct")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


@pytest.fixture(scope="session")
def real_model_path() -> str:
    """The converted SmolLM2-135M-Instruct folder (made by `make model`)."""
    from hotswap.engine.models.fetch import ensure_model

    return ensure_model(REAL_MODEL_DIR)


def write_tiny_chat_model(path: str, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """A tiny random model with SmolLM2's real tokenizer and chat template (vocab 49152)."""
    import shutil

    from hotswap.engine.models.fetch import ensure_model

    src = ensure_model(REAL_MODEL_DIR)
    overrides.setdefault("vocab_size", 49152)
    overrides.setdefault("max_position_embeddings", 2048)
    write_tiny_model(path, arch, seed=seed, **overrides)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(path, name))
    return path


@pytest.fixture(scope="session")
def tiny_chat_model_path(tmp_path_factory) -> str:
    return write_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-chat")))


# The HTTP server tests (tests/engine/server): one tiny chat model (fixtures.py's trained
# tokenizer, no download) and one server with an API key and an admin key per test module, on a
# free localhost port. Keys and requests are in fixtures.py. fixtures.py imports this module, so
# these fixtures import it when they run.


@pytest.fixture(scope="module")
def api_model_path(tmp_path_factory) -> str:
    from fixtures import write_tiny_chat_model as write_trained_tokenizer_chat_model

    return write_trained_tokenizer_chat_model(str(tmp_path_factory.mktemp("chat")))


@pytest.fixture(scope="module")
def api_engine(api_model_path):
    from hotswap.engine import Engine

    with Engine(api_model_path, device="cpu", max_total_tokens=16384) as eng:
        yield eng


@pytest.fixture(scope="module")
def api_server(api_engine):
    from fixtures import ADMIN_KEY, API_KEY, serve

    with serve(api_engine, api_key=API_KEY, admin_key=ADMIN_KEY, max_body_bytes=1 << 20) as srv:
        yield srv


@pytest.fixture
def api_client(api_server):
    """The official OpenAI client, with the API key."""
    import openai
    from fixtures import API_KEY

    return openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def api_admin(api_server):
    """An httpx client with the admin key."""
    import httpx
    from fixtures import ADMIN_KEY

    with httpx.Client(base_url=api_server.url, timeout=30,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        yield c


@pytest.fixture
def api_user(api_server):
    """An httpx client with the API key."""
    import httpx
    from fixtures import API_KEY

    with httpx.Client(base_url=api_server.url, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c

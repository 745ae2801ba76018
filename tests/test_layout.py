"""Import direction (DESIGN.md "Layout"): read every module's imports with ast and check them.

Imports under `if TYPE_CHECKING:` are annotations only and are not counted; function-local
(lazy) imports are.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"engine": "hotswap.engine", "weight_sync": "hotswap.weight_sync",
            "rollout": "hotswap.rollout", "trainers_adapters": "hotswap.trainers_adapters"}

E = "hotswap.engine"
_EXECUTOR_SIDE = (f"{E}.executor", f"{E}.attention", f"{E}.layers", f"{E}.models", f"{E}.lora",
                  f"{E}.grammar", f"{E}.distributed")
_BASE = (f"{E}.config", f"{E}.errors", f"{E}.core")
# Area (longest matching prefix wins) -> the hotswap modules it may import (prefixes).
ALLOWED: dict[str, tuple[str, ...]] = {
    "hotswap.weight_sync": ("hotswap.weight_sync",),
    f"{E}.core": _BASE,
    f"{E}.kvcache": (*_BASE, f"{E}.kvcache"),
    **{area: (*_BASE, f"{E}.kvcache", *_EXECUTOR_SIDE, "hotswap.weight_sync")
       for area in _EXECUTOR_SIDE},
    f"{E}.scheduler": (*_BASE, f"{E}.kvcache", *_EXECUTOR_SIDE, f"{E}.scheduler"),
    f"{E}.weights": (*_BASE, f"{E}.kvcache", *_EXECUTOR_SIDE, f"{E}.weights",
                     "hotswap.weight_sync"),
    # The server talks to the Engine API only (the Engine object it is handed, public errors).
    f"{E}.server": (f"{E}.server", f"{E}.errors", f"{E}.Engine", f"{E}.router", f"{E}.client"),
    f"{E}.client": (f"{E}.client", f"{E}.errors", "hotswap.weight_sync"),
    f"{E}.config": (f"{E}.config", f"{E}.errors"),
    f"{E}.errors": ("hotswap.weight_sync",),
    E: (E, "hotswap.weight_sync"),  # engine.py and the package root: anything in the engine
    "hotswap.rollout": ("hotswap.rollout", E, "hotswap.weight_sync"),
    "hotswap.trainers_adapters": ("hotswap.trainers_adapters", "hotswap.rollout", E,
                                  "hotswap.weight_sync"),
}
# What engine.py and the package root may still not reach: nothing in the engine imports the server.
FORBIDDEN_FOR_ENGINE = ("hotswap.rollout", "hotswap.trainers_adapters", f"{E}.server")
# ...except the package root's lazy public names: `hotswap.engine.Router` lives in the server.
PUBLIC_REEXPORTS = {E: (f"{E}.server.router",)}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    pkg = PACKAGES[rel.parts[0]]
    parts = [p for p in rel.with_suffix("").parts[1:] if p != "__init__"]
    return ".".join([pkg, *parts])


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imported_modules(source: str, module: str) -> list[str]:
    tree = ast.parse(source)
    skip = _type_checking_nodes(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = module.split(".")[: -node.level]
                base = ".".join([*pkg, base] if base else pkg)
            # `from hotswap.engine import Engine` names the package; `from x import mod` a module
            out += [f"{base}.{a.name}" for a in node.names] if base == E else [base]
    return [m for m in out if m.startswith("hotswap.")]


def area_of(module: str) -> str:
    return max((a for a in ALLOWED if module == a or module.startswith(a + ".")), key=len)


def violations(source: str, module: str) -> list[str]:
    area = area_of(module)
    bad = []
    for target in imported_modules(source, module):
        ok = any(target == p or target.startswith(p + ".") for p in ALLOWED[area])
        if area == E and target.startswith(FORBIDDEN_FOR_ENGINE):
            ok = target in PUBLIC_REEXPORTS.get(module, ())
        if not ok:
            bad.append(f"{module} imports {target} (area {area})")
    return bad


def all_modules() -> list[tuple[Path, str]]:
    return [(p, module_name(p)) for top in PACKAGES for p in sorted((ROOT / top).rglob("*.py"))]


def test_every_import_points_the_allowed_way():
    bad = [v for path, mod in all_modules() for v in violations(path.read_text(), mod)]
    assert not bad, "imports against the allowed direction:\n" + "\n".join(bad)


def test_checker_catches_forbidden_imports():
    cases = {
        f"{E}.kvcache.radix_cache": "from hotswap.engine.scheduler.scheduler import Scheduler",
        f"{E}.core.request": "from hotswap.engine.kvcache.radix_cache import TreeNode",
        f"{E}.server.app": "from hotswap.engine.scheduler.scheduler import Scheduler",
        f"{E}.scheduler.scheduler": "from hotswap.engine.server import app",
        "hotswap.weight_sync.sender": "import hotswap.engine.engine",
        f"{E}.engine": "from hotswap.rollout import TokenClient",
        f"{E}.executor.sampling": "def f():\n    from hotswap.engine.weights import weight_manager",
    }
    for module, source in cases.items():
        assert violations(source, module), (module, source)
    # annotations only and allowed directions pass
    ok = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n" \
         "    from hotswap.engine.kvcache.radix_cache import TreeNode\n"
    assert not violations(ok, f"{E}.core.request")
    assert not violations("from hotswap.engine.kvcache.memory import KVPool",
                          f"{E}.scheduler.kv_manager")


def test_every_engine_folder_is_a_package():
    for folder in (ROOT / "engine").iterdir():
        if folder.is_dir() and folder.name != "__pycache__":
            assert (folder / "__init__.py").exists(), folder

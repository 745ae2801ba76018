"""Import direction (docs/design.md#layout): read every module's imports with ast and check them.

Imports under `if TYPE_CHECKING:` are annotations only and are not counted; function-local
(lazy) imports are. The cycle tests at the end count every import, TYPE_CHECKING ones included.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"engine": "hotswap.engine", "weight_sync": "hotswap.weight_sync",
            "rollout": "hotswap.rollout", "trainers_adapters": "hotswap.trainers_adapters",
            "fleet": "hotswap.fleet"}

E = "hotswap.engine"
_EXECUTOR_SIDE = (f"{E}.executor", f"{E}.attention", f"{E}.layers", f"{E}.models", f"{E}.lora",
                  f"{E}.grammar", f"{E}.distributed", f"{E}.speculative", f"{E}.multimodal")
# The interface's rules (pause modes, MAX_N) sit in client.protocol and its requests in
# client.request, which import nothing else.
_BASE = (f"{E}.config", f"{E}.cpu_features", f"{E}.errors", f"{E}.core",
         f"{E}.client.protocol", f"{E}.client.request")
# Area (longest matching prefix wins) -> the hotswap modules it may import (prefixes).
ALLOWED: dict[str, tuple[str, ...]] = {
    "hotswap.weight_sync": ("hotswap.weight_sync",),
    f"{E}.core": (f"{E}.core", f"{E}.client.protocol", f"{E}.client.request"),
    f"{E}.kvcache": (*_BASE, f"{E}.kvcache"),
    **{area: (*_BASE, f"{E}.kvcache", *_EXECUTOR_SIDE, "hotswap.weight_sync")
       for area in _EXECUTOR_SIDE},
    f"{E}.scheduler": (*_BASE, f"{E}.kvcache", *_EXECUTOR_SIDE, f"{E}.scheduler"),
    f"{E}.weights": (*_BASE, f"{E}.kvcache", *_EXECUTOR_SIDE, f"{E}.weights",
                     "hotswap.weight_sync"),
    # The server talks to the Engine API only (the Engine object it is handed, public errors,
    # the config whose fields are its flags), and reads chat through the parsers, which stand
    # on nothing else of the engine.
    f"{E}.server": (f"{E}.server", f"{E}.errors", f"{E}.Engine", f"{E}.config", f"{E}.client",
                    f"{E}.parsers", "hotswap.weight_sync.serialize"),
    f"{E}.parsers": (f"{E}.parsers",),
    f"{E}.client": (f"{E}.client", f"{E}.errors", "hotswap.weight_sync"),
    f"{E}.client.protocol": (f"{E}.client.request",),
    f"{E}.client.request": (),
    f"{E}.config": (f"{E}.config", f"{E}.cpu_features", f"{E}.errors"),
    f"{E}.cpu_features": (),
    f"{E}.errors": ("hotswap.weight_sync",),
    E: (E, "hotswap.weight_sync"),  # engine.py and the package root: anything in the engine
    # The fleet drives engines through the interface; its Ray replica actor holds an Engine.
    "hotswap.fleet": ("hotswap.fleet", f"{E}.client", f"{E}.errors", f"{E}.server",
                      f"{E}.Engine", "hotswap.weight_sync"),
    "hotswap.rollout": ("hotswap.rollout", "hotswap.fleet", E, "hotswap.weight_sync"),
    "hotswap.trainers_adapters": ("hotswap.trainers_adapters", "hotswap.rollout",
                                  "hotswap.fleet", E, "hotswap.weight_sync"),
}
# What engine.py and the package root may still not reach: nothing in the engine imports the
# server, and the engine never imports what is above it (trainers_adapters -> rollout -> fleet).
FORBIDDEN_FOR_ENGINE = ("hotswap.rollout", "hotswap.trainers_adapters", "hotswap.fleet",
                        f"{E}.server")
PUBLIC_REEXPORTS: dict[str, tuple[str, ...]] = {}


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


# examples/ and bench/ use public names only (docs/design.md#import-direction): a name a package
# exports in `__all__` (from the package or the module defining it), or any name of a module the
# docs give users.
PUBLIC_PACKAGES = (E, "hotswap.weight_sync", "hotswap.rollout", "hotswap.fleet")
PUBLIC_MODULES = (f"{E}.config", f"{E}.errors", f"{E}.models.fetch", "hotswap.rollout.grpo",
                  "hotswap.trainers_adapters")
_WS = "hotswap.weight_sync"
# What a benchmark times from inside, by script: the list in docs/design.md, exactly.
BENCH_INTERNALS: dict[str, tuple[str, ...]] = {
    "bench/bench_sampling.py": (f"{E}.core.sampling_params", f"{E}.executor.sampling",
                                f"{E}.executor.sampling_batch_info"),
    "bench/throughput.py": (f"{E}.layers",),
    "bench/matmul.py": (f"{E}.layers", f"{E}.models.llama.InvariantHead",
                        f"{E}.models.llama.invariant_logits"),
    "bench/attention.py": (f"{E}.layers", f"{E}.kvcache.memory.KVPool"),
    "bench/colocation.py": (f"{E}.executor.omp", f"{E}.scheduler.scheduler"),
    "bench/grpo_step.py": ("hotswap.rollout.trainer",
                           "hotswap.rollout.exact_forward.segment_sequences"),
    "bench/finite_check.py": (f"{E}.models.loader",),
    "bench/weight_sync.py": (f"{_WS}.group.free_port", f"{_WS}.rpc",
                             f"{_WS}.sender.hf_module_order"),
    "bench/delta_sync.py": (f"{_WS}.group.free_port", f"{_WS}.rpc"),
    "bench/gpu_check.py": (f"{_WS}.group.free_port", f"{_WS}.rpc"),
    "bench/fleet.py": (f"{_WS}.group.free_port",),
    "bench/tensor_parallel.py": (f"{_WS}.group.free_port",),
    "bench/disagg.py": (f"{_WS}.group.free_port",),
}


def script_imports(source: str) -> list[str]:
    """What a script takes from hotswap, anywhere in it: `module.Name`, or `module`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("hotswap.")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hotswap."):
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def exported(package: str) -> set[str]:
    """A package's `__all__`."""
    tree = ast.parse((ROOT.joinpath(*package.split(".")[1:]) / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def is_public(target: str) -> bool:
    module, _, name = target.rpartition(".")
    if target in PUBLIC_PACKAGES or name.startswith("_"):
        return target in PUBLIC_PACKAGES
    if any(target.startswith(m + ".") for m in PUBLIC_MODULES):
        return True
    return any(module == p or module.startswith(p + ".") for p in PUBLIC_PACKAGES
               if name in exported(p))


def _short(module: str) -> str:
    """How docs/design.md names a module in its list: without hotswap.engine., else hotswap."""
    return module.removeprefix(f"{E}.") if module.startswith(f"{E}.") else \
        module.removeprefix("hotswap.")


def documented_bench_internals() -> dict[str, tuple[str, ...]]:
    """docs/design.md's list: `- what: `bench/a.py` [and `bench/b.py`] imports `x`, `y``."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Import direction", 1)[1].split("\n## ", 1)[0]
    out: dict[str, tuple[str, ...]] = {}
    for item in re.split(r"\n- ", section)[1:]:
        names = re.findall(r"`([^`]+)`", item.split("\n\n", 1)[0])
        scripts = [n for n in names if n.startswith("bench/")]
        out.update(dict.fromkeys(scripts, tuple(n for n in names if n not in scripts)))
    return out


def test_examples_and_bench_use_public_names_or_the_documented_internals():
    bad, used = [], set()
    for path in sorted([*(ROOT / "examples").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        script = path.relative_to(ROOT).as_posix()
        for target in script_imports(path.read_text()):
            hits = [m for m in BENCH_INTERNALS.get(script, ())
                    if target == m or target.startswith(m + ".")]
            used.update((script, m) for m in hits)
            if not hits and not is_public(target):
                bad.append(f"{script} imports {target}")
    assert not bad, "internal names outside docs/design.md's list:\n" + "\n".join(bad)
    unused = [f"{s}: {m}" for s, ms in BENCH_INTERNALS.items() for m in ms if (s, m) not in used]
    assert not unused, "listed but no longer imported (drop them here and in docs/design.md):\n" \
        + "\n".join(unused)
    listed = {s: tuple(_short(m) for m in ms) for s, ms in BENCH_INTERNALS.items()}
    assert documented_bench_internals() == listed


def test_public_name_check():
    assert is_public(f"{E}.Engine") and is_public("hotswap.weight_sync.WeightSender")
    assert is_public("hotswap.weight_sync.group.init_process_group")  # exported by the package
    assert is_public("hotswap.trainers_adapters.sglang")
    assert is_public(f"{E}.models.fetch.ensure_model")
    assert not is_public(f"{E}.Scheduler") and not is_public("hotswap.weight_sync.group.free_port")
    assert not is_public(f"{E}.scheduler.scheduler") and not is_public(f"{E}.config._private")
    assert script_imports("def f():\n    import hotswap.engine.scheduler.scheduler as s\n") == \
        [f"{E}.scheduler.scheduler"]


def _ray_imports(tree: ast.AST) -> list[ast.AST]:
    return [node for node in ast.walk(tree)
            if any(n == "ray" or n.startswith("ray.") for n in
                   ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []))]


def test_only_the_fleet_imports_ray_at_module_level():
    """Ray is the `ray` extra: the engine, weight sync and rollouts never import it; the
    adapters for Ray-based trainers (verl, OpenRLHF) import it only inside functions, so every
    module imports without Ray installed."""
    bad = []
    for path, module in all_modules():
        if module.startswith("hotswap.fleet"):
            continue
        tree = ast.parse(path.read_text())
        found = _ray_imports(tree)
        if module.startswith("hotswap.trainers_adapters"):
            local = {id(n) for fn in ast.walk(tree)
                     if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
                     for n in ast.walk(fn)}
            found = [n for n in found if id(n) not in local]
        bad += [f"{module} imports ray (line {n.lineno})" for n in found]
    assert not bad, bad


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


def _lazy_reexports(tree: ast.Module) -> dict[str, str]:
    """A package's `__getattr__` re-exports: public name -> the module it is imported from."""
    out: dict[str, str] = {}
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__getattr__":
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.module:
                    out.update({a.asname or a.name: node.module for a in node.names})
    return out


def _named_imports(tree: ast.AST) -> list[str]:
    """Modules imported by name at run time: registry strings "pkg.mod:Class" (imported lazily
    with importlib) and import_module("pkg.mod") calls."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith("hotswap.") and ":" in node.value:
            out.append(node.value.split(":")[0])
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") \
                and node.args and isinstance(node.args[0], ast.Constant):
            out.append(str(node.args[0].value))
    return out


def _import_targets(tree: ast.AST, module: str, is_package: bool, modules: set[str],
                    lazy: dict[str, dict[str, str]]) -> list[str]:
    """Every module `module` imports, anywhere in its source. `from pkg import Name` is the
    submodule pkg.Name, else the module pkg's lazy `__getattr__` re-exports Name from, else pkg."""
    targets = _named_imports(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: a package resolves `.` to itself, a module to its parent
                parts = module.split(".")
                pkg = parts[: len(parts) - node.level + int(is_package)]
                base = ".".join([*pkg, base] if base else pkg)
            for a in node.names:
                sub = f"{base}.{a.name}"
                targets.append(sub if sub in modules else lazy.get(base, {}).get(a.name, base))
    return targets


def _known(name: str, modules: set[str]) -> str | None:
    """The longest prefix of `name` that is a hotswap module (`import a.b.C` names a.b)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the hotswap modules importing it runs, over every module of the package (or
    `sources`: module -> source). Imports under TYPE_CHECKING, function-local ones and lazy
    registries all count. So do the parent packages of each target, whose __init__ runs first,
    except the importer's own (already running); a package's lazy `__getattr__` counts only for
    the names asked of it."""
    if sources is None:
        sources = {mod: path.read_text() for path, mod in all_modules()}
    trees = {mod: ast.parse(src) for mod, src in sources.items()}
    modules = set(trees)
    packages = {m.rpartition(".")[0] for m in modules} & modules
    lazy = {mod: _lazy_reexports(tree) for mod, tree in trees.items() if mod in packages}
    graph: dict[str, set[str]] = {}
    for mod, tree in trees.items():
        edges: set[str] = set()
        for target in _import_targets(tree, mod, mod in packages, modules, lazy):
            found = _known(target, modules) if target.startswith("hotswap.") else None
            if found is None:
                continue
            parts = found.split(".")
            parents = (".".join(parts[:i]) for i in range(2, len(parts)))
            edges.add(found)
            edges.update(p for p in parents if p in packages and not mod.startswith(p + "."))
        edges.discard(mod)
        graph[mod] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (the shortest way back to its first module) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan; recursion depth is bounded by the module count
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set(stack[stack.index(node):])
            del stack[stack.index(node):]
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first inside the component
        node = frontier.pop(0)
        for nxt in sorted(graph[node] & component):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                frontier.append(nxt)
    return sorted(component)


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (TYPE_CHECKING and function-local imports count):\n" + \
        "\n".join(" -> ".join(cycle) for cycle in cycles)


def _unit(module: str) -> str:
    """The folder a module belongs to: hotswap.engine.<sub> inside the engine, else hotswap.<top>
    (engine.py, config/ and errors.py are units of their own)."""
    parts = module.split(".")
    return ".".join(parts[:3] if parts[1] == "engine" else parts[:2])


def test_no_import_cycles_between_folders():
    """No two folders import each other, even through different modules (lora imported the
    scheduler's types while the scheduler imported lora)."""
    folders: dict[str, set[str]] = {}
    for mod, targets in import_graph().items():
        folders.setdefault(_unit(mod), set()).update(
            _unit(t) for t in targets if _unit(t) != _unit(mod))
    cycles = find_cycles(folders)
    assert not cycles, "folders importing each other:\n" + \
        "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_cycle_finder_counts_annotation_local_and_package_imports():
    tc = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hotswap.x.b import B\n"
    local = "def f():\n    from hotswap.x.a import A\n"
    graph = import_graph({"hotswap.x": "", "hotswap.x.a": tc, "hotswap.x.b": local})
    assert find_cycles(graph) == [["hotswap.x.a", "hotswap.x.b", "hotswap.x.a"]]
    # an eager package __init__ is a real edge; a lazy `__getattr__` only for the names asked
    eager = {"hotswap.p": "from hotswap.p.m import M\n", "hotswap.p.m": "",
             "hotswap.q": "", "hotswap.q.n": "from hotswap.p.m import M\n"}
    assert import_graph(eager)["hotswap.q.n"] == {"hotswap.p", "hotswap.p.m"}
    eager["hotswap.p.m"] = "import hotswap.q.n\n"
    assert find_cycles(import_graph(eager))
    lazy = "def __getattr__(name):\n    from hotswap.p.m import M\n    return M\n"
    sources = {"hotswap.p": lazy, "hotswap.p.m": "", "hotswap.p.k": "from hotswap.p import M\n"}
    assert import_graph(sources)["hotswap.p.k"] == {"hotswap.p.m"}
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    real = import_graph()
    assert f"{E}.engine" in real[E] and f"{E}.scheduler.scheduler" in real[f"{E}.engine"]

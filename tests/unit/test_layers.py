"""The package's layers, read from its imports (``ast``): what may import what.

The layers, lowest first, and the rules are those of ``ray_triton_shm/_private/__init__.py``:
a layer imports only itself and the layers below it; nothing below the node layer
imports Ray (at any depth: at the top of a module or inside a function); nothing
in the library imports the benchmark or the command line, save the command line
running the benchmark; no import circles; an import inside a function says why
with a ``# lazy: <reason>`` comment. The checker runs over the package, and over
small packages written here that break each rule, to show that it fails.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "ray_triton_shm"

LAYERS = ("base", "shm", "triton", "core", "node", "serve", "bench", "cli")
RAY_FROM = "node"  # the lowest layer that may import Ray
TOP_ONLY = {"bench": ("bench", "cli"), "cli": ("cli",)}  # layer -> the layers that may import it

# Public modules, by the layer they belong to; the package itself names the Ray
# layer's classes (loaded on first use) and sits with serve.
PUBLIC = {
    "ray_triton_shm": "serve",
    "ray_triton_shm.__main__": "cli",
    "ray_triton_shm.errors": "base",
    "ray_triton_shm.config": "base",
    "ray_triton_shm.server": "triton",
    "ray_triton_shm.client": "core",
    "ray_triton_shm.node": "node",
    "ray_triton_shm.serve": "serve",
    "ray_triton_shm.data": "serve",
    "ray_triton_shm._private": "base",
}


def layer_of(module: str) -> str | None:
    """The layer of a module of the package (``None``: not placed in any layer)."""
    if module in PUBLIC:
        return PUBLIC[module]
    parts = module.split(".")
    if parts[:2] == ["ray_triton_shm", "_private"] and len(parts) > 2 and parts[2] in LAYERS:
        return parts[2]
    return None


@dataclass(frozen=True)
class Import:
    """One import statement's target, as read from the source."""

    module: str  # the importing module
    target: str  # the imported module: one of the package's, or the external name
    internal: bool
    line: int
    in_function: bool
    marked_lazy: bool  # a `# lazy: <reason>` comment on it or just above its block


def _modules(root: Path, package: str) -> dict[str, Path]:
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _marked(lines: list[str], node: ast.stmt, import_lines: set[int]) -> bool:
    """A ``# lazy:`` comment on the statement, or above it in its block of imports and comments."""
    if any("# lazy:" in lines[n - 1] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)):
        return True
    n = node.lineno - 1
    while n >= 1:
        text = lines[n - 1].strip()
        if "# lazy:" in text:
            return True
        if not (text == "" or text.startswith("#") or n in import_lines):
            return False
        n -= 1
    return False


def read_imports(root: Path, package: str) -> tuple[set[str], list[Import]]:
    """The package's modules and every import statement in them (at any depth)."""
    modules = _modules(root, package)
    found: list[Import] = []
    for module, path in modules.items():
        source = path.read_text()
        tree = ast.parse(source, str(path))
        lines = source.splitlines()
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        import_lines = {n for i in imports for n in range(i.lineno, (i.end_lineno or i.lineno) + 1)}
        for node in imports:
            in_function = False
            parent = parents.get(node)
            while parent is not None:
                if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    in_function = True
                parent = parents.get(parent)
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join(here + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in modules else base)
            for target in targets:
                internal = _resolve(target, modules)
                if internal == module:
                    continue
                found.append(
                    Import(
                        module=module,
                        target=internal or target,
                        internal=internal is not None,
                        line=node.lineno,
                        in_function=in_function,
                        marked_lazy=in_function and _marked(lines, node, import_lines),
                    )
                )
    return set(modules), found


def _circles(modules: Iterable[str], edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check(
    root: Path,
    package: str,
    layer_of: Callable[[str], str | None],
    layers: tuple[str, ...] = LAYERS,
    ray_from: str = RAY_FROM,
    top_only: dict[str, tuple[str, ...]] = TOP_ONLY,
) -> list[str]:
    """Every breach of the layer rules in ``root/package``, one line each (empty when none)."""
    modules, imports = read_imports(root, package)
    rank = {name: i for i, name in enumerate(layers)}
    problems = [f"{m}: in no layer" for m in sorted(modules) if layer_of(m) not in rank]
    for imp in imports:
        where = f"{imp.module} line {imp.line}"
        mine = layer_of(imp.module)
        if mine not in rank:
            continue
        if imp.in_function and not imp.marked_lazy:
            problems.append(f"{where}: imports {imp.target} inside a function without a '# lazy:' reason")
        if not imp.internal:
            if (imp.target == "ray" or imp.target.startswith("ray.")) and rank[mine] < rank[ray_from]:
                problems.append(f"{where}: the {mine} layer imports Ray ({imp.target})")
            continue
        theirs = layer_of(imp.target)
        if theirs not in rank:
            continue
        if rank[theirs] > rank[mine]:
            problems.append(f"{where}: the {mine} layer imports {imp.target}, of the {theirs} layer above it")
        if theirs in top_only and mine not in top_only[theirs]:
            problems.append(f"{where}: imports {imp.target}; only {', '.join(top_only[theirs])} may")
    edges = [(i.module, i.target) for i in imports if i.internal]
    problems += [f"import circle: {' -> '.join(circle)}" for circle in _circles(modules, edges)]
    return problems


def test_the_package_keeps_its_layers() -> None:
    problems = check(ROOT, PACKAGE, layer_of)
    assert problems == [], "\n".join(problems)


def test_every_layer_has_its_subpackage() -> None:
    private = ROOT / PACKAGE / "_private"
    assert sorted(p.name for p in private.iterdir() if (p / "__init__.py").is_file()) == sorted(LAYERS)
    assert sorted(p.name for p in private.glob("*.py")) == ["__init__.py"], "a module outside the layers"


def test_the_docstring_states_the_layers_in_order() -> None:
    doc = ast.get_docstring(ast.parse((ROOT / PACKAGE / "_private" / "__init__.py").read_text()))
    assert doc is not None
    positions = [doc.find(f"``{name}``") for name in LAYERS[1:]]
    assert -1 not in positions and positions == sorted(positions), positions


def test_importing_the_package_and_its_core_loads_no_ray() -> None:
    """What the static check promises, seen at run time: the package and its layers below node."""
    code = (
        "import sys, ray_triton_shm, ray_triton_shm.client, ray_triton_shm.server\n"
        "import ray_triton_shm._private.core.slot_runs, ray_triton_shm._private.shm.cuda_pool\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# -- The checker fails where it should: small packages that break one rule each. --


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _toy_layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "base"


TOY = {
    "toy/__init__.py": "",
    "toy/shm/__init__.py": "",
    "toy/node/__init__.py": "",
    "toy/bench/__init__.py": "",
    "toy/cli/__init__.py": "",
    "toy/shm/low.py": "X = 1\n",
    "toy/node/actor.py": "import ray\n\nfrom toy.shm.low import X\n",
    "toy/bench/run.py": "from toy.node.actor import ray\n",
    "toy/cli/main.py": """\
        def bench():
            from toy.bench import run  # lazy: the benchmark loads only for its command

            return run
        """,
}


def test_the_checker_passes_a_toy_package_that_keeps_the_rules(tmp_path: Path) -> None:
    _write(tmp_path, TOY)
    assert check(tmp_path, "toy", _toy_layer) == []


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        (
            "toy/shm/up.py",
            "from toy.node.actor import X\n",
            "the shm layer imports toy.node.actor, of the node layer",
        ),
        (
            "toy/shm/up.py",
            "from toy.node import actor\n",
            "the shm layer imports toy.node.actor, of the node layer",
        ),
        (
            "toy/shm/up.py",
            "def f():\n    import ray.util  # lazy: Ray\n\n    return ray\n",
            "the shm layer imports Ray (ray.util)",
        ),
        (
            "toy/node/uses_bench.py",
            "from toy.bench import run\n",
            "imports toy.bench.run; only bench, cli may",
        ),
        (
            "toy/bench/uses_cli.py",
            "import toy.cli.main\n",
            "the bench layer imports toy.cli.main, of the cli layer",
        ),
        (
            "toy/shm/hidden.py",
            "def f():\n    from toy.shm import low\n\n    return low\n",
            "imports toy.shm.low inside a function without a '# lazy:' reason",
        ),
        ("toy/shm/a.py", "from toy.shm import b\n", "import circle: toy.shm.a -> toy.shm.b"),
        ("toy/stray/thing.py", "", "toy.stray.thing: in no layer"),
    ],
)
def test_the_checker_reports_a_broken_rule(tmp_path: Path, name: str, text: str, expected: str) -> None:
    files = {**TOY, name: text}
    if name == "toy/shm/a.py":
        files["toy/shm/b.py"] = "from toy.shm import a\n"
    _write(tmp_path, files)

    def layer(module: str) -> str | None:
        found = _toy_layer(module)
        return found if found in LAYERS else None

    problems = check(tmp_path, "toy", layer)
    assert any(expected in p for p in problems), problems


# -- The serve layer's rooms: the protocol apart from the transports, the door joining them. --

SERVE = f"{PACKAGE}._private.serve"
# room -> the rooms it may import (beside itself); modules of serve outside a room are free.
ROOMS: dict[str, frozenset[str]] = {
    "net": frozenset(),
    "protocol": frozenset({"net"}),
    "http1": frozenset({"net"}),
    "http2": frozenset({"net"}),
    "ingress": frozenset({"net", "protocol"}),
    "door": frozenset({"net", "protocol", "http1", "http2"}),
}


def room_of(module: str) -> str | None:
    """The room of a module of the serve layer (``None``: outside every room)."""
    if not module.startswith(SERVE + "."):
        return None
    room = module[len(SERVE) + 1 :].split(".")[0]
    return room if room in ROOMS else None


def room_problems(imports: Iterable[Import], rooms: dict[str, frozenset[str]] = ROOMS) -> list[str]:
    """Every import from one room of the serve layer into a room it may not use."""
    problems = []
    for imp in imports:
        mine, theirs = room_of(imp.module), room_of(imp.target)
        if mine is None or theirs is None or theirs == mine:
            continue
        if theirs not in rooms[mine]:
            problems.append(f"{imp.module} line {imp.line}: the {mine} room imports {imp.target} ({theirs})")
    return problems


def test_the_serve_layer_keeps_its_rooms() -> None:
    modules, imports = read_imports(ROOT, PACKAGE)
    assert {room_of(m) for m in modules} >= set(ROOMS), "a room without modules"
    problems = room_problems(imports)
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    ("module", "target"),
    [
        ("http1.server", "protocol.kserve"),  # a transport that knows KServe
        ("http2.h2_wire", "http1.server"),  # a transport that uses the other
        ("protocol.kserve", "door.frontdoor"),  # the protocol reaching up to the door
        ("net.listener", "http2.grpc_h2"),
    ],
)
def test_the_room_check_reports_a_breach(module: str, target: str) -> None:
    imp = Import(f"{SERVE}.{module}", f"{SERVE}.{target}", True, 1, False, False)
    assert len(room_problems([imp])) == 1
    allowed = Import(f"{SERVE}.door.frontdoor", f"{SERVE}.{target}", True, 1, False, False)
    assert room_problems([allowed]) == []

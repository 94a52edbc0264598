"""The layering, checked on the source: who may import whom (docs/architecture.md), and the
gateway's rooms as that document maps them.

Pure: reads the project's files with ``ast`` and starts nothing. The import graph counts every
``import`` and ``from`` anywhere in a file (under ``TYPE_CHECKING``, inside functions), with
relative imports resolved. Each check returns what it found, so a failure names the edge, the
cycle or the file; the tests at the end feed each check a small synthetic input it must reject.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIPPED_DIRS = {"models", "build", "dist", "node_modules", "__pycache__"}
MAX_LINES = 500  # a .py file outside tests/ above this is cut by what it does
MAX_FUNCTION_LINES = 80  # a function outside tests/ above this is cut into named steps

# The gateway's imports of workers/ go to the bottom layer only (workers.api), with one exception:
# `specgate worker` is the worker's own command line under the specgate command, so the CLI hands
# its arguments to workers.__main__ (a function-level import: the gateway never loads it otherwise).
GATEWAY_MAY_IMPORT = ("workers.api",)
ALLOWED_GATEWAY_EDGES = {("gateway.cli", "workers.__main__")}
# The bottom layer imports no engine, no server, no gateway, and not torch.
API_MAY_IMPORT = ("workers.api", "policies")
API_FORBIDDEN_EXTERNAL = {"torch", "safetensors", "vllm"}

# The gateway in rooms by job (issue #42): these packages exist, and few modules are left beside them.
GATEWAY_ROOMS = ("config", "fleet", "observe", "sessions", "relay", "epp", "scheduling")
MAX_GATEWAY_TOP_LEVEL = 12  # .py files directly in gateway/, __init__.py and __main__.py counted
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"

Graph = Mapping[str, set[str]]


# -- reading the tree ------------------------------------------------------------------------------------
def python_files(root: Path) -> list[Path]:
    """Every .py file of the project: not in a hidden folder (virtual environments), nor models/."""
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts[:-1]
        if any(p.startswith(".") or p in SKIPPED_DIRS or p.endswith(".egg-info") for p in parts):
            continue
        out.append(path)
    return out


def module_name(path: Path) -> str | None:
    """The dotted name Python imports ``path`` under: up through the folders with an __init__.py
    (so workers/vllm_plugin/specgate_vllm/ is ``specgate_vllm``, its own distribution)."""
    parts = [] if path.name == "__init__.py" else [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts) or None


Imports = list[tuple[str, tuple[str, ...]]]  # (module, names from it); () for ``import module``


def imports_of(tree: ast.AST, module: str, is_package: bool) -> Imports:
    """Every import statement anywhere in ``tree``, relative ones resolved."""
    package = module if is_package else module.rpartition(".")[0]
    out: Imports = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([base] if base else []))
            out.append((base, tuple(alias.name for alias in node.names)))
    return out


def read_project(root: Path) -> tuple[dict[str, Imports], dict[str, Path]]:
    """(every project module's imports, module -> file)."""
    files = {name: path for path in python_files(root) if (name := module_name(path))}
    imports = {name: imports_of(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py")
               for name, path in files.items()}
    return imports, files


def imported_modules(imports: Mapping[str, Imports]) -> dict[str, set[str]]:
    """module -> the modules it names (project or not), for the checks on external imports."""
    return {source: {base for base, _ in found} for source, found in imports.items()}


def import_graph(imports: Mapping[str, Imports]) -> dict[str, set[str]]:
    """Edges between project modules, as Python runs them: ``import a.b.c`` and ``from a.b.c
    import x`` run a, a.b and a.b.c (each package's __init__), and ``from a.b import c`` runs
    a.b.c too when c is a submodule. A module's own parent packages are already being imported
    when it runs, so they are edges only when it takes a name from one (``from pkg import name``)."""
    modules = set(imports)
    graph: dict[str, set[str]] = {}
    for source, found in imports.items():
        own_parents = {source.rsplit(".", i)[0] for i in range(1, source.count(".") + 1)}
        targets: set[str] = set()
        for base, names in found:
            submodules = {f"{base}.{n}" for n in names if f"{base}.{n}" in modules}
            takes_a_name = len(submodules) < len(names)
            parts = base.split(".")
            for i in range(1, len(parts) + 1):
                ancestor = ".".join(parts[:i])
                if ancestor in modules and (ancestor not in own_parents or (ancestor == base and takes_a_name)):
                    targets.add(ancestor)
            targets |= submodules
        graph[source] = targets - {source}
    return graph


# -- the checks: each returns what it found -------------------------------------------------------------
def gateway_violations(graph: Graph) -> list[str]:
    """Edges from gateway/ into workers/ other than the bottom layer."""
    found = []
    for source in sorted(graph):
        if source != "gateway" and not source.startswith("gateway."):
            continue
        for target in sorted(graph[source]):
            if target == "workers" or not target.startswith("workers."):
                continue
            allowed = any(target == p or target.startswith(p + ".") for p in GATEWAY_MAY_IMPORT)
            if not allowed and (source, target) not in ALLOWED_GATEWAY_EDGES:
                found.append(f"{source} -> {target}")
    return found


def api_violations(raw: Mapping[str, Iterable[str]], graph: Graph) -> list[str]:
    """workers.api importing anything of the project but itself and policies, or torch."""
    found = []
    for source in sorted(graph):
        if not (source == "workers.api" or source.startswith("workers.api.")):
            continue
        for target in sorted(graph[source]):
            if target != "workers" and not any(target == p or target.startswith(p + ".") for p in API_MAY_IMPORT):
                found.append(f"{source} -> {target}")
        for name in sorted(raw[source]):
            if name.split(".")[0] in API_FORBIDDEN_EXTERNAL:
                found.append(f"{source} -> {name}")
    return found


def policies_violations(raw: Mapping[str, Iterable[str]]) -> list[str]:
    """policies/ importing anything but the standard library and itself."""
    allowed = set(sys.stdlib_module_names) | {"__future__", "policies"}
    found = []
    for source in sorted(raw):
        if source == "policies" or source.startswith("policies."):
            found += [f"{source} -> {name}" for name in sorted(raw[source])
                      if name and name.split(".")[0] not in allowed]
    return sorted(set(found))


def imports_of_test_modules(graph: Graph) -> list[str]:
    """Imports of a test module (``test_*``) from anywhere: what two test files share lives in a
    helper module, so collecting one never runs the other's tests or fixtures."""
    return [f"{source} -> {target}" for source in sorted(graph) for target in sorted(graph[source])
            if target.rpartition(".")[2].startswith("test_")]


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle (a path back to its start) per strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return [_cycle_in(group, graph) for group in sorted(groups)]


def _cycle_in(group: list[str], graph: Graph) -> list[str]:
    """A concrete cycle through the group's first module (breadth-first back to it)."""
    start, members = group[0], set(group)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if nxt in members and nxt not in parent:
                    parent[nxt] = node
                    following.append(nxt)
        frontier = following
    return group


def long_files(files: Mapping[str, Path], root: Path, limit: int = MAX_LINES) -> list[str]:
    """.py files outside tests/ longer than ``limit`` lines."""
    found = []
    for path in sorted(files.values()):
        relative = path.relative_to(root)
        if relative.parts[0] == "tests":
            continue
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{relative}: {lines} lines")
    return found


def long_functions(files: Mapping[str, Path], root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions and methods outside tests/ longer than ``limit`` lines, decorators not counted
    (``end_lineno - lineno + 1`` of the ``def``)."""
    found = []
    for path in sorted(files.values()):
        relative = path.relative_to(root)
        if relative.parts[0] == "tests":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{relative}:{node.lineno} {node.name}: {lines} lines")
    return found


def map_layers(doc: str, package: str) -> list[list[str]]:
    """The package's map in the architecture document: the fenced block under its ``## package/``
    heading, one layer an indented line, top first; each entry ``name.py`` or ``room/``, before
    the line's `` — `` and its description."""
    section = doc.split(f"\n## {package}/\n", 1)[1]
    block = section.split("```\n", 2)[1]
    return [line.split(" — ")[0].split() for line in block.splitlines() if line.startswith(" ") and line.strip()]


def top_level_entries(root: Path, package: str) -> tuple[set[str], int]:
    """(the package's rooms, ``room/``, and modules, ``name.py``, __init__.py aside; how many .py
    files lie directly in it)."""
    folder = root / package
    modules = {p.name for p in folder.glob("*.py")}
    rooms = {f"{d.name}/" for d in folder.iterdir() if (d / "__init__.py").is_file()}
    return rooms | (modules - {"__init__.py"}), len(modules)


def layout_problems(layers: list[list[str]], entries: set[str], py_files: int, rooms: Iterable[str],
                    max_top_level: int) -> list[str]:
    """The map against the tree: every entry on it exists and every one that exists is on it, the
    rooms are there, and the top level holds at most ``max_top_level`` .py files."""
    mapped = [entry for layer in layers for entry in layer]
    found = [f"{e}: on the map, not in the tree" for e in mapped if e not in entries]
    found += [f"{e}: in the tree, not on the map" for e in sorted(entries - set(mapped))]
    found += [f"{room}/: no such room" for room in rooms if f"{room}/" not in entries]
    if py_files > max_top_level:
        found.append(f"{py_files} modules at the top level (at most {max_top_level})")
    return found


def layer_violations(graph: Graph, layers: list[list[str]], package: str) -> list[str]:
    """Imports between the package's entries that do not go down the map: a module imports its
    own room and the lines below its own only."""
    line_of = {entry: i for i, layer in enumerate(layers) for entry in layer}
    rooms = {entry.rstrip("/") for entry in line_of if entry.endswith("/")}

    def entry_of(module: str) -> str | None:
        parts = module.split(".")
        if parts[0] != package or len(parts) < 2:
            return None
        return f"{parts[1]}/" if parts[1] in rooms else f"{parts[1]}.py"

    found = []
    for source in sorted(graph):
        here = entry_of(source)
        for target in sorted(graph[source]):
            there = entry_of(target)
            if here is None or there is None or here == there or here not in line_of or there not in line_of:
                continue
            if line_of[there] <= line_of[here]:
                found.append(f"{source} -> {target} ({there} is not below {here} on the map)")
    return found


# -- the project --------------------------------------------------------------------------------------------
Project = tuple[dict[str, set[str]], dict[str, Path], dict[str, set[str]]]


@pytest.fixture(scope="module")
def project() -> Project:
    """(module -> the modules it names, module -> file, the import graph)."""
    imports, files = read_project(ROOT)
    return imported_modules(imports), files, import_graph(imports)


def test_the_tree_is_read(project: Project) -> None:
    _, files, graph = project
    assert {"gateway.relay.relay", "workers.api.wire", "policies.speculation", "specgate_vllm.rules"} <= set(files)
    assert "workers.api.wire" in graph["gateway.relay.relay"]


def test_gateway_imports_only_the_bottom_layer_of_workers(project: Project) -> None:
    assert gateway_violations(project[2]) == []


def test_the_bottom_layer_imports_no_engine_server_gateway_or_torch(project: Project) -> None:
    assert api_violations(project[0], project[2]) == []


def test_policies_import_only_the_standard_library(project: Project) -> None:
    assert policies_violations(project[0]) == []


def test_no_import_cycles(project: Project) -> None:
    assert cycles(project[2]) == []


def test_no_module_imports_a_test_module(project: Project) -> None:
    assert imports_of_test_modules(project[2]) == []


def test_no_long_files_outside_tests(project: Project) -> None:
    assert long_files(project[1], ROOT) == []


def test_no_long_functions_outside_tests(project: Project) -> None:
    assert long_functions(project[1], ROOT) == []


def test_the_gateway_is_in_rooms_as_the_map_shows(project: Project) -> None:
    layers = map_layers(ARCHITECTURE_DOC.read_text(), "gateway")
    entries, py_files = top_level_entries(ROOT, "gateway")
    assert layout_problems(layers, entries, py_files, GATEWAY_ROOMS, MAX_GATEWAY_TOP_LEVEL) == []
    assert layer_violations(project[2], layers, "gateway") == []


# -- each check can fail ----------------------------------------------------------------------------------
def test_gateway_check_names_an_upward_edge() -> None:
    graph = {"gateway.relay.relay": {"workers.api.wire", "workers.engines.interface", "policies"},
             "gateway.cli": {"workers.__main__"}}
    assert gateway_violations(graph) == ["gateway.relay.relay -> workers.engines.interface"]


def test_api_check_names_an_engine_or_torch() -> None:
    raw = {"workers.api.limits": {"torch", "policies.config"}}
    graph = {"workers.api.limits": {"workers.engines.embedded.sampling", "policies.config"}}
    assert api_violations(raw, graph) == ["workers.api.limits -> workers.engines.embedded.sampling",
                                          "workers.api.limits -> torch"]


def test_policies_check_names_a_third_party_or_project_import() -> None:
    raw = {"policies.cost": {"math", "__future__", "policies.config", "numpy", "workers.api.limits"}}
    assert policies_violations(raw) == ["policies.cost -> numpy", "policies.cost -> workers.api.limits"]


def test_test_import_check_names_the_edge() -> None:
    graph = {"tests.e2e.test_semantics": {"tests.unit.engine.test_seeded", "tests.unit.engine.seeded_reference"},
             "tests.unit.engine.seeded_reference": {"workers.engines.embedded.llama"}}
    assert imports_of_test_modules(graph) == ["tests.e2e.test_semantics -> tests.unit.engine.test_seeded"]


@pytest.mark.parametrize(("graph", "expected"), [
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b", "a"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}, [["a", "b", "c", "a"]]),
    ({"a": {"a"}}, [["a", "a"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_cycle_check_names_the_cycle(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(graph) == expected


def _write(root: Path, files: Mapping[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_graph_counts_type_checking_function_level_and_relative_imports(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "pkg/b.py": "def f():\n    from . import a\n",
        "pkg/sub/__init__.py": "from ..c import C\n",
        "pkg/sub/d.py": "",
        "pkg/c.py": "import pkg.sub.d\n",
    })
    imports, _ = read_project(tmp_path)
    graph = import_graph(imports)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    # pkg.c imports pkg.sub.d, which runs pkg/sub/__init__, which imports pkg.c: a cycle through __init__.
    assert graph["pkg.c"] == {"pkg.sub.d", "pkg.sub"} and graph["pkg.sub"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.c", "pkg.sub", "pkg.c"]]


def test_long_file_check_names_the_file(tmp_path: Path) -> None:
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/big.py": "x = 1\n" * 501, "pkg/ok.py": "x = 1\n" * 500,
                      "tests/__init__.py": "", "tests/test_big.py": "x = 1\n" * 900})
    _, files = read_project(tmp_path)
    assert long_files(files, tmp_path) == ["pkg/big.py: 501 lines"]


def _function(name: str, lines: int, indent: str = "") -> str:
    """A function of ``lines`` lines in all, its ``def`` included."""
    return f"{indent}def {name}():\n" + f"{indent}    x = 1\n" * (lines - 1)


def test_long_function_check_names_the_function(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/mod.py": _function("ok", 80) + _function("big", 81) + "class C:\n" + _function("method", 82, "    "),
        "tests/__init__.py": "", "tests/test_mod.py": _function("test_big", 200),
    })
    _, files = read_project(tmp_path)
    assert long_functions(files, tmp_path) == ["pkg/mod.py:81 big: 81 lines", "pkg/mod.py:163 method: 82 lines"]


MAP = """# Architecture

## pkg/
Words.

```
pkg/
  cli.py         — the top
  room/ b.py     — a room, and a module beside it
  a.py           — the bottom
```
"""


def test_map_is_read_one_layer_a_line() -> None:
    assert map_layers(MAP, "pkg") == [["cli.py"], ["room/", "b.py"], ["a.py"]]


def test_layout_check_names_what_is_missing_extra_or_too_many(tmp_path: Path) -> None:
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/cli.py": "", "pkg/a.py": "", "pkg/c.py": "",
                      "pkg/room/__init__.py": "", "pkg/room/x.py": "", "pkg/loose/notes.txt": ""})
    entries, py_files = top_level_entries(tmp_path, "pkg")
    assert entries == {"cli.py", "a.py", "c.py", "room/"} and py_files == 4
    layers = map_layers(MAP, "pkg")
    assert layout_problems(layers, entries, py_files, ("room", "gone"), 3) == [
        "b.py: on the map, not in the tree", "c.py: in the tree, not on the map", "gone/: no such room",
        "4 modules at the top level (at most 3)"]


def test_layer_check_names_an_import_up_or_across_the_map() -> None:
    layers = map_layers(MAP, "pkg")
    graph = {"pkg.cli": {"pkg.room.x", "pkg.a"}, "pkg.room.x": {"pkg.room.y", "pkg.a", "pkg.b"},
             "pkg.a": {"pkg.room.x", "policies"}, "pkg.b": set()}
    assert layer_violations(graph, layers, "pkg") == [
        "pkg.a -> pkg.room.x (room/ is not below a.py on the map)",
        "pkg.room.x -> pkg.b (b.py is not below room/ on the map)"]

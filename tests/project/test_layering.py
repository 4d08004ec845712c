"""The architecture's one direction of imports, read from the source with ast."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ckptkit"
CORE = {"ckptkit.errors", "ckptkit.keys", "ckptkit.meta", "ckptkit.text"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The rooms of ckptkit.formats, lowest first: each may import only its own and lower ones.
FORMAT_ROOMS = ("base", "pickles", "files", "folders", "open", "output")


def layer(name: str) -> int:
    if name in CORE or name.startswith("ckptkit.storage"):
        return 0  # the ground floor: the core, and where bytes live
    if name.startswith("ckptkit.formats"):
        return 1
    if name in ("ckptkit.cli", "ckptkit.__main__"):
        return 3
    return 2  # convert, load, summary, diff, engine


def room(name: str) -> int:
    """A module's rank among the rooms of ``ckptkit.formats``."""
    parts = name.split(".")
    assert parts[:2] == ["ckptkit", "formats"] and len(parts) > 2, name
    assert parts[2] in FORMAT_ROOMS, f"{name} is in no room of ckptkit.formats"
    return FORMAT_ROOMS.index(parts[2])


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(path: Path, *, top_level_only: bool = False) -> list[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name):
    if name == "ckptkit":
        return  # the package front re-exports the public API
    # As written, and resolved (relative imports; ``from ckptkit import cli`` names the module).
    for target in sorted(set(imports(MODULES[name])) | GRAPH[name]):
        if target.startswith("ckptkit"):
            assert target != "ckptkit.cli" or name == "ckptkit.__main__", f"{name} imports the CLI"
            assert layer(target) <= layer(name), f"{name} (layer {layer(name)}) imports {target}"


FORMAT_MODULES = sorted(n for n in MODULES if n.startswith("ckptkit.formats."))


@pytest.mark.parametrize("name", FORMAT_MODULES)
def test_format_rooms_import_down(name):
    for target in imports(MODULES[name]):
        if target == "ckptkit.formats":
            raise AssertionError(f"{name} imports the package front; import the module itself")
        if target.startswith("ckptkit.formats."):
            assert room(target) <= room(name), f"{name} imports {target}, a higher room"


def test_every_format_module_is_in_a_room():
    assert {name.split(".")[2] for name in FORMAT_MODULES} == set(FORMAT_ROOMS)


def test_the_room_check_catches_an_upward_import(tmp_path):
    # The check itself: a module of files/ that imports folders/ is refused.
    module = tmp_path / "bad.py"
    module.write_text("from ckptkit.formats.folders.dcp import DCPSource\n")
    target = imports(module)[0]
    assert room(target) > room("ckptkit.formats.files.bad")


@pytest.mark.parametrize("name", sorted(CORE))
def test_core_is_stdlib_only(name):
    for target in imports(MODULES[name]):
        root = target.split(".")[0]
        assert root in ("ckptkit", "__future__") or root in __import__("sys").stdlib_module_names, (
            f"{name} imports {target}"
        )
        assert not target.startswith("ckptkit") or target in CORE


STORAGE_MODULES = sorted(n for n in MODULES if n.startswith("ckptkit.storage"))


@pytest.mark.parametrize("name", STORAGE_MODULES)
def test_storage_imports_only_the_errors_and_itself(name):
    for target in imports(MODULES[name]):
        if target.startswith("ckptkit"):
            assert target == "ckptkit.errors" or target.startswith("ckptkit.storage"), (
                f"{name} imports {target}"
            )


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not n.startswith("ckptkit.engine")))
def test_no_module_imports_torch_at_import_time(name):
    # The engine is torch code through and through; everything else imports torch on first use.
    top = imports(MODULES[name], top_level_only=True)
    assert not [t for t in top if t.split(".")[0] in ("torch", "safetensors", "tqdm")], name


def import_edges(path: Path, name: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that the module ``name`` (at ``path``) imports, anywhere in it:
    at the top, in a function, under ``TYPE_CHECKING``. ``import a.b.c`` is an edge to ``a.b.c``;
    ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``;
    relative imports are resolved. Importing a submodule runs its package's ``__init__`` too,
    but that implicit step is no edge: only what the source names counts."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    return {target for target in found if target in modules and target != name}


def import_graph(package: Path) -> dict[str, set[str]]:
    """Every module of the package under ``package`` and the package's modules it imports."""
    paths = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {name: import_edges(path, name, set(paths)) for name, path in paths.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) for each group of modules that import each other, however
    far round; empty when the imports form no circle."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(name: str) -> None:  # Tarjan's strongly connected components
        order[name] = low[name] = len(order)
        stack.append(name)
        for target in sorted(graph[name]):
            if target not in order:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], order[target])
        if low[name] == order[name]:
            group = {stack.pop()}
            while name not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for name in sorted(graph):
        if name not in order:
            visit(name)
    return [_shortest_cycle(graph, group) for group in groups]


def _shortest_cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest way from the group's first module (by name) back to itself."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        step = []
        for name in frontier:
            for target in sorted(graph[name] & group):
                if target == start:
                    return paths[name] + [start]
                if target not in paths:
                    paths[target] = paths[name] + [target]
                    step.append(target)
        frontier = step
    raise AssertionError(f"{sorted(group)} is no cycle")


def test_no_import_cycles():
    cycles = [" -> ".join(cycle) for cycle in import_cycles(GRAPH)]
    assert not cycles, "import cycles (function-local imports count too):\n" + "\n".join(cycles)


GRAPH = import_graph(PACKAGE)


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_no_module_imports_its_own_package_front(name):
    # A package's __init__ imports its modules (to re-export them): a module that imports the
    # __init__ of a package it is in points up, and closes a circle with it.
    fronts = {target for target in GRAPH[name] if name.startswith(target + ".")}
    assert not fronts, f"{name} imports {', '.join(sorted(fronts))}: import the module itself"


def test_the_cycle_check_catches_a_cycle(tmp_path):
    # The check itself, on a package of its own: a -> b at the top, b -> c in a function
    # (``from pkg import c``), c -> a through a relative import; d only imports into it.
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg import a\n")
    (package / "a.py").write_text("import pkg.b\n")
    (package / "b.py").write_text("def late():\n    from pkg import c\n")
    (package / "c.py").write_text("from .a import something\n")
    (package / "d.py").write_text("import pkg.a\nimport os\n")
    graph = import_graph(package)
    assert graph["pkg.d"] == {"pkg.a"}  # the package's __init__ is no edge of its submodules'
    assert graph["pkg.c"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert import_cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []
    assert import_cycles({"x": {"y"}, "y": {"x"}, "z": {"x"}}) == [["x", "y", "x"]]


def test_importing_the_package_and_the_cli_stays_light():
    import subprocess
    import sys

    code = "import sys, ckptkit, ckptkit.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

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
    for target in imports(MODULES[name]):
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


def test_importing_the_package_and_the_cli_stays_light():
    import subprocess
    import sys

    code = "import sys, ckptkit, ckptkit.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

"""The build switch does what it says: the hot modules are C extensions exactly when the run says so.

``scripts/test --compiled`` runs the tests from this tree against ``.venv-compiled``'s regular install
with ``KEYFAILOVER_COMPILED=1`` in the environment; every other run has the plain package. A compiled
build that silently fell back to plain Python, or a run that imported the source tree instead of the
install, fails here.
"""

from __future__ import annotations

import ast
import importlib
import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import keyfailover

ROOT = Path(__file__).resolve().parent.parent


def compiled_modules() -> list[str]:
    """The dotted names of the modules setup.py's ``COMPILED`` lists."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "COMPILED" for t in node.targets):
            paths: tuple[str, ...] = ast.literal_eval(node.value)
            return [path.removesuffix(".py").replace("/", ".") for path in paths]
    raise AssertionError("setup.py assigns no COMPILED")


def test_setup_lists_modules_that_exist() -> None:
    names = compiled_modules()
    assert names
    assert all((ROOT / name.replace(".", "/")).with_suffix(".py").is_file() for name in names)


def test_the_hot_modules_are_extensions_exactly_in_the_compiled_run() -> None:
    compiled = os.environ.get("KEYFAILOVER_COMPILED") == "1"
    for name in compiled_modules():
        path = importlib.import_module(name).__file__
        assert path is not None
        assert path.endswith(tuple(EXTENSION_SUFFIXES)) == compiled, f"{name} is {path}"


def test_no_other_module_is_an_extension() -> None:
    package = Path(keyfailover.__file__).parent
    extensions = {
        ".".join([*path.relative_to(package.parent).parent.parts, path.name.split(".", 1)[0]])
        for path in package.rglob("*")
        if path.name.endswith(tuple(EXTENSION_SUFFIXES))
    }
    assert extensions <= set(compiled_modules())


def test_the_compiled_run_imports_the_install_not_this_tree() -> None:
    from_tree = Path(keyfailover.__file__).resolve().parent == ROOT / "keyfailover"
    assert from_tree != (os.environ.get("KEYFAILOVER_COMPILED") == "1"), keyfailover.__file__

"""Docstrings never nest parentheses: "(a, b)" reads, "(a (b))" makes the reader count.

Every docstring of a module, class or function is read with :mod:`ast`; a ``(`` that opens
while another is still open is a violation. Code keeps its own parentheses: a literal block
after ``::`` and a doctest line are not read, and an inline literal between double backticks
counts as one word, so a formula or a call in it nests only when it stands inside parentheses.

:data:`COVERED` lists what is checked: the whole package and the benchmarks.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COVERED = ("keyfailover", "benchmarks")
"""The folders whose every module is checked."""

_LITERAL = re.compile(r"``(.*?)``", re.DOTALL)
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def prose(docstring: str) -> str:
    """``docstring`` without its literal blocks after ``::`` and its doctest lines."""
    kept: list[str] = []
    block_indent: int | None = None  # the indent of the line that opened a literal block
    for line in inspect.cleandoc(docstring).splitlines():
        indent = len(line) - len(line.lstrip())
        if block_indent is not None and (not line.strip() or indent > block_indent):
            continue
        block_indent = indent if line.rstrip().endswith("::") else None
        if not line.lstrip().startswith(">>>"):
            kept.append(line)
    return "\n".join(kept)


def nests_parentheses(docstring: str) -> bool:
    """Whether a ``(`` opens in the prose of ``docstring`` while another is open.

    A literal counts as one word: its parentheses nest only when it stands inside open ones.
    """
    depth = 0
    text = prose(docstring)
    for index, piece in enumerate(_LITERAL.split(text)):
        if index % 2:  # a literal, without its backticks
            if depth and "(" in piece:
                return True
            continue
        for char in piece:
            if char == "(":
                if depth:
                    return True
                depth = 1
            elif char == ")":
                depth = 0
    return False


def nested_docstrings(path: Path) -> list[str]:
    """``"path:line name"`` for every docstring of the module at ``path`` that nests parentheses."""
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, _DOCUMENTED):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None and nests_parentheses(docstring):
                name = "<module>" if isinstance(node, ast.Module) else node.name
                found.append(f"{shown}:{getattr(node, 'lineno', 1)} {name}")
    return found


def covered_modules() -> list[Path]:
    """The ``.py`` files of :data:`COVERED`."""
    return [path for entry in COVERED for path in sorted((ROOT / entry).rglob("*.py"))]


def test_no_docstring_nests_parentheses() -> None:
    modules = covered_modules()
    assert len(modules) > 100
    assert [found for path in modules for found in nested_docstrings(path)] == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('"""A module (that says (too) much)."""\n', "<module>"),
        ('class Planted:\n    """A class (see :meth:`go` (below))."""\n', "Planted"),
        ('def planted() -> None:\n    """A function (one\n    (two) lines)."""\n', "planted"),
        ('async def planted() -> None:\n    """An async one ((doubled))."""\n', "planted"),
        ('def planted() -> None:\n    """A call (``f(x)``) inside prose parentheses."""\n', "planted"),
        ('def outer() -> None:\n    def planted() -> None:\n        """Nested (a (b))."""\n', "planted"),
    ],
)
def test_a_planted_nesting_is_caught(tmp_path: Path, source: str, expected: str) -> None:
    path = tmp_path / "planted.py"
    path.write_text(source)
    found = nested_docstrings(path)
    assert len(found) == 1
    assert found[0].endswith(f" {expected}")


@pytest.mark.parametrize(
    "docstring",
    [
        "Side by side (a, b) and (c) are fine.",
        "A call in a literal, ``f(g(x))``, is code, and (``x``) a literal without any.",
        "A half-open interval ``(after, up_to]`` (of positions) is a literal.",
        "An example::\n\n    register(Collector(lambda: [view()]))\n\nAfter it (prose again).",
        ">>> f(g(1))\n2",
    ],
)
def test_code_and_parentheses_side_by_side_are_not_nesting(docstring: str) -> None:
    assert not nests_parentheses(docstring)

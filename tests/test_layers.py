"""The package's folders are its layers: no import runs back up a floor, and no module imports in a circle.

Layers, inside out: ``core`` < ``wire`` < ``broker`` and ``client`` (side by side: neither imports
the other) < ``integrations`` < ``tools``. A module may import its own layer and the ones below it
(:data:`BELOW`); ``core`` imports nothing else of the package. The top-level facade modules
(``keyfailover/__init__.py``, ``__main__`` and the short paths ``dispatcher``, ``metrics``,
``spark``) only re-export, and nothing inside imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "keyfailover"
LAYERS = ("core", "wire", "broker", "client", "integrations", "tools")
BELOW: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "wire": frozenset({"core"}),
    "broker": frozenset({"core", "wire"}),
    "client": frozenset({"core", "wire"}),
    "integrations": frozenset({"core", "wire", "broker", "client"}),
    "tools": frozenset({"core", "wire", "broker", "client", "integrations"}),
}
"""The layers each layer may import besides its own."""
FACADE = "facade"


def module_sources(root: Path = PACKAGE) -> dict[str, str]:
    """``{dotted module name: source}`` for every ``.py`` file of the package."""
    sources = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        sources[".".join(parts)] = path.read_text()
    return sources


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else FACADE


def imports_of(module: str, source: str, known: set[str]) -> set[str]:
    """The package modules ``module`` imports (at any depth of its code, lazy imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            # ``from pkg import name`` imports pkg.name when that is a module, else pkg.
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            target = name
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def layer_violations(sources: dict[str, str]) -> list[str]:
    """Every import that runs outwards (or into the facade), and every import cycle, as sentences."""
    known = set(sources)
    graph = {module: imports_of(module, source, known) for module, source in sources.items()}
    problems = []
    for module, targets in sorted(graph.items()):
        here = layer_of(module)
        if here == FACADE:
            continue
        for target in sorted(targets):
            there = layer_of(target)
            if there == FACADE:
                problems.append(f"{module} ({here}) imports the facade module {target}")
            elif there != here and there not in BELOW[here]:
                problems.append(f"{module} ({here}) imports {target} of the layer {there}, not below it")
    problems.extend(f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph))
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append([*sorted(component), sorted(component)[0]])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_every_module_is_in_a_layer_folder() -> None:
    facade = sorted(module for module in module_sources() if layer_of(module) == FACADE)
    assert facade == [
        "keyfailover",
        "keyfailover.__main__",
        "keyfailover.dispatcher",
        "keyfailover.metrics",
        "keyfailover.spark",
    ]


def test_no_import_runs_outwards_and_none_in_a_circle() -> None:
    assert layer_violations(module_sources()) == []


@pytest.mark.parametrize(
    ("module", "planted", "expected"),
    [
        ("keyfailover.core.ranges", "from keyfailover.wire.protocol import Key", "of the layer wire, not below"),
        (
            "keyfailover.wire.properties",
            "from keyfailover.broker.cursor import Cursor",
            "of the layer broker, not below",
        ),
        ("keyfailover.broker.cursor", "import keyfailover.tools.cli", "of the layer tools, not below"),
        ("keyfailover.client.aio", "from keyfailover.broker.cursor import Cursor", "of the layer broker, not below"),
        ("keyfailover.broker.cursor", "from keyfailover.client import Client", "of the layer client, not below"),
        (
            "keyfailover.client.aio",
            "from keyfailover.integrations import metrics",
            "of the layer integrations, not below",
        ),
        ("keyfailover.integrations.plot", "from keyfailover import spark", "imports the facade module"),
        ("keyfailover.core.hashing", "from keyfailover.core.ranges import RangeMap", "import cycle"),
    ],
)
def test_the_checker_catches_a_planted_violation(module: str, planted: str, expected: str) -> None:
    sources = module_sources()
    sources[module] = sources[module] + "\n\ndef _planted() -> None:\n    " + planted + "\n"
    problems = layer_violations(sources)
    assert any(expected in problem and module in problem for problem in problems), problems

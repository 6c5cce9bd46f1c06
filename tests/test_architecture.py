"""The package's import structure: rules apart from the engine, io apart from analysis, no cycles.

Imports are read from the sources (ast), function-level ones included; those under
`if TYPE_CHECKING:` are types only and do not count.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "keras_gradtrack"
# The one module that reaches Keras' private names; it imports nothing of the package,
# and every layer may import it.
SEAM = "keras_gradtrack._keras_seam"
# The one way to swap an attribute for a block and restore it; as free of the package.
PATCHING = "keras_gradtrack._patching"
# What a rule module may import of the package: the contract, the shared math, the seam.
RULE_FOUNDATIONS = {
    SEAM,
    PATCHING,
    "keras_gradtrack.rules.contract",
    "keras_gradtrack.rules.ops",
    "keras_gradtrack.rules.cost",
    "keras_gradtrack.rules.windows",
    "keras_gradtrack.rules.filter_gradients",
    "keras_gradtrack.rules.chunks",
    "keras_gradtrack.rules.recurrent_cells",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node, skipping the bodies of `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports (a `from package import module` counts
    as the module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import module` is the module; `from module import Name` the module.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            # The longest known module the target names (`pkg.mod.Name` -> `pkg.mod`).
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imported_modules(path, modules) for path in paths}


GRAPH = import_graph()


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read_from_the_sources() -> None:
    # A walk that found nothing would pass every test below.
    assert "keras_gradtrack.rules.contract" in GRAPH["keras_gradtrack.rules.dense"]
    assert "keras_gradtrack.engine.step" in GRAPH["keras_gradtrack.models.trainer"]
    assert "keras_gradtrack.io.schema" in GRAPH["keras_gradtrack.io.reader"]


def test_no_import_cycle_between_modules() -> None:
    assert cycles(GRAPH) == []


def test_cycle_detection_finds_a_planted_cycle() -> None:
    planted = {**GRAPH, "keras_gradtrack.rules.contract": {"keras_gradtrack.engine.step"}}
    assert cycles(planted)


@pytest.mark.parametrize(
    "module", sorted(m for m in GRAPH if m.startswith("keras_gradtrack.rules."))
)
def test_rules_import_only_the_contract_and_the_math(module: str) -> None:
    package_imports = {m for m in GRAPH[module] if m.startswith("keras_gradtrack")}
    assert package_imports <= RULE_FOUNDATIONS, sorted(package_imports - RULE_FOUNDATIONS)


def test_the_rule_registry_imports_no_engine() -> None:
    assert not {
        m
        for m in GRAPH["keras_gradtrack.rules"]
        if not m.startswith("keras_gradtrack.rules") and m != SEAM
    }


@pytest.mark.parametrize("module", [SEAM, PATCHING])
def test_the_seam_and_the_patching_import_nothing_of_the_package(module: str) -> None:
    assert not {m for m in GRAPH[module] if m.startswith("keras_gradtrack")}


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("keras_gradtrack.io")))
def test_io_does_not_import_analysis(module: str) -> None:
    assert not {m for m in GRAPH[module] if m.startswith("keras_gradtrack.analysis")}


@pytest.mark.parametrize(
    "module", sorted(m for m in GRAPH if m.startswith("keras_gradtrack.privacy"))
)
def test_privacy_imports_nothing_of_the_package_but_itself(module: str) -> None:
    assert not {
        m
        for m in GRAPH[module]
        if m.startswith("keras_gradtrack") and not m.startswith("keras_gradtrack.privacy")
    }

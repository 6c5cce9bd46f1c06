"""The package's import structure: the layers of docs/architecture.md, no cycles.

The layers and what each may import are read from the table in docs/architecture.md
("Layers of the package"), the one the docs show. Imports are read from the sources
(ast), function-level ones included; those under `if TYPE_CHECKING:` are types only
and do not count.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "keras_gradtrack"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
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
    "keras_gradtrack.rules.windows",
    "keras_gradtrack.rules.filter_gradients",
    "keras_gradtrack.rules.chunks",
    "keras_gradtrack.recurrent_cells",
    "keras_gradtrack.rule_math",
    "keras_gradtrack.attribution_math",
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


# The table of layer classes to rule names that both engines' registries read.
RULE_TABLE = "keras_gradtrack.rule_table"


def test_the_rule_registry_imports_no_engine() -> None:
    assert not {
        m
        for m in GRAPH["keras_gradtrack.rules"]
        if not m.startswith("keras_gradtrack.rules") and m not in (SEAM, RULE_TABLE)
    }


BACKEND_PACKAGES = ("tensorflow", "jax", "torch")


def backends_imported(module: str) -> set[str]:
    """`tensorflow`, `jax` and `torch` where the module imports them (at any depth of its
    code)."""
    found = set()
    for node in runtime_nodes(ast.parse((PACKAGE / module_path(module)).read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found.update(n.split(".")[0] for n in names if n.split(".")[0] in BACKEND_PACKAGES)
    return found


@pytest.mark.parametrize(
    "module",
    [
        RULE_TABLE,
        "keras_gradtrack.rule_math",
        "keras_gradtrack.recurrent_cells",
        "keras_gradtrack.attribution_math",
        "keras_gradtrack.engine.tracked_layer",
    ],
)
def test_the_backend_free_modules_import_no_backend(module: str) -> None:
    assert backends_imported(module) == set()


# The modules of the TensorFlow engine that still import TensorFlow (its protocol
# pieces: the tape, taps, `tf.while_loop` chunks, `tf.distribute`, the compiled loops,
# and rules not yet in `keras.ops`). Every other module of `engine/` and `rules/`
# imports no backend; a module that stops importing TensorFlow leaves this list.
TENSORFLOW_ENGINE_MODULES = {
    "keras_gradtrack.engine.backward",
    "keras_gradtrack.engine.batchless",
    "keras_gradtrack.engine.checks",
    "keras_gradtrack.engine.clipping",
    "keras_gradtrack.engine.coupled",
    "keras_gradtrack.engine.distribute",
    "keras_gradtrack.engine.executions",
    "keras_gradtrack.engine.fallback",
    "keras_gradtrack.engine.preflight",
    "keras_gradtrack.engine.secure_noise",
    "keras_gradtrack.engine.step",
    "keras_gradtrack.engine.taps",
    "keras_gradtrack.rules.chunks",
    "keras_gradtrack.rules.filter_gradients",
    "keras_gradtrack.rules.ops",
    "keras_gradtrack.rules.recurrent",
}


def test_only_the_listed_engine_modules_import_tensorflow() -> None:
    modules = in_package("keras_gradtrack.engine") + in_package("keras_gradtrack.rules")
    importing = {m for m in modules if backends_imported(m)}
    assert all(backends_imported(m) == {"tensorflow"} for m in importing)
    assert importing == TENSORFLOW_ENGINE_MODULES, (
        f"import a backend, not listed: {sorted(importing - TENSORFLOW_ENGINE_MODULES)}; "
        f"listed, import none: {sorted(TENSORFLOW_ENGINE_MODULES - importing)}"
    )


def in_package(prefix: str) -> list[str]:
    return sorted(m for m in GRAPH if m == prefix or m.startswith(prefix + "."))


@pytest.mark.parametrize(
    ("prefix", "allowed"),
    [
        ("keras_gradtrack.backends.ops", set()),
        ("keras_gradtrack.backends.jax", {"jax"}),
        ("keras_gradtrack.backends.torch", {"torch"}),
    ],
)
def test_each_probed_engine_imports_only_its_backend(prefix: str, allowed: set[str]) -> None:
    modules = in_package(prefix)
    assert modules, prefix
    for module in modules:
        assert backends_imported(module) <= allowed, module


@pytest.mark.parametrize("module", [SEAM, PATCHING])
def test_the_seam_and_the_patching_import_nothing_of_the_package(module: str) -> None:
    assert not {m for m in GRAPH[module] if m.startswith("keras_gradtrack")}


# -- the layers of docs/architecture.md -------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layer:
    """One row of the table: its modules (paths in the package, `dir/` for a whole
    subpackage) and the layers it may import."""

    name: str
    paths: tuple[str, ...]
    may_import: tuple[str, ...]
    imported_by_every_layer: bool


def read_layers(markdown: str) -> list[Layer]:
    """The rows of the "Layers of the package" table, top to bottom."""
    section = markdown.split("## Layers of the package", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    rows = [dict(zip(header, row, strict=True)) for row in cells]
    names = [row["layer"] for row in rows]
    layers = []
    for position, row in enumerate(rows):
        allowed = row["may import"]
        # A remark in parentheses is prose, except the one that opens a row to all.
        listed = re.sub(r"\([^)]*\)", "", allowed).strip()
        if listed == "everything below":
            may_import = tuple(names[position + 1 :])
        elif listed == "nothing of the package":
            may_import = ()
        else:
            may_import = tuple(name.strip() for name in listed.split(","))
        layers.append(
            Layer(
                name=row["layer"],
                paths=tuple(re.findall(r"`([^`]+)`", row["modules"])),
                may_import=may_import,
                imported_by_every_layer="every layer may import" in allowed,
            )
        )
    return layers


LAYERS = read_layers(ARCHITECTURE.read_text())


def module_path(module: str) -> str:
    """`keras_gradtrack.engine.step` -> `engine/step.py` (a package: its `__init__.py`)."""
    relative = module.split(".")[1:]
    if (PACKAGE.joinpath(*relative) / "__init__.py").exists():
        return "/".join([*relative, "__init__.py"])
    return "/".join(relative) + ".py"


def layers_of(module: str, layers: list[Layer]) -> list[str]:
    path = module_path(module)
    return [
        layer.name
        for layer in layers
        if any(path == p or (p.endswith("/") and path.startswith(p)) for p in layer.paths)
    ]


def layer_violations(graph: dict[str, set[str]], layers: list[Layer]) -> list[str]:
    """`module -> imported (layer -> layer)` for every import the table does not allow."""
    by_name = {layer.name: layer for layer in layers}
    everyone = {layer.name for layer in layers if layer.imported_by_every_layer}
    found = []
    for module, imports in sorted(graph.items()):
        (own,) = layers_of(module, layers)
        allowed = {own, *by_name[own].may_import, *everyone}
        for imported in sorted(imports):
            (target,) = layers_of(imported, layers)
            if target not in allowed:
                found.append(f"{module} -> {imported} ({own} -> {target})")
    return found


def test_the_table_is_read_from_the_docs() -> None:
    # A table read as empty would allow nothing and place nothing; one read wrongly
    # could allow everything.
    names = [layer.name for layer in LAYERS]
    assert names[0] == "entry points" and names[-1] == "the seam"
    assert {"callbacks", "models", "attribution", "engine", "statistics", "io"} <= set(names)
    by_name = {layer.name: layer for layer in LAYERS}
    assert by_name["engine"].may_import == ("rules", "statistics", "privacy", "rule math")
    assert by_name["io"].may_import == ()
    assert by_name["entry points"].may_import == tuple(names[1:])
    assert by_name["the seam"].imported_by_every_layer
    assert not by_name["io"].imported_by_every_layer


def test_every_path_the_table_names_exists() -> None:
    missing = [path for layer in LAYERS for path in layer.paths if not (PACKAGE / path).exists()]
    assert missing == []


def test_every_module_is_in_exactly_one_layer() -> None:
    placed = {module: layers_of(module, LAYERS) for module in GRAPH}
    assert {m: layers for m, layers in placed.items() if len(layers) != 1} == {}


def test_each_layer_may_import_only_layers_below_it() -> None:
    names = [layer.name for layer in LAYERS]
    for position, layer in enumerate(LAYERS):
        assert set(layer.may_import) <= set(names[position + 1 :]), layer.name


def test_every_import_is_one_the_table_allows() -> None:
    assert layer_violations(GRAPH, LAYERS) == []


def test_a_planted_import_against_the_table_is_found() -> None:
    planted = {**GRAPH, "keras_gradtrack.io.reader": {"keras_gradtrack.engine.step"}}
    assert layer_violations(planted, LAYERS) == [
        "keras_gradtrack.io.reader -> keras_gradtrack.engine.step (io -> engine)"
    ]
    upward = {**GRAPH, "keras_gradtrack.statistics": {"keras_gradtrack.engine.schedule"}}
    assert layer_violations(upward, LAYERS) == [
        "keras_gradtrack.statistics -> keras_gradtrack.engine.schedule (statistics -> engine)"
    ]


def test_a_module_left_out_of_the_table_is_found() -> None:
    table = ARCHITECTURE.read_text().replace("`statistics.py`", "`statistics_of_old.py`")
    assert layers_of("keras_gradtrack.statistics", read_layers(table)) == []

"""The package's import graph has no cycle and every import follows the layer table
(`ALLOWED`: cli, render -> runtime -> solver -> cost -> spec, the runtime's rooms in their own
order); the registry's dotted paths count as imports of `nereus.spec.registry`.

The graph is read from the source with `ast`, not by importing: every `import` and
`from ... import` of a nereus module counts, at module level or inside a function (a
function-local import hides a cycle from the interpreter, not from the reader), except
those under `if TYPE_CHECKING:`, which never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from repo_paths import ROOT

pytestmark = pytest.mark.logic

PACKAGE = ROOT / "nereus"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_names(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Every dotted name an import statement of `tree` reaches (outside TYPE_CHECKING blocks);
    `from a import b` gives both `a` and `a.b` (`b` may be a submodule or a name in `a`)."""
    names: list[str] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and is_type_checking(node.test):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]
        pending.extend(ast.iter_child_nodes(node))
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the nereus modules it imports."""
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        reached = imported_names(tree, module, path.name == "__init__.py")
        graph[module] = {name for name in reached if name in files and name != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, iterative)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once explored
    for root in sorted(graph):
        if root in state:
            continue
        path = [root]
        children = [iter(sorted(graph[root]))]
        state[root] = "open"
        while children:
            child = next(children[-1], None)
            if child is None:
                state[path.pop()] = "done"
                children.pop()
            elif state.get(child) == "open":
                return [*path[path.index(child) :], child]
            elif child not in state:
                state[child] = "open"
                path.append(child)
                children.append(iter(sorted(graph[child])))
    return None


def test_the_graph_sees_function_local_imports_and_skips_type_checking() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n    import nereus.hidden\n"
        "def late():\n    from nereus.spec.io import load_document\n"
    )
    names = imported_names(tree, "nereus.spec.check", is_package=False)
    assert {"nereus.spec.sibling", "nereus.spec.io", "nereus.spec.io.load_document"} <= set(names)
    assert "nereus.hidden" not in names
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "nereus.runtime.rl.step" in graph and "nereus.spec.io" in graph  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_render_imports_nothing_from_the_runtime() -> None:
    graph = import_graph()
    reaches = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module.startswith("nereus.render")
        for target in targets
        if target == "nereus.runtime" or target.startswith("nereus.runtime.")
    )
    assert reaches == []


# ---- the layers ----

#: The runtime's rooms: each a unit of its own in the layer table.
RUNTIME_ROOMS = ("comm", "observe", "state", "model", "generation", "hf", "rl", "run")
#: What every layer may import besides the units the table names: the error types and units.
LEAVES = {"errors", "units"}
BELOW_RUNTIME = {"solver", "cost", "spec"} | LEAVES

#: Which unit may import which (a unit: a top-level package or module of nereus, or a room of
#: the runtime). Imports point one way, down: cli, render -> runtime -> solver -> cost -> spec;
#: within the runtime: run (a run's life) -> rl -> hf, generation -> model -> state -> observe -> comm.
ALLOWED: dict[str, set[str]] = {
    "nereus": set(),
    "__main__": {"cli"},
    "errors": set(),
    "units": set(),
    "spec": LEAVES,
    "cost": {"spec"} | LEAVES,
    "solver": {"cost", "spec"} | LEAVES,
    "interop": {"cost", "spec"} | LEAVES,
    "render": BELOW_RUNTIME,
    "runtime.comm": BELOW_RUNTIME,
    "runtime.observe": {"runtime.comm"} | BELOW_RUNTIME,
    "runtime.state": {"runtime.comm", "runtime.observe"} | BELOW_RUNTIME,
    "runtime.model": {"runtime.state", "runtime.comm", "runtime.observe"} | BELOW_RUNTIME,
    "runtime.generation": {"runtime.model", "runtime.state", "runtime.comm", "runtime.observe"} | BELOW_RUNTIME,
    "runtime.hf": {"runtime.model", "runtime.state", "runtime.comm", "runtime.observe"} | BELOW_RUNTIME,
    "runtime.rl": {f"runtime.{room}" for room in RUNTIME_ROOMS if room not in ("rl", "run")} | BELOW_RUNTIME,
    "runtime.run": {f"runtime.{room}" for room in RUNTIME_ROOMS if room != "run"} | BELOW_RUNTIME,
    "runtime": set(),
    "cli": {"nereus", "render", "interop", "runtime"} | {f"runtime.{room}" for room in RUNTIME_ROOMS} | BELOW_RUNTIME,
}

#: Edges against the direction, each module to module with its reason. Admission reads three
#: facts the runtime owns from torch-free runtime modules, inside the functions that need them.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("nereus.solver.admission", "nereus.runtime.rl.tasks"): "the character tokenizer's vocabulary",
    ("nereus.solver.admission", "nereus.runtime.model.fused_schedule"): "whether a fused schedule exists",
    ("nereus.solver.admission", "nereus.runtime.rl.inter_stage"): "whether the fused rollout can migrate",
    ("nereus.solver.admission", "nereus.runtime.state.shard_layout"): "the shard contract (state bytes by rank)",
    ("nereus.solver.admission", "nereus.runtime.state.sharded_state"): "the shard contract (state bytes by rank)",
}

#: The registry names classes and checks of higher layers by dotted path (imported on first use).
REGISTRY_MODULE = "nereus.spec.registry"
REGISTRY_TARGETS = {"cost", "solver"}


def unit(module: str) -> str:
    """The layer-table unit of a nereus module: `nereus.runtime.rl.step` -> `runtime.rl`."""
    parts = module.split(".")[1:]
    if not parts:
        return "nereus"
    if parts[0] == "runtime" and len(parts) > 1 and parts[1] in RUNTIME_ROOMS:
        return f"runtime.{parts[1]}"
    return parts[0]


def registry_edges() -> set[str]:
    """The modules the registry's dotted paths name (`module:attribute`)."""
    from dataclasses import astuple

    from nereus.spec.registry import REGISTRY

    paths: list[str] = []
    for entry in REGISTRY.values():
        for value in astuple(entry):
            paths += [value] if isinstance(value, str) else list(value)
    return {path.partition(":")[0] for path in paths}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in graph.items():
        here = unit(module)
        assert here in ALLOWED, f"{module}: unit {here} is not in the layer table; add it"
        for target in targets:
            there = unit(target)
            allowed = there == here or there in ALLOWED[here] or (module, target) in EXCEPTIONS
            if module == REGISTRY_MODULE and there in REGISTRY_TARGETS:
                allowed = True
            if not allowed:
                found.append(f"{module} ({here}) imports {target} ({there})")
    return sorted(found)


def test_the_layer_check_catches_an_edge_against_the_direction() -> None:
    assert unit("nereus.runtime.rl.step") == "runtime.rl" and unit("nereus.spec.io") == "spec"
    assert unit("nereus") == "nereus" and unit("nereus.runtime") == "runtime"
    graph = {"nereus.cost.stage": {"nereus.solver.layouts"}, "nereus.solver.layouts": {"nereus.cost.stage"}}
    assert layer_violations(graph) == ["nereus.cost.stage (cost) imports nereus.solver.layouts (solver)"]
    assert layer_violations({"nereus.runtime.model.engine": {"nereus.runtime.rl.step"}}) != []
    assert layer_violations({REGISTRY_MODULE: {"nereus.solver.admission"}}) == []
    assert layer_violations({REGISTRY_MODULE: {"nereus.runtime.rl.setup"}}) != []
    assert "nereus.solver.admission" in registry_edges() and "nereus.spec.check" in registry_edges()


def test_every_import_follows_the_layer_table() -> None:
    graph = import_graph()
    graph[REGISTRY_MODULE] = graph[REGISTRY_MODULE] | registry_edges()
    assert all(target in graph for target in registry_edges()), "a dotted path of the registry names no module"
    assert layer_violations(graph) == []


def test_every_exception_is_still_an_edge() -> None:
    graph = import_graph()
    assert [edge for edge in EXCEPTIONS if edge[1] not in graph.get(edge[0], set())] == []

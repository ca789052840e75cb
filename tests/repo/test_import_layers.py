"""The package's import graph has no cycle, and the renderers do not reach into the runtime.

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

"""Every name a benchmark or example script imports from nereus exists.

The scripts under benchmarks/ and examples/ run by hand, not in the suite, and many import
inside the function that needs the name, so a name the package renames or inlines breaks them
unseen until someone reruns them (it happened: `fused_rollout.infer_samples`). Each script's
`from nereus... import name` statements, at module level or inside functions, are read with
`ast` and every name is looked up in its module (a submodule counts).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest
from repo_paths import BENCHMARKS, ROOT

pytestmark = pytest.mark.one_rank

SCRIPTS = sorted([*BENCHMARKS.glob("*.py"), *(ROOT / "examples").glob("*.py")])


def nereus_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from nereus... import name` in the script at `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [
        (node.lineno, node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "nereus"
        for alias in node.names
    ]


def missing_name(module: str, name: str) -> str | None:
    """Why `from module import name` fails, or None (also None when the module needs an
    optional dependency that is not installed here)."""
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "nereus":
            return None  # e.g. vLLM absent: the script cannot run here, nothing to check
        return f"no module {error.name}"
    if hasattr(imported, name):
        return None
    if hasattr(imported, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None:
        return None  # a submodule not imported yet
    return f"{module} has no {name}"


def test_the_scripts_import_nothing_that_is_gone() -> None:
    assert len(SCRIPTS) > 30
    found = [
        f"{path.relative_to(ROOT)}:{line}: {problem}"
        for path in SCRIPTS
        for line, module, name in nereus_imports(path)
        if (problem := missing_name(module, name)) is not None
    ]
    assert found == []


def test_a_name_that_is_gone_is_reported() -> None:
    assert missing_name("nereus.runtime.rl.fused_rollout", "fused_rollout") is None
    assert missing_name("nereus.runtime.rl.fused_rollout", "infer_samples") == (
        "nereus.runtime.rl.fused_rollout has no infer_samples"
    )
    assert missing_name("nereus.runtime", "rl") is None  # a submodule
    assert missing_name("nereus.nowhere", "x") == "no module nereus.nowhere"

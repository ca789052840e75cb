"""The kind registry: checks of every layer run whatever the caller imported first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nereus.spec import registry
from nereus.spec.base import Document
from nereus.spec.io import load_document, save_document
from nereus.spec.plan import Plan

pytestmark = pytest.mark.logic

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# A fresh interpreter that imports only the spec layer's public entry point, checks the file
# and reports what it found and whether the cost model was imported before the check.
FRESH_CHECK = """
import json, sys
from nereus.spec import check_file
before = "nereus.cost" in sys.modules
result = check_file(sys.argv[1])
print(json.dumps({"cost_before": before, "kind": result.kind, "errors": result.errors}))
"""


def tiny_gpu_plan(tmp_path: Path) -> Path:
    """The 4-rank example plan on GPUs of 1 MiB: every model-stage overflows."""
    plan = load_document(EXAMPLES / "plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan, Plan)
    gpu = plan.cluster.gpu.model_copy(update={"memory_bytes": 2**20})
    small = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"gpu": gpu})})
    path = tmp_path / "plan-small-gpus.yaml"
    save_document(small, path)
    return path


def test_memory_check_runs_in_a_fresh_interpreter(tmp_path: Path) -> None:
    path = tiny_gpu_plan(tmp_path)
    out = subprocess.run([sys.executable, "-c", FRESH_CHECK, str(path)], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert report["cost_before"] is False  # the spec layer imports no cost model at module level
    assert report["kind"] == "Plan"
    assert report["errors"], "a plan whose memory does not fit must fail the check"
    assert all(": memory: " in line for line in report["errors"]), report["errors"]


def test_load_document_refuses_the_plan_in_a_fresh_interpreter(tmp_path: Path) -> None:
    path = tiny_gpu_plan(tmp_path)
    code = "import sys\nfrom nereus.spec import load_document\nload_document(sys.argv[1])\n"
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert out.returncode != 0
    assert "SpecError" in out.stderr and "memory: " in out.stderr


def test_spec_layer_imports_no_higher_layer() -> None:
    code = (
        "import sys, nereus.spec\n"
        "print(sorted(m for m in sys.modules if m.startswith('nereus.')\n"
        "             and m.split('.')[1] not in ('spec', 'errors')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("kind", registry.KINDS)
def test_every_entry_resolves(kind: str) -> None:
    entry = registry.REGISTRY[kind]
    document = registry.document_class(kind)
    assert document is not None and issubclass(document, Document)
    assert document.model_fields["kind"].default == kind
    for dotted in (*entry.checks, *entry.layered_checks):
        assert callable(registry._resolve(dotted)), dotted


def test_an_unknown_kind_has_no_class() -> None:
    assert registry.document_class("Nope") is None

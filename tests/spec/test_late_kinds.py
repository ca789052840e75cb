"""Kinds defined above the spec layer load in a fresh interpreter without importing their module first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.logic

DOCUMENTS = {
    "RunConfig": "kind: RunConfig\nversion: 1\n",
    "Calibration": "kind: Calibration\nversion: 1\n",
}


@pytest.mark.parametrize("kind", sorted(DOCUMENTS))
def test_load_document_finds_the_module_of_a_late_kind(kind: str, tmp_path: Path) -> None:
    path = tmp_path / f"{kind}.yaml"
    path.write_text(DOCUMENTS[kind])
    code = (
        "import sys\n"
        "from nereus.spec.io import load_document\n"
        f"document = load_document({str(path)!r})\n"
        "print(type(document).__name__, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [kind, "False"]


def test_an_unknown_kind_lists_the_late_kinds_too(tmp_path: Path) -> None:
    from nereus.errors import SpecError
    from nereus.spec.io import load_document

    path = tmp_path / "x.yaml"
    path.write_text("kind: Nope\nversion: 1\n")
    with pytest.raises(SpecError) as caught:
        load_document(path)
    for kind in ("Calibration", "RunConfig", "Schedule", "Trace", "Plan"):
        assert kind in str(caught.value)

"""Every `nereus check` error names the line and column of its field, in the human, --json and
github forms; the pre-commit hook runs its entry on plan files."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from cli_helpers import invoke

pytestmark = pytest.mark.cli

ROOT = Path(__file__).resolve().parents[2]
BROKEN = ROOT / "tests" / "broken"


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_a_broken_plan_names_the_line_in_every_form(tmp_path: Path) -> None:
    plan = yaml.safe_load((ROOT / "examples" / "plan-tiny-ppo-4rank.yaml").read_text())
    plan["stages"][5]["tp"] = 3  # actor/training: tp=3 does not divide 4 heads
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    lines = path.read_text().splitlines()
    expected = next(i for i, line in enumerate(lines, 1) if line.strip() == "tp: 3")
    column = lines[expected - 1].index("tp") + 1
    human = invoke("check", path)
    assert human.exit_code == 1
    assert f"  {path}:{expected}:{column}: stages[5].tp: tp=3 does not divide" in human.stdout
    payload = json.loads(invoke("check", path, "--format", "json").stdout)
    [problem] = [p for p in payload["files"][0]["problems"] if p["field"] == "stages[5].tp"]
    assert (problem["line"], problem["column"], problem["severity"]) == (expected, column, "error")
    github = invoke("check", path, "--format", "github")
    assert github.exit_code == 1
    assert f"::error file={path},line={expected},col={column},title=nereus check::stages[5].tp: tp=3" in github.stdout


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("cluster-string-for-int.yaml", "num_nodes:"),
        ("plan-gpu-used-twice-in-model-stage.yaml", None),
        ("cluster-duplicate-yaml-key.yaml", None),
        ("model-missing-required-field.yaml", None),
    ],
)
def test_broken_corpus_errors_carry_a_position(name: str, text: str | None) -> None:
    path = BROKEN / name
    result = invoke("check", path, "--json")
    [entry] = json.loads(result.stdout)["files"]
    assert entry["problems"] and all(p["line"] for p in entry["problems"])
    if text is not None:
        assert entry["problems"][0]["line"] == _line_of(path, text)
    if name == "cluster-duplicate-yaml-key.yaml":
        assert entry["problems"][0]["line"] == 5  # the second `num_nodes`, where the YAML error is


def test_github_annotations_escape_the_message() -> None:
    from nereus.cli.spec_commands import github_annotation
    from nereus.spec.check import Finding

    finding = Finding("a,b.yaml", "a,b.yaml: x: 50% off\nnext", "warning", "x", 3, 1)
    expected = "::warning file=a%2Cb.yaml,line=3,col=1,title=nereus check::x: 50%25 off%0Anext"
    assert github_annotation(finding) == expected


@pytest.mark.multiprocess
def test_pre_commit_hook_entry_runs_on_the_files_it_selects(tmp_path: Path) -> None:
    [hook] = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert hook["id"] == "nereus-check" and hook["language"] == "python"
    selected = re.compile(hook["files"])
    good, bad = ROOT / "examples" / "plan-tiny-ppo-4rank.yaml", BROKEN / "plan-tp-not-dividing-heads.yaml"
    unrelated = tmp_path / ".github" / "workflows" / "ci.yaml"
    assert selected.search(str(good.relative_to(ROOT))) and selected.search(str(bad.relative_to(ROOT)))
    assert not selected.search(".github/workflows/ci.yaml") and unrelated.suffix == ".yaml"
    entry = shlex.split(hook["entry"])
    assert shutil.which(entry[0]), f"{entry[0]} is not on PATH (install nereus)"
    ok = subprocess.run([*entry, str(good)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    failed = subprocess.run([*entry, str(good), str(bad)], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1
    assert f"{bad}:{_line_of(bad, 'tp: 3')}:" in failed.stdout and "Traceback" not in failed.stderr

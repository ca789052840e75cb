"""Every file in tests/broken is refused, with the cause named on one line per problem.

Each broken file holds one realistic mistake derived from a file in examples/;
tests/broken/EXPECTED.yaml maps its name to a substring one of its error lines must hold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from check_lines import names_file
from repo_paths import TESTS
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.spec.check import check_file

pytestmark = pytest.mark.logic

ROOT = TESTS.parent
BROKEN = TESTS / "broken"
EXAMPLES = ROOT / "examples"
EXPECTED: dict[str, str] = yaml.safe_load((BROKEN / "EXPECTED.yaml").read_text(encoding="utf-8"))
BROKEN_FILES = sorted(p for p in BROKEN.iterdir() if p.is_file() and p.name != "EXPECTED.yaml")
EXAMPLE_FILES = sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".yaml", ".json"))

runner = CliRunner()


def test_corpus_is_large_and_fully_described() -> None:
    assert len(BROKEN_FILES) >= 30
    names = {p.name for p in BROKEN_FILES}
    assert names == set(EXPECTED), "EXPECTED.yaml and tests/broken disagree"
    assert all(isinstance(v, str) and v for v in EXPECTED.values())


def test_corpus_has_the_raw_byte_cases() -> None:
    binary = (BROKEN / "binary-garbage.yaml").read_bytes()
    assert b"\x00" in binary and len(binary) > 100
    latin1 = (BROKEN / "non-utf8-bytes.yaml").read_bytes()
    assert b"\x00" not in latin1
    with pytest.raises(UnicodeDecodeError):
        latin1.decode("utf-8")
    assert (BROKEN / "empty-file.yaml").read_bytes() == b""
    assert not (BROKEN / "whitespace-only.yaml").read_text().strip()
    with_tab = (BROKEN / "whitespace-with-tab.yaml").read_text()
    assert "\t" in with_tab and not with_tab.strip()


@pytest.mark.parametrize("path", BROKEN_FILES, ids=lambda p: p.name)
def test_check_file_names_the_cause(path: Path) -> None:
    result = check_file(path)
    assert not result.ok
    assert result.errors
    expected = EXPECTED[path.name]
    assert any(expected in line for line in result.errors), (expected, result.errors)
    for line in result.errors + result.warnings:
        assert names_file(line, path), line
        assert "\n" not in line and "\r" not in line, line


@pytest.mark.parametrize(
    "name",
    [
        "whitespace-only.yaml",
        "whitespace-with-tab.yaml",
        "plan-duplicate-pool-name.yaml",
        "cluster-infinite-flops.yaml",
    ],
)
def test_single_cause_gives_a_single_error(name: str) -> None:
    """No follow-on noise: e.g. a duplicated pool name is not also reported as GPUs 'not in pool'."""
    errors = check_file(BROKEN / name).errors
    assert len(errors) == 1, errors
    assert not any("not in pool" in line for line in errors), errors


@pytest.mark.parametrize("path", BROKEN_FILES, ids=lambda p: p.name)
def test_cli_check_exits_1_with_one_line_per_error(path: Path) -> None:
    result = runner.invoke(app, ["check", str(path)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[0] == f"{path}: invalid" or lines[0].startswith(f"{path}: invalid (")
    errors = lines[1:]
    # One output line per reported error: no error spills onto a second line.
    assert len(errors) == len(check_file(path).errors)
    for line in errors:
        assert names_file(line, path, indent="  "), line
    assert any(EXPECTED[path.name] in line for line in errors)


@pytest.mark.parametrize("path", BROKEN_FILES, ids=lambda p: p.name)
def test_cli_check_json_says_not_ok(path: Path) -> None:
    result = runner.invoke(app, ["check", str(path), "--json"])
    assert result.exit_code == 1, result.output
    payload = json.loads(result.stdout)
    assert payload["ok"] is False
    [entry] = payload["files"]
    assert entry["file"] == str(path)
    assert entry["ok"] is False
    assert entry["errors"]
    assert any(EXPECTED[path.name] in line for line in entry["errors"])


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_every_example_passes_check(path: Path) -> None:
    result = runner.invoke(app, ["check", str(path)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"{path}: ok")


def test_all_examples_at_once_and_json() -> None:
    result = runner.invoke(app, ["check", *map(str, EXAMPLE_FILES), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["ok"] is True
    assert [entry["file"] for entry in payload["files"]] == [str(p) for p in EXAMPLE_FILES]


def test_one_broken_file_among_good_ones_fails_the_run() -> None:
    broken = BROKEN / "plan-tp-not-dividing-heads.yaml"
    result = runner.invoke(app, ["check", *map(str, EXAMPLE_FILES), str(broken)])
    assert result.exit_code == 1
    assert f"{broken}: invalid" in result.output
    for example in EXAMPLE_FILES:
        assert f"{example}: ok" in result.output


@pytest.mark.parametrize("name", ["plan-tp-not-dividing-heads.yaml", "binary-garbage.yaml"])
def test_real_subprocess_exits_1_without_traceback(name: str) -> None:
    path = BROKEN / name
    proc = subprocess.run(
        [sys.executable, "-c", "from nereus.cli.app import main; main()", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert "Traceback" not in proc.stdout
    assert f"{path}: invalid" in proc.stdout
    assert EXPECTED[name] in proc.stdout

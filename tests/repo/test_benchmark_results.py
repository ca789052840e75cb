"""Every benchmark result file says where its numbers came from (pure logic tier).

A file in benchmarks/results/*.json either carries the provenance that benchmarks/_record.py
writes (command line, commit, date, machine, raw repetitions), or is named in
benchmarks/README.md's list of results recorded before that helper existed. A listed file that
has since been re-run with the helper must leave the list, so the list stays true.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from repo_paths import ROOT

pytestmark = pytest.mark.logic
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"
LIST = re.compile(r"<!-- recorded-before-helper:begin -->\n(.*?)<!-- recorded-before-helper:end -->", re.S)
MACHINE_FIELDS = ("cores", "load_average_before", "load_average_after", "python", "torch", "cpu_model")


def recorded_before_helper() -> set[str]:
    """The file names listed between the README's recorded-before-helper markers."""
    found = LIST.search(README.read_text(encoding="utf-8"))
    assert found, f"{README.relative_to(ROOT)}: no <!-- recorded-before-helper:begin/end --> list"
    return set(re.findall(r"^- `([\w.-]+\.json)`", found.group(1), re.M))


def provenance_problems(record: dict[str, Any]) -> list[str]:
    """What a result written through benchmarks/_record.py has and this one lacks."""
    origin = record.get("provenance")
    if not isinstance(origin, dict):
        return ["no provenance"]
    problems = [f"provenance.{key} missing" for key in ("command", "commit", "date") if not origin.get(key)]
    if not isinstance(origin.get("dirty"), bool):
        problems.append("provenance.dirty missing")
    machine = origin.get("machine")
    if not isinstance(machine, dict):
        return [*problems, "provenance.machine missing"]
    problems += [f"provenance.machine.{key} missing" for key in MACHINE_FIELDS if key not in machine]
    if not isinstance(record.get("repetitions"), dict):
        problems.append("no repetitions")
    return problems


def test_every_result_records_where_it_came_from_or_is_listed_as_older() -> None:
    listed = recorded_before_helper()
    files = sorted(RESULTS.glob("*.json"))
    assert files, "no benchmark results"
    missing = []
    for path in files:
        problems = provenance_problems(json.loads(path.read_text(encoding="utf-8")))
        if path.name in listed and not problems:
            missing.append(f"{path.name}: re-run with the helper; take it off the recorded-before-helper list")
        elif path.name not in listed and problems:
            missing.append(f"{path.name}: {', '.join(problems)}")
    assert not missing, "\n".join(missing)


def test_the_recorded_before_helper_list_names_only_existing_results() -> None:
    stale = sorted(recorded_before_helper() - {p.name for p in RESULTS.glob("*.json")})
    assert not stale, f"listed in benchmarks/README.md but not in benchmarks/results: {stale}"


def test_a_result_without_a_commit_or_machine_is_caught() -> None:
    complete = {
        "provenance": {
            "command": "python benchmarks/x.py",
            "commit": "0" * 40,
            "dirty": False,
            "date": "2026-01-01T00:00:00+00:00",
            "machine": dict.fromkeys(MACHINE_FIELDS, 1),
        },
        "repetitions": {"step_s": [1.0, 1.1]},
    }
    assert provenance_problems(complete) == []
    no_commit = {**complete, "provenance": {**complete["provenance"], "commit": None}}
    assert provenance_problems(no_commit) == ["provenance.commit missing"]
    assert provenance_problems({"results": []}) == ["no provenance"]
    no_cpu = {**complete, "provenance": {**complete["provenance"], "machine": {"cores": 2}}}
    assert "provenance.machine.cpu_model missing" in provenance_problems(no_cpu)

"""Result files that say where their numbers came from: every benchmark writes through `write_result`.

A result file is the benchmark's own fields plus two of this module's:

* `provenance`: the exact command line, the git commit and whether the tree had uncommitted
  changes, the date (UTC, ISO 8601) at start and end, and the machine (cores, load average before
  and after, Python, torch if installed, the CPU model, the platform);
* `repetitions`: the raw number of every timed repetition, by what was timed, so a table can
  quote their median (and a reader can see their spread) instead of one run.

Standard library only (no nereus, no torch import), so the numbers' record does not depend on
the code it measures. Use:

    started = begin()                         # first thing in main(): load average, start time
    ...                                       # the benchmark
    write_result(path, payload, started, repetitions={"search_ms": [4.1, 4.3, 4.2]})
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: Keys this module adds to a result; a benchmark's own fields must not use them.
RESERVED = ("provenance", "repetitions")


@dataclass(frozen=True)
class Started:
    """What `begin` saw before the benchmark ran."""

    date: str
    """UTC start time, ISO 8601."""
    load_average: tuple[float, float, float]
    """1-, 5- and 15-minute load averages before the run."""
    commit: str | None
    """HEAD when the run started; None outside a git checkout."""
    changed: tuple[str, ...] | None
    """Tracked files with uncommitted changes when the run started (None outside a checkout)."""


def begin() -> Started:
    """Call first in a benchmark's main(): the load average before it loads the machine itself,
    and the state of the code it is about to run."""
    commit, changed = _git_state()
    return Started(date=_now(), load_average=os.getloadavg(), commit=commit, changed=changed)


def write_result(
    path: Path,
    payload: Mapping[str, Any],
    started: Started,
    repetitions: Mapping[str, Any],
    *,
    render: Callable[[dict[str, Any]], str] | None = None,
) -> Path:
    """Write `payload` plus provenance and the raw repetitions to `path` (JSON, atomically).

    `repetitions` maps what was timed to its per-repetition numbers (a list, or lists by case).
    `render` turns the merged record into the file's text, for a benchmark with a JSON layout of
    its own (it must stay a JSON object holding the record); by default, indented JSON.
    """
    record = _merged(payload, started, repetitions)
    body = json.dumps(record, indent=1) + "\n" if render is None else render(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(body, encoding="utf-8")
    partial.replace(path)
    return path


def rank_times(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Per-rank rows of a benchmark (`model`, `rank`, and `times_s`: what was timed -> its
    repetitions) split into the rows without their times and the times as `repetitions`
    (`MODEL/rankN/WHAT_s`)."""
    kept = [{k: v for k, v in row.items() if k != "times_s"} for row in rows]
    times = {f"{row['model']}/rank{row['rank']}/{what}_s": t for row in rows for what, t in row["times_s"].items()}
    return kept, times


def _merged(payload: Mapping[str, Any], started: Started, repetitions: Mapping[str, Any]) -> dict[str, Any]:
    clash = [key for key in RESERVED if key in payload]
    if clash:
        raise ValueError(f"the benchmark's fields {clash} clash with the provenance helper's")
    return {**payload, "provenance": provenance(started), "repetitions": dict(repetitions)}


def provenance(started: Started) -> dict[str, Any]:
    """Command, commit, dates and machine (the load average and end date as of now)."""
    return {
        "command": shlex.join(sys.orig_argv),
        "cwd": os.getcwd(),
        "commit": started.commit,
        "dirty": None if started.changed is None else bool(started.changed),
        "dirty_files": None if started.changed is None else list(started.changed),
        "date": started.date,
        "finished": _now(),
        "machine": {
            "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "load_average_before": list(started.load_average),
            "load_average_after": list(os.getloadavg()),
            "python": platform.python_version(),
            "torch": _version("torch"),
            "cpu_model": _cpu_model(),
            "platform": platform.platform(),
        },
    }


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _git_state() -> tuple[str | None, tuple[str, ...] | None]:
    """(HEAD commit, tracked files with uncommitted changes); (None, None) outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changed = git("status", "--porcelain", "--untracked-files=no").splitlines()
    except (OSError, subprocess.CalledProcessError):
        return None, None
    # The changed files, not just a flag: a tree dirty only in benchmarks/results/ ran the committed code.
    return commit, tuple(line[3:] for line in changed)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return platform.processor() or None
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or None

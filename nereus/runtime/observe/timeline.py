"""The run's span log: what every rank did when, in DIR/timeline/rank-R.jsonl.

Each rank keeps the spans of the step it is running (model-stages, phases, a transition
and its primitives, a checkpoint save, the controller's decision) and appends them to its
own file after the step, one JSON object per line:

    {"rank": R, "step": S, "cat": "stage", "name": "actor/generation",
     "start": 1764466800.12, "end": 1764466800.31, "args": {...}}

`start` and `end` are `time.time()` seconds, so spans of ranks on one host line up.
`nereus report` and the Perfetto trace read these files. A resume drops the spans of the
steps it will redo, as it drops their metrics.

The recorder is per process (one rank per process): code deep in a step records through
`record(...)` without the timeline being threaded through every call.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nereus.spec.io import keep_json_lines
from nereus.spec.run_folder import timeline_file, timeline_files


@dataclass
class Timeline:
    """One rank's spans, buffered for the current step."""

    out: Path
    """The run folder."""
    rank: int
    step: int = 0
    """The step spans are recorded for (set by the run loop before each step)."""
    spans: list[dict[str, Any]] = field(default_factory=list)

    def add(self, cat: str, name: str, start: float, end: float, **args: Any) -> None:
        self.spans.append(
            {"rank": self.rank, "step": self.step, "cat": cat, "name": name, "start": start, "end": end, "args": args}
        )

    def flush(self) -> None:
        """Append the buffered spans to this rank's file (after a step: a crash loses one step's spans)."""
        if not self.spans:
            return
        path = timeline_file(self.out, self.rank)
        path.parent.mkdir(exist_ok=True)
        with path.open("a") as handle:
            handle.write("".join(json.dumps(span) + "\n" for span in self.spans))
        self.spans.clear()


#: The timeline `record` writes to inside a `recording` block. Process-wide on purpose, like a
#: logging handler: a rank is one process with one span log, which code deep in a step
#: appends to (see the module's docstring); only `recording` sets it, and restores it after.
_current: Timeline | None = None


@contextmanager
def recording(timeline: Timeline) -> Iterator[Timeline]:
    """Make `timeline` the one `record` and `span` write to, for the duration."""
    global _current
    previous, _current = _current, timeline
    try:
        yield timeline
    finally:
        _current = previous


def record(cat: str, name: str, start: float, end: float, **args: Any) -> None:
    """Record a span on this process's timeline (nothing when none is recording)."""
    if _current is not None:
        _current.add(cat, name, start, end, **args)


@contextmanager
def span(cat: str, name: str, **args: Any) -> Iterator[dict[str, Any]]:
    """Time the block as a span; the yielded dict collects args known only at its end."""
    late: dict[str, Any] = {}
    start = time.time()
    try:
        yield late
    finally:
        record(cat, name, start, time.time(), **args, **late)


def drop_steps_from(out: Path, step: int) -> None:
    """Drop every rank's spans of steps >= `step` (a resume redoes them)."""
    for path in timeline_files(out):
        keep_json_lines(path, lambda span: span["step"] < step)

"""A run's closing summary: what one `nereus run` invocation did (its steps and timings) and
where the whole run stands (the rewards of every step so far, from the run folder's
metrics.jsonl). The CLI prints it as a table or `--json`; benchmarks record it. Torch-free.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nereus.spec.run_folder import StepMetrics, latest_checkpoint, read_metrics

#: Steps at each end of a run whose mean reward the summary reports.
REWARD_WINDOW = 10


@dataclass(frozen=True)
class RunSummary:
    """What this invocation did (timings) and where the whole run stands (rewards of every
    step so far, from metrics.jsonl): the closing table, or `--json`."""

    out: str
    num_ranks: int
    first_step: int
    """Steps done before this invocation (0 for a new run)."""
    num_steps: int
    steps_run: int
    wall_s: float
    reward_first10: float | None
    """Mean reward of the run's first 10 steps."""
    reward_last10: float | None
    reward_margin: float | None
    """Last-10 mean minus first-10 mean."""
    mean_step_s: float | None
    mean_stage_s: dict[str, float]
    checkpoint: str | None
    timeline: str | None = None
    """The run's Perfetto trace (DIR/timeline.json), rewritten at the end of every invocation."""


def reward_means(rewards: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean reward of the first and of the last REWARD_WINDOW steps (None, None: no steps)."""
    if not rewards:
        return None, None
    return statistics.mean(rewards[:REWARD_WINDOW]), statistics.mean(rewards[-REWARD_WINDOW:])


def summarize(
    out: Path, records: Sequence[StepMetrics], wall_s: float, *, num_ranks: int, first_step: int, num_steps: int
) -> RunSummary:
    """The summary of an invocation that ran `records` (its steps) in `wall_s` seconds on
    `num_ranks` ranks, from step `first_step` towards `num_steps`, in run folder `out`. A
    model-stage or phase missing from a step counts 0 s in that step's mean."""
    first, last = reward_means([record["reward"] for record in read_metrics(out)])
    names = sorted({name for m in records for name in m.stage_seconds})
    checkpoint = latest_checkpoint(out)
    return RunSummary(
        out=str(out),
        num_ranks=num_ranks,
        first_step=first_step,
        num_steps=num_steps,
        steps_run=len(records),
        wall_s=round(wall_s, 2),
        reward_first10=first,
        reward_last10=last,
        reward_margin=None if first is None or last is None else last - first,
        mean_step_s=statistics.mean(m.step_seconds for m in records) if records else None,
        mean_stage_s={name: statistics.mean(m.stage_seconds.get(name, 0.0) for m in records) for name in names},
        checkpoint=None if checkpoint is None else str(checkpoint),
    )

"""Trace: the drift one RL job sees, step by step (GPU pool, response lengths, efficiency).

A trace starts from the conditions at step 0 and lists the steps where something
changes. `nereus.spec.registry` names the kind and its semantic check.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from nereus.spec.base import Document, StrictModel
from nereus.spec.check import Problem
from nereus.spec.workload import ResponseLengths

#: Most steps a trace covers: RL jobs run thousands of steps, and everything that reads a trace
#: (`trace show`, `simulate`, the controller's replay) walks it step by step.
MAX_STEPS = 1_000_000


class TraceEvent(StrictModel):
    """What changes at one step; fields left out keep their previous value."""

    step: int = Field(ge=0)
    """The step from which the new conditions hold."""
    gpus: int | None = Field(default=None, gt=0)
    """GPUs available to the job from this step on (GPU ids 0 .. gpus-1 of the plan's cluster)."""
    notice_steps: int = Field(default=0, ge=0)
    """How many steps before `step` the job learns of this pool change; 0 = no advance notice."""
    response_len: ResponseLengths | None = None
    """The response-length distribution from this step on."""
    efficiency: float | None = Field(default=None, gt=0, le=4)
    """Measured compute efficiency relative to the calibration (1 = as calibrated)."""


class Trace(Document):
    """Per-step drift of one job: pool changes, response-length growth, efficiency changes."""

    kind: Literal["Trace"] = "Trace"
    name: str = Field(min_length=1)
    """Name used in reports, e.g. `seq-growth`."""
    description: str = ""
    """How the trace was made (generator and its parameters) or where it was measured."""
    num_steps: int = Field(gt=0, le=MAX_STEPS)
    """RL steps the trace covers (at most MAX_STEPS)."""
    gpus: int = Field(gt=0)
    """GPUs available at step 0."""
    response_len: ResponseLengths
    """Response-length distribution at step 0."""
    efficiency: float = Field(default=1.0, gt=0, le=4)
    """Measured efficiency relative to the calibration at step 0."""
    events: list[TraceEvent] = Field(default_factory=list)
    """Changes, in increasing step order, at most one per step."""


@dataclass(frozen=True)
class Conditions:
    """What holds at one step of a trace."""

    step: int
    gpus: int
    response_len: ResponseLengths
    efficiency: float
    announced_gpus: int | None = None
    """A pool change already announced for a later step (None: none known)."""
    announced_step: int | None = None
    """The step the announced pool change takes effect."""


def trace_conditions(trace: Trace) -> Iterator[Conditions]:
    """The conditions at every step 0 .. num_steps-1 (assumes a trace that passed its check)."""
    by_step = {event.step: event for event in trace.events}
    pool_events = [e for e in trace.events if e.gpus is not None]
    gpus, lengths, efficiency = trace.gpus, trace.response_len, trace.efficiency
    for step in range(trace.num_steps):
        event = by_step.get(step)
        if event is not None:
            gpus = event.gpus if event.gpus is not None else gpus
            lengths = event.response_len if event.response_len is not None else lengths
            efficiency = event.efficiency if event.efficiency is not None else efficiency
        upcoming = next((e for e in pool_events if e.step > step and e.step - e.notice_steps <= step), None)
        yield Conditions(
            step,
            gpus,
            lengths,
            efficiency,
            upcoming.gpus if upcoming else None,
            upcoming.step if upcoming else None,
        )


def _event_problems(trace: Trace, i: int, event: TraceEvent, previous_step: int) -> Iterator[Problem]:
    at = f"events[{i}]"
    if event.step <= previous_step:
        yield Problem(f"{at}.step", f"step {event.step} is not after the previous event's step {previous_step}")
    if event.step >= trace.num_steps:
        yield Problem(f"{at}.step", f"step {event.step} is past the trace's last step {trace.num_steps - 1}")
    if event.gpus is None and event.response_len is None and event.efficiency is None:
        yield Problem(at, "the event changes nothing; give gpus, response_len or efficiency, or remove it")
    if event.notice_steps and event.gpus is None:
        yield Problem(f"{at}.notice_steps", "notice applies to pool changes only; give gpus or drop notice_steps")
    if event.notice_steps > event.step:
        yield Problem(f"{at}.notice_steps", f"notice of {event.notice_steps} steps reaches before step 0")


def trace_problems(trace: Trace) -> Iterator[Problem]:
    """Events in order, inside the trace, each changing something."""
    previous = -1
    for i, event in enumerate(trace.events):
        yield from _event_problems(trace, i, event, previous)
        previous = max(previous, event.step)

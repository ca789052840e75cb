"""A pipeline schedule as Chrome trace-event JSON (open it in https://ui.perfetto.dev).

One track per node with an "X" event per op, and a counter per node with its activation
memory over time (allocated when a forward starts, released when its backward ends). Times
are written in microseconds of the schedule's unit (seconds for plan-derived schedules;
unitless schedules count one unit as one second).
"""

from __future__ import annotations

import json
from typing import Any

from nereus.spec.schedule import Schedule

PID = 1
US = 1e6


def schedule_events(schedule: Schedule) -> list[dict[str, Any]]:
    """Track names, one X event per op, and per-node activation counters."""
    events: list[dict[str, Any]] = [{"ph": "M", "pid": PID, "name": "process_name", "args": {"name": "schedule"}}]
    activation = {(m.name, stage): value for m in schedule.models for stage, value in enumerate(m.activation)}
    for record in schedule.nodes:
        node = record.node
        events.append({"ph": "M", "pid": PID, "tid": node, "name": "thread_name", "args": {"name": f"node {node}"}})
        events.append({"ph": "M", "pid": PID, "tid": node, "name": "thread_sort_index", "args": {"sort_index": node}})
        held = 0.0
        for op in record.ops:
            events.append({
                "ph": "X", "pid": PID, "tid": node, "cat": f"{op.model} {op.kind}",
                "name": f"{op.model} {op.kind}{op.microbatch}", "ts": op.start * US, "dur": (op.end - op.start) * US,
                "args": {"model": op.model, "replica": op.replica, "microbatch": op.microbatch, "stage": op.stage},
            })  # fmt: skip
            change = {"F": 1.0, "B": -1.0}.get(op.kind, 0.0) * activation[(op.model, op.stage)]
            if change:
                held += change
                events.append({"ph": "C", "pid": PID, "name": f"activation node {node}",
                               "ts": (op.start if change > 0 else op.end) * US, "args": {"memory": held}})  # fmt: skip
    return events


def schedule_trace(schedule: Schedule) -> str:
    """The Chrome trace-event JSON text of a schedule."""
    payload = {
        "traceEvents": schedule_events(schedule),
        "displayTimeUnit": "ms",
        "otherData": {"makespan": schedule.summary.makespan, "time_unit": schedule.time_unit or "unitless"},
    }
    return json.dumps(payload, separators=(",", ":"))

"""A transition as Chrome trace-event JSON (open it in https://ui.perfetto.dev).

One track per GPU holds an "X" (complete) event for every primitive that occupies the
GPU; a counter per GPU shows its memory above the initial state. Times are in
microseconds, as the format requires.
"""

from __future__ import annotations

import json
from typing import Any

from nereus.render import layout_text
from nereus.spec.transition import Transition

PID = 1
US = 1e6


def trace_events(transition: Transition) -> list[dict[str, Any]]:
    """The trace events: track names, one X event per (primitive, GPU), memory counters."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": PID, "name": "process_name", "args": {"name": "transition"}},
    ]
    gpus = sorted({gpu for p in transition.primitives for gpu in p.gpus})
    for gpu in gpus:
        events.append({"ph": "M", "pid": PID, "tid": gpu, "name": "thread_name", "args": {"name": f"GPU {gpu}"}})
        events.append({"ph": "M", "pid": PID, "tid": gpu, "name": "thread_sort_index", "args": {"sort_index": gpu}})
    changes: list[tuple[float, int, int, float]] = []  # (time, order, gpu, delta bytes)
    for p in transition.primitives:
        alloc = {e.gpu: e.bytes for e in p.alloc_bytes}
        free = {e.gpu: e.bytes for e in p.free_bytes}
        for gpu in p.gpus:
            events.append(
                {
                    "ph": "X",
                    "pid": PID,
                    "tid": gpu,
                    "name": f"{p.kind} {p.model_stage}",
                    "cat": p.kind,
                    "ts": p.start_s * US,
                    "dur": (p.end_s - p.start_s) * US,
                    "args": {
                        "id": p.id,
                        "model_stage": p.model_stage,
                        "layouts": f"{layout_text(p.source_layout)} -> {layout_text(p.target_layout)}",
                        "alloc_bytes": alloc.get(gpu, 0.0),
                        "free_bytes": free.get(gpu, 0.0),
                        "depends_on": p.depends_on,
                        "ownership_deps": p.ownership_deps,
                    },
                }
            )
        changes += [(p.start_s, 1, gpu, nbytes) for gpu, nbytes in alloc.items()]
        changes += [(p.end_s, 0, gpu, -nbytes) for gpu, nbytes in free.items()]
    extra: dict[int, float] = {}
    for time_s, _, gpu, delta in sorted(changes):
        extra[gpu] = extra.get(gpu, 0.0) + delta
        events.append(
            {
                "ph": "C",
                "pid": PID,
                "name": f"extra memory GPU {gpu}",
                "ts": time_s * US,
                "args": {"bytes": extra[gpu]},
            }
        )
    return events


def transition_trace(transition: Transition) -> str:
    """The Chrome trace-event JSON text of a transition."""
    payload = {
        "traceEvents": trace_events(transition),
        "displayTimeUnit": "ms",
        "otherData": {
            "makespan_s": transition.summary.makespan_s,
            "feasible": transition.summary.feasible,
            "cluster": transition.target.cluster.name,
        },
    }
    return json.dumps(payload, separators=(",", ":"))

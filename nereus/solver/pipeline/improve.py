"""Forward-backward improvement: re-justify a schedule right, then left, while it gets shorter.

A serial schedule generation scheme places ops one by one in a priority order, each at the
earliest time its dependencies allow on the first gap of its node long enough to hold it
(earlier ops are never moved). Placing ops in decreasing order of their end times in mirrored
time packs the schedule against its end (right-justified); placing them in increasing order
of those start times packs it against time 0 again. Each pass keeps the relative order of
ops that compete for a node unless a gap lets one move ahead, so the makespan never grows
in exact arithmetic, and often shrinks (the classical forward-backward improvement of
resource-constrained project scheduling). Memory is not modelled here: callers check the
activation cap of the result.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from nereus.solver.pipeline.bounds import topological_order
from nereus.solver.pipeline.evaluate import Orders, simulate
from nereus.solver.pipeline.model import Instance

#: Relative improvement below which another forward-backward round is not worth it.
MIN_GAIN = 1e-9


def serial_schedule(inst: Instance, priority: Sequence[int], *, mirrored: bool = False) -> list[list[int]]:
    """Per-node orders from placing ops in `priority` order, each in the first gap that fits.

    `priority` must list every op after its dependencies (after its dependents when
    `mirrored`, which schedules the reversed dependency graph; the orders are returned in
    forward time).
    """
    preds = inst.succs if mirrored else inst.preds
    duration = inst.duration
    end = [0.0] * inst.num_ops
    start = [0.0] * inst.num_ops
    busy: list[list[tuple[float, float]]] = [[] for _ in range(inst.problem.num_nodes)]
    for op in priority:
        ready = 0.0
        for pred, lat in preds[op]:
            ready = max(ready, end[pred] + lat)
        ready = _first_gap(busy[inst.node[op]], ready, duration[op])
        start[op], end[op] = ready, ready + duration[op]
    orders: list[list[int]] = [[] for _ in range(inst.problem.num_nodes)]
    for op in sorted(range(inst.num_ops), key=lambda o: (start[o], end[o])):
        orders[inst.node[op]].append(op)
    if mirrored:
        for order in orders:
            order.reverse()
    return orders


def _first_gap(intervals: list[tuple[float, float]], ready: float, length: float) -> float:
    """Earliest start >= ready of a `length` gap among sorted busy intervals; books it."""
    i = bisect.bisect_left(intervals, (ready, -1.0))
    if i and intervals[i - 1][1] > ready:
        ready = intervals[i - 1][1]
    while i < len(intervals) and intervals[i][0] < ready + length:
        ready = max(ready, intervals[i][1])
        i += 1
    intervals.insert(i, (ready, ready + length))
    return ready


def forward_backward(inst: Instance, orders: Orders, max_rounds: int = 20) -> tuple[list[list[int]], float]:
    """Alternate right- and left-justification from `orders`; the shortest orders and makespan."""
    state = simulate(inst, orders)
    assert state is not None, "forward-backward improves a schedule that runs"
    best_makespan, _, end = state
    best = [list(order) for order in orders]
    # Ties (zero-length weight-gradient ops) fall back to a topological rank, so every
    # priority list still respects the dependencies.
    rank = [0] * inst.num_ops
    for position, op in enumerate(topological_order(inst)):
        rank[op] = position
    ops = range(inst.num_ops)
    for _ in range(max_rounds):
        backward = serial_schedule(inst, sorted(ops, key=lambda o: (-end[o], -rank[o])), mirrored=True)
        right = simulate(inst, backward)
        assert right is not None, "a serial schedule runs"
        forward = serial_schedule(inst, sorted(ops, key=lambda o: (right[1][o], rank[o])))
        left = simulate(inst, forward)
        assert left is not None, "a serial schedule runs"
        makespan, _, end = min(left, right, key=lambda s: s[0])
        if makespan >= best_makespan * (1 - MIN_GAIN):
            break
        best_makespan, best = makespan, forward if left[0] <= right[0] else backward
    return best, best_makespan

"""Forward-backward improvement: re-justify a schedule right, then left, while it gets shorter.

A serial schedule generation scheme places ops one by one in a priority order, each at the
earliest time its dependencies allow on the first gap of its node long enough to hold it
(earlier ops are never moved). Placing ops in decreasing order of their end times in mirrored
time packs the schedule against its end (right-justified); placing them in increasing order
of those start times packs it against time 0 again. Each pass keeps the relative order of
ops that compete for a node unless a gap lets one move ahead, so the makespan never grows
in exact arithmetic, and often shrinks (the classical forward-backward improvement of
resource-constrained project scheduling). With a `cap`, each pass also keeps every node's
activation within it: a forward (a backward in mirrored time, where the roles swap) takes its
node's memory from its start until its partner is placed, so it is placed no earlier than the
moment from which the node holds at most `cap` less its activation for good. Fast schedules
then stay lean instead of pulling every forward to the front.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence

from nereus.solver.pipeline.bounds import topological_order
from nereus.solver.pipeline.evaluate import Orders, simulate
from nereus.solver.pipeline.model import Instance

#: Relative improvement below which another forward-backward round is not worth it.
MIN_GAIN = 1e-9


def serial_schedule(
    inst: Instance, priority: Sequence[int], *, mirrored: bool = False, cap: float | None = None
) -> list[list[int]] | None:
    """Per-node orders from placing ops in `priority` order, each in the first gap that fits.

    `priority` must list every op after its dependencies (after its dependents when
    `mirrored`, which schedules the reversed dependency graph; the orders are returned in
    forward time). With `cap`, an op is placed only where its node's activation stays within
    the cap; one that cannot be (its node holds too much for good) waits, and its dependents
    with it, until an op of its node that frees activation is placed: forwards are delayed
    until backwards free memory. None when ops are still waiting at the end.
    """
    preds, succs = (inst.succs, inst.preds) if mirrored else (inst.preds, inst.succs)
    duration = inst.duration
    end = [0.0] * inst.num_ops
    start = [0.0] * inst.num_ops
    busy: list[list[tuple[float, float]]] = [[] for _ in range(inst.problem.num_nodes)]
    memory = None if cap is None else _Memory(inst, cap, mirrored)
    rank = [0] * inst.num_ops
    for position, op in enumerate(priority):
        rank[op] = position
    waiting = [len(p) for p in preds]
    ready_ops = [(rank[op], op) for op in range(inst.num_ops) if not waiting[op]]
    heapq.heapify(ready_ops)
    deferred: list[list[int]] = [[] for _ in range(inst.problem.num_nodes)]
    placed = 0
    while ready_ops:
        op = heapq.heappop(ready_ops)[1]
        node = inst.node[op]
        ready = max([end[pred] + lat for pred, lat in preds[op]], default=0.0)
        if memory is not None:
            ready = memory.earliest(op, ready)
            if ready == math.inf:
                deferred[node].append(op)
                continue
            if memory.frees(op):
                for waiter in deferred[node]:
                    heapq.heappush(ready_ops, (rank[waiter], waiter))
                deferred[node].clear()
        ready = _first_gap(busy[node], ready, duration[op])
        start[op], end[op] = ready, ready + duration[op]
        if memory is not None:
            memory.book(op, ready, end[op])
        placed += 1
        for succ, _ in succs[op]:
            waiting[succ] -= 1
            if not waiting[succ]:
                heapq.heappush(ready_ops, (rank[succ], succ))
    if placed < inst.num_ops:
        return None
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


class _Memory:
    """Per-node activation over time while a serial schedule is built: an op that opens an
    activation (a forward; a backward in mirrored time) holds it from its start until the op
    that closes it is placed, then until that one's end."""

    def __init__(self, inst: Instance, cap: float, mirrored: bool) -> None:
        self.inst, self.limit, self.sign = inst, cap * (1 + 1e-12), -1.0 if mirrored else 1.0
        self.events: list[list[tuple[float, float]]] = [[] for _ in range(inst.problem.num_nodes)]
        self.held = [0.0] * inst.problem.num_nodes
        """Per node, the activation held after its last event."""

    def earliest(self, op: int, ready: float) -> float:
        """Earliest start >= ready from which the node can hold `op`'s activation for good."""
        grow = self.sign * self.inst.memory_delta[op]
        if grow <= 0:
            return ready
        node = self.inst.node[op]
        events = self.events[node]
        # Walk back from the last event (the node's holding after event i is `held`): the
        # latest moment over the cap is usually near the end, so the walk stops early.
        held = self.held[node]
        for i in range(len(events) - 1, -1, -1):
            if held + grow > self.limit:
                return max(ready, events[i + 1][0]) if i + 1 < len(events) else math.inf
            held -= events[i][1]
        return ready

    def frees(self, op: int) -> bool:
        return self.sign * self.inst.memory_delta[op] < 0

    def book(self, op: int, start: float, end: float) -> None:
        delta = self.sign * self.inst.memory_delta[op]
        if delta:
            bisect.insort(self.events[self.inst.node[op]], (start, delta) if delta > 0 else (end, delta))
            self.held[self.inst.node[op]] += delta


def forward_backward(
    inst: Instance, orders: Orders, max_rounds: int = 20, cap: float | None = None
) -> tuple[list[list[int]], float]:
    """Alternate right- and left-justification from `orders`; the shortest orders and makespan
    (with `cap`, every pass keeps each node's activation within it; `orders` must)."""
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
        backward = serial_schedule(inst, sorted(ops, key=lambda o: (-end[o], -rank[o])), mirrored=True, cap=cap)
        right = None if backward is None else simulate(inst, backward)
        if backward is None or right is None:
            break
        forward = serial_schedule(inst, sorted(ops, key=lambda o: (right[1][o], rank[o])), cap=cap)
        left = None if forward is None else simulate(inst, forward)
        if forward is None or left is None:
            break
        makespan, _, end = min(left, right, key=lambda s: s[0])
        if makespan >= best_makespan * (1 - MIN_GAIN):
            break
        best_makespan, best = makespan, forward if left[0] <= right[0] else backward
    return best, best_makespan

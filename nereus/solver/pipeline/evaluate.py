"""The evaluator: per-node op orders -> start/end times, peak memory, bubbles, deadlock.

Every node runs its ops one at a time in the given order; an op starts when the node is
free and every dependency has ended (plus the p2p latency across nodes). The earliest
such times are found by Kahn's algorithm over dependency edges plus node-order edges;
ops never reached form a cycle: the order deadlocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from nereus.solver.pipeline.model import Instance

Orders = Sequence[Sequence[int]]

#: Relative slack when comparing stored times with recomputed ones.
TIME_TOLERANCE = 1e-9


@dataclass
class Evaluation:
    """What a schedule achieves (times are None when it deadlocks)."""

    makespan: float
    start: list[float] | None
    end: list[float] | None
    peak_memory: list[float]
    """Peak activation memory per node."""
    bubble_ratio: float
    """Idle fraction of num_nodes x makespan."""
    deadlocked: list[int]
    """Ops that can never start (empty when the schedule runs)."""
    violations: list[str]
    """Structural problems (ops missing, repeated or on the wrong node)."""

    @property
    def ok(self) -> bool:
        return not self.deadlocked and not self.violations

    @property
    def max_peak_memory(self) -> float:
        return max(self.peak_memory, default=0.0)


def simulate(inst: Instance, orders: Orders) -> tuple[float, list[float], list[float]] | None:
    """(makespan, starts, ends) of well-formed orders, or None if they deadlock."""
    n = inst.num_ops
    remaining = [len(p) for p in inst.preds]
    next_on_node = [-1] * n
    for order in orders:
        for a, b in itertools.pairwise(order):
            next_on_node[a] = b
            remaining[b] += 1
    earliest = [0.0] * n
    end = [0.0] * n
    stack = [order[0] for order in orders if order and remaining[order[0]] == 0]
    done = _propagate(inst, stack, earliest, remaining, next_on_node, earliest, end)
    if done < n:
        return None
    return max(end, default=0.0), earliest, end


def _propagate(
    inst: Instance,
    stack: list[int],
    earliest: list[float],
    remaining: list[int],
    next_on_node: list[int],
    start: list[float],
    end: list[float],
) -> int:
    """Kahn's algorithm from the ready ops on `stack`: time each op at its earliest start,
    release its dependents and its successor on the node; return how many ops ran."""
    duration, succs = inst.duration, inst.succs
    done = 0
    while stack:
        op = stack.pop()
        finish = earliest[op] + duration[op]
        start[op], end[op] = earliest[op], finish
        done += 1
        for succ, lat in succs[op]:
            if finish + lat > earliest[succ]:
                earliest[succ] = finish + lat
            remaining[succ] -= 1
            if not remaining[succ]:
                stack.append(succ)
        nxt = next_on_node[op]
        if nxt >= 0:
            if finish > earliest[nxt]:
                earliest[nxt] = finish
            remaining[nxt] -= 1
            if not remaining[nxt]:
                stack.append(nxt)
    return done


def resimulate(
    inst: Instance, orders: Orders, start: Sequence[float], end: Sequence[float], since: float
) -> tuple[float, list[float], list[float]] | None:
    """`simulate` after a change to orders that ran as (start, end), touching only ops that
    started at or after `since` there (a node's ops from one position on).

    Ops that started before `since` keep their times: their dependencies and node
    predecessors all ended before it, so nothing they wait for changed. The rest (on each
    node a suffix of its order) is recomputed.
    """
    n = inst.num_ops
    affected = [t >= since for t in start]
    remaining = [0] * n
    earliest = [0.0] * n
    next_on_node = [-1] * n
    stack = []
    count = 0
    preds = inst.preds
    for order in orders:
        previous = -1
        for op in order:
            if affected[op]:
                count += 1
                ready, waiting = 0.0, 0
                for pred, lat in preds[op]:
                    if affected[pred]:
                        waiting += 1
                    elif end[pred] + lat > ready:
                        ready = end[pred] + lat
                if previous >= 0:
                    if affected[previous]:
                        waiting += 1
                        next_on_node[previous] = op
                    elif end[previous] > ready:
                        ready = end[previous]
                remaining[op], earliest[op] = waiting, ready
                if not waiting:
                    stack.append(op)
            previous = op
    new_start, new_end = list(start), list(end)
    done = _propagate(inst, stack, earliest, remaining, next_on_node, new_start, new_end)
    if done < count:
        return None
    return max(new_end, default=0.0), new_start, new_end


def peak_memory(inst: Instance, orders: Orders) -> list[float]:
    """Peak activation per node: nodes run ops one by one, so a prefix sum in order suffices."""
    peaks = []
    delta = inst.memory_delta
    for order in orders:
        held = peak = 0.0
        for op in order:
            held += delta[op]
            if held > peak:
                peak = held
        peaks.append(peak)
    return peaks


def structure_violations(inst: Instance, orders: Orders) -> list[str]:
    """Ops missing, listed twice, or on a node other than their stage's."""
    problems = []
    if len(orders) != inst.problem.num_nodes:
        problems.append(f"{len(orders)} node lists for {inst.problem.num_nodes} nodes")
    seen = [0] * inst.num_ops
    for node, order in enumerate(orders):
        for op in order:
            seen[op] += 1
            if inst.node[op] != node:
                problems.append(
                    f"{describe(inst, op)} is listed on node {node} but its stage runs on node {inst.node[op]}"
                )
    for op, count in enumerate(seen):
        if count != 1:
            problems.append(f"{describe(inst, op)} is listed {count} times; list it once")
    return problems


def describe(inst: Instance, op: int) -> str:
    k = inst.keys[op]
    return f"{k.kind}({k.model} replica {k.replica} micro-batch {k.microbatch} stage {k.stage})"


def evaluate(inst: Instance, orders: Orders) -> Evaluation:
    """Makespan, per-node peak memory, bubble ratio, deadlock and structural problems."""
    violations = structure_violations(inst, orders)
    peaks = peak_memory(inst, orders) if not violations else [0.0] * inst.problem.num_nodes
    if violations:
        return Evaluation(0.0, None, None, peaks, 0.0, [], violations)
    result = simulate(inst, orders)
    if result is None:
        stuck = _stuck_ops(inst, orders)
        return Evaluation(0.0, None, None, peaks, 0.0, stuck, [])
    makespan, start, end = result
    busy = sum(inst.duration)
    capacity = inst.problem.num_nodes * makespan
    bubble = max(0.0, 1.0 - busy / capacity) if capacity > 0 else 0.0
    return Evaluation(makespan, start, end, peaks, bubble, [], [])


def _stuck_ops(inst: Instance, orders: Orders) -> list[int]:
    """The first op of every node that can never start (the heads of the waiting cycle)."""
    done: set[int] = set()
    heads = [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for node, order in enumerate(orders):
            while heads[node] < len(order) and all(p in done for p, _ in inst.preds[order[heads[node]]]):
                done.add(order[heads[node]])
                heads[node] += 1
                progress = True
    return [order[heads[node]] for node, order in enumerate(orders) if heads[node] < len(order)]


def timing_violations(inst: Instance, orders: Orders, start: Sequence[float], end: Sequence[float]) -> list[str]:
    """Stored times that break a duration, the node order or a dependency (with latency)."""
    scale = max([1.0, *map(abs, end)])
    tol = TIME_TOLERANCE * scale
    problems = []
    for op in range(inst.num_ops):
        if abs(end[op] - start[op] - inst.duration[op]) > tol:
            problems.append(
                f"{describe(inst, op)} lasts {end[op] - start[op]:g}, its stage takes {inst.duration[op]:g}"
            )
        if start[op] < -tol:
            problems.append(f"{describe(inst, op)} starts before 0")
        for pred, lat in inst.preds[op]:
            if start[op] < end[pred] + lat - tol:
                problems.append(
                    f"dependency violated: {describe(inst, op)} starts at {start[op]:g} before "
                    f"{describe(inst, pred)} ends at {end[pred]:g}" + (f" + latency {lat:g}" if lat else "")
                )
    for node, order in enumerate(orders):
        for a, b in itertools.pairwise(order):
            if start[b] < end[a] - tol:
                problems.append(f"node {node}: {describe(inst, b)} starts before {describe(inst, a)} ends (overlap)")
    return problems

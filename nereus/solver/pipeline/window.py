"""Peak windows: a large-neighbourhood search that lowers the peak activation at a fixed makespan.

Each step picks a moment where a node holds the schedule's peak, frees the ops of every
node that start near it (on each node a run of consecutive ops), keeps every other op at
its time, and asks CP-SAT for the free ops' times that minimise the highest activation any
node holds within the freed spans. Free ops stay between their node's fixed neighbours and
meet their fixed dependencies, so the schedule stays as fast as it was (in the model's
whole time units; the real re-timing is checked and a slower result rejected). A step is
kept when it lowers the peak, or keeps it and lowers the sum of the nodes' peaks (another
high moment gone). ortools is imported only when a search runs.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from nereus.solver.pipeline.evaluate import peak_memory, simulate
from nereus.solver.pipeline.exact import MEMORY_STEPS, ceil_units, whole_units
from nereus.solver.pipeline.model import Instance
from nereus.solver.pipeline.policy import RELATIVE_EPS

Orders = list[list[int]]

#: Free ops per window: drawn between these (smaller ones rarely find a lower peak, larger
#: ones rarely solve within WINDOW_SOLVE_S; measured on the schedule benchmark's worst case).
WINDOW_OPS = (40, 120)
#: CP-SAT seconds per window.
WINDOW_SOLVE_S = 0.5


@dataclass
class WindowOutcome:
    """The search's best schedule and how it got there."""

    orders: Orders
    makespan: float
    peak: float
    windows: int
    """Windows solved."""
    kept: int
    """Windows whose schedule was kept."""


def _key(peaks: list[float]) -> tuple[float, float]:
    return max(peaks), sum(peaks)


def lower_peak(
    inst: Instance, orders: Orders, time_limit_s: float, target: float = 0.0, seed: int = 0, workers: int = 2
) -> WindowOutcome:
    """Re-solve windows around the peak for `time_limit_s`, or until the peak is at most
    `target`; the result is never slower than `orders` and never holds more."""
    from ortools.sat.python import cp_model

    began = time.perf_counter()
    rng = random.Random(seed)
    _, units = whole_units(inst)
    state = simulate(inst, orders)
    assert state is not None, "the schedule to improve runs"
    makespan = state[0]
    best = [list(o) for o in orders]
    peaks = peak_memory(inst, best)
    windows = kept = 0
    while time.perf_counter() - began < time_limit_s - 0.2 and max(peaks) > target * (1 + RELATIVE_EPS):
        timed = simulate(units, best)
        assert timed is not None
        free = _window(inst, best, timed[1], peaks, rng)
        budget = min(WINDOW_SOLVE_S, time_limit_s - (time.perf_counter() - began))
        found = _solve_window(cp_model, inst, units, best, timed, free, budget, workers)
        windows += 1
        if found is None:
            continue
        state = simulate(inst, found)
        if state is None or state[0] > makespan * (1 + RELATIVE_EPS):
            continue
        new_peaks = peak_memory(inst, found)
        if _key(new_peaks) < _key(peaks):
            best, peaks, kept = found, new_peaks, kept + 1
    final = simulate(inst, best)
    assert final is not None
    return WindowOutcome(best, final[0], max(peaks, default=0.0), windows, kept)


def _window(inst: Instance, orders: Orders, start: list[float], peaks: list[float], rng: random.Random) -> list[range]:
    """Per node, the positions of the ops to free: those starting nearest a peak moment
    (a node at the highest peak, a position where it holds it), WINDOW_OPS of them."""
    top = max(peaks)
    nodes = [n for n, p in enumerate(peaks) if p >= top * (1 - RELATIVE_EPS)]
    node = rng.choice(nodes)
    held, moments = 0.0, []
    for op in orders[node]:
        held += inst.memory_delta[op]
        if held >= top * (1 - RELATIVE_EPS):
            moments.append(start[op])
    centre = rng.choice(moments)
    size = rng.randint(*WINDOW_OPS)
    distance = sorted(abs(start[op] - centre) for order in orders for op in order)
    reach = distance[min(size, len(distance)) - 1]
    spans = []
    for order in orders:
        inside = [i for i, op in enumerate(order) if abs(start[op] - centre) <= reach]
        spans.append(range(inside[0], inside[-1] + 1) if inside else range(0))
    return spans


def _solve_window(
    cp_model: Any,
    inst: Instance,
    units: Instance,
    orders: Orders,
    timed: tuple[float, list[float], list[float]],
    spans: list[range],
    time_limit_s: float,
    workers: int,
) -> Orders | None:
    """The orders with each span re-sequenced by CP-SAT at the least activation the spans
    hold, every free op between its fixed neighbours (None when it found nothing)."""
    model, free, start, end = _window_model(cp_model, units, orders, timed, spans)
    peak = _window_memory(model, inst, units, orders, spans, free, start, end)
    if peak is None:
        return None
    model.minimize(peak)
    solver = _solver(cp_model, time_limit_s, workers)
    if solver.solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return _resequenced(solver, orders, spans, free)


def _window_model(
    cp_model: Any, units: Instance, orders: Orders, timed: tuple[float, list[float], list[float]], spans: list[range]
) -> tuple[Any, dict[int, Any], list[int], list[int]]:
    """CP-SAT model of the spans' ops: one start per free op, hinted at its time in `timed`,
    between the node's fixed neighbours (the last ones by the makespan), no overlap on a
    node, and every dependency with the fixed ops and among the free ones. Also returns the
    whole-unit start and end of every op."""
    makespan, start, end = (round(timed[0]), [round(s) for s in timed[1]], [round(e) for e in timed[2]])
    model = cp_model.CpModel()
    free: dict[int, Any] = {}
    for node, span in enumerate(spans):
        if not span:
            continue
        low = end[orders[node][span.start - 1]] if span.start else 0
        high = start[orders[node][span.stop]] if span.stop < len(orders[node]) else makespan
        intervals = []
        for i in span:
            op = orders[node][i]
            length = round(units.duration[op])
            free[op] = model.new_int_var(low, high - length, f"s{op}")
            intervals.append(model.new_fixed_size_interval_var(free[op], length, f"i{op}"))
            model.add_hint(free[op], start[op])
        model.add_no_overlap(intervals)
    for op, var in free.items():
        for pred, lat in units.preds[op]:
            if pred in free:
                model.add(var >= free[pred] + round(units.duration[pred]) + round(lat))
            else:
                model.add(var >= end[pred] + round(lat))
        for succ, lat in units.succs[op]:
            if succ not in free:
                model.add(var + round(units.duration[op]) + round(lat) <= start[succ])
    return model, free, start, end


def _solver(cp_model: Any, time_limit_s: float, workers: int) -> Any:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, time_limit_s)
    solver.parameters.num_workers = workers
    return solver


def _resequenced(solver: Any, orders: Orders, spans: list[range], free: dict[int, Any]) -> Orders:
    """`orders` with each span sorted by the solver's start times."""
    new = [list(order) for order in orders]
    for node, span in enumerate(spans):
        if span:
            block = sorted(new[node][span.start : span.stop], key=lambda op: (solver.value(free[op]), op))
            new[node][span.start : span.stop] = block
    return new


def _window_memory(
    model: Any,
    inst: Instance,
    units: Instance,
    orders: Orders,
    spans: list[range],
    free: dict[int, Any],
    start: list[int],
    end: list[int],
) -> Any:
    """The highest activation any node holds within its span, as a variable under one
    cumulative per node: what stays held across the span is a constant, each forward in the
    span holds from its start to its backward's end (or the span's end), each backward in the
    span whose forward came before holds from the span's start to its own end."""
    grows = [d for d in inst.memory_delta if d > 0]
    if not grows:
        return None
    scale = max(grows) / MEMORY_STEPS
    release = _releases(inst)
    forward_of = {b: f for f, b in release.items()}
    peak = model.new_int_var(0, MEMORY_STEPS * inst.num_ops, "peak")
    for node, span in enumerate(spans):
        if not span:
            continue
        order = orders[node]
        inside = set(order[span.start : span.stop])
        low = end[order[span.start - 1]] if span.start else 0
        high = start[order[span.stop]] if span.stop < len(order) else max(end)
        held = sum(ceil_units(inst.memory_delta[op] / scale - 1e-9) for op in order[: span.start] if op in release)
        held -= sum(ceil_units(-inst.memory_delta[op] / scale - 1e-9) for op in order[: span.start] if op in forward_of)
        intervals, demands = [], []
        for op in order[span.start : span.stop]:
            demand = ceil_units(abs(inst.memory_delta[op]) / scale - 1e-9)
            if op in release:  # a forward: held until its backward ends
                b = release[op]
                stop = free[b] + round(units.duration[b]) if b in inside else high
                intervals.append(_interval(model, free[op], stop, f"h{op}"))
            elif op in forward_of and forward_of[op] not in inside:  # held since before the span
                held -= demand
                intervals.append(_interval(model, low, free[op] + round(units.duration[op]), f"h{op}"))
            else:
                continue
            demands.append(demand)
        capacity = model.new_int_var(0, MEMORY_STEPS * inst.num_ops, f"cap{node}")
        model.add(capacity + max(held, 0) <= peak)
        if intervals:
            model.add_cumulative(intervals, demands, capacity)
    return peak


def _interval(model: Any, begin: Any, stop: Any, name: str) -> Any:
    length = model.new_int_var(0, 1 << 40, f"l{name}")
    model.add(length == stop - begin)
    return model.new_interval_var(begin, length, stop, name)


def _releases(inst: Instance) -> dict[int, int]:
    """Forward op -> the backward op that frees its activation."""
    back = {}
    for op, delta in enumerate(inst.memory_delta):
        if delta < 0:
            k = inst.keys[op]
            back[(inst.pipeline_of[op], k.microbatch, k.stage)] = op
    return {
        op: back[(inst.pipeline_of[op], inst.keys[op].microbatch, inst.keys[op].stage)]
        for op, delta in enumerate(inst.memory_delta)
        if delta > 0
    }


#: Endgame windows: free ops per try, growing while the goal is not met (ops of every node
#: that start last; what a lean schedule misses of the best makespan is how its last
#: micro-batches interleave). Each try starts from the last one's (shorter) result.
ENDGAME_OPS = (60, 120, 240, 400, 640)
#: The endgame's time unit: the longest op is this many. Its solves order no time grid, so
#: fine units cost nothing, and coarse ones hide the last gaps: at 10,000 steps
#: (`exact.TIME_STEPS`) a schedule 0.003% above the bound is already at it in whole units
#: (schedule benchmark, 65B/33B 16/8/64).
ENDGAME_TIME_STEPS = 1_000_000
#: Relative slack of the endgame's goal in those units (rounding of the durations).
ROUNDING_SLACK = 1e-6
#: CP-SAT seconds per endgame window, at most.
ENDGAME_SOLVE_S = 1.0


def meet_makespan(
    inst: Instance, orders: Orders, target: float, time_limit_s: float, workers: int = 2
) -> Orders | None:
    """`orders` with the ops that start last re-sequenced to end by `target` (`shorten`), or
    None when no window of ENDGAME_OPS gets there in `time_limit_s`.

    A lean schedule a fraction of a percent slower than the fastest one usually differs
    from a lean and as fast one only in its last micro-batches: its prefix, where the peak
    is, stays as it is. Schedule benchmark, 33B/13B 16/8/64, six lean starts 0.0035-0.17%
    slower: three reach the bound with a 400-op window in 0.4-0.9 s; asked instead for the
    least activation with every op ending by the target, CP-SAT found any solution in
    2-4 s when it found one at all."""
    found = shorten(inst, orders, target, time_limit_s, workers)
    state = simulate(inst, found)
    assert state is not None
    return found if state[0] <= target * (1 + RELATIVE_EPS) else None


def shorten(inst: Instance, orders: Orders, target: float, time_limit_s: float, workers: int = 2) -> Orders:
    """The shortest schedule found from `orders` by re-sequencing the ops that start last (on
    every node a suffix of its order, ENDGAME_OPS of them, each window from the last one's
    result) with CP-SAT, until one ends by `target` or `time_limit_s` is spent; `orders`
    itself when nothing ends earlier.

    CP-SAT minimises the window's makespan from the schedule's own times (a feasible hint,
    so its local search starts from a solution and walks down) down to `target`, where the
    solve is optimal and stops. Every result is re-timed with the real durations and kept
    only when it ends earlier."""
    from ortools.sat.python import cp_model

    began = time.perf_counter()
    unit, units = whole_units(inst, ENDGAME_TIME_STEPS)
    goal = int(target / unit * (1 + ROUNDING_SLACK))
    current = simulate(inst, orders)
    assert current is not None, "the schedule to shorten runs"
    makespan = current[0]
    for size in sorted({min(size, inst.num_ops) for size in ENDGAME_OPS}):
        left = time_limit_s - (time.perf_counter() - began)
        if makespan <= target * (1 + RELATIVE_EPS) or left <= 0.1:
            break
        timed = simulate(units, orders)
        assert timed is not None
        spans = _last_ops(orders, timed[1], size)
        found = _shorten_window(cp_model, units, orders, timed, spans, goal, min(ENDGAME_SOLVE_S, left), workers)
        if found is None:
            continue
        state = simulate(inst, found)
        if state is not None and state[0] < makespan:
            orders, makespan = found, state[0]  # the next, larger window starts from it
    return orders


def _last_ops(orders: Orders, start: list[float], size: int) -> list[range]:
    """Per node, the suffix of its order that holds its ops among the `size` that start last."""
    by_start = sorted(range(len(start)), key=lambda op: -start[op])
    position = {op: (node, i) for node, order in enumerate(orders) for i, op in enumerate(order)}
    first = [len(order) for order in orders]
    for op in by_start[:size]:
        node, i = position[op]
        first[node] = min(first[node], i)
    return [range(f, len(order)) for f, order in zip(first, orders, strict=True)]


def _shorten_window(
    cp_model: Any,
    units: Instance,
    orders: Orders,
    timed: tuple[float, list[float], list[float]],
    spans: list[range],
    goal: int,
    time_limit_s: float,
    workers: int,
) -> Orders | None:
    """The orders with each span (a suffix) re-sequenced by CP-SAT to end as early as it
    finds, no earlier than `goal` (whole units; reaching it proves the optimum, so the
    solve stops there). None when the solve found nothing, which the hint makes rare."""
    model, free, _, end = _window_model(cp_model, units, orders, timed, spans)
    fixed_end = max((end[op] for op in range(units.num_ops) if op not in free), default=0)
    makespan = model.new_int_var(min(max(goal, fixed_end), round(timed[0])), round(timed[0]), "makespan")
    for op, var in free.items():
        model.add(makespan >= var + round(units.duration[op]))
    model.add_hint(makespan, round(timed[0]))
    model.minimize(makespan)
    solver = _solver(cp_model, time_limit_s, workers)
    if solver.solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return _resequenced(solver, orders, spans, free)

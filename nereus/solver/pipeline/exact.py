"""An exact CP-SAT model of the fused-schedule problem, for small instances.

Variables: a start per op; an interval per op on its node (NoOverlap: one op at a time);
precedence with the p2p latency; for each (F, B) pair an activation interval from F's
start to B's end, and a per-node Cumulative over them bounded by the activation cap.
Lexicographic objective as in the heuristic: minimise the makespan; with the makespan
fixed at its optimum, minimise the largest per-node peak. Times are scaled to integers
(`TIME_STEPS` units for the longest op); the returned order is re-timed with the real
durations by the evaluator, so its makespan is exact for the real times. ortools is
imported only here, when the solver runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Literal

from nereus.errors import MissingDependency, NereusError
from nereus.solver.pipeline.evaluate import Evaluation, evaluate, simulate
from nereus.solver.pipeline.model import Instance

ExactStatus = Literal["optimal", "feasible", "infeasible", "unknown"]
TIME_STEPS = 10_000
MEMORY_STEPS = 10_000
#: The exact model refuses instances with more ops than this (it would not finish).
MAX_EXACT_OPS = 2_000


@dataclass
class ExactResult:
    """CP-SAT's schedule (re-timed by the evaluator), its status and bound."""

    status: ExactStatus
    """Of the makespan: "optimal" certifies that no schedule is faster."""
    memory_optimal: bool
    """The peak memory is the least among schedules with the optimal makespan."""
    makespan: float | None
    """Makespan of the returned order with the real durations."""
    bound: float | None
    """A lower bound on the optimal makespan (in real time units, less rounding slack)."""
    peak_memory: float | None
    orders: list[list[int]] | None
    evaluation: Evaluation | None
    wall_s: float
    time_limit_s: float


@dataclass
class _Scaled:
    """The CP-SAT model of an instance in whole time units, before an objective is set."""

    model: Any
    unit: float
    """Real time of one integer time unit."""
    duration: list[int]
    latency: list[list[int]]
    """Per op, the integer latency of each of its dependency edges (as in `inst.preds`)."""
    start: list[Any]
    makespan: Any
    peak: Any
    """The largest per-node activation (None when no op holds any)."""
    memory_scale: float
    """Real activation of one integer memory unit."""


def _check_size(inst: Instance) -> None:
    if inst.num_ops > MAX_EXACT_OPS:
        raise NereusError(
            f"{inst.num_ops} ops is too many for the exact pipeline model (at most {MAX_EXACT_OPS}); "
            "use fewer stages or micro-batches"
        )


def _scaled_model(inst: Instance) -> _Scaled:
    """Starts, one-at-a-time nodes, dependencies with latency, and the per-node activation."""
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise MissingDependency("the exact pipeline model", "OR-Tools", "exact") from None
    unit, duration, latency = _units(inst)
    horizon = sum(duration) + sum(lat + 1 for lats in latency for lat in lats)
    model = cp_model.CpModel()
    start = [model.new_int_var(0, horizon, f"s{op}") for op in range(inst.num_ops)]
    makespan = model.new_int_var(0, horizon, "makespan")
    by_node: dict[int, list] = {}
    for op in range(inst.num_ops):
        interval = model.new_fixed_size_interval_var(start[op], duration[op], f"i{op}")
        by_node.setdefault(inst.node[op], []).append(interval)
        model.add(makespan >= start[op] + duration[op])
        for (pred, _), lat in zip(inst.preds[op], latency[op], strict=True):
            model.add(start[op] >= start[pred] + duration[pred] + lat)
    for intervals in by_node.values():
        model.add_no_overlap(intervals)
    peak, scale = _memory(model, inst, start, duration, horizon)
    return _Scaled(model, unit, duration, latency, start, makespan, peak, scale)


def _solver(cp_model: Any, time_limit_s: float, workers: int) -> Any:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    return solver


def solve_exact(
    inst: Instance, time_limit_s: float = 10.0, workers: int = 2, *, minimise_memory: bool = True
) -> ExactResult:
    """Minimise makespan, then (with `minimise_memory`) peak memory, with CP-SAT within `time_limit_s`."""
    _check_size(inst)
    from ortools.sat.python import cp_model

    started = time.perf_counter()
    scaled = _scaled_model(inst)
    model, start, makespan, peak, unit = scaled.model, scaled.start, scaled.makespan, scaled.peak, scaled.unit
    model.minimize(makespan)
    solver = _solver(cp_model, time_limit_s, workers)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        name: ExactStatus = "infeasible" if status == cp_model.INFEASIBLE else "unknown"
        wall = time.perf_counter() - started
        return ExactResult(name, False, None, None, None, None, None, wall, time_limit_s)
    optimal = status == cp_model.OPTIMAL
    bound_units = solver.best_objective_bound
    memory_optimal = False
    starts = [solver.value(s) for s in start]
    if optimal and peak is not None and minimise_memory:
        model.add(makespan <= int(solver.objective_value))
        for op in range(inst.num_ops):
            model.add_hint(start[op], solver.value(start[op]))
        model.minimize(peak)
        solver.parameters.max_time_in_seconds = max(0.1, time_limit_s - (time.perf_counter() - started))
        second = solver.solve(model)
        memory_optimal = second == cp_model.OPTIMAL
        if second in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            starts = [solver.value(s) for s in start]
    orders = _orders(inst, starts)
    evaluation = evaluate(inst, orders)
    assert evaluation.ok, "CP-SAT's order respects every dependency"
    slack = unit * (inst.num_ops + 1)  # rounding each op to whole units moves the optimum by at most this
    return ExactResult(
        "optimal" if optimal else "feasible",
        memory_optimal,
        evaluation.makespan,
        max(0.0, bound_units * unit - slack),
        evaluation.max_peak_memory,
        orders,
        evaluation,
        time.perf_counter() - started,
        time_limit_s,
    )


@dataclass
class ExactMemory:
    """CP-SAT's least peak activation among schedules no slower than a given one."""

    status: ExactStatus
    """Of the peak: "optimal" certifies that no schedule this fast holds less."""
    peak_memory: float | None
    """Peak of CP-SAT's schedule (from its node orders)."""
    bound: float | None
    """A lower bound on that least peak (in real memory units, less rounding slack)."""
    makespan: float | None
    """Makespan of CP-SAT's schedule re-timed with the real durations."""
    orders: list[list[int]] | None
    wall_s: float


def solve_memory_at(
    inst: Instance, orders: list[list[int]], time_limit_s: float = 10.0, workers: int = 2
) -> ExactMemory:
    """Minimise the peak activation per node over schedules no slower than `orders`.

    "No slower" is judged in the model's whole time units: `orders` re-timed with the
    rounded durations gives the makespan limit, and that timing is the solver's hint, so it
    starts from a feasible schedule and never returns one holding more than `orders`.
    """
    _check_size(inst)
    from ortools.sat.python import cp_model

    started = time.perf_counter()
    scaled = _scaled_model(inst)
    if scaled.peak is None:
        return ExactMemory("optimal", 0.0, 0.0, None, None, time.perf_counter() - started)
    timed = simulate(_in_units(inst, scaled), orders)
    assert timed is not None, "the schedule to match runs"
    scaled.model.add(scaled.makespan <= round(timed[0]))
    for op in range(inst.num_ops):
        scaled.model.add_hint(scaled.start[op], round(timed[1][op]))
    scaled.model.minimize(scaled.peak)
    solver = _solver(cp_model, time_limit_s, workers)
    status = solver.solve(scaled.model)
    wall = time.perf_counter() - started
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        name: ExactStatus = "infeasible" if status == cp_model.INFEASIBLE else "unknown"
        return ExactMemory(name, None, None, None, None, wall)
    found = _orders(inst, [solver.value(s) for s in scaled.start])
    evaluation = evaluate(inst, found)
    assert evaluation.ok, "CP-SAT's order respects every dependency"
    # Demands are rounded up to whole memory units, at most one unit per in-flight activation.
    slack = scaled.memory_scale * sum(1 for d in inst.memory_delta if d > 0)
    return ExactMemory(
        "optimal" if status == cp_model.OPTIMAL else "feasible",
        evaluation.max_peak_memory,
        max(0.0, solver.best_objective_bound * scaled.memory_scale - slack),
        evaluation.makespan,
        found,
        wall,
    )


def _units(inst: Instance, steps: int = TIME_STEPS) -> tuple[float, list[int], list[list[int]]]:
    """The model's time unit (the longest op is `steps` of them), and the durations and
    edge latencies in whole units."""
    unit = max(inst.duration) / steps
    duration = [max(1, round(d / unit)) for d in inst.duration]
    latency = [[ceil_units(lat / unit) for _, lat in preds] for preds in inst.preds]
    return unit, duration, latency


def whole_units(inst: Instance, steps: int = TIME_STEPS) -> tuple[float, Instance]:
    """The model's time unit and `inst` with its whole-unit durations and latencies."""
    unit, duration, latency = _units(inst, steps)
    return unit, _with_times(inst, duration, latency)


def _in_units(inst: Instance, scaled: _Scaled) -> Instance:
    """`inst` with the model's whole-unit durations and latencies (for re-timing an order)."""
    return _with_times(inst, scaled.duration, scaled.latency)


def _with_times(inst: Instance, duration: list[int], latency: list[list[int]]) -> Instance:
    preds = [
        [(pred, float(lat)) for (pred, _), lat in zip(edges, lats, strict=True)]
        for edges, lats in zip(inst.preds, latency, strict=True)
    ]
    succs: list[list[tuple[int, float]]] = [[] for _ in range(inst.num_ops)]
    for op, edges in enumerate(preds):
        for pred, lat in edges:
            succs[pred].append((op, lat))
    return replace(inst, duration=[float(d) for d in duration], preds=preds, succs=succs)


def ceil_units(value: float) -> int:
    whole = int(value)
    return whole + (whole < value)


def _memory(model: Any, inst: Instance, start: list[Any], duration: list[int], horizon: int) -> tuple[Any, float]:
    """Activation intervals (F start .. B end) per node under a cumulative; returns the peak
    variable and the real activation of one of its units."""
    grows = [op for op in range(inst.num_ops) if inst.memory_delta[op] > 0]
    if not grows:
        return None, 1.0
    scale = max(inst.memory_delta[op] for op in grows) / MEMORY_STEPS
    release = {}
    for op in range(inst.num_ops):
        if inst.memory_delta[op] < 0:
            k = inst.keys[op]
            release[(inst.pipeline_of[op], k.microbatch, k.stage)] = op
    cap = inst.problem.activation_cap
    peak_limit = horizon if cap is None else int(cap / scale)
    peak = model.new_int_var(0, max(peak_limit, 0) + MEMORY_STEPS * inst.num_ops, "peak")
    if cap is not None:
        model.add(peak <= int(cap / scale))
    by_node: dict[int, tuple[list, list]] = {}
    for op in grows:
        k = inst.keys[op]
        free = release[(inst.pipeline_of[op], k.microbatch, k.stage)]
        length = model.new_int_var(1, horizon, f"hold{op}")
        end = model.new_int_var(0, horizon, f"free{op}")
        model.add(end == start[free] + duration[free])
        interval = model.new_interval_var(start[op], length, end, f"a{op}")
        intervals, demands = by_node.setdefault(inst.node[op], ([], []))
        intervals.append(interval)
        demands.append(max(1, ceil_units(inst.memory_delta[op] / scale - 1e-9)))
    for intervals, demands in by_node.values():
        model.add_cumulative(intervals, demands, peak)
    return peak, scale


def _orders(inst: Instance, starts: list[int]) -> list[list[int]]:
    orders: list[list[int]] = [[] for _ in range(inst.problem.num_nodes)]
    for op in sorted(range(inst.num_ops), key=lambda o: (starts[o], inst.duration[o] == 0, o)):
        orders[inst.node[op]].append(op)
    return orders

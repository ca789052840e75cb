"""Exact schedules of a transition DAG, to measure how far the list scheduler is from optimal.

Both solvers take the problem `build_transition` hands its list scheduler and choose
start times that minimise the makespan subject to

(a) precedence: a primitive starts once every primitive in its `deps` has ended
    (a schedule's GPU-ownership dependencies are the heuristic's output and are ignored);
(b) GPUs: a GPU runs at most one primitive at a time, and a primitive occupies every
    GPU in `primitive.gpus` for its whole duration (a zero-duration primitive may sit
    at the boundary of another one on its GPU, never strictly inside it);
(c) memory: on every GPU, initial bytes + allocations of started primitives - frees of
    ended primitives <= capacity at all times (allocation at start, release at end;
    events at the same instant count together, as in the list scheduler).

Unlike the list scheduler, which checks memory only when something allocates, (c) also
holds at time 0: a GPU that starts over capacity makes the problem infeasible.

`solve_cpsat` (OR-Tools CP-SAT) is exact up to a time resolution of 1e-5 of the longest
duration; `solve_scip` (SCIP, time-indexed MILP) is a coarser approximation on ~100 time
steps and never reports "optimal". Both count memory in whole units (1 byte, or the least
power of two that keeps the capacity within 2**30 units; `unit_bytes` overrides it)
rounded conservatively: allocations and initial bytes up, frees and capacity down, so
every schedule they return is feasible for the real byte counts (schedules within a few
units of the capacity may be lost). ortools and pyscipopt are optional
(`pip install 'nereus[exact]'`) and imported only when a solver is called.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Literal

from nereus.errors import MissingDependency, NereusError
from nereus.solver.transition.primitives import Primitive, Schedule

ExactStatus = Literal["optimal", "feasible", "infeasible", "unknown"]

TIME_STEPS = 100_000  # CP-SAT: the longest duration spans this many time units
MEMORY_LEVELS = 2**30  # both solvers: capacity spans at most this many memory units
SCIP_STEPS = 100  # SCIP: the reference makespan spans this many time steps by default


@dataclass
class ExactResult:
    """One solver's schedule of a transition DAG.

    `makespan_s` is the makespan of the returned schedule with the real durations
    (`starts` maps primitive id -> start in seconds). `bound_s` is a lower bound: for
    CP-SAT a valid one on the continuous optimum (its bound on the rounded problem less
    2 * len(primitives) time units, the most rounding can add; so with "optimal" it sits
    just below `makespan_s`); for SCIP only a bound on the time-indexed problem
    (durations rounded up to whole steps), not on the continuous optimum. `time_unit_s`
    is the time resolution used (CP-SAT's unit, SCIP's step), `detail` the solver's own
    words (raw status, horizon, why infeasible).
    """

    solver: str
    status: ExactStatus
    makespan_s: float | None
    bound_s: float | None
    time_limit_s: float
    wall_s: float
    starts: dict[int, float]
    time_unit_s: float = 0.0
    detail: str = ""


@dataclass
class _Instance:
    """The scheduling problem in integers: ids, durations, edges, GPUs and memory units."""

    ids: list[int]
    duration_s: dict[int, float]
    deps: dict[int, list[int]]
    gpus: dict[int, tuple[int, ...]]
    alloc: dict[int, dict[int, int]]
    free: dict[int, dict[int, int]]
    initial: dict[int, int]
    capacity: int
    unit_bytes: int
    heuristic_starts: dict[int, float] | None

    @property
    def memory_gpus(self) -> list[int]:
        """GPUs whose memory level can rise: the only ones where (c) can bind."""
        return sorted({g for j in self.ids for g in self.alloc[j]})

    def over_capacity(self) -> str:
        """Why (c) fails before anything starts, or ''."""
        for gpu, held in sorted(self.initial.items()):
            if held > self.capacity:
                over = f"{held * self.unit_bytes} bytes, over the capacity of {self.capacity * self.unit_bytes}"
                return f"GPU {gpu} already holds about {over} at the start"
        return ""


def memory_unit(capacity_bytes: float) -> int:
    """Bytes per memory unit: the least power of two that keeps capacity within 2**30 units."""
    if capacity_bytes <= MEMORY_LEVELS:
        return 1
    return int(2 ** math.ceil(math.log2(capacity_bytes / MEMORY_LEVELS)))


def _instance(
    primitives: list[Primitive],
    initial_bytes: dict[int, float],
    capacity_bytes: float,
    unit_bytes: int | None,
    schedule: Schedule | None,
) -> _Instance:
    """Integer data of the problem; allocations and initial bytes round up, frees and capacity down."""
    if unit_bytes is None:
        unit_bytes = memory_unit(capacity_bytes)
    if unit_bytes < 1:
        raise NereusError(f"unit_bytes must be a positive number of bytes, got {unit_bytes}")
    ids = [p.id for p in primitives]
    if len(set(ids)) != len(ids):
        raise NereusError("the primitives of a transition must have distinct ids")
    known = set(ids)
    for p in primitives:
        missing = [d for d in p.deps if d not in known]
        if missing:
            raise NereusError(f"primitive {p.id} depends on primitives {missing} that are not in the transition")
        if p.duration_s < 0 or not math.isfinite(p.duration_s):
            raise NereusError(f"primitive {p.id} has duration {p.duration_s} s; durations must be finite and >= 0")
    scheduled = schedule is not None and bool(primitives)
    if schedule is not None:  # a complete schedule (none left unrun by a deadlock) of these durations
        scheduled = scheduled and all(
            schedule.scheduled(p)
            and abs(schedule.end_s(p) - schedule.start_s(p) - p.duration_s) <= 1e-9 * max(1.0, p.duration_s)
            for p in primitives
        )
        scheduled = scheduled and max(schedule.end_s(p) for p in primitives) > 0
    return _Instance(
        ids=ids,
        duration_s={p.id: p.duration_s for p in primitives},
        deps={p.id: sorted(set(p.deps)) for p in primitives},
        gpus={p.id: p.gpus for p in primitives},
        alloc={p.id: {g: math.ceil(b / unit_bytes) for g, b in p.alloc.items() if b > 0} for p in primitives},
        free={p.id: {g: math.floor(b / unit_bytes) for g, b in p.free.items() if b > 0} for p in primitives},
        initial={g: math.ceil(b / unit_bytes) for g, b in initial_bytes.items()},
        capacity=math.floor(capacity_bytes / unit_bytes),
        unit_bytes=unit_bytes,
        heuristic_starts={p.id: schedule.start_s(p) for p in primitives} if scheduled and schedule else None,
    )


def _round_up(value: float, unit: float) -> int:
    """Whole units covering `value`, forgiving float noise of 1e-9 units."""
    return max(0, math.ceil(value / unit - 1e-9))


def _topological(inst: _Instance) -> list[int]:
    """Ids in dependency order; NereusError on a cycle."""
    indegree = {j: len(inst.deps[j]) for j in inst.ids}
    children: dict[int, list[int]] = {j: [] for j in inst.ids}
    for j in inst.ids:
        for d in inst.deps[j]:
            children[d].append(j)
    order = [j for j in inst.ids if indegree[j] == 0]
    for j in order:
        for c in children[j]:
            indegree[c] -= 1
            if indegree[c] == 0:
                order.append(c)
    if len(order) != len(inst.ids):
        raise NereusError("the transition's dependencies form a cycle; it has no schedule")
    return order


def _heads_tails(inst: _Instance, dur: dict[int, int]) -> tuple[dict[int, int], dict[int, int]]:
    """Earliest start (longest path in) and tail (longest path out, own duration included)."""
    order = _topological(inst)
    head = {j: 0 for j in inst.ids}
    for j in order:
        head[j] = max((head[d] + dur[d] for d in inst.deps[j]), default=0)
    tail = {j: dur[j] for j in inst.ids}
    for j in reversed(order):
        for d in inst.deps[j]:
            tail[d] = max(tail[d], dur[d] + tail[j])
    return head, tail


def _empty(solver: str, time_limit_s: float, started: float) -> ExactResult:
    return ExactResult(solver, "optimal", 0.0, 0.0, time_limit_s, time.perf_counter() - started, {})


def _infeasible(solver: str, time_limit_s: float, started: float, why: str) -> ExactResult:
    return ExactResult(solver, "infeasible", None, None, time_limit_s, time.perf_counter() - started, {}, detail=why)


def _left_shift(
    inst: _Instance, start: dict[int, float], end: dict[int, float], duration: dict[int, Any]
) -> dict[int, Any]:
    """Start times that keep a schedule's order, as early as `duration` allows.

    Whenever i ends no later than j starts in the given schedule (`start`, `end`) and the
    two are linked (a data edge, a shared GPU, or i frees memory on a GPU where j
    allocates), j starts after i ends in the result too. Every constraint only depends on
    those orders (memory events on a GPU all belong to primitives occupying it, so they
    keep their order), hence the result is feasible whenever the schedule was and the
    new durations are no longer than the ones it was built with; used to turn a grid
    schedule into real times and the heuristic's schedule into a grid one.
    """
    order = sorted(inst.ids, key=lambda j: (start[j], end[j], j))
    gpus = {j: set(inst.gpus[j]) for j in inst.ids}
    deps = {j: set(inst.deps[j]) for j in inst.ids}
    shifted: dict[int, Any] = {}
    for n, j in enumerate(order):
        earliest = 0 * duration[j]
        for i in order[:n]:
            if end[i] > start[j] + 1e-12 * max(1.0, abs(start[j])):
                continue
            if i in deps[j] or gpus[i] & gpus[j] or inst.free[i].keys() & inst.alloc[j].keys():
                earliest = max(earliest, shifted[i] + duration[i])
        shifted[j] = earliest
    return shifted


def _true_makespan(inst: _Instance, starts: dict[int, float]) -> float:
    return max((starts[j] + inst.duration_s[j] for j in inst.ids), default=0.0)


def _trivial(solver: str, inst: _Instance, time_limit_s: float, started: float) -> ExactResult | None:
    """The answer without a solver: nothing to schedule, or memory over capacity at t = 0."""
    if not inst.ids:
        return _empty(solver, time_limit_s, started)
    why = inst.over_capacity()
    return _infeasible(solver, time_limit_s, started, why) if why else None


def solve_cpsat(
    primitives: list[Primitive],
    initial_bytes: dict[int, float],
    capacity_bytes: float,
    time_limit_s: float = 10.0,
    workers: int = 1,
    *,
    hint: bool = True,
    unit_bytes: int | None = None,
    schedule: Schedule | None = None,
) -> ExactResult:
    """Minimum-makespan schedule with OR-Tools CP-SAT.

    Time is integer in units of max(duration) / 1e5 (`time_unit_s`) and durations round
    up, so a schedule found is feasible with the real durations. The returned starts keep
    CP-SAT's order but are left-shifted in continuous time with the real durations;
    `makespan_s` is their makespan. The optimum of the rounded problem is within
    2 * len(primitives) * time_unit_s of the continuous optimum (the grid schedule
    ceil(s / unit) + 2 * rank follows any continuous one), so "optimal" means optimal to
    that resolution, and `bound_s` already subtracts that margin.

    Each GPU gets an AddNoOverlap of the intervals occupying it and, when some primitive
    allocates on it, an AddReservoirConstraint of its memory level in memory units
    (`memory_unit`; initial and allocations round up, frees and capacity down). With
    `hint`, a complete `schedule` of the primitives (`build_transition`'s) seeds the
    search with the heuristic's start times. `workers` is CP-SAT's number of search workers.
    """
    started = time.perf_counter()
    try:
        from ortools.sat.python import cp_model
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependency("the CP-SAT transition solver", "OR-Tools", "exact") from exc
    inst = _instance(primitives, initial_bytes, capacity_bytes, unit_bytes, schedule)
    trivial = _trivial("cpsat", inst, time_limit_s, started)
    if trivial is not None:
        return trivial
    longest = max(inst.duration_s.values())
    unit = longest / TIME_STEPS if longest > 0 else 1.0
    dur = {j: _round_up(inst.duration_s[j], unit) for j in inst.ids}
    head, tail = _heads_tails(inst, dur)
    horizon = sum(dur.values())  # a left-justified schedule never needs more

    model = cp_model.CpModel()
    start = {j: model.new_int_var(head[j], horizon - tail[j], f"s{j}") for j in inst.ids}
    interval = {j: model.new_fixed_size_interval_var(start[j], dur[j], f"i{j}") for j in inst.ids}
    for j in inst.ids:
        for d in inst.deps[j]:
            model.add(start[j] >= start[d] + dur[d])
    on_gpu: dict[int, list[int]] = {}
    for j in inst.ids:
        for g in inst.gpus[j]:
            on_gpu.setdefault(g, []).append(j)
    for members in on_gpu.values():
        if len(members) > 1:
            model.add_no_overlap([interval[j] for j in members])
    for g in inst.memory_gpus:
        times: list[Any] = [0]
        changes = [inst.initial.get(g, 0)]
        for j in inst.ids:
            if g in inst.alloc[j]:
                times.append(start[j])
                changes.append(inst.alloc[j][g])
            if g in inst.free[j]:
                times.append(start[j] + dur[j])
                changes.append(-inst.free[j][g])
        lowest = sum(c for c in changes if c < 0)  # no lower limit: frees never exceed what is held
        model.add_reservoir_constraint(times, changes, lowest, inst.capacity)
    makespan = model.new_int_var(max(head[j] + tail[j] for j in inst.ids), horizon, "makespan")
    for j in inst.ids:
        model.add(makespan >= start[j] + dur[j])
    model.minimize(makespan)
    if hint and inst.heuristic_starts is not None:
        for j in inst.ids:
            model.add_hint(start[j], min(max(head[j], round(inst.heuristic_starts[j] / unit)), horizon - tail[j]))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = max(1, int(workers))
    solver.parameters.random_seed = 0
    code = solver.solve(model)
    names = {
        cp_model.OPTIMAL: "optimal",
        cp_model.FEASIBLE: "feasible",
        cp_model.INFEASIBLE: "infeasible",
    }
    status: ExactStatus = names.get(code, "unknown")  # type: ignore[assignment]
    if code == cp_model.MODEL_INVALID:  # pragma: no cover - a bug in this module
        raise NereusError(f"CP-SAT rejected the transition model: {model.validate()}")
    wall = time.perf_counter() - started
    detail = f"cp-sat {solver.status_name(code)}; {horizon} units of {unit:.3g} s horizon"
    if status in ("optimal", "feasible"):
        grid = {j: float(solver.value(start[j])) for j in inst.ids}
        starts = _left_shift(inst, grid, {j: grid[j] + dur[j] for j in inst.ids}, inst.duration_s)
        bound = max(0.0, solver.best_objective_bound - 2 * len(inst.ids)) * unit
        return ExactResult(
            "cpsat", status, _true_makespan(inst, starts), bound, time_limit_s, wall, starts, unit, detail
        )
    bound_s = max(0.0, solver.best_objective_bound - 2 * len(inst.ids)) * unit if status == "unknown" else None
    return ExactResult("cpsat", status, None, bound_s, time_limit_s, wall, {}, unit, detail)


def _discretised_heuristic(inst: _Instance, dur: dict[int, int]) -> dict[int, int] | None:
    """The heuristic schedule on the time grid: its order, left-shifted with grid durations."""
    if inst.heuristic_starts is None:
        return None
    s = inst.heuristic_starts
    grid = _left_shift(inst, s, {j: s[j] + inst.duration_s[j] for j in inst.ids}, dur)
    return None if _grid_violation(inst, grid, dur) else grid  # the memory rounding may break it


def _grid_violation(inst: _Instance, start: dict[int, int], dur: dict[int, int]) -> str:
    """The first constraint an integer schedule breaks, or ''."""
    for j in inst.ids:
        for d in inst.deps[j]:
            if start[j] < start[d] + dur[d]:
                return f"primitive {j} starts before its dependency {d} ends"
    on_gpu: dict[int, list[int]] = {}
    for j in inst.ids:
        for g in inst.gpus[j]:
            on_gpu.setdefault(g, []).append(j)
    for g, members in on_gpu.items():
        for a in members:
            for b in members:
                if a < b and max(start[a], start[b]) < min(start[a] + dur[a], start[b] + dur[b]):
                    return f"primitives {a} and {b} overlap on GPU {g}"
                inside = start[a] < start[b] < start[a] + dur[a]
                if a != b and dur[b] == 0 and inside:
                    return f"primitive {b} sits inside primitive {a} on GPU {g}"
    for g in inst.memory_gpus:
        events: dict[int, int] = {0: inst.initial.get(g, 0)}
        for j in inst.ids:
            if g in inst.alloc[j]:
                events[start[j]] = events.get(start[j], 0) + inst.alloc[j][g]
            if g in inst.free[j]:
                events[start[j] + dur[j]] = events.get(start[j] + dur[j], 0) - inst.free[j][g]
        level = 0
        for t in sorted(events):
            level += events[t]
            if level > inst.capacity:
                return f"GPU {g} holds {level} units at step {t}, over the capacity of {inst.capacity} units"
    return ""


def solve_scip(
    primitives: list[Primitive],
    initial_bytes: dict[int, float],
    capacity_bytes: float,
    time_limit_s: float = 10.0,
    horizon_steps: int | None = None,
    *,
    unit_bytes: int | None = None,
    schedule: Schedule | None = None,
) -> ExactResult:
    """Minimum-makespan schedule with SCIP on a time-indexed MILP (an approximation).

    Time is cut into steps: the reference makespan (the heuristic's, when `schedule` is
    a complete schedule from `build_transition`, else the larger of the critical
    path and the busiest GPU's total work) spans `horizon_steps` steps (default 100).
    Durations round UP to whole steps, so the model is the continuous problem restricted
    to a grid with padded durations; its optimum may exceed the continuous one by up to
    about one step per primitive on the critical path. Its schedule is feasible with the
    real durations; the returned starts keep its order, left-shifted in continuous time
    with the real durations (as in `solve_cpsat`), and `makespan_s` is their makespan.
    The status is therefore never "optimal": it is "feasible" when SCIP finds a schedule
    (`detail` says whether SCIP proved it optimal on the grid), and `bound_s` is SCIP's
    dual bound on the grid problem (None before it has one), not a bound on the
    continuous optimum.

    Model (step formulation): binary y[j, t] = 1 when primitive j has started by step t,
    nondecreasing in t; precedence y[j, t] <= y[d, t - dur(d)]; on each GPU at most one
    primitive runs in each step and a zero-duration one never starts while another runs
    across that boundary; each GPU's memory level (memory units, rounded as in
    `solve_cpsat`) stays within capacity at every step where something may allocate;
    minimise the makespan in steps. The horizon is long enough to hold the heuristic's
    schedule moved onto the grid (given to SCIP as a start solution) or, without one, the
    sum of the rounded durations, so "infeasible" means no schedule exists at all (up to
    the memory rounding).
    """
    started = time.perf_counter()
    try:
        import pyscipopt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependency("the SCIP transition solver", "PySCIPOpt", "exact") from exc
    inst = _instance(primitives, initial_bytes, capacity_bytes, unit_bytes, schedule)
    trivial = _trivial("scip", inst, time_limit_s, started)
    if trivial is not None:
        return trivial
    steps = int(horizon_steps) if horizon_steps is not None else SCIP_STEPS
    if steps < 1:
        raise NereusError(f"horizon_steps must be at least 1, got {horizon_steps}")
    if inst.heuristic_starts is not None:
        reference = _true_makespan(inst, inst.heuristic_starts)
    else:
        load: dict[int, float] = {}
        for j in inst.ids:
            for g in inst.gpus[j]:
                load[g] = load.get(g, 0.0) + inst.duration_s[j]
        longest_path = _critical_path_s(inst)
        reference = max(longest_path, *load.values()) if load else longest_path
    if reference <= 0:
        return ExactResult("scip", "feasible", 0.0, 0.0, time_limit_s, time.perf_counter() - started, {}, 0.0)
    step = reference / steps
    dur = {j: _round_up(inst.duration_s[j], step) for j in inst.ids}
    head, tail = _heads_tails(inst, dur)
    seed = _discretised_heuristic(inst, dur)
    # Any horizon past a feasible schedule holds an optimum; without one, a left-justified
    # schedule never needs more than every duration in a row.
    horizon = max(seed[j] + dur[j] for j in inst.ids) if seed is not None else sum(dur.values())
    horizon = max(horizon, max(head[j] + tail[j] for j in inst.ids))

    model = pyscipopt.Model("transition")
    model.hideOutput()
    model.setParam("limits/time", float(time_limit_s))
    model.setParam("randomization/randomseedshift", 0)
    first = head
    last = {j: horizon - tail[j] for j in inst.ids}
    # y[j, t] = 1 when j has started by step t; it starts at the first t where y[j, t] = 1.
    y = {(j, t): model.addVar(vtype="B", name=f"y_{j}_{t}") for j in inst.ids for t in range(first[j], last[j])}

    def by(j: int, t: int) -> Any:
        """1 when j has started by step t (a constant outside its window)."""
        if t < first[j]:
            return 0
        if t >= last[j]:
            return 1
        return y[j, t]

    start_of = {j: last[j] - pyscipopt.quicksum(y[j, t] for t in range(first[j], last[j])) for j in inst.ids}
    for j in inst.ids:
        for t in range(first[j] + 1, last[j]):
            model.addCons(y[j, t - 1] <= y[j, t], name=f"mono_{j}_{t}")
        for d in inst.deps[j]:  # started by t only if d started by t - dur[d]
            for t in range(first[j], last[j]):
                if isinstance(by(d, t - dur[d]), int):
                    continue  # d surely started by then
                model.addCons(y[j, t] <= by(d, t - dur[d]), name=f"dep_{d}_{j}_{t}")

    def running(j: int, t: int) -> Any:
        """1 when j runs during step [t, t + 1)."""
        return by(j, t) - by(j, t - dur[j])

    on_gpu: dict[int, list[int]] = {}
    for j in inst.ids:
        for g in inst.gpus[j]:
            on_gpu.setdefault(g, []).append(j)
    for g, members in on_gpu.items():
        if len(members) < 2:
            continue
        timed = [j for j in members if dur[j] > 0]
        for tau in range(horizon):  # step [tau, tau + 1): at most one primitive
            busy = [j for j in timed if first[j] <= tau < last[j] + dur[j]]
            if len(busy) > 1:
                model.addCons(pyscipopt.quicksum(running(j, tau) for j in busy) <= 1, name=f"gpu_{g}_{tau}")
        for j in (j for j in members if dur[j] == 0):  # never strictly inside another
            for t in range(first[j], last[j] + 1):
                across = [i for i in timed if dur[i] > 1 and first[i] < t < last[i] + dur[i]]
                if across:  # i started in (t - dur[i], t): it runs across the boundary t
                    starts_here = by(j, t) - by(j, t - 1)
                    inside = pyscipopt.quicksum(by(i, t - 1) - by(i, t - dur[i]) for i in across)
                    model.addCons(starts_here + inside <= 1, name=f"edge_{g}_{j}_{t}")
    for g in inst.memory_gpus:
        allocs = [j for j in inst.ids if g in inst.alloc[j]]
        frees = [j for j in inst.ids if g in inst.free[j]]
        checkpoints = sorted({t for j in allocs for t in range(first[j], last[j] + 1)})
        for t in checkpoints:  # the level only rises when something allocates
            level = pyscipopt.quicksum(inst.alloc[j][g] * by(j, t) for j in allocs)
            released = pyscipopt.quicksum(inst.free[j][g] * by(j, t - dur[j]) for j in frees)
            model.addCons(inst.initial.get(g, 0) + level - released <= inst.capacity, name=f"mem_{g}_{t}")
    makespan = model.addVar(vtype="I", lb=max(head[j] + tail[j] for j in inst.ids), ub=horizon, name="makespan")
    has_child = {d for j in inst.ids for d in inst.deps[j]}
    for j in inst.ids:
        if j not in has_child:
            model.addCons(makespan >= start_of[j] + dur[j], name=f"end_{j}")
    model.setObjective(makespan, "minimize")
    seeded = False
    if seed is not None:
        sol = model.createSol()
        for (j, t), var in y.items():
            model.setSolVal(sol, var, 1.0 if seed[j] <= t else 0.0)
        model.setSolVal(sol, makespan, float(max(seed[j] + dur[j] for j in inst.ids)))
        seeded = bool(model.addSol(sol, free=True))
    model.optimize()
    wall = time.perf_counter() - started
    raw = str(model.getStatus())
    detail = (
        f"scip {raw} on the grid; {horizon} steps of {step:.3g} s"
        + ("; seeded with the heuristic" if seeded else "")
        + (" (optimal for the grid problem only)" if raw == "optimal" else "")
    )
    if model.getNSols() > 0:
        best = model.getBestSol()
        grid = {
            j: next((t for t in range(first[j], last[j]) if model.getSolVal(best, y[j, t]) > 0.5), last[j])
            for j in inst.ids
        }
        ends = {j: float(grid[j] + dur[j]) for j in inst.ids}
        starts = _left_shift(inst, {j: float(t) for j, t in grid.items()}, ends, inst.duration_s)
        dual = model.getDualbound()
        bound = dual * step if math.isfinite(dual) and abs(dual) < 1e15 else None
        return ExactResult(
            "scip", "feasible", _true_makespan(inst, starts), bound, time_limit_s, wall, starts, step, detail
        )
    status: ExactStatus = "infeasible" if raw == "infeasible" else "unknown"
    return ExactResult("scip", status, None, None, time_limit_s, wall, {}, step, detail)


def _critical_path_s(inst: _Instance) -> float:
    """Longest dependency chain in seconds."""
    finish: dict[int, float] = {}
    for j in _topological(inst):
        finish[j] = max((finish[d] for d in inst.deps[j]), default=0.0) + inst.duration_s[j]
    return max(finish.values(), default=0.0)

"""Exact transition schedules (CP-SAT, SCIP) against the list scheduler of build_transition."""

from __future__ import annotations

import math
import sys

import pytest
from plan_helpers import relayout

from nereus.cost.calibration import Calibration
from nereus.errors import NereusError
from nereus.solver.transition import Primitive, TransitionResult, build_transition
from nereus.solver.transition.exact import ExactResult, memory_unit, solve_cpsat, solve_scip
from nereus.spec.io import load_document
from nereus.spec.plan import Plan

pytestmark = pytest.mark.logic

pytest.importorskip("ortools")

TINY = "examples/plan-tiny-ppo-4rank.yaml"
TIGHT = 6_140_000.0  # bytes per GPU: just above the least capacity of the two-stage relayout below


def _tiny() -> Plan:
    plan = load_document(TINY)
    assert isinstance(plan, Plan)
    return plan


def _with_capacity(plan: Plan, capacity: float) -> Plan:
    """The plan on GPUs whose usable memory is at least `capacity` bytes (default calibration)."""
    calibration = Calibration()
    usable = 1 - calibration.memory_headroom - calibration.workspace_fraction
    gpu = plan.cluster.gpu.model_copy(update={"memory_bytes": math.ceil(capacity / usable)})
    return plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"gpu": gpu})})


CASES = {
    "one-stage-tp4": [("actor/training", 4, 1, [[0, 1, 2, 3]])],
    "two-stages-mixed": [("actor/training", 4, 1, [[0, 1, 2, 3]]), ("critic/inference", 1, 1, [[0], [1], [2], [3]])],
    "swap-ranks": [("actor/generation", 2, 1, [[1, 0], [3, 2]]), ("critic/training", 2, 2, [[0, 1, 2, 3]])],
    "memory-bound": [("actor/generation", 4, 1, [[0, 1, 2, 3]]), ("actor/training", 1, 4, [[3, 2, 1, 0]])],
}


def _transition(
    changes: list[tuple[str, int, int, list[list[int]]]], capacity: float | None = None
) -> TransitionResult:
    plan_a = _tiny()
    if capacity is not None:
        plan_a = _with_capacity(plan_a, capacity)
    plan_b = plan_a
    for change in changes:
        plan_b = relayout(plan_b, *change)
    return build_transition(plan_a, plan_b)


def _violations(
    primitives: list[Primitive], starts: dict[int, float], initial: dict[int, float], capacity: float
) -> list[str]:
    """Every constraint a schedule breaks, checked from the primitives themselves."""
    tol = 1e-9
    by_id = {p.id: p for p in primitives}
    end = {p.id: starts[p.id] + p.duration_s for p in primitives}
    problems = []
    for p in primitives:
        problems += [f"{p.id} starts before dep {d} ends" for d in p.deps if starts[p.id] < end[d] - tol]
    for a in primitives:
        for b in primitives:
            if a.id < b.id and set(a.gpus) & set(b.gpus):
                apart = end[a.id] <= starts[b.id] + tol or end[b.id] <= starts[a.id] + tol
                if not apart:
                    problems.append(f"{a.id} and {b.id} overlap on GPUs {set(a.gpus) & set(b.gpus)}")
    gpus = {g for p in primitives for g in (*p.alloc, *p.free)}
    for g in gpus:
        events = [(starts[p.id], 1, p.alloc[g]) for p in primitives if g in p.alloc]
        events += [(end[p.id], 0, -p.free[g]) for p in primitives if g in p.free]  # frees first on ties
        level = initial.get(g, 0.0)
        for t, _, change in sorted(events):
            level += change
            if level > capacity + 1e-6:
                problems.append(f"GPU {g} holds {level} > {capacity} bytes at {t}")
    assert set(starts) == set(by_id)
    return problems


def _tolerance(result: ExactResult, primitives: list[Primitive]) -> float:
    """How far time rounding may move an optimum: two time units per primitive."""
    return 2 * len(primitives) * result.time_unit_s + 1e-9


@pytest.mark.parametrize("case", sorted(CASES))
def test_cpsat_proves_optimal_and_the_heuristic_is_never_better(case: str) -> None:
    result = _transition(CASES[case])
    assert result.feasible and result.primitives
    exact = solve_cpsat(
        result.primitives, result.initial_bytes, result.capacity_bytes, time_limit_s=10.0, schedule=result.schedule
    )
    assert exact.status == "optimal", exact.detail
    assert exact.makespan_s is not None and exact.bound_s is not None
    tol = _tolerance(exact, result.primitives)
    assert exact.bound_s <= exact.makespan_s <= exact.bound_s + tol
    assert result.makespan_s >= exact.makespan_s - tol
    assert not _violations(result.primitives, exact.starts, result.initial_bytes, result.capacity_bytes)
    assert math.isclose(exact.makespan_s, max(exact.starts[p.id] + p.duration_s for p in result.primitives))


def test_a_single_chain_is_scheduled_optimally_by_both() -> None:
    """One EMU split into four and merged into a pipeline: split -> merge, nothing to reorder."""
    plan_a = relayout(_tiny(), "critic/inference", 4, 1, [[0, 1, 2, 3]])
    plan_b = relayout(plan_a, "critic/inference", 1, 4, [[0, 1, 2, 3]])
    result = build_transition(plan_a, plan_b)
    assert [p.kind for p in result.primitives] == ["split", "merge"]
    assert result.primitives[1].deps == [result.primitives[0].id]
    exact = solve_cpsat(result.primitives, result.initial_bytes, result.capacity_bytes, schedule=result.schedule)
    chain = sum(p.duration_s for p in result.primitives)
    assert exact.status == "optimal" and exact.makespan_s is not None
    assert math.isclose(exact.makespan_s, chain, rel_tol=1e-12)
    assert math.isclose(result.makespan_s, chain, rel_tol=1e-12)


@pytest.mark.parametrize("case", ["two-stages-mixed", "memory-bound"])
def test_scip_schedule_is_feasible_and_no_better_than_the_cpsat_optimum(case: str) -> None:
    pytest.importorskip("pyscipopt")
    result = _transition(CASES[case])
    exact = solve_cpsat(result.primitives, result.initial_bytes, result.capacity_bytes, schedule=result.schedule)
    scip = solve_scip(
        result.primitives, result.initial_bytes, result.capacity_bytes, time_limit_s=10.0, schedule=result.schedule
    )
    assert scip.status == "feasible" and "optimal" in scip.detail, scip.detail  # optimal on its grid, here
    assert scip.makespan_s is not None and exact.makespan_s is not None
    assert scip.makespan_s >= exact.makespan_s - _tolerance(exact, result.primitives)
    # Durations round up to whole steps: at most one step lost per primitive.
    assert scip.makespan_s <= exact.makespan_s + len(result.primitives) * scip.time_unit_s
    assert 50 <= result.makespan_s / scip.time_unit_s <= 200
    assert not _violations(result.primitives, scip.starts, result.initial_bytes, result.capacity_bytes)


def test_scip_without_a_heuristic_schedule_still_finds_one() -> None:
    pytest.importorskip("pyscipopt")
    result = _transition(CASES["swap-ranks"])
    # No schedule given (the list schedule forgotten): SCIP must size its own horizon.
    scip = solve_scip(result.primitives, result.initial_bytes, result.capacity_bytes, horizon_steps=60)
    assert scip.status == "feasible" and scip.makespan_s is not None
    assert not _violations(result.primitives, scip.starts, result.initial_bytes, result.capacity_bytes)


def test_tight_memory_makes_the_optimum_longer() -> None:
    ample = _transition(CASES["memory-bound"])
    tight = _transition(CASES["memory-bound"], capacity=TIGHT)
    assert tight.capacity_bytes < ample.capacity_bytes / 100
    free = solve_cpsat(ample.primitives, ample.initial_bytes, ample.capacity_bytes, schedule=ample.schedule)
    bound = solve_cpsat(tight.primitives, tight.initial_bytes, tight.capacity_bytes, schedule=tight.schedule)
    assert free.status == bound.status == "optimal"
    assert free.makespan_s is not None and bound.makespan_s is not None
    assert bound.makespan_s > free.makespan_s + 0.05  # at least half a communicator set-up later
    assert not _violations(tight.primitives, bound.starts, tight.initial_bytes, tight.capacity_bytes)
    assert _violations(tight.primitives, free.starts, tight.initial_bytes, tight.capacity_bytes)
    if tight.feasible:  # the heuristic respects the same memory, so it cannot beat the optimum
        assert tight.makespan_s >= bound.makespan_s - _tolerance(bound, tight.primitives)
    too_tight = solve_cpsat(
        tight.primitives, tight.initial_bytes, max(tight.initial_bytes.values()) + 1.0, schedule=tight.schedule
    )
    assert too_tight.status == "infeasible" and too_tight.makespan_s is None


def _prim(
    pid: int,
    gpus: tuple[int, ...],
    duration: float,
    alloc: dict[int, float] | None = None,
    free: dict[int, float] | None = None,
    deps: list[int] | None = None,
) -> Primitive:
    primitive = Primitive(
        id=pid,
        kind="extend",
        model_stage="x/inference",
        source_layout=(1, 1),
        target_layout=(1, 1),
        reads=gpus,
        writes=gpus,
        alloc=alloc or {},
        free=free or {},
        transfers=(),
        deps=deps or [],
        duration_s=duration,
    )
    return primitive


def _serialising_dag() -> list[Primitive]:
    """X allocates on GPU 0 then feeds W (5 s); Y frees GPU 0 only after Z (5 s) ends."""
    return [
        _prim(0, (0,), 1.0, alloc={0: 10.0}),  # X
        _prim(1, (2,), 5.0, deps=[0]),  # W
        _prim(2, (1,), 5.0),  # Z
        _prim(3, (0,), 1.0, free={0: 10.0}, deps=[2]),  # Y
    ]


@pytest.mark.parametrize(("capacity", "makespan"), [(20.0, 6.0), (10.0, 12.0)])
def test_memory_serialises_a_synthetic_dag(capacity: float, makespan: float) -> None:
    dag = _serialising_dag()
    exact = solve_cpsat(dag, {0: 10.0}, capacity)
    assert exact.status == "optimal" and exact.makespan_s is not None
    assert math.isclose(exact.makespan_s, makespan, rel_tol=1e-9)
    assert not _violations(dag, exact.starts, {0: 10.0}, capacity)
    pytest.importorskip("pyscipopt")
    scip = solve_scip(dag, {0: 10.0}, capacity, horizon_steps=12)
    assert scip.status == "feasible" and scip.makespan_s is not None
    assert math.isclose(scip.makespan_s, makespan, rel_tol=1e-9)
    assert not _violations(dag, scip.starts, {0: 10.0}, capacity)


def test_edge_cases() -> None:
    empty = solve_cpsat([], {}, 1.0)
    assert empty.status == "optimal" and empty.makespan_s == 0.0 and empty.starts == {}
    over = solve_cpsat([_prim(0, (0,), 1.0)], {0: 20.0}, 10.0)
    assert over.status == "infeasible" and "GPU 0" in over.detail
    with pytest.raises(NereusError, match="not in the transition"):
        solve_cpsat([_prim(0, (0,), 1.0, deps=[7])], {}, 10.0)
    with pytest.raises(NereusError, match="cycle"):
        solve_cpsat([_prim(0, (0,), 1.0, deps=[1]), _prim(1, (1,), 1.0, deps=[0])], {}, 10.0)
    assert memory_unit(2.0**30) == 1 and memory_unit(80 * 2.0**30) == 128


def test_missing_solvers_raise_a_nereus_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    monkeypatch.setitem(sys.modules, "pyscipopt", None)
    with pytest.raises(NereusError, match="OR-Tools"):
        solve_cpsat([_prim(0, (0,), 1.0)], {}, 10.0)
    with pytest.raises(NereusError, match="PySCIPOpt"):
        solve_scip([_prim(0, (0,), 1.0)], {}, 10.0)

"""The schedulers behind build_transition beyond list scheduling: the serial generator,
the local search over orders and the exhaustive order search, each checked by the
independent replay checker and, where small enough, against CP-SAT."""

from __future__ import annotations

import dataclasses
import random
import sys

import pytest
from repo_paths import BENCHMARKS, DATA

from nereus.solver.transition import build_transition
from nereus.solver.transition.check import check_result
from nereus.solver.transition.order_search import OrderSearch
from nereus.solver.transition.primitives import Primitive, Schedule
from nereus.solver.transition.schedule import makespan_lower_bound, priority_rules
from nereus.solver.transition.serial import improve_order, pilot_order, schedule_in_order, serial_schedule
from nereus.spec.io import load_document
from nereus.spec.plan import Plan

pytestmark = pytest.mark.logic

DATA = DATA


def _pair(name: str) -> tuple[Plan, Plan]:
    plan_a = load_document(DATA / f"{name}-a.yaml", check=False)
    plan_b = load_document(DATA / f"{name}-b.yaml", check=False)
    assert isinstance(plan_a, Plan) and isinstance(plan_b, Plan)
    return plan_a, plan_b


def _prim(pid: int, gpus: tuple[int, ...], duration: float, deps: list[int], alloc: float = 0.0) -> Primitive:
    return Primitive(
        id=pid,
        kind="extend",
        model_stage=f"m{pid}/inference",
        source_layout=(1, 1),
        target_layout=(1, 1),
        reads=gpus,
        writes=gpus,
        alloc=dict.fromkeys(gpus, alloc) if alloc else {},
        free={},
        transfers=(),
        deps=deps,
        duration_s=duration,
    )


def test_serial_generator_fills_a_gap_before_an_earlier_placement() -> None:
    """The chain is placed first (GPU 0 from t=1); the short job, placed after it, still
    goes into the free second of GPU 0 before the chain arrives."""
    prims = [
        _prim(0, (1,), 1.0, []),  # the chain's head, on GPU 1
        _prim(1, (0,), 5.0, [0]),  # the chain's long tail needs GPU 0 at t=1
        _prim(2, (0,), 1.0, []),  # a short job on GPU 0, ready at t=0
    ]
    rank = {0: 0, 1: 1, 2: 2}
    placed = serial_schedule(prims, {}, 1.0, lambda p: (rank[p.id],))
    assert placed is not None
    times = placed[0]
    assert times.start_s(prims[1]) == pytest.approx(1.0) and times.start_s(prims[2]) == pytest.approx(0.0)
    assert max(times.end_s(p) for p in prims) == pytest.approx(6.0)


def test_serial_generator_respects_memory_at_every_later_moment() -> None:
    """An allocation placed early must not overflow memory that later allocations use."""
    prims = [_prim(0, (0,), 1.0, [], alloc=6.0), _prim(1, (1,), 1.0, [], alloc=6.0)]
    prims[1] = prims[1]._replace(reads=(1,), writes=(1,), alloc={0: 6.0})  # both allocate on GPU 0: only one fits
    assert serial_schedule(prims, {}, 10.0, lambda p: (p.id,)) is None


def test_order_search_finds_an_order_every_priority_rule_misses() -> None:
    """Coordination pair (busiest-GPU capacity, seed 266): every list-scheduling rule, the
    serial generator and whole model-stages one after another deadlock; the exhaustive
    search finds an order, the serial generator packs it and the checker accepts it."""
    from nereus.solver.transition.schedule import Replay, _one_model_stage_at_a_time, list_schedule

    plan_a, plan_b = _pair("order-search")
    result = build_transition(plan_a, plan_b)
    assert result.feasible and result.priority_rule == "order search"
    assert check_result(result, plan_a, plan_b) == []
    prims, initial, capacity = result.primitives, result.initial_bytes, result.capacity_bytes
    for rule in priority_rules(prims).values():
        assert list_schedule(prims, Replay(dict(initial), capacity), rule, explain=False)
        assert serial_schedule(prims, initial, capacity, rule) is None
    assert _one_model_stage_at_a_time(prims, initial, capacity) is None


def test_an_order_that_fits_one_at_a_time_always_packs() -> None:
    plan_a, plan_b = _pair("order-search")
    result = build_transition(plan_a, plan_b)
    found = OrderSearch(result.primitives, result.initial_bytes, result.capacity_bytes).run(100, 3000)
    assert isinstance(found, list) and sorted(found) == sorted(p.id for p in result.primitives)
    placed = schedule_in_order(result.primitives, result.initial_bytes, result.capacity_bytes, found)
    assert placed is not None
    assert check_result(dataclasses.replace(result, schedule=placed[0]), plan_a, plan_b) == []


def test_a_pair_with_no_safe_order_is_reported_as_proved_infeasible() -> None:
    plan_a, plan_b = _pair("no-order")
    result = build_transition(plan_a, plan_b)
    assert not result.feasible
    assert result.blocking_cycle[-1] == "no order of these primitives fits in memory (exhaustive search)"
    assert OrderSearch(result.primitives, result.initial_bytes, result.capacity_bytes).run(100, 3000) == "infeasible"


def test_local_search_never_lengthens_and_stays_valid() -> None:
    plan_a, plan_b = _pair("order-search")
    result = build_transition(plan_a, plan_b)
    prims, initial, capacity = result.primitives, result.initial_bytes, result.capacity_bytes
    times = result.schedule
    order = [
        p.id for p in sorted(prims, key=lambda p: (times.start_s(p), 0 if p.releases else 1, times.end_s(p), p.id))
    ]

    def evaluate(candidate: list[int]) -> Schedule | None:
        placed = schedule_in_order(prims, initial, capacity, candidate)
        return None if placed is None else placed[0]

    def span(candidate: list[int]) -> float | None:
        schedule = evaluate(candidate)
        return None if schedule is None else max(schedule.end_s(p) for p in prims)

    found = improve_order(prims, evaluate, order, result.makespan_s, 30, 0, makespan_lower_bound(prims))
    if found is not None:
        assert found[1] < result.makespan_s
        assert span(found[0]) == pytest.approx(found[1])
        result = dataclasses.replace(result, schedule=evaluate(found[0]))
        assert check_result(result, plan_a, plan_b) == []


@pytest.mark.parametrize("name", ["gap-25", "gap-79", "order-search", "sequential-fallback"])
def test_the_pilot_order_is_at_least_as_good_as_its_priority_alone_and_replays_exactly(name: str) -> None:
    plan_a, plan_b = _pair(name)
    result = build_transition(plan_a, plan_b)
    prims, initial, capacity = result.primitives, result.initial_bytes, result.capacity_bytes
    rule = priority_rules(prims)["release-then-critical-path"]
    alone = serial_schedule(prims, initial, capacity, rule)
    alone_span = max(alone[0].end_s(p) for p in prims) if alone is not None else None
    found = pilot_order(prims, initial, capacity, rule)
    if alone_span is not None:  # its first step's pilot run under the rule's own pick is that schedule
        assert found is not None and found[0] <= alone_span + 1e-12
    if found is not None:
        assert sorted(found[1]) == sorted(p.id for p in prims)
        placed = schedule_in_order(prims, initial, capacity, found[1])
        assert placed is not None
        assert max(placed[0].end_s(p) for p in prims) == pytest.approx(found[0], abs=1e-12)
        assert check_result(dataclasses.replace(result, schedule=placed[0]), plan_a, plan_b) == []


def test_every_rule_under_the_serial_generator_is_valid_or_reports_deadlock() -> None:
    plan_a, plan_b = _pair("sequential-fallback")
    result = build_transition(plan_a, plan_b)
    for rule in priority_rules(result.primitives).values():
        placed = serial_schedule(result.primitives, result.initial_bytes, result.capacity_bytes, rule)
        if placed is not None:
            assert check_result(dataclasses.replace(result, schedule=placed[0]), plan_a, plan_b) == []


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(24))
def test_pairs_with_a_known_safe_order_are_always_scheduled(seed: int) -> None:
    """Memory just above what a one-at-a-time witness needs: a safe order exists, so the
    global DAG must find one, and the checker must accept it (the coordination benchmark
    runs 1,000 of these)."""
    sys.path.insert(0, str(BENCHMARKS))
    from random_plans import random_setting, random_stages, with_capacity
    from transition_coordination import witness_peak

    rng = random.Random(seed)
    setting = random_setting(rng)
    plan_a, plan_b = random_stages(rng, setting), random_stages(rng, setting)
    capacity = rng.uniform(1.0, 1.1) * witness_peak(rng, plan_a, plan_b)
    plan_a, plan_b = with_capacity(plan_a, capacity), with_capacity(plan_b, capacity)
    result = build_transition(plan_a, plan_b)
    assert result.feasible, result.blocking_cycle
    assert check_result(result, plan_a, plan_b) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gap-20", "gap-25", "gap-28", "gap-35", "gap-65", "gap-77", "gap-79"])
def test_former_outliers_are_within_five_percent_of_the_cpsat_optimum(name: str) -> None:
    """Instances of benchmarks/transition_gap.py where list scheduling alone was 10-22% above
    the proved optimum; the serial generator and the local search close the gap, and on
    gap-25, gap-65, gap-77 and gap-79 (memory-tight; 7-29% above with them alone) the
    pilot method does."""
    from nereus.solver.transition.exact import solve_cpsat

    plan_a, plan_b = _pair(name)
    result = build_transition(plan_a, plan_b)
    assert result.feasible and check_result(result, plan_a, plan_b) == []
    exact = solve_cpsat(
        result.primitives, result.initial_bytes, result.capacity_bytes, time_limit_s=20.0, schedule=result.schedule
    )
    assert exact.status in ("optimal", "feasible") and exact.makespan_s is not None and exact.bound_s is not None
    if exact.status == "optimal":  # the heuristic never beats a proven optimum
        assert exact.makespan_s <= result.makespan_s * (1 + 1e-9)
    bound = max(exact.bound_s, makespan_lower_bound(result.primitives))
    best_known = min(exact.makespan_s, result.makespan_s)
    assert result.makespan_s <= 1.05 * (best_known if exact.status == "optimal" else bound)

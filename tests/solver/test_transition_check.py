"""The transition checker: it passes scheduled DAGs, catches injected faults, and holds on random plan pairs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from random_plans import BASE, CUSTOM, Layouts, random_setting, random_stages, relayout_stages, with_capacity

from nereus.cost.calibration import Calibration
from nereus.cost.plan_cost import replica_state_bytes
from nereus.solver.plan_search import PlanRequest
from nereus.solver.planner import make_plan
from nereus.solver.transition import Emu, Primitive, Schedule, build_transition, local_dag, plan_emus, priced
from nereus.solver.transition.check import check_result, check_transition
from nereus.solver.transition.schedule import (
    Replay,
    TransitionResult,
    held_bytes,
    list_schedule,
    lower_bound_bytes,
)
from nereus.spec.plan import Plan, StagePlan
from nereus.spec.presets import MODELS

pytestmark = pytest.mark.logic


HAND_CASES: dict[str, Layouts] = {
    "merge tp2x2 -> tp4": {"actor/training": (4, 1, [[0, 1, 2, 3]])},
    "split to dp4": {"critic/inference": (1, 1, [[0], [1], [2], [3]])},
    "pp4 reversed": {"actor/training": (1, 4, [[3, 2, 1, 0]]), "critic/training": (2, 2, [[0, 1, 2, 3]])},
    "swap tp ranks": {"reward/inference": (2, 1, [[1, 0], [3, 2]])},
    "move to new GPUs": {"actor/generation": (2, 1, [[3, 1]]), "reference/inference": (1, 1, [[1], [3]])},
    "every stage": {e.model_stage: (1, 2, [[1, 3], [0, 2]]) for e in BASE.stages},
}


def _hand(name: str) -> tuple[Plan, TransitionResult]:
    plan_b = relayout_stages(BASE, HAND_CASES[name])
    return plan_b, build_transition(BASE, plan_b)


@pytest.mark.parametrize("name", sorted(HAND_CASES))
def test_checker_passes_scheduled_hand_cases(name: str) -> None:
    plan_b, result = _hand(name)
    assert result.feasible and result.primitives
    assert check_result(result, BASE, plan_b) == []
    assert check_result(build_transition(plan_b, BASE), plan_b, BASE) == []


@pytest.mark.parametrize(("gpus_a", "gpus_b"), [(8, 4), (4, 8), (8, 6), (6, 8)])
def test_checker_passes_pool_changes_between_searched_plans(gpus_a: int, gpus_b: int) -> None:
    cluster = BASE.cluster.model_copy(update={"num_nodes": 2})

    def plan(gpus: int) -> Plan:
        return make_plan(PlanRequest(cluster, tuple(BASE.models), BASE.workload, gpus)).best

    plan_a, plan_b = plan(gpus_a), plan(gpus_b)
    result = build_transition(plan_a, plan_b)
    assert result.feasible and result.primitives
    assert check_result(result, plan_a, plan_b) == []


def test_identical_plans_pass_and_a_missing_transition_does_not() -> None:
    assert check_result(build_transition(BASE, BASE), BASE, BASE) == []
    plan_b, result = _hand("merge tp2x2 -> tp4")
    emus_a, emus_b = plan_emus(BASE), plan_emus(plan_b)
    violations = check_transition([], Schedule(), emus_a, emus_b, result.initial_bytes, result.capacity_bytes)
    assert violations == [
        "actor/training ends with replicas ['tp1pp2[0, 1]', 'tp1pp2[2, 3]'] that B lacks and without B's "
        "['tp4pp1[0, 1, 2, 3]']"
    ]


# --- injected faults -------------------------------------------------------------------------------


def _faulty(name: str) -> tuple[Plan, list[Primitive], Schedule, TransitionResult]:
    """A hand case's primitives and a copy of its schedule to inject faults into."""
    plan_b, result = _hand(name)
    times = result.schedule
    copy = Schedule(dict(times.start), dict(times.end), {pid: list(deps) for pid, deps in times.ownership.items()})
    return plan_b, list(result.primitives), copy, result


def _check(
    primitives: list[Primitive], times: Schedule, plan_b: Plan, result: TransitionResult, capacity: float = 0.0
) -> list[str]:
    emus_a, emus_b = plan_emus(BASE), plan_emus(plan_b)
    return check_transition(primitives, times, emus_a, emus_b, result.initial_bytes, capacity or result.capacity_bytes)


def test_catches_two_primitives_on_one_gpu_at_once() -> None:
    plan_b, prims, times, result = _faulty("every stage")
    first, later = next(
        (p, q)
        for p in prims
        for q in prims
        if times.start_s(q) >= times.end_s(p) and set(p.gpus) & set(q.gpus) and p.duration_s > 0 and q.duration_s > 0
    )
    times.start[later.id], times.end[later.id] = times.start_s(first), times.start_s(first) + later.duration_s
    assert any(v.startswith("GPU ") and "runs primitive" in v for v in _check(prims, times, plan_b, result))


def test_catches_a_dependent_started_before_its_dependency_ends() -> None:
    plan_b, prims, times, result = _faulty("merge tp2x2 -> tp4")
    merge = next(p for p in prims if p.kind == "merge")
    times.start[merge.id] -= 0.05
    violations = _check(prims, times, plan_b, result)
    assert any(f"primitive {merge.id} (merge, actor/training) starts" in v for v in violations)


def test_catches_an_ownership_dependency_broken() -> None:
    plan_b, prims, times, result = _faulty("every stage")
    child = min(prims, key=times.start_s)
    parent = max(prims, key=times.end_s)
    times.ownership.setdefault(child.id, []).append(parent.id)
    assert any(f"ownership dependency {parent.id} ends" in v for v in _check(prims, times, plan_b, result))


def _move_critic() -> tuple[list[Primitive], dict[str, list[Emu]], dict[str, list[Emu]], dict[int, float]]:
    """A tp2 critic replica copied from GPUs 0, 1 to GPUs 2, 3: an Extend, then a Destroy."""
    a = {"critic/inference": [Emu("critic/inference", 2, 1, (0, 1))]}
    b = {"critic/inference": [Emu("critic/inference", 2, 1, (2, 3))]}
    prims = local_dag("critic/inference", 100.0, a["critic/inference"], b["critic/inference"])
    assert [p.kind for p in prims] == ["extend", "destroy"]
    return priced(prims, [1.0] * len(prims)), a, b, {0: 50.0, 1: 50.0}


def test_catches_a_dropped_dependency_through_the_replicas() -> None:
    """Without its edge to the copy, the old replica is destroyed first (releases go first)."""
    prims, a, b, initial = _move_critic()
    replay = Replay(dict(initial), 1000.0)
    assert list_schedule(prims, replay) == []
    assert check_transition(prims, replay.schedule(), a, b, initial, 1000.0) == []
    prims, a, b, initial = _move_critic()
    prims[1] = prims[1]._replace(deps=[])
    replay = Replay(dict(initial), 1000.0)
    assert list_schedule(prims, replay) == []
    violations = check_transition(prims, replay.schedule(), a, b, initial, 1000.0)
    assert violations == [
        "critic/inference has no complete replica from 0s (after primitive 1)",
        "primitive 0 (extend, critic/inference) copies from replica tp2pp1[0, 1], which is not a complete copy "
        "from 1s to 2s",
    ]


def test_ends_within_the_schedulers_tolerance_count_as_before_a_start() -> None:
    """The scheduler finishes everything ending within 1e-9 s of `now` before starting more."""
    prims, a, b, initial = _move_critic()
    replay = Replay(dict(initial), 1000.0)
    assert list_schedule(prims, replay) == []
    times = replay.schedule()
    times.end[prims[0].id] += 5e-10  # the copy ends a hair after the destroy that waits for it starts
    assert check_transition(prims, times, a, b, initial, 1000.0) == []


def test_catches_a_replica_dropped_twice_and_memory_freed_twice() -> None:
    prims, a, b, initial = _move_critic()
    replay = Replay(dict(initial), 1000.0)
    assert list_schedule(prims, replay) == []
    times = replay.schedule()
    prims.append(prims[1]._replace(id=2, deps=[1]))
    times.start[2], times.end[2] = times.start[1], times.end[1]  # the copy keeps the original's times
    violations = check_transition(prims, times, a, b, initial, 1000.0)
    assert "primitive 2 drops critic/inference replica tp2pp1[0, 1], which it does not hold" in violations
    assert any(v.startswith("GPU 0 frees more than it holds when primitive 2 ends") for v in violations)


def test_catches_a_shrunk_capacity() -> None:
    plan_b, prims, times, result = _faulty("every stage")
    tight = max(result.initial_bytes.values()) + 1.0  # every GPU starts with the same bytes here
    assert len(set(result.initial_bytes.values())) == 1
    violations = _check(prims, times, plan_b, result, capacity=tight)
    assert violations and all("> capacity" in v for v in violations)


def test_catches_a_missing_final_merge() -> None:
    plan_b, prims, times, result = _faulty("merge tp2x2 -> tp4")
    prims = [p for p in prims if p.kind != "merge"]
    violations = _check(prims, times, plan_b, result)
    assert len(violations) == 1 and violations[0].startswith("actor/training ends with replicas")


def test_catches_the_only_replica_destroyed_first() -> None:
    plan_b, prims, times, result = _faulty("move to new GPUs")
    extend = next(p for p in prims if p.kind == "extend" and p.model_stage == "actor/generation")
    destroy = next(p for p in prims if p.kind == "destroy" and extend.id in p.deps)
    times.start[destroy.id] = times.end[destroy.id] = times.start_s(extend)
    violations = _check(prims, times, plan_b, result)
    assert (
        f"actor/generation has no complete replica from {times.start_s(extend):.6g}s (after primitive {destroy.id})"
        in (violations)
    )


# --- random plan pairs -----------------------------------------------------------------------------


def max_held(plan: Plan) -> float:
    sizes: dict[str, float] = {
        e.model_stage: replica_state_bytes(plan, e.model_stage, Calibration()) for e in plan.stages
    }
    return max(held_bytes(plan, sizes).values())


def random_pair(rng: random.Random) -> tuple[Plan, Plan]:
    """Two random plans for one setting; one in twenty has memory for 1-1.5x the fuller plan's busiest GPU."""
    setting = random_setting(rng)
    plan_a = random_stages(rng, setting)
    plan_b = random_stages(rng, setting)
    kept = [e for e in plan_a.stages if rng.random() < 0.2]  # model-stages that keep their layout
    plan_b = relayout_stages(plan_b, {e.model_stage: (e.tp, e.pp, e.emus) for e in kept})
    if rng.random() < 0.05:
        capacity = rng.uniform(1.0, 1.5) * max(max_held(plan_a), max_held(plan_b))
        return with_capacity(plan_a, capacity), with_capacity(plan_b, capacity)
    return plan_a, plan_b


def _assert_sound(plan_a: Plan, plan_b: Plan) -> TransitionResult:
    result = build_transition(plan_a, plan_b)
    if not result.feasible:
        assert result.blocking_cycle
        return result
    assert check_result(result, plan_a, plan_b) == []
    assert result.bytes_moved >= result.lower_bound_bytes - 1e-6
    return result


def digest(result: TransitionResult) -> str:
    """A hash of every outcome of a transition (floats by their exact repr): the DAG, the
    schedule, makespan, bytes, peaks, feasibility, blocking cycle and rule."""
    schedule = result.schedule
    fields = (
        result.feasible,
        result.blocking_cycle,
        result.priority_rule,
        result.makespan_s,
        result.bytes_moved,
        sorted(result.bytes_by_link.items()),
        result.lower_bound_bytes,
        sorted(result.peak_extra_bytes.items()),
        result.capacity_bytes,
        result.engine_ready_s,
        sorted(schedule.start.items()),
        sorted(schedule.end.items()),
        sorted((pid, list(deps)) for pid, deps in schedule.ownership.items()),
        [tuple(p) for p in result.primitives],
    )
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:20]


#: `digest` of `build_transition` on the sweep's pairs, recorded by the scheduler before it was
#: made faster (commit fd6d28d; benchmarks/transition_schedule_speed.py digests --seeds 0:200):
#: the polish (serial generator, local search, pilot runs) must give exactly the same outcomes.
SWEEP_DIGESTS = Path(__file__).with_name("transition_sweep_digests.json")


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False))
def test_random_plan_pairs_are_valid_or_report_a_blocking_cycle(rng: random.Random) -> None:
    plan_a, plan_b = random_pair(rng)
    _assert_sound(plan_a, plan_b)


def _placement(entry: StagePlan) -> tuple[int, int, list[list[int]]]:
    return entry.tp, entry.pp, entry.emus


def _lower_bound_by_boxes(plan_a: Plan, plan_b: Plan) -> float:
    """Per B GPU of each changed model-stage: the exact area of its box that its A box
    (if any) does not cover, times the state's bytes. GPU `s * tp + r` of an EMU holds box (s, r)."""

    def boxes(entry: StagePlan) -> dict[int, tuple[Fraction, Fraction, Fraction, Fraction]]:
        out = {}
        for emu in entry.emus:
            for index, gpu in enumerate(emu):
                s, r = divmod(index, entry.tp)
                out[gpu] = (
                    Fraction(s, entry.pp),
                    Fraction(s + 1, entry.pp),
                    Fraction(r, entry.tp),
                    Fraction(r + 1, entry.tp),
                )
        return out

    total = 0.0
    for entry_b in plan_b.stages:
        entry_a = plan_a.stage_plan(entry_b.model_stage)
        if _placement(entry_a) == _placement(entry_b):
            continue
        held, needed = boxes(entry_a), boxes(entry_b)
        missing = Fraction(0)
        for gpu, (top, bottom, left, right) in needed.items():
            missing += (bottom - top) * (right - left)
            if gpu in held:
                a_top, a_bottom, a_left, a_right = held[gpu]
                rows = max(Fraction(0), min(bottom, a_bottom) - max(top, a_top))
                missing -= rows * max(Fraction(0), min(right, a_right) - max(left, a_left))
        total += replica_state_bytes(plan_b, entry_b.model_stage, Calibration()) * float(missing)
    return total


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False))
def test_lower_bound_is_the_box_area_each_gpu_lacks(rng: random.Random) -> None:
    plan_a, plan_b = random_pair(rng)
    changed: list[str] = [
        b.model_stage for b in plan_b.stages if _placement(b) != _placement(plan_a.stage_plan(b.model_stage))
    ]
    sizes: dict[str, float] = {
        e.model_stage: replica_state_bytes(plan_b, e.model_stage, Calibration()) for e in plan_b.stages
    }
    expected = _lower_bound_by_boxes(plan_a, plan_b)
    assert math.isclose(lower_bound_bytes(plan_a, plan_b, changed, sizes), expected, rel_tol=1e-9, abs_tol=1e-6)


@pytest.mark.slow
def test_seeded_sweep_of_200_pairs_is_mostly_feasible_and_always_valid_and_unchanged() -> None:
    recorded = json.loads(SWEEP_DIGESTS.read_text(encoding="utf-8"))["digests"]
    results = {seed: _assert_sound(*random_pair(random.Random(seed))) for seed in range(200)}
    assert sum(result.feasible for result in results.values()) >= 180
    changed = [seed for seed, result in results.items() if digest(result) != recorded[str(seed)]]
    assert changed == [], f"these seeds' transitions differ from the recorded ones: {changed}"


# --- a hold-and-wait trap for greedy list scheduling -------------------------------------------------


def _hold_and_wait_pair() -> tuple[Plan, Plan]:
    """Found by benchmarks/transition_coordination.py (seed 597), cut down to three model-stages.

    Under the release-first rule alone, actor/training copies onto GPU 2 and
    actor/inference onto GPU 1; then each needs the room the other took: a deadlock,
    though running one model-stage at a time fits.
    """
    six, odd = CUSTOM
    gpu = BASE.cluster.gpu.model_copy(update={"memory_bytes": 17_709_140})
    workload = BASE.workload.model_copy(update={"actor": "six", "critic": "odd", "reference": "tiny", "reward": "odd"})
    setting = BASE.model_copy(
        update={
            "cluster": BASE.cluster.model_copy(update={"gpu": gpu}),
            "models": [six, odd, MODELS["tiny"]],
            "workload": workload,
        }
    )
    a: Layouts = {
        "actor/generation": (1, 3, [[3, 1, 2]]),
        "actor/inference": (2, 1, [[3, 0]]),
        "reference/inference": (2, 2, [[2, 3, 0, 1]]),
        "reward/inference": (1, 1, [[2], [1]]),
        "critic/inference": (4, 1, [[3, 2, 0, 1]]),
        "actor/training": (1, 1, [[3]]),
        "critic/training": (1, 1, [[2], [0], [1]]),
    }
    b = a | {
        "actor/inference": (1, 3, [[0, 1, 2]]),
        "actor/training": (1, 3, [[2, 3, 1]]),
        "critic/training": (1, 3, [[0, 2, 1]]),
    }
    return relayout_stages(setting, a), relayout_stages(setting, b)


def test_hold_and_wait_pair_has_a_safe_order() -> None:
    """One model-stage at a time is safe; whatever the scheduler returns must be too."""
    plan_a, plan_b = _hold_and_wait_pair()
    result = build_transition(plan_a, plan_b)
    assert result.feasible or result.blocking_cycle
    if result.feasible:
        assert check_result(result, plan_a, plan_b) == []
    order = ["critic/training", "actor/training", "actor/inference"]
    now, start, end = 0.0, {}, {}
    for p in sorted(result.primitives, key=lambda p: (order.index(p.model_stage), p.id)):
        start[p.id], end[p.id] = now, now + p.duration_s
        now = end[p.id]
    result = dataclasses.replace(result, schedule=Schedule(start, end))
    assert check_result(result, plan_a, plan_b) == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False))
def test_colocated_twins_share_arrays_without_changing_bytes_or_bounds(rng: random.Random) -> None:
    """A model-stage placed exactly as another one in both plans (colocated inference):
    held bytes, the lower bound and the built DAG are what each model-stage gives alone."""
    plan_a, plan_b = random_pair(rng)
    original, twin = rng.sample([e.model_stage for e in plan_a.stages], 2)
    placed = [plan.stage_plan(original) for plan in (plan_a, plan_b)]
    plan_a, plan_b = (
        relayout_stages(p, {twin: (e.tp, e.pp, e.emus)}) for p, e in zip((plan_a, plan_b), placed, strict=True)
    )
    sizes: dict[str, float] = {
        e.model_stage: replica_state_bytes(plan_b, e.model_stage, Calibration()) for e in plan_b.stages
    }
    expected: dict[int, float] = {}
    for entry in plan_a.stages:
        for gpus in entry.emus:
            for gpu in gpus:
                expected[gpu] = expected.get(gpu, 0.0) + sizes[entry.model_stage] / (entry.tp * entry.pp)
    assert held_bytes(plan_a, sizes) == pytest.approx(expected, rel=1e-12)
    changed = [b.model_stage for b in plan_b.stages if _placement(b) != _placement(plan_a.stage_plan(b.model_stage))]
    bound = lower_bound_bytes(plan_a, plan_b, changed, sizes)
    assert math.isclose(bound, _lower_bound_by_boxes(plan_a, plan_b), rel_tol=1e-9, abs_tol=1e-6)
    _assert_sound(plan_a, plan_b)

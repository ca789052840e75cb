"""Pipeline-schedule model, evaluator and baselines: closed forms, memory, deadlock, violations."""

from __future__ import annotations

import pytest

from nereus.errors import NereusError
from nereus.solver.pipeline.baselines import (
    chimera,
    chimera_problem,
    gpipe,
    interleaved_one_f_one_b,
    interleaved_problem,
    one_f_one_b,
    pair_baselines,
    zero_bubble_h1,
)
from nereus.solver.pipeline.bounds import lower_bounds
from nereus.solver.pipeline.evaluate import evaluate, timing_violations
from nereus.solver.pipeline.model import Instance, ModelTimes, build_instance, fused_problem, single_problem

pytestmark = pytest.mark.logic

SHAPES = [(1, 1), (2, 1), (2, 4), (4, 4), (4, 8), (4, 2), (8, 16), (8, 3)]


def _single(p: int, m: int, f: float = 1.0, b: float = 2.0, act: float = 1.5, w: float | None = None) -> Instance:
    return build_instance(single_problem(ModelTimes.uniform("a", p, m, f, b, act, w), p))


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_1f1b_and_gpipe_closed_form(p: int, m: int) -> None:
    inst = _single(p, m, 1.5, 3.25)
    for orders in (one_f_one_b(inst), gpipe(inst)):
        ev = evaluate(inst, orders)
        assert ev.ok
        assert ev.makespan == pytest.approx((m + p - 1) * (1.5 + 3.25))
        assert ev.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    # 1F1B holds at most min(p - s, m) micro-batches on stage s; GPipe holds all m.
    assert evaluate(inst, one_f_one_b(inst)).peak_memory == pytest.approx([min(p - s, m) * 1.5 for s in range(p)])
    assert evaluate(inst, gpipe(inst)).max_peak_memory == pytest.approx(m * 1.5)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 8), (8, 16)])
def test_zero_bubble_h1_closed_form(p: int, m: int) -> None:
    inst = _single(p, m, 1.0, 1.0, 1.0, w=1.0)
    ev = evaluate(inst, zero_bubble_h1(inst))
    assert ev.ok
    # Bubble (p - 1)(F + B - W) instead of 1F1B's (p - 1)(F + B + W); same memory as 1F1B.
    assert ev.makespan == pytest.approx(m * 3 + (p - 1) * 1)
    assert ev.max_peak_memory == pytest.approx(p)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 2, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 2)])
def test_interleaved_bubble_shrinks_by_chunks(p: int, m: int, v: int) -> None:
    model = ModelTimes.uniform("a", p, m, 1.0, 2.0)
    inst = build_instance(interleaved_problem(model, p, v))
    ev = evaluate(inst, interleaved_one_f_one_b(inst, v))
    assert ev.ok
    assert ev.makespan == pytest.approx(m * 3 + (p - 1) * 3 / v)


def test_chimera_beats_1f1b_when_micro_batches_equal_stages() -> None:
    model = ModelTimes.uniform("a", 4, 4, 1.0, 2.0)
    inst = build_instance(chimera_problem(model, 4))
    ev = evaluate(inst, chimera(inst))
    assert ev.ok and ev.makespan < (4 + 4 - 1) * 3


@pytest.mark.parametrize(("stages", "replicas", "per_replica"), [(2, 2, 1), (1, 4, 1), (2, 2, 2), (1, 4, 3)])
def test_chimera_runs_replicas_with_a_single_micro_batch(stages: int, replicas: int, per_replica: int) -> None:
    """Each replica splits its own micro-batches between the two directions, so a model run
    as several replicas with one micro-batch each (which used to leave the upward half
    without enough micro-batches and raise) gets a schedule with every micro-batch in it."""
    model = ModelTimes.uniform("critic", stages, replicas * per_replica, 1.0, 2.0)
    problem = chimera_problem(model, stages * replicas)
    assert sorted(mb for p in problem.pipelines for mb in p.microbatches) == list(range(replicas * per_replica))
    inst = build_instance(problem)
    ev = evaluate(inst, chimera(inst))
    assert ev.ok
    if per_replica == 1:  # one micro-batch down each replica's stages, all replicas side by side
        assert ev.makespan == pytest.approx(3 * stages)
    baselines = pair_baselines(ModelTimes.uniform("actor", stages * replicas, replicas * per_replica, 1.0, 2.0), model)
    assert baselines["serial-chimera"].makespan > 0


def test_serial_baseline_adds_both_models() -> None:
    actor, critic = ModelTimes.uniform("actor", 4, 8, 1, 2, 2.0), ModelTimes.uniform("critic", 2, 8, 1, 1, 1.0)
    serial = pair_baselines(actor, critic)["serial-1f1b"]
    # Critic: 2 replicas of 2 stages, 4 micro-batches each: (4 + 1) * 2.
    assert serial.makespan == pytest.approx((8 + 3) * 3 + (4 + 1) * 2)
    assert serial.peak_memory == pytest.approx(4 * 2.0)


def test_p2p_latency_on_the_critical_path() -> None:
    problem = single_problem(ModelTimes.uniform("a", 4, 1, 1.0, 2.0), 4, p2p_latency=0.5)
    inst = build_instance(problem)
    ev = evaluate(inst, one_f_one_b(inst))
    assert ev.makespan == pytest.approx(4 * 3 + 2 * 3 * 0.5)
    assert lower_bounds(inst).critical_path == pytest.approx(ev.makespan)


def test_deadlock_is_detected() -> None:
    inst = _single(2, 2)
    orders = one_f_one_b(inst)
    # Stage 1 runs the backward of micro-batch 1 before its forward of micro-batch 0... and stage 0
    # waits for the backward of micro-batch 0 first: a cycle.
    orders[0] = sorted(orders[0], key=lambda op: (inst.keys[op].kind != "B", op))
    ev = evaluate(inst, orders)
    assert not ev.ok and ev.deadlocked and ev.start is None


def test_structure_violations() -> None:
    inst = _single(2, 2)
    orders = one_f_one_b(inst)
    moved = orders[0].pop()
    orders[1].append(moved)
    ev = evaluate(inst, orders)
    assert any("listed on node 1" in v for v in ev.violations)
    orders = one_f_one_b(inst)
    orders[0].append(orders[0][0])
    assert any("listed 2 times" in v for v in evaluate(inst, orders).violations)


def test_timing_violations_name_the_dependency() -> None:
    inst = _single(2, 1)
    orders = one_f_one_b(inst)
    ev = evaluate(inst, orders)
    assert ev.start is not None and ev.end is not None
    assert timing_violations(inst, orders, ev.start, ev.end) == []
    start, end = list(ev.start), list(ev.end)
    last_b = orders[0][-1]  # B(0) on stage 0 needs B(0) on stage 1 first
    start[last_b] -= 1.0
    end[last_b] -= 1.0
    problems = timing_violations(inst, orders, start, end)
    assert any(p.startswith("dependency violated") for p in problems)


def test_fused_layout_runs_critic_replicas_in_reverse() -> None:
    problem = fused_problem(ModelTimes.uniform("actor", 8, 8, 1, 2), ModelTimes.uniform("critic", 4, 8, 1, 2))
    critic = [p for p in problem.pipelines if p.model.name == "critic"]
    assert [p.stage_nodes for p in critic] == [(7, 6, 5, 4), (3, 2, 1, 0)]
    assert [len(p.microbatches) for p in critic] == [4, 4]


def test_bad_shapes_are_user_errors() -> None:
    with pytest.raises(NereusError, match="do not divide"):
        fused_problem(ModelTimes.uniform("actor", 6, 8, 1, 2), ModelTimes.uniform("critic", 4, 8, 1, 2))
    with pytest.raises(NereusError, match="micro-batches"):
        fused_problem(ModelTimes.uniform("actor", 8, 8, 1, 2), ModelTimes.uniform("critic", 2, 3, 1, 2))
    with pytest.raises(NereusError, match="positive"):
        ModelTimes.uniform("actor", 2, 2, 0.0, 1.0)


def test_incremental_resimulation_matches_a_full_one() -> None:
    import random

    from nereus.solver.pipeline.evaluate import resimulate, simulate
    from nereus.solver.pipeline.moves import neighbour
    from nereus.solver.pipeline.policy import DEFAULT_POLICY
    from nereus.solver.pipeline.starts import greedy_schedule

    actor = ModelTimes.uniform("actor", 8, 8, 3.0, 6.0, 1.0)
    critic = ModelTimes.uniform("critic", 4, 8, 2.0, 5.0, 1.0)
    inst = build_instance(fused_problem(actor, critic, p2p_latency=0.25))
    _, orders, _ = greedy_schedule(inst, ("actor", "critic"))
    state = simulate(inst, orders)
    assert state is not None
    rng = random.Random(7)
    checked = deadlocked = 0
    for _ in range(400):
        node, new_order, first = neighbour(rng, orders, list(range(inst.problem.num_nodes)), DEFAULT_POLICY.move_span)
        old_order = orders[node]
        orders[node] = new_order
        full = simulate(inst, orders)
        fast = resimulate(inst, orders, state[1], state[2], state[1][old_order[first]])
        assert (full is None) == (fast is None)
        if full is None or fast is None:
            deadlocked += 1
            orders[node] = old_order
            continue
        checked += 1
        assert fast[0] == pytest.approx(full[0])
        assert fast[1] == pytest.approx(full[1]) and fast[2] == pytest.approx(full[2])
        state = full  # walk on, so later moves start from changed schedules
    assert checked > 100 and deadlocked > 10

"""The latency lower bounds are valid: CP-SAT's optimum never lies below them on small instances."""

from __future__ import annotations

import random

import pytest

from nereus.solver.pipeline.bounds import jackson_preemptive, lower_bounds, one_machine_bound, rank_tables
from nereus.solver.pipeline.model import ModelTimes, Problem, build_instance, fused_problem, single_problem

pytestmark = pytest.mark.logic

# (actor stages, critic stages); the critic runs as replicas when it has fewer stages.
SHAPES = [(1, 1), (2, 2), (2, 1), (3, 3), (3, 1), (4, 2), (4, 4)]
#: Keeps every instance small enough for CP-SAT to prove its optimum in well under a second or so.
MAX_OPS = 36


def _random_model(rng: random.Random, name: str, stages: int, microbatches: int, split: bool) -> ModelTimes:
    def times() -> tuple[float, ...]:
        return tuple(float(rng.randint(1, 9)) for _ in range(stages))

    return ModelTimes(name, microbatches, times(), times(), times(), times() if split else None)


def _random_problem(seed: int) -> Problem:
    """At most MAX_OPS ops; integer times with a longest op of exactly 10 units, so CP-SAT's
    time scaling is exact and its optimum is the true one."""
    rng = random.Random(seed)
    sa, sc = SHAPES[seed % len(SHAPES)]
    split = seed % 5 == 4
    kinds = 3 if split else 2
    while True:
        m_actor, m_critic = rng.randint(sa // sc, 4), rng.randint(sa // sc, 4)
        if (sa * m_actor + sc * m_critic) * kinds <= MAX_OPS:
            break
    actor = _random_model(rng, "actor", sa, m_actor, split)
    critic = _random_model(rng, "critic", sc, m_critic, split)
    longest = list(actor.backward)
    longest[rng.randrange(sa)] = 10.0
    actor = ModelTimes("actor", m_actor, actor.forward, tuple(longest), actor.activation, actor.weight_grad)
    return fused_problem(actor, critic, p2p_latency=float(rng.choice([0, 0, 1, 2])))


@pytest.mark.parametrize("seed", range(24))
def test_cp_sat_optimum_is_never_below_the_bound(seed: int) -> None:
    pytest.importorskip("ortools")
    from nereus.solver.pipeline.exact import solve_exact

    inst = build_instance(_random_problem(seed))
    bounds = lower_bounds(inst)
    # Each proves optimal in well under a second alone; the limit leaves room for a loaded machine.
    exact = solve_exact(inst, time_limit_s=90, workers=2, minimise_memory=False)
    assert exact.status == "optimal" and exact.makespan is not None
    assert exact.makespan >= bounds.latency * (1 - 1e-9), (bounds, exact.makespan)


def test_rank_bound_is_tight_where_the_old_bounds_were_loose() -> None:
    """Fused 4+4 stages, 4 micro-batches: the node bounds miss the pipeline fill, the rank bound
    sees it and equals CP-SAT's optimum (the schedule file tests pin the same makespan)."""
    actor = ModelTimes.uniform("actor", 4, 4, 3.0, 6.0)
    critic = ModelTimes.uniform("critic", 4, 4, 1.0, 2.0)
    inst = build_instance(fused_problem(actor, critic))
    bounds = lower_bounds(inst)
    old = max(bounds.critical_path, bounds.node_work, bounds.average_work, bounds.arrival_work_tail)
    assert bounds.one_machine > old
    pytest.importorskip("ortools")
    from nereus.solver.pipeline.exact import solve_exact

    exact = solve_exact(inst, time_limit_s=20, workers=2, minimise_memory=False)
    assert exact.status == "optimal" and exact.makespan == pytest.approx(bounds.latency)


def test_rank_tables_of_one_pipeline() -> None:
    """1F1B alone: the rank releases of the last stage's forwards are (S - 1 + k) F apart."""
    problem = single_problem(ModelTimes.uniform("a", 3, 4, 1.0, 2.0), 3)
    tables = rank_tables(problem)
    assert tables.release[(0, 2, "F")] == [2.0, 3.0, 4.0, 5.0]
    assert tables.release[(0, 2, "B")] == [3.0, 5.0, 7.0, 9.0]
    # The last backward of stage 0 ends the schedule; the k-th from last has k more after it.
    assert tables.tail[(0, 0, "B")] == [6.0, 4.0, 2.0, 0.0]
    # 1F1B's (m + p - 1)(F + B) = 18 is optimal and the rank bound proves it.
    assert one_machine_bound(problem) == pytest.approx(18.0)


def test_jackson_preemptive_schedule() -> None:
    # The long-tail job arrives at 1 and preempts the first one.
    assert jackson_preemptive([(0.0, 4.0, 0.0), (1.0, 2.0, 10.0)]) == pytest.approx(13.0)
    assert jackson_preemptive([(0.0, 1.0, 0.0), (5.0, 1.0, 1.0)]) == pytest.approx(7.0)
    assert jackson_preemptive([]) == 0.0


@pytest.mark.parametrize("seed", range(40))
def test_no_list_schedule_beats_the_bound_on_larger_instances(seed: int) -> None:
    """Beyond CP-SAT's reach: every schedule the list scheduler makes is at least the bound."""
    from nereus.solver.pipeline.evaluate import evaluate
    from nereus.solver.pipeline.greedy import GreedyRule, list_schedule, rule_key, window_limits

    rng = random.Random(1000 + seed)
    sa = rng.choice([2, 4, 8])
    sc = sa // rng.choice([1, 2])
    split = rng.random() < 0.3
    actor = _random_model(rng, "actor", sa, rng.randint(sa // sc, 3 * sa), split)
    critic = _random_model(rng, "critic", sc, rng.randint(sa // sc, 3 * sa), split)
    inst = build_instance(fused_problem(actor, critic, p2p_latency=rng.choice([0.0, 0.5])))
    bound = lower_bounds(inst).latency
    for order in (("actor", "critic"), ("critic", "actor")):
        for windows in (True, False):
            rule = GreedyRule("any", order, windows)
            orders = list_schedule(inst, rule_key(inst, rule), window_limits(inst) if windows else None)
            assert orders is not None
            assert evaluate(inst, orders).makespan >= bound * (1 - 1e-9)

"""The latency lower bounds are valid: CP-SAT's optimum never lies below them on small instances."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from nereus.solver.pipeline.bounds import (
    jackson_preemptive,
    lower_bounds,
    memory_bound,
    memory_bound_at,
    memory_rank_tables,
    one_machine_bound,
    rank_tables,
)
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


def _with_activations(problem: Problem, rng: random.Random) -> Problem:
    """The problem with activations of 1 or 2 per stage: CP-SAT's memory scaling is exact."""
    pipelines = []
    for pipeline in problem.pipelines:
        model = pipeline.model
        activation = tuple(float(rng.choice([1, 2])) for _ in range(model.num_stages))
        pipelines.append(replace(pipeline, model=replace(model, activation=activation)))
    # Replicas of one model share one ModelTimes: rebuild them from the first replica's model.
    first = {p.model.name: p.model for p in reversed(pipelines)}
    pipelines = [replace(p, model=first[p.model.name]) for p in pipelines]
    return replace(problem, pipelines=tuple(pipelines))


#: Seeds of `_random_problem` whose replicated model has at least two micro-batches per
#: replica (the serial Chimera baseline of `search_fused` halves them).
MEMORY_SEEDS = [0, 1, 3, 6, 7, 9, 10, 13, 14, 15, 17, 20]


@pytest.mark.slow
@pytest.mark.parametrize("seed", MEMORY_SEEDS)
def test_least_peak_at_the_makespan_lies_between_the_memory_bound_and_the_heuristic(seed: int) -> None:
    """CP-SAT's least peak among schedules as fast as the heuristic's is never above the
    heuristic's peak and never below `memory_bound_at`; on most instances it equals the heuristic's."""
    pytest.importorskip("ortools")
    from nereus.solver.pipeline.exact import solve_memory_at
    from nereus.solver.pipeline.search import SearchConfig, search_fused

    problem = _with_activations(_random_problem(seed), random.Random(seed))
    actor, critic = problem.models
    config = SearchConfig(time_limit_s=60, seeds=1, max_iterations=4000)
    result = search_fused(actor, critic, config, p2p_latency=problem.p2p_latency)
    peak = result.evaluation.max_peak_memory
    lean = solve_memory_at(result.instance, result.orders, time_limit_s=90, workers=2)
    assert lean.status == "optimal" and lean.peak_memory is not None and lean.makespan is not None
    assert lean.makespan <= result.evaluation.makespan * (1 + 1e-9)
    assert result.memory_lower_bound <= lean.peak_memory + 1e-9 <= peak + 2e-9
    _MATCHED.append(peak <= lean.peak_memory + 1e-9)


_MATCHED: list[bool] = []


@pytest.mark.slow
def test_the_heuristic_matches_the_least_peak_on_most_instances() -> None:
    """Runs after the parametrised test above (pytest keeps file order) and tallies it."""
    if len(_MATCHED) < len(MEMORY_SEEDS):
        pytest.skip("tallies the CP-SAT memory cases above: run the whole file")
    assert sum(_MATCHED) >= 8, _MATCHED


@pytest.mark.parametrize("seed", range(6))
def test_memory_bound_at_holds_for_every_list_schedule(seed: int) -> None:
    from nereus.solver.pipeline.starts import list_schedules

    rng = random.Random(seed)
    sa = rng.choice([2, 4])
    actor = ModelTimes("actor", rng.randint(2, 8), *(tuple(rng.uniform(1, 3) for _ in range(sa)) for _ in range(3)))
    sc = sa // rng.choice([1, 2])
    critic = ModelTimes("critic", rng.randint(2, 8), *(tuple(rng.uniform(1, 3) for _ in range(sc)) for _ in range(3)))
    inst = build_instance(fused_problem(actor, critic, p2p_latency=rng.choice([0.0, 0.3])))
    for _, _, ev in list_schedules(inst, ("actor", "critic")):
        assert memory_bound_at(inst, ev.makespan) <= ev.max_peak_memory + 1e-9
    slow = memory_bound_at(inst, 10 * lower_bounds(inst).latency)
    assert slow == pytest.approx(max(d for d in inst.memory_delta if d > 0))  # one micro-batch at a time


def test_memory_rank_tables_count_the_node_work_of_every_stage() -> None:
    """1F1B alone, 3 stages: the k-th backward of the last stage follows k + 1 forwards and k
    backwards on its node (the plain rank chain sees only one of each)."""
    problem = single_problem(ModelTimes.uniform("a", 3, 4, 1.0, 2.0), 3)
    plain, raised = rank_tables(problem), memory_rank_tables(problem)
    assert plain.release[(0, 2, "B")] == [3.0, 5.0, 7.0, 9.0]
    assert raised.release[(0, 2, "B")] == [3.0, 6.0, 9.0, 12.0]
    # Stage 0's first forward leaves on the last stage all 4 forwards and backwards (12) after
    # the stage-1 forward that reaches it (1), then the backward chain of stages 1 and 0 (4):
    # with its own forward that is 1F1B's optimal 18, where the plain rank chain sees less.
    assert plain.tail[(0, 0, "F")][0] < 17.0
    assert raised.tail[(0, 0, "F")][0] == pytest.approx(1 + 12 + 4)


#: Seeds of `_random_problem` whose CP-SAT memory optimum proves in well under a second.
EXACT_MEMORY_SEEDS = [3, 4, 5, 6, 11, 12, 13, 17, 19, 20, 25, 27]


@pytest.mark.parametrize("seed", EXACT_MEMORY_SEEDS)
def test_memory_bound_at_is_never_above_the_exact_memory_optimum(seed: int) -> None:
    """CP-SAT's least peak at its optimal makespan (times and activations scaled exactly)
    is never below `memory_bound_at` at that makespan."""
    pytest.importorskip("ortools")
    from nereus.solver.pipeline.exact import solve_exact

    inst = build_instance(_with_activations(_random_problem(seed), random.Random(seed)))
    exact = solve_exact(inst, time_limit_s=60, workers=2)
    assert exact.status == "optimal" and exact.memory_optimal and exact.makespan is not None
    assert exact.peak_memory is not None
    bound = memory_bound_at(inst, exact.makespan)
    assert bound <= exact.peak_memory + 1e-9
    if seed in (13, 27):  # the fastest schedules there must hold more than serial 1F1B does
        assert bound > memory_bound(inst.problem)


@pytest.mark.parametrize("seed", range(12))
def test_node_tails_put_every_schedule_end_at_its_makespan(seed: int) -> None:
    """An op's end plus what must follow it on its node (`follow_tails`) is never past the
    makespan, and the op that ends last reaches it: the annealing's lateness is zero exactly
    when a schedule meets its target. Each op's value is at least its own chain tail."""
    from nereus.solver.pipeline.bounds import follow_tails, heads_and_tails
    from nereus.solver.pipeline.evaluate import simulate
    from nereus.solver.pipeline.greedy import GreedyRule, list_schedule, rule_key, window_limits

    rng = random.Random(2000 + seed)
    sa = rng.choice([2, 4])
    sc = sa // rng.choice([1, 2])
    actor = _random_model(rng, "actor", sa, rng.randint(sa // sc, 2 * sa), rng.random() < 0.3)
    critic = _random_model(rng, "critic", sc, rng.randint(sa // sc, 2 * sa), False)
    inst = build_instance(fused_problem(actor, critic, p2p_latency=rng.choice([0.0, 0.5])))
    tail = heads_and_tails(inst)[1]
    for windows in (True, False):
        orders = list_schedule(inst, rule_key(inst, GreedyRule("any", ("actor", "critic"), windows)),
                               window_limits(inst) if windows else None)  # fmt: skip
        assert orders is not None
        makespan, _, end = simulate(inst, orders)
        follow = follow_tails(inst, orders, tail)
        assert all(f >= t for f, t in zip(follow, tail, strict=True))
        assert max(e + f for e, f in zip(end, follow, strict=True)) == pytest.approx(makespan, rel=1e-12)

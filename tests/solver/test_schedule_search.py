"""The fused search's parts: forward-backward improvement, critical arcs, peak moves, and the
search reaching the lower bound where list scheduling alone does not."""

from __future__ import annotations

import random

import pytest

from nereus.solver.pipeline.baselines import gpipe, one_f_one_b
from nereus.solver.pipeline.bounds import lower_bounds
from nereus.solver.pipeline.evaluate import evaluate, peak_memory, simulate
from nereus.solver.pipeline.improve import forward_backward, serial_schedule
from nereus.solver.pipeline.model import Instance, ModelTimes, build_instance, fused_problem, single_problem
from nereus.solver.pipeline.search import (
    SearchConfig,
    _peak_move,
    critical_node_arcs,
    greedy_schedule,
    search_fused,
)

pytestmark = pytest.mark.logic


def _random_instance(seed: int) -> Instance:
    rng = random.Random(seed)
    sa = rng.choice([2, 4])
    sc = sa // rng.choice([1, 2])
    split = seed % 3 == 0

    def model(name: str, stages: int) -> ModelTimes:
        def times() -> tuple[float, ...]:
            return tuple(rng.uniform(0.5, 3.0) for _ in range(stages))

        m = rng.randint(sa // sc, 2 * sa)
        weight = tuple(rng.choice([0.0, 1.0]) for _ in range(stages)) if split else None
        return ModelTimes(name, m, times(), times(), times(), weight)

    problem = fused_problem(model("actor", sa), model("critic", sc), p2p_latency=rng.choice([0.0, 0.2]))
    return build_instance(problem)


@pytest.mark.parametrize("seed", range(12))
def test_forward_backward_never_worsens_and_runs(seed: int) -> None:
    inst = _random_instance(seed)
    _, orders, ev = greedy_schedule(inst, ("actor", "critic"))
    improved, makespan = forward_backward(inst, orders)
    again = evaluate(inst, improved)
    assert again.ok
    assert again.makespan == pytest.approx(makespan)
    assert makespan <= ev.makespan * (1 + 1e-9)
    assert makespan >= lower_bounds(inst).latency * (1 - 1e-9)


def test_forward_backward_turns_gpipe_into_a_shorter_schedule() -> None:
    """GPipe's per-stage order leaves bubbles that re-justification closes up to the bound."""
    actor = ModelTimes.uniform("actor", 4, 4, 1.0, 2.0)
    critic = ModelTimes.uniform("critic", 4, 4, 1.0, 2.0)
    inst = build_instance(fused_problem(actor, critic))
    start = gpipe(inst)
    before = evaluate(inst, start).makespan
    improved, makespan = forward_backward(inst, start)
    assert makespan < before
    assert evaluate(inst, improved).ok


def test_mirrored_serial_schedule_packs_against_the_end() -> None:
    inst = build_instance(single_problem(ModelTimes.uniform("a", 3, 3, 1.0, 2.0), 3))
    state = simulate(inst, one_f_one_b(inst))
    assert state is not None
    by_end = sorted(range(inst.num_ops), key=lambda o: -state[2][o])
    mirrored = serial_schedule(inst, by_end, mirrored=True)
    ev = evaluate(inst, mirrored)
    assert ev.ok and ev.makespan == pytest.approx(state[0])


def test_critical_arcs_are_tight_node_arcs() -> None:
    inst = build_instance(single_problem(ModelTimes.uniform("a", 4, 8, 1.0, 2.0), 4))
    orders = one_f_one_b(inst)
    state = simulate(inst, orders)
    assert state is not None
    arcs = critical_node_arcs(inst, orders, state[1], state[2])
    assert arcs
    for node, i in arcs:
        assert state[1][orders[node][i]] == pytest.approx(state[2][orders[node][i - 1]])


def test_peak_move_moves_one_op_on_a_peak_node() -> None:
    inst = build_instance(single_problem(ModelTimes.uniform("a", 4, 8, 1.0, 2.0, 1.0), 4))
    orders = gpipe(inst)  # every forward first: node 0 peaks at 8 micro-batches
    peaks = peak_memory(inst, orders)
    rng = random.Random(3)
    lowered = 0
    for _ in range(50):
        node, order, first = _peak_move(inst, rng, orders, peaks)
        assert peaks[node] == max(peaks)
        assert sorted(order) == sorted(orders[node])
        assert order[:first] == orders[node][:first]
        lowered += peak_memory(inst, [order])[0] < peaks[node]
    assert lowered > 0


def test_search_reaches_the_bound_where_list_scheduling_does_not() -> None:
    """Actor 4 stages, critic 2 (two replicas), 4 micro-batches each, 65B/33B-like times."""
    actor = ModelTimes.uniform("actor", 4, 4, 13.4, 26.8, 3.3)
    critic = ModelTimes.uniform("critic", 2, 4, 13.3, 26.6, 2.0)
    result = search_fused(actor, critic, SearchConfig(time_limit_s=30, seeds=1, max_iterations=2000))
    assert result.greedy.makespan > result.bounds.latency * 1.05
    assert result.evaluation.makespan <= result.bounds.latency * (1 + 1e-9)
    assert result.evaluation.ok

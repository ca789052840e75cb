"""The fused search's parts: forward-backward improvement, critical arcs, peak moves, and the
search reaching the lower bound where list scheduling alone does not."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from nereus.solver.pipeline.anneal import AnnealOutcome, SeedJob, _lean_phase, _memory_phase, _Phase, anneal
from nereus.solver.pipeline.baselines import gpipe, one_f_one_b
from nereus.solver.pipeline.bounds import lower_bounds
from nereus.solver.pipeline.document import to_document
from nereus.solver.pipeline.evaluate import evaluate, peak_memory, simulate
from nereus.solver.pipeline.exact import ExactResult, solve_exact
from nereus.solver.pipeline.greedy import GreedyRule, list_schedule, rule_key, window_limits
from nereus.solver.pipeline.improve import forward_backward, serial_schedule
from nereus.solver.pipeline.model import Instance, ModelTimes, build_instance, fused_problem, single_problem
from nereus.solver.pipeline.moves import critical_node_arcs, memory_profile, peak_move
from nereus.solver.pipeline.policy import DEFAULT_POLICY, SearchPolicy
from nereus.solver.pipeline.search import FusedResult, SearchConfig, search_fused
from nereus.solver.pipeline.starts import greedy_schedule, lean_starts, starting_schedules

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


@pytest.mark.parametrize("seed", range(12))
def test_capped_forward_backward_keeps_to_the_cap_and_never_worsens(seed: int) -> None:
    """From a list schedule within a cap, passes that keep to the cap stay within it, run,
    and are no slower; serial schedules under a cap do too (or say they cannot)."""
    inst = _random_instance(seed)
    cap = max(peak_memory(inst, one_f_one_b_fused(inst))) * random.Random(seed).uniform(1.0, 1.5)
    orders = list_schedule(inst, rule_key(inst, GreedyRule("r", ("actor", "critic"), True)), window_limits(inst), cap)
    if orders is None:
        return
    ev = evaluate(inst, orders)
    improved, makespan = forward_backward(inst, orders, cap=cap)
    again = evaluate(inst, improved)
    assert again.ok and again.makespan == pytest.approx(makespan)
    assert makespan <= ev.makespan * (1 + 1e-9)
    assert again.max_peak_memory <= cap * (1 + 1e-9)
    state = simulate(inst, orders)
    assert state is not None
    by_start = sorted(range(inst.num_ops), key=lambda o: state[1][o])
    for mirrored in (False, True):
        priority = by_start[::-1] if mirrored else by_start
        serial = serial_schedule(inst, priority, mirrored=mirrored, cap=cap)
        if serial is not None:
            assert evaluate(inst, serial).ok
            assert max(peak_memory(inst, serial)) <= cap * (1 + 1e-9)


def test_a_capped_serial_schedule_delays_forwards_until_backwards_free_memory() -> None:
    """GPipe order (every forward first) as the priority under a cap of two activations:
    forwards wait for backwards, and the result holds two at most."""
    inst = build_instance(single_problem(ModelTimes.uniform("a", 2, 6, 1.0, 2.0), 2))
    state = simulate(inst, gpipe(inst))
    assert state is not None
    orders = serial_schedule(inst, sorted(range(inst.num_ops), key=lambda o: state[1][o]), cap=2.0)
    assert orders is not None and evaluate(inst, orders).ok
    assert max(peak_memory(inst, orders)) == 2.0 < max(peak_memory(inst, gpipe(inst)))


def one_f_one_b_fused(inst: Instance) -> list[list[int]]:
    """A lean reference schedule of a fused instance: 1F1B windows, list-scheduled."""
    orders = list_schedule(inst, rule_key(inst, GreedyRule("r", ("actor", "critic"), True)), window_limits(inst))
    assert orders is not None
    return orders


@pytest.mark.parametrize("seed", range(6))
def test_lean_starts_hold_at_most_their_cap(seed: int) -> None:
    inst = _random_instance(seed)
    for start in lean_starts(inst, ("actor", "critic")):
        ev = evaluate(inst, start.orders)
        assert ev.ok and ev.makespan == pytest.approx(start.makespan)
        assert ev.max_peak_memory == start.peak <= start.cap * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_lean_phase_never_raises_the_makespan_and_reports_its_replay(seed: int) -> None:
    inst = _random_instance(seed)
    bounds = lower_bounds(inst)
    _, starts = starting_schedules(inst, ("actor", "critic"))
    _, orders, ev = starts[0]
    best = AnnealOutcome(seed, [list(o) for o in orders], ev.makespan, ev.max_peak_memory, 0)
    movable = [n for n, o in enumerate(orders) if len(o) > 1]
    lean = lean_starts(inst, ("actor", "critic"))
    _lean_phase(inst, _Phase(float("inf"), 3000), best, random.Random(seed), movable, 0, bounds.memory, lean)
    replay = evaluate(inst, best.orders)
    assert replay.ok and best.makespan <= ev.makespan * (1 + 1e-9)
    assert replay.makespan == pytest.approx(best.makespan, rel=1e-12)
    assert replay.max_peak_memory == best.peak <= ev.max_peak_memory


def test_the_lean_phase_finds_a_lean_schedule_as_fast_as_a_front_loaded_one() -> None:
    """The benchmark's 65B/33B times, 4 actor stages, critic 2 stages x 2 replicas, 8
    micro-batches: the fastest start holds over 2x the memory bound; the lean phase finds
    one as fast under 1.3x."""
    inst = _front_loaded_instance()
    bounds = lower_bounds(inst)
    _, starts = starting_schedules(inst, ("actor", "critic"))
    _, orders, ev = starts[0]
    best = AnnealOutcome(0, [list(o) for o in orders], ev.makespan, ev.max_peak_memory, 0)
    lean = lean_starts(inst, ("actor", "critic"))
    _lean_phase(inst, _Phase(float("inf"), 4000), best, random.Random(0), list(range(4)), 0, bounds.memory, lean)
    assert best.makespan <= ev.makespan * (1 + 1e-9)
    assert ev.max_peak_memory > 2 * bounds.memory
    assert best.peak <= 1.3 * bounds.memory


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


def test_peak_move_moves_one_op_on_a_node_above_the_level() -> None:
    inst = build_instance(single_problem(ModelTimes.uniform("a", 4, 8, 1.0, 2.0, 1.0), 4))
    orders = gpipe(inst)  # every forward first: node 0 peaks at 8 micro-batches
    peaks = peak_memory(inst, orders)
    level = max(peaks) - 1
    excess = [memory_profile(inst.memory_delta, order, level)[1] for order in orders]
    assert all(e == 1.0 for e in excess)  # every node holds all 8 for one moment
    rng = random.Random(3)
    lowered = 0
    for _ in range(50):
        span, nearest = DEFAULT_POLICY.move_span, DEFAULT_POLICY.nearest_ops
        node, order, first = peak_move(inst, rng, orders, excess, level, span, nearest)
        assert excess[node] > 0
        assert sorted(order) == sorted(orders[node])
        assert order[:first] == orders[node][:first]
        lowered += memory_profile(inst.memory_delta, order, level)[1] < excess[node]
    assert lowered > 0


def test_memory_profile_is_the_peak_and_the_excess_over_the_level() -> None:
    inst = build_instance(single_problem(ModelTimes.uniform("a", 2, 3, 1.0, 2.0, 2.0), 2))
    order = gpipe(inst)[0]  # node 0: F F F B B B, holding 2, 4, 6, 4, 2, 0
    assert memory_profile(inst.memory_delta, order, 3.0) == (6.0, 1 + 3 + 1)
    assert memory_profile(inst.memory_delta, order, 6.0) == (6.0, 0.0)


@pytest.mark.parametrize("seed", range(8))
def test_memory_phase_never_raises_the_makespan_and_reports_its_replay(seed: int) -> None:
    inst = _random_instance(seed)
    bounds = lower_bounds(inst)
    _, starts = starting_schedules(inst, ("actor", "critic"))
    _, orders, ev = starts[-1]  # the slowest start: room to lower the peak at its makespan
    best = AnnealOutcome(seed, [list(o) for o in orders], ev.makespan, ev.max_peak_memory, 0)
    movable = [n for n, o in enumerate(orders) if len(o) > 1]
    _memory_phase(inst, _Phase(float("inf"), 3000), best, random.Random(seed), movable, 0, 0.0)
    replay = evaluate(inst, best.orders)
    assert replay.ok
    assert best.makespan <= ev.makespan * (1 + 1e-9)
    assert replay.makespan == pytest.approx(best.makespan, rel=1e-12)
    assert replay.max_peak_memory == best.peak <= ev.max_peak_memory
    assert bounds.latency <= replay.makespan + 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_anneal_outcome_is_its_own_replay(seed: int) -> None:
    inst = _random_instance(seed)
    bounds = lower_bounds(inst)
    _, starts = starting_schedules(inst, ("actor", "critic"))
    job = SeedJob(seed, starts[0].orders, 60.0, bounds.latency, bounds.memory, max_iterations=2000)
    outcome = anneal(inst, job)
    replay = evaluate(inst, outcome.orders)
    assert replay.ok and replay.makespan == pytest.approx(outcome.makespan, rel=1e-12)
    assert replay.max_peak_memory == outcome.peak
    assert outcome.makespan <= starts[0][2].makespan * (1 + 1e-9)


@pytest.mark.slow
def test_the_memory_phase_lowers_the_peak_of_a_fast_schedule() -> None:
    """33B/13B-like times, 4 actor and 4 critic stages, 16 micro-batches: the fastest list
    schedule front-loads forwards; annealed from it without a cap, the schedule ends no
    slower than the greedy one (here at the bound, 458.8 against 461.4) and the memory phase
    holds under half as much at that makespan (95 against 206)."""
    actor = ModelTimes.uniform("actor", 4, 16, 6.6, 13.3, 10.0)
    critic = ModelTimes.uniform("critic", 4, 16, 2.6, 5.2, 5.1)
    inst = build_instance(fused_problem(actor, critic))
    bounds = lower_bounds(inst)
    _, _, greedy = greedy_schedule(inst, ("actor", "critic"))
    _, starts = starting_schedules(inst, ("actor", "critic"))
    outcome = anneal(inst, SeedJob(0, starts[0].orders, 60.0, bounds.latency, bounds.memory, max_iterations=40000))
    assert outcome.makespan <= greedy.makespan * (1 + 1e-9)
    assert outcome.peak < 0.6 * greedy.max_peak_memory
    assert evaluate(inst, outcome.orders).max_peak_memory == outcome.peak


def test_search_reaches_the_bound_where_list_scheduling_does_not() -> None:
    """Actor 4 stages, critic 2 (two replicas), 4 micro-batches each, 65B/33B-like times."""
    actor = ModelTimes.uniform("actor", 4, 4, 13.4, 26.8, 3.3)
    critic = ModelTimes.uniform("critic", 2, 4, 13.3, 26.6, 2.0)
    result = search_fused(actor, critic, SearchConfig(time_limit_s=30, seeds=1, max_iterations=2000))
    assert result.greedy.makespan > result.bounds.latency * 1.05
    assert result.evaluation.makespan <= result.bounds.latency * (1 + 1e-9)
    assert result.evaluation.ok


def _front_loaded_instance() -> Instance:
    """The benchmark's 65B/33B times, 4 actor stages, critic 2 stages x 2 replicas, 8 micro-batches."""
    actor = ModelTimes.uniform("actor", 4, 8, 13.42, 26.84, 16.38)
    critic = ModelTimes.uniform("critic", 2, 8, 6.645, 13.29, 9.98)
    return build_instance(fused_problem(actor, critic))


@pytest.mark.parametrize("seed", range(5))
def test_the_lean_phase_never_leaves_more_memory_than_the_descent_alone(seed: int) -> None:
    """Same iteration budget, same start and seed: with lean starts the annealing ends as fast
    and never higher than the latency phase and peak descent on their own (seed 4: the
    front-loaded instance, where the lean phase is what gets under 1.3x the memory bound)."""
    inst = _random_instance(seed) if seed < 4 else _front_loaded_instance()
    bounds = lower_bounds(inst)
    _, starts = starting_schedules(inst, ("actor", "critic"))
    lean = lean_starts(inst, ("actor", "critic"))
    job = SeedJob(seed, starts[0].orders, 1e6, bounds.latency, bounds.memory, 6000, fallback=starts[0].orders)
    alone, with_lean = anneal(inst, job), anneal(inst, replace(job, lean=lean))
    assert with_lean.makespan <= alone.makespan * (1 + 1e-9)
    assert with_lean.peak <= alone.peak
    assert evaluate(inst, with_lean.orders).max_peak_memory == with_lean.peak
    if seed == 4:
        assert alone.peak > 1.3 * bounds.memory >= with_lean.peak


def test_the_schedule_reports_its_leaner_slower_alternatives() -> None:
    """The document's trade-off: every alternative holds less than the schedule, at a longer
    makespan, within its cap; a leaner one is always slower than a less lean one."""
    actor = ModelTimes.uniform("actor", 4, 16, 6.6, 13.3, 10.0)
    critic = ModelTimes.uniform("critic", 4, 16, 2.6, 5.2, 5.1)
    result = search_fused(actor, critic, SearchConfig(time_limit_s=60, seeds=1, max_iterations=300))
    alternatives = to_document(result).summary.lean_alternatives
    ev = result.evaluation
    assert alternatives, "the front-loaded fastest schedule has leaner, slower alternatives"
    for lean in alternatives:
        assert lean.peak_memory < ev.max_peak_memory and lean.makespan > ev.makespan
        assert lean.peak_memory <= lean.activation_cap * (1 + 1e-9)
    assert all(a.makespan > b.makespan for a, b in itertools.pairwise(alternatives))


def _seed_outcome(actor: ModelTimes, critic: ModelTimes, policy: SearchPolicy = DEFAULT_POLICY) -> FusedResult:
    """Two seeds, iteration-bounded (the same schedule on any machine)."""
    return search_fused(actor, critic, SearchConfig(time_limit_s=60, seeds=2, max_iterations=3000), policy=policy)


def _exact(result: FusedResult) -> ExactResult:
    """CP-SAT's certified optimum of the result's instance: least makespan, then least peak."""
    pytest.importorskip("ortools")
    exact = solve_exact(result.instance, time_limit_s=60, workers=2)
    assert exact.status == "optimal" and exact.memory_optimal
    assert exact.makespan is not None and exact.peak_memory is not None
    return exact


def test_every_seed_is_capped_where_the_fastest_start_is_lean() -> None:
    """Actor 2 stages, critic 8, 4 micro-batches: the fastest start holds 1.49x the memory
    bound and is above the lower bound. An uncapped walk from there drifts to schedules that
    run every forward early, so both seeds keep under `capped_seed_factor` x the bound (the
    run's `seed_caps` record), and so does the schedule: it holds no more than CP-SAT's least
    peak at the optimal makespan. Its makespan is within 10% of CP-SAT's optimum (9.1% above
    it at 3000 iterations; the time-limited CP-SAT windows, not run here, shorten it)."""
    actor = ModelTimes.uniform("actor", 2, 4, 13.4, 26.8, 10.0)
    critic = ModelTimes.uniform("critic", 8, 4, 2.6, 5.2, 5.1)
    result = _seed_outcome(actor, critic)
    cap = DEFAULT_POLICY.capped_seed_factor * result.bounds.memory
    assert result.seed_caps == [pytest.approx(cap)] * 2
    exact = _exact(result)
    assert exact.makespan <= result.evaluation.makespan <= exact.makespan * 1.1
    assert result.evaluation.max_peak_memory <= cap * (1 + 1e-9)
    assert result.evaluation.max_peak_memory <= exact.peak_memory * (1 + 1e-9)


def test_every_seed_catches_up_under_the_cap_where_the_fastest_start_is_fat() -> None:
    """Actor and critic 2 stages, 4 micro-batches: the fastest start holds 2x the memory bound
    and is above the lower bound; both seeds anneal under the cap from the lean starts (the
    fat start still competes as it is). The schedule reaches CP-SAT's optimal makespan within
    the cap, where the fastest start holds more than it."""
    actor = ModelTimes.uniform("actor", 2, 4, 6.6, 13.2, 10.0)
    critic = ModelTimes.uniform("critic", 2, 4, 2.6, 5.2, 5.1)
    result = _seed_outcome(actor, critic)
    cap = DEFAULT_POLICY.capped_seed_factor * result.bounds.memory
    assert result.seed_caps == [pytest.approx(cap)] * 2
    exact = _exact(result)
    assert result.evaluation.makespan == pytest.approx(exact.makespan)
    assert exact.peak_memory <= result.evaluation.max_peak_memory <= cap * (1 + 1e-9)


def test_no_seed_is_capped_where_a_lean_start_meets_the_bound() -> None:
    """Actor and critic 2 stages, 4 micro-batches, equal times: the fastest start meets the
    lower bound at 1.26x the memory bound; no walk looks for speed, the seeds only lower the
    peak, the odd one from the leanest start within `restart_slack`. The schedule is at
    CP-SAT's optimal makespan and holds less than the fastest start."""
    actor = ModelTimes.uniform("actor", 2, 4, 6.6, 13.2, 10.0)
    critic = ModelTimes.uniform("critic", 2, 4, 6.6, 13.2, 5.1)
    result = _seed_outcome(actor, critic)
    assert result.seed_caps == [None, None]
    exact = _exact(result)
    assert result.evaluation.makespan == pytest.approx(exact.makespan)
    assert exact.peak_memory <= result.evaluation.max_peak_memory <= 1.26 * result.bounds.memory


def test_the_seed_cap_follows_the_policy() -> None:
    """The policy is what caps the seeds: a `capped_seed_factor` every start fits under caps
    both seeds of the lean-start instance at that factor, and the same search again gives the
    same schedule (the policy and the seeds decide it)."""
    actor = ModelTimes.uniform("actor", 2, 4, 13.4, 26.8, 10.0)
    critic = ModelTimes.uniform("critic", 8, 4, 2.6, 5.2, 5.1)
    loose = SearchPolicy(capped_seed_factor=100.0)
    result = _seed_outcome(actor, critic, loose)
    assert result.seed_caps == [pytest.approx(100.0 * result.bounds.memory)] * 2
    again = _seed_outcome(actor, critic, loose)
    assert again.orders == result.orders and again.per_seed == result.per_seed


def test_a_policy_with_a_share_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="peak_share is a share"):
        SearchPolicy(peak_share=1.5)
    with pytest.raises(ValueError, match="cooling"):
        SearchPolicy(cooling=0.0)

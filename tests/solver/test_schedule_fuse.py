"""The fused schedule: greedy + annealing vs bounds, baselines and the exact CP-SAT optimum."""

from __future__ import annotations

import pytest
from repo_paths import EXAMPLES

from nereus.errors import NereusError
from nereus.solver.pipeline.baselines import one_f_one_b
from nereus.solver.pipeline.bounds import lower_bounds
from nereus.solver.pipeline.evaluate import evaluate
from nereus.solver.pipeline.from_plan import plan_pipelines
from nereus.solver.pipeline.model import ModelTimes, build_instance, single_problem
from nereus.solver.pipeline.search import FusedResult, SearchConfig, search_fused
from nereus.spec.io import load_document
from nereus.spec.plan import Plan

pytestmark = pytest.mark.logic

EXAMPLE = EXAMPLES / "plan-tiny-ppo-4rank.yaml"
# Iteration-bounded (the time limit is a generous safety net): results do not depend on machine load.
QUICK = SearchConfig(time_limit_s=30, seeds=1, max_iterations=3000)

# (actor stages, critic stages, micro-batches per model, actor F, B, critic F, B)
CASES = [
    (2, 2, 2, 5, 10, 4, 8),
    (2, 1, 4, 5, 10, 4, 8),
    (4, 2, 4, 5, 10, 4, 8),
    (4, 4, 4, 3, 6, 3, 6),
    (4, 4, 8, 5, 10, 2, 4),
    (8, 4, 8, 5, 10, 4, 8),
    (3, 3, 6, 2, 5, 1, 3),
]


def _fuse(case: tuple[int, ...], config: SearchConfig = QUICK, cap: float | None = None) -> FusedResult:
    sa, sc, m, fa, ba, fc, bc = case
    actor = ModelTimes.uniform("actor", sa, m, fa, ba, 1.95)
    critic = ModelTimes.uniform("critic", sc, m, fc, bc, 2.0)
    return search_fused(actor, critic, config, activation_cap=cap)


@pytest.mark.parametrize("case", CASES)
def test_fused_schedule_is_valid_and_never_worse_than_greedy(case: tuple[int, ...]) -> None:
    result = _fuse(case)
    ev = evaluate(result.instance, result.orders)
    assert ev.ok and ev.makespan == pytest.approx(result.evaluation.makespan)
    fused, greedy = result.evaluation, result.greedy
    assert fused.makespan <= greedy.makespan * (1 + 1e-9)
    if fused.makespan >= greedy.makespan * (1 - 1e-9):  # as fast (up to float sums): no more memory
        assert fused.max_peak_memory <= greedy.max_peak_memory
    bound = result.bounds.latency
    assert bound <= result.evaluation.makespan + 1e-9
    for baseline in result.baselines.values():
        assert bound <= baseline.makespan + 1e-9
    assert result.evaluation.makespan < result.baselines["serial-1f1b"].makespan


def test_lower_bounds_hold_for_single_model_baselines() -> None:
    inst = build_instance(single_problem(ModelTimes.uniform("a", 4, 6, 1.0, 2.0), 4))
    bounds = lower_bounds(inst)
    assert bounds.critical_path == pytest.approx(4 * 3)
    assert bounds.node_work == pytest.approx(6 * 3)
    # The last stage cannot start before 3 forwards, works 18, then 3 backwards must follow: 1F1B's
    # (m + p - 1)(F + B) = 27 meets this bound, so 1F1B is optimal here.
    assert bounds.arrival_work_tail == pytest.approx(3 * 1 + 18 + 3 * 2)
    assert bounds.latency == pytest.approx(evaluate(inst, one_f_one_b(inst)).makespan)
    assert bounds.memory == pytest.approx(4 * 1.0)


def test_activation_cap_is_respected_and_too_small_a_cap_is_an_error() -> None:
    case = (4, 4, 8, 5, 10, 2, 4)
    free = _fuse(case)
    cap = free.bounds.memory * 1.5
    capped = _fuse(case, cap=cap)
    assert capped.evaluation.max_peak_memory <= cap + 1e-9
    assert capped.evaluation.ok
    with pytest.raises(NereusError, match="too small"):
        _fuse(case, cap=1.0)


def test_parallel_seeds_in_processes() -> None:
    result = _fuse((4, 2, 8, 5, 10, 4, 8), SearchConfig(time_limit_s=30, seeds=2, max_iterations=2000))
    assert [seed for seed, _, _ in result.per_seed] == [0, 1]
    assert result.evaluation.makespan == pytest.approx(min(m for _, m, _ in result.per_seed))


@pytest.mark.parametrize("case", CASES[:4])
def test_exact_optimum_between_bound_and_heuristic(case: tuple[int, ...]) -> None:
    pytest.importorskip("ortools")
    from nereus.solver.pipeline.exact import solve_exact

    result = _fuse(case, SearchConfig(time_limit_s=30, seeds=1, max_iterations=20000))
    exact = solve_exact(result.instance, time_limit_s=30, workers=2, minimise_memory=False)
    assert exact.status == "optimal" and exact.makespan is not None and exact.evaluation is not None
    assert exact.evaluation.ok
    assert exact.makespan >= result.bounds.latency - 1e-6
    assert exact.makespan <= result.evaluation.makespan + 1e-6
    # On these tiny instances the heuristic is provably optimal: it matches CP-SAT's certified optimum.
    assert result.evaluation.makespan == pytest.approx(exact.makespan)


def test_plan_form_groups_stages_by_tp_ratio() -> None:
    plan = load_document(EXAMPLE)
    assert isinstance(plan, Plan)
    entries = {e.model_stage: e for e in plan.stages}
    critic = entries["critic/training"].model_copy(update={"tp": 1, "pp": 4, "emus": [[0, 1, 2, 3]], "dp": 1})
    actor = entries["actor/training"].model_copy(update={"tp": 2, "pp": 2, "emus": [[0, 1, 2, 3]], "dp": 1})
    stages = [actor if e.model_stage == "actor/training" else critic if e.model_stage == "critic/training" else e
              for e in plan.stages]  # fmt: skip
    relaid = plan.model_copy(update={"stages": stages})
    pipelines = plan_pipelines(relaid)
    # Critic tp=1 is half the actor's tp=2: two critic stages share a node, so 4 stages -> 2 groups.
    assert (pipelines.critic_group, pipelines.actor_group, pipelines.gpus_per_node) == (2, 1, 2)
    assert pipelines.critic.num_stages == 2 and pipelines.actor.num_stages == 2
    assert pipelines.activation_cap > 0
    result = search_fused(pipelines.actor, pipelines.critic, QUICK)
    assert result.evaluation.ok

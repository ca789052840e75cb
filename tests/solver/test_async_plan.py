"""Async execution planned and priced: the steady state of two pools, the split the planner
chooses against an exhaustive enumeration of every split, and what async cannot plan."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from nereus.cost.plan_cost import evaluate_plan, plan_cost_problems
from nereus.errors import NereusError
from nereus.solver.async_search import async_placements, async_search, reference_async_search
from nereus.solver.plan_search import PlanRequest, compile_problem, price_all
from nereus.solver.planner import build_plan, make_plan
from nereus.spec.plan import Plan
from nereus.spec.presets import cluster_preset, models_for, workload_preset
from nereus.spec.stages import ACTOR_GENERATION
from nereus.spec.workload import Workload
from tests.solver.test_plan_search import random_request

pytestmark = pytest.mark.logic

REL = 1e-9
#: Exhaustive assignments (summed over the async placements) a random case may have.
MAX_PRODUCT = 20_000


def as_async(workload: Workload, staleness: int = 1, partial: bool = False) -> Workload:
    return workload.model_copy(update={"execution": "async", "max_staleness": staleness, "partial_rollout": partial})


def async_request(request: PlanRequest, staleness: int = 1) -> PlanRequest:
    return dataclasses.replace(request, workload=as_async(request.workload, staleness))


def exhaustive_size(request: PlanRequest) -> int:
    layouts = async_placements(request)
    tables = price_all(request, layouts)
    return sum(math.prod(len(o) for o in compile_problem(request, p, tables, prune=False).options) for p in layouts)


def small_async_cases(count: int, staleness: int, first_seed: int) -> list[tuple[int, PlanRequest]]:
    """The first `count` seeded random requests (tests/solver/test_plan_search) with at least 2
    GPUs whose async enumeration is small enough."""
    out = []
    for seed in itertools.count(first_seed):
        request = random_request(seed)
        if request.num_gpus < 2:
            continue
        request = async_request(request, staleness)
        if exhaustive_size(request) <= MAX_PRODUCT:
            out.append((seed, request))
        if len(out) == count:
            return out
    raise AssertionError("unreachable")


def h100_request(workload: str, gpus: int = 64) -> PlanRequest:
    the_workload = workload_preset(workload)
    return PlanRequest(cluster_preset("h100", gpus), models_for(the_workload, None), the_workload, gpus)


@pytest.mark.parametrize("staleness", [1, 2, 0])
def test_the_planners_split_is_the_best_of_every_fixed_split(staleness: int) -> None:
    """On small random cases the planner's async plan is no slower than the best plan of any
    split the reference enumerates in full, and equals the best of them."""
    fitted = 0
    for seed, request in small_async_cases(40, staleness, first_seed=1000 * staleness):
        per_split = reference_async_search(request)
        found = async_search(request).candidates
        fixed = [c.step_time_s for c in per_split.values() if c is not None]
        assert bool(found) == bool(fixed), seed
        if not found:
            continue
        fitted += 1
        best = found[0].step_time_s
        assert all(best <= t * (1 + REL) for t in fixed), (seed, best, fixed)
        assert best == pytest.approx(min(fixed), rel=REL), seed
        plan = build_plan(request, found[0])  # its predictions equal the search's step (asserted there)
        assert plan.predictions is not None
        assert (plan.predictions.steady_state is not None) == (staleness >= 1), seed
    assert fitted >= 10  # the cases exercise feasible splits, not only refusals


def test_top_k_are_distinct_splits_or_layouts_in_order() -> None:
    request = async_request(h100_request("grpo"))
    found = async_search(request, top_k=4).candidates
    assert len(found) == 4
    times = [c.step_time_s for c in found]
    assert times == sorted(times)
    keys = {(c.placement.name, dict(c.choices)[ACTOR_GENERATION][3:6]) for c in found}
    assert len(keys) == 4


def test_steady_state_is_the_slower_pool_and_names_it() -> None:
    plan = make_plan(h100_request("grpo-async")).best
    predictions = plan.predictions
    assert predictions is not None and predictions.steady_state is not None
    steady, phases = predictions.steady_state, predictions.step_breakdown_s
    assert steady.generation_s == pytest.approx(phases["generation"], rel=REL)
    assert steady.training_s == pytest.approx(phases["inference"] + phases["training"] + phases["weight_sync"], rel=REL)
    assert predictions.step_time_s == pytest.approx(max(steady.generation_s, steady.training_s), rel=REL)
    assert steady.bound == ("generation" if steady.generation_s >= steady.training_s else "training")
    # the generation pool holds actor/generation alone, the other model-stages share the rest
    generation = set(plan.stage_plan(ACTOR_GENERATION).gpus)
    others = {g for e in plan.stages if e.model_stage != ACTOR_GENERATION for g in e.gpus}
    assert generation and others and not generation & others


def _with_workload(plan: Plan, **update: object) -> Plan:
    return plan.model_copy(update={"workload": plan.workload.model_copy(update=update), "predictions": None})


def test_staleness_zero_prices_the_sync_composition_of_the_same_layouts() -> None:
    plan = make_plan(h100_request("grpo-async")).best
    zero = evaluate_plan(_with_workload(plan, max_staleness=0)).predictions
    sync = evaluate_plan(_with_workload(plan, execution="sync", max_staleness=None)).predictions
    assert zero.steady_state is None
    assert zero.step_time_s == sync.step_time_s
    assert zero.step_breakdown_s == sync.step_breakdown_s
    overlapped = evaluate_plan(plan).predictions
    assert overlapped.step_time_s < zero.step_time_s  # overlap pays on this split


def test_async_beats_sync_where_generation_and_training_both_take_time() -> None:
    sync = make_plan(h100_request("grpo")).best.predictions
    asynchronous = make_plan(h100_request("grpo-async")).best.predictions
    assert sync is not None and asynchronous is not None
    assert asynchronous.step_time_s < sync.step_time_s


def test_staleness_zero_plans_like_sync_on_a_split() -> None:
    """k = 0: the async search's best equals the synchronous search restricted to the same splits."""
    request = async_request(h100_request("grpo", 16), staleness=0)
    found = async_search(request).candidates[0]
    reference = reference_size_free_sync_best(request)
    assert found.step_time_s == pytest.approx(reference, rel=REL)


def reference_size_free_sync_best(request: PlanRequest) -> float:
    """The best synchronous objective over the async placements (the sync branch and bound per placement)."""
    from nereus.solver.plan_search import _TopK, branch_and_bound

    layouts = async_placements(request)
    tables = price_all(request, layouts)
    best = _TopK(1)
    for placement in layouts:
        branch_and_bound(compile_problem(request, placement, tables, prune=True), best)
    return best.sorted()[0].step_time_s


def test_async_on_one_gpu_is_one_line() -> None:
    request = async_request(h100_request("grpo", 1))
    with pytest.raises(NereusError) as error:
        make_plan(request)
    message = str(error.value)
    assert "\n" not in message and "execution: async" in message and "at least 2 GPUs" in message


def test_an_async_plan_with_generation_sharing_gpus_is_refused() -> None:
    sync_plan = make_plan(h100_request("grpo", 8)).best
    assert len(sync_plan.pools) == 1  # colocated
    plan = _with_workload(sync_plan, execution="async")
    problems = [p for p in plan_cost_problems(plan) if p.path == "workload.execution"]
    assert len(problems) == 1 and "pool of its own" in problems[0].message
    assert evaluate_plan(plan).predictions.steady_state is None  # priced as what it can run: in turns


def test_nereus_run_refuses_an_async_plan_without_pools_in_one_line() -> None:
    """The async run loop needs actor/generation on ranks of its own: a colocated plan is
    refused in one line rather than run synchronously."""
    from repo_paths import ROOT

    from nereus.solver.admission import plan_problems
    from nereus.spec.io import load_document
    from nereus.spec.run_config import RLConfig

    plan = load_document(ROOT / "examples" / "plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan, Plan)
    assert not [p for p in plan_problems(plan, 4, RLConfig()) if "execution" in p]
    refused = [p for p in plan_problems(_with_workload(plan, execution="async"), 4, RLConfig()) if "execution" in p]
    assert len(refused) == 1 and "shares ranks with another model-stage" in refused[0], refused

"""Expert parallelism in the plan search: exact against the exhaustive reference on small
mixture-of-experts cases, searched only for models with experts, pinned by `expert_parallel`."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
from test_plan_search import MAX_PRODUCT, assert_matches_reference, exhaustive_size, random_request

from nereus.solver.layouts import EP, MemoryChoices
from nereus.solver.plan_search import PlanRequest, placements, price_all
from nereus.solver.planner import make_plan
from nereus.spec.check import semantic_problems
from nereus.spec.model import MoE
from nereus.spec.presets import cluster_preset, models_for, workload_preset

pytestmark = pytest.mark.logic


def moe_request(seed: int) -> PlanRequest:
    """`random_request`'s case with every model given experts (2 to 8, 1 or 2 per token, a
    random expert width), ep searched and cp pinned off (ep with cp is refused)."""
    request = random_request(seed)
    rng = random.Random(seed + 7)
    models = []
    for model in request.models:
        experts = rng.choice([2, 4, 8])
        moe = MoE(num_experts=experts, experts_per_token=rng.choice([1, 2]), expert_ffn_dim=rng.choice([8, 16, 32]))
        models.append(model.model_copy(update={"moe": moe}))
    choices = MemoryChoices(context_parallel=(False,))
    return dataclasses.replace(request, models=tuple(models), choices=choices)


def ep_cases(count: int, start: int = 0) -> list[tuple[int, PlanRequest]]:
    """The first `count` seeded MoE cases whose exhaustive product is small enough and whose
    option tables list some ep > 1 option."""
    out: list[tuple[int, PlanRequest]] = []
    seed = start
    while len(out) < count:
        request = moe_request(seed)
        if exhaustive_size(request) <= MAX_PRODUCT:
            tables = price_all(request, placements(request))
            if any(o[EP] > 1 for table in tables.values() for o in table.options):
                out.append((seed, request))
        seed += 1
    return out


@pytest.mark.slow
def test_search_with_ep_matches_reference() -> None:
    """With ep searched on every model-stage of small mixtures of experts, the exact search finds
    the exhaustive enumeration's best step and its top 3; every candidate builds into a plan that
    passes the checks with its stated time, and some optima use ep."""
    stats: Counter[str] = Counter()
    for seed, request in ep_cases(25):
        slow = assert_matches_reference(seed, request)
        if slow.candidates and any(o[EP] > 1 for _, o in slow.candidates[0].choices):
            stats["optimum_uses_ep"] += 1
    # Today 2 of the 25 optima use ep.
    assert stats["optimum_uses_ep"] >= 1, stats


def test_search_with_ep_matches_reference_on_a_few_cases() -> None:
    """The reference check on the first 3 cases (the fast tier's share of the slow test above)."""
    for seed, request in ep_cases(3):
        assert_matches_reference(seed, request)


def test_dense_models_never_get_ep_and_moe_tables_list_every_divisor() -> None:
    """A dense model's option tables hold ep = 1 only; a mixture of 8 experts lists ep 2, 4
    and 8 (each dividing the experts) wherever the pool holds them."""
    dense = random_request(3)
    tables = price_all(dense, placements(dense))
    assert {o[EP] for table in tables.values() for o in table.options} == {1}
    seed, moe = ep_cases(1)[0]
    degrees = {o[EP] for table in price_all(moe, placements(moe)).values() for o in table.options}
    experts = {m.moe.num_experts for m in moe.models if m.moe is not None}
    assert degrees - {1}, seed
    assert all(any(e % d == 0 for e in experts) for d in degrees), (seed, degrees)


def test_qwen3_moe_on_16_h100s_plans_ep_and_pinning_it_off_is_slower() -> None:
    """Qwen3-30B-A3B GRPO on 16 H100s: the plan splits the experts of some model-stage (ep > 1),
    its built plan passes the checks, and pinning ep to 1 gives a slower step (never a faster one:
    the pinned space is a subset)."""
    workload = workload_preset("grpo", "qwen3-30b-a3b")
    request = PlanRequest(cluster_preset("h100", 16), models_for(workload, None), workload, 16)
    best = make_plan(request).best
    pinned = make_plan(dataclasses.replace(request, choices=MemoryChoices(expert_parallel=(False,)))).best
    assert any(entry.ep > 1 for entry in best.stages)
    assert all(entry.ep == 1 for entry in pinned.stages)
    assert [p for p in semantic_problems(best) if p.severity == "error"] == []
    assert best.predictions is not None and pinned.predictions is not None
    assert best.predictions.step_time_s < pinned.predictions.step_time_s


def test_pinning_ep_on_plans_ep_on_every_model_stage() -> None:
    """`expert_parallel=(True,)` leaves only ep > 1 layouts for a mixture of experts."""
    workload = workload_preset("grpo", "qwen3-30b-a3b")
    request = PlanRequest(
        cluster_preset("h100", 16),
        models_for(workload, None),
        workload,
        16,
        choices=MemoryChoices(expert_parallel=(True,)),
    )
    best = make_plan(request).best
    assert all(entry.ep > 1 for entry in best.stages)

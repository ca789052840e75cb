"""Published mixture-of-experts RL set-ups (nereus/spec/moe_setups.py holds them as documents
with their layouts): each reads as a valid workload, cites its recipe at a commit, and gets a
memory-feasible nereus plan on its GPU count of H100s; the recipes' layouts that nereus can
express pass its checks, the one it cannot is refused by name."""

from __future__ import annotations

import pytest

from nereus.cost.plan_cost import evaluate_plan
from nereus.solver.plan_search import PlanRequest
from nereus.solver.planner import make_plan
from nereus.spec.check import plan_problems
from nereus.spec.moe_setups import SETUPS, published_plan
from nereus.spec.presets import cluster_preset, models_for

pytestmark = pytest.mark.logic


@pytest.mark.parametrize("name", list(SETUPS))
def test_each_setup_cites_its_recipe_and_reads_as_a_workload(name: str) -> None:
    setup = SETUPS[name]
    assert setup.url.startswith("https://github.com/") and "/blob/" in setup.url
    assert len(setup.url.split("/blob/")[1].split("/")[0]) == 40  # pinned to a commit
    workload = setup.workload()
    assert workload.name == name
    model = models_for(workload, None)[0]
    assert model.moe is not None and model.moe.num_experts % setup.train_ep == 0


@pytest.mark.parametrize("name", list(SETUPS))
def test_each_setup_gets_a_memory_feasible_nereus_plan(name: str) -> None:
    setup = SETUPS[name]
    workload = setup.workload()
    request = PlanRequest(cluster_preset("h100", setup.gpus), models_for(workload, None), workload, setup.gpus)
    best = make_plan(request).best
    assert [p for p in plan_problems(best) if p.severity == "error"] == []
    evaluation = evaluate_plan(best)
    assert evaluation.feasible, evaluation.memory_problems
    assert best.predictions is not None
    assert best.predictions.step_time_s == pytest.approx(evaluation.predictions.step_time_s)


def test_the_expressible_recipe_layouts_pass_the_checks_and_uneven_pipelines_are_named() -> None:
    for name, setup in SETUPS.items():
        plan = published_plan(setup, cluster_preset("h100", setup.gpus))
        errors = [f"{p.path}: {p.message}" for p in plan_problems(plan) if p.severity == "error"]
        assert all(entry.replica_size * entry.dp == setup.gpus for entry in plan.stages), name
        if name == "verl-grpo-qwen3-235b-a22b":  # TP 4 x PP 8 x EP 4 on 94 layers: uneven stages
            assert errors and all("pp=8 does not divide the 94 layers" in e for e in errors), errors
        else:
            assert errors == [], (name, errors)
            assert plan.stage_plan("actor/training").ep == setup.train_ep

"""Recompute levels in the cost model and the planner: what `full` and `selective` keep and
cost, the code a plan entry maps to, and `nereus plan --recompute` (pure logic tier)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_cost_model import CLUSTER, TINY, cost, workload

from nereus.cost.plan_cost import stage_choices
from nereus.cost.stage import KORTHIKANTI_BYTES_PER_SBH, RECOMPUTE_BYTES_PER_SBH, SELECTIVE_SAVED_BYTES_PER_SBF
from nereus.solver.layouts import MemoryChoices
from nereus.solver.planner import PlanRequest, make_plan
from nereus.spec.plan import RECOMPUTE_LEVELS, StagePlan
from tests.cli_helpers import invoke, one_error_line

pytestmark = pytest.mark.logic


def activations(recompute: int, tp: int = 2, pp: int = 2, m: int = 4) -> float:
    return float(cost("training", workload()).memory_terms(tp, pp, 1, m, recompute=recompute)["activations"])


def test_each_level_keeps_what_the_runtime_keeps() -> None:
    c = cost("training", workload())
    tp, pp, m = 2, 2, 4
    tokens = c.micro_batch_tokens(1, m)
    sbh = tokens * TINY.hidden_dim * c.dtype_bytes / 2
    layers, in_flight = TINY.num_layers / pp, min(pp, m)
    one_layer = KORTHIKANTI_BYTES_PER_SBH * sbh / tp
    assert activations(0) == pytest.approx(one_layer * layers * in_flight)
    # full: each layer's (whole, tp-replicated) input, and one layer rerun in the backward, in
    # the room of the logits the head's backward has freed before it (only the excess counts)
    rerun = max(one_layer - c.logits_bytes(tokens, tp), 0.0)
    assert 0 < rerun < one_layer  # this tiny model's logits are smaller than a layer's working set
    assert activations(1) == pytest.approx(RECOMPUTE_BYTES_PER_SBH * sbh * layers * in_flight + rerun)
    # selective: all but the gate activation's output (ffn wide), nothing rerun beyond it and the core
    dropped = SELECTIVE_SAVED_BYTES_PER_SBF * sbh * TINY.ffn_dim / TINY.hidden_dim / tp
    assert activations(2) == pytest.approx((one_layer - dropped) * layers * in_flight)
    assert activations(1) < activations(2) < activations(0)


def test_selective_reruns_only_the_attention_flops() -> None:
    c = cost("training", workload())
    args = (np.array([2.0]), np.array([1.0]), np.array([1.0]), np.array([4.0]), False, False)
    compute = [float(c.time_terms(*args, recompute=level)["compute"][0]) for level in (0, 1, 2)]
    none, full, selective = compute
    assert none < selective < full
    assert full == pytest.approx(none * 4 / 3)


def test_a_plan_entry_maps_to_its_level_code() -> None:
    entry = StagePlan(model_stage="actor/training", pool="p", tp=1, pp=1, dp=1, emus=[[0]], recompute="selective")
    assert stage_choices(entry)["recompute"] == RECOMPUTE_LEVELS.index("selective") == 2
    with pytest.raises(ValueError, match="recompute applies to training model-stages only"):
        StagePlan(model_stage="actor/inference", pool="p", tp=1, pp=1, dp=1, emus=[[0]], recompute="selective")


def test_the_planner_writes_the_level_it_searched() -> None:
    request = PlanRequest(CLUSTER, (TINY,), workload(), 8)
    for level in RECOMPUTE_LEVELS:
        plan = make_plan(dataclasses.replace(request, choices=MemoryChoices(recompute=(level,)))).best
        assert plan.stage_plan("actor/training").recompute == level
        assert all(s.recompute == "none" for s in plan.stages if s.stage != "training")


def test_plan_takes_selective_and_names_every_level() -> None:
    result = invoke("plan", "--gpus", "8", "--cluster", "h100", "--model", "llama-3.1-8b", "--workload", "ppo")
    assert result.exit_code == 0, result.output
    selective = invoke(
        "plan", "--gpus", "8", "--cluster", "h100", "--model", "llama-3.1-8b", "--workload", "ppo",
        "--recompute", "selective", "--json",
    )  # fmt: skip
    assert selective.exit_code == 0, selective.output
    assert '"recompute": "selective"' in selective.output
    line = one_error_line(invoke("plan", "--gpus", "8", "--recompute", "some"))
    assert "--recompute some: use none, full, selective or search" in line

"""The simulator replays a drift trace under async execution: the steady state between plan
changes, a pipeline refill (the synchronous composition) after each, policies deciding at
step boundaries (each a weight-sync boundary in the steady state)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import invoke

from nereus.solver.plan_search import PlanRequest
from nereus.solver.planner import make_plan
from nereus.solver.policy import Replanner, make_policy
from nereus.solver.simulate import simulate
from nereus.solver.traces import DEFAULT_SHAPE, GrowthConfig, SpotConfig, combined_trace, scaled_lengths
from nereus.spec.io import save_document
from nereus.spec.plan import Plan
from nereus.spec.presets import cluster_preset, model_preset, workload_preset
from nereus.spec.trace import trace_conditions

pytestmark = pytest.mark.logic

GPUS = 16


@pytest.fixture(scope="module")
def plan() -> Plan:
    workload = workload_preset("grpo-async").model_copy(update={"response_len": scaled_lengths(DEFAULT_SHAPE, 500)})
    request = PlanRequest(cluster_preset("h100", GPUS), (model_preset("llama-3.1-8b"),), workload, GPUS)
    best = make_plan(request).best
    assert best.predictions is not None and best.predictions.steady_state is not None
    return best


def test_a_plan_fills_the_pipeline_then_runs_the_steady_state(plan: Plan) -> None:
    trace = combined_trace(30, GPUS, GrowthConfig(every_steps=5, end_tokens=2000), SpotConfig(num_changes=0), seed=1)
    replanner = Replanner(plan)
    result = simulate(trace, make_policy("fixed", plan, replanner))
    changed = [d.step for d in result.decisions if d.action in ("transition", "restart")]
    first_change = min(changed, default=len(result.steps))
    assert first_change > 1
    conditions = list(trace_conditions(trace))
    first, *rest = result.steps[:first_change]
    assert first.pipeline_fill and not any(r.pipeline_fill for r in rest)
    assert {r.step for r in result.steps if r.pipeline_fill} == {0, *changed}
    fill = replanner.fill_time(plan, conditions[0].response_len, conditions[0].efficiency)
    steady = replanner.step_time(plan, conditions[0].response_len, conditions[0].efficiency)
    assert fill is not None and steady is not None
    assert first.latency_s == pytest.approx(fill)
    assert fill > steady  # the empty pipeline pays generation and training in turn
    for record in rest:
        seen = conditions[record.step]
        assert record.latency_s == pytest.approx(replanner.step_time(plan, seen.response_len, seen.efficiency))


def test_every_plan_change_refills_the_pipeline(plan: Plan) -> None:
    trace = combined_trace(60, GPUS, GrowthConfig(every_steps=5, end_tokens=2000), SpotConfig(num_changes=11), seed=1)
    result = simulate(trace, make_policy("nereus", plan))
    changed = {d.step for d in result.decisions if d.action in ("transition", "restart")}
    assert changed, "the trace should make the policy move"
    resumed = set()
    for before, record in zip(result.steps, result.steps[1:], strict=False):
        if before.latency_s is None and record.latency_s is not None:
            resumed.add(record.step)
    fills = {r.step for r in result.steps if r.pipeline_fill}
    assert fills == ({result.steps[0].step} | changed | resumed) - {r.step for r in result.steps if r.latency_s is None}


def test_simulate_compare_replays_async(plan: Plan, tmp_path: Path) -> None:
    trace = combined_trace(40, GPUS, GrowthConfig(every_steps=5, end_tokens=2000), SpotConfig(num_changes=5), seed=2)
    save_document(plan, tmp_path / "plan.yaml")
    save_document(trace, tmp_path / "trace.yaml")
    shown = invoke("simulate", tmp_path / "trace.yaml", "--plan", tmp_path / "plan.yaml", "--compare")
    assert shown.exit_code == 0, shown.output
    assert "fills" in shown.output and "async: steady state" in shown.output
    result = invoke("simulate", tmp_path / "trace.yaml", "--plan", tmp_path / "plan.yaml", "--compare", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["results"]
    assert [r["policy"] for r in rows] == ["nereus", "fixed", "dynarl", "periodic:3"]
    assert all(r["num_pipeline_fills"] >= 1 + r["num_transitions"] for r in rows)

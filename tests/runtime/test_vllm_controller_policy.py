"""The online controller under `generation.engine: vllm`, without starting vLLM: its replanner
prices a move that changes actor/generation's layout with the engines it rebuilds, it refuses
plans whose generation layout vLLM's external launcher cannot run, and it logs each move once
the ranks made it, with the measured cost beside the predicted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereus.cost.calibration import Calibration
from nereus.runtime.run.controller import Controller
from nereus.runtime.run.resolve import resolve_switches
from nereus.solver.transition.schedule import build_transition
from nereus.spec.io import load_document, save_document
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig, RunConfig
from nereus.spec.stages import ACTOR_GENERATION
from nereus.spec.trace import Trace

pytestmark = pytest.mark.logic

DATA = Path(__file__).parent.parent / "data"


def fixtures() -> tuple[Plan, Trace]:
    plan = load_document(DATA / "plan-tiny-ppo-2rank.yaml")
    trace = load_document(DATA / "trace-spot-2rank.yaml")
    assert isinstance(plan, Plan) and isinstance(trace, Trace)
    return plan, trace


def with_generation(plan: Plan, tp: int, emus: list[list[int]]) -> Plan:
    stages = [
        s.model_copy(update={"tp": tp, "dp": len(emus), "emus": emus}) if s.model_stage == ACTOR_GENERATION else s
        for s in plan.stages
    ]
    return plan.model_copy(update={"stages": stages, "predictions": None})


def test_moves_are_priced_with_the_vllm_engines_they_rebuild(tmp_path: Path) -> None:
    plan, trace = fixtures()
    calibration = Calibration()
    vllm = Controller(plan, trace, "nereus", tmp_path, RLConfig(), 6, 2, calibration, "vllm")
    own = Controller(plan, trace, "nereus", tmp_path, RLConfig(), 6, 2, calibration)
    assert (vllm.replanner.engine, own.replanner.engine) == ("vllm", "nereus")
    two_engines = with_generation(plan, 1, [[0], [1]])  # tp=2 x dp=1 -> tp=1 x dp=2
    priced = vllm.replanner.transition(plan, two_engines).cost_s
    unpriced = own.replanner.transition(plan, two_engines).cost_s
    assert priced - unpriced >= calibration.vllm_engine_start_s
    assert priced == pytest.approx(build_transition(plan, two_engines, calibration, "vllm").makespan_s)
    # A move that keeps actor/generation's layout starts no engine.
    critic = [s.model_copy(update={"tp": 2, "dp": 1, "emus": [[0, 1]]}) if s.model_stage == "critic/inference" else s
              for s in plan.stages]  # fmt: skip
    kept = plan.model_copy(update={"stages": critic, "predictions": None})
    assert vllm.replanner.transition(plan, kept).cost_s == pytest.approx(own.replanner.transition(plan, kept).cost_s)


def test_plans_vllm_cannot_generate_under_are_refused(tmp_path: Path) -> None:
    plan, trace = fixtures()
    vllm = Controller(plan, trace, "nereus", tmp_path, RLConfig(), 6, 2, Calibration(), "vllm")
    own = Controller(plan, trace, "nereus", tmp_path, RLConfig(), 6, 2, Calibration())
    on_rank_1 = with_generation(plan, 1, [[1]])  # not every rank, in order: no external launcher layout
    assert not own.refusal(on_rank_1)
    (problem,) = vllm.refusal(on_rank_1)
    assert problem.startswith("generation.engine: vllm: actor/generation runs on [[1]]"), problem
    assert not vllm.refusal(with_generation(plan, 1, [[0], [1]]))


def test_a_move_is_logged_with_its_measured_cost_once_made(tmp_path: Path) -> None:
    plan, trace = fixtures()
    controller = Controller(plan, trace, "dynarl", tmp_path, RLConfig(), 6, 2, Calibration(), "vllm")
    log = tmp_path / "decisions.jsonl"
    for step in range(6):
        move = controller.decide(step)
        if move is None:
            continue
        logged = log.read_text().splitlines() if log.exists() else []
        assert all(json.loads(line)["observation"]["step"] < step for line in logged)
        controller.moved(1.5)
        record = json.loads(log.read_text().splitlines()[-1])
        assert record["observation"]["step"] == step and record["decision"]["action"] == move.action
        assert record["measured_cost_s"] == 1.5 and record["engine"] == "vllm"
        assert record["decision"]["transition_cost_s"] == pytest.approx(move.predicted_s) or move.action == "restart"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["observation"]["step"] for r in records] == list(range(6))
    assert any("measured_cost_s" in r for r in records)
    controller.moved(2.0)  # a configured plan switch: nothing of the controller's to log
    assert len(log.read_text().splitlines()) == 6


def test_plan_switches_are_priced_with_the_runs_calibration(tmp_path: Path) -> None:
    """A `calibration:` fitted from earlier vLLM runs prices the engines a configured switch rebuilds."""
    plan, _ = fixtures()
    save_document(with_generation(plan, 1, [[0], [1]]), tmp_path / "two-engines.yaml")
    config = RunConfig.model_validate(
        {"num_steps": 3, "generation": {"engine": "vllm"}, "plan_switches": [{"step": 1, "plan": "two-engines.yaml"}]}
    )
    (default,) = resolve_switches(config, tmp_path, plan, 2)
    fitted = Calibration(vllm_engine_start_s=Calibration().vllm_engine_start_s + 300.0)
    (calibrated,) = resolve_switches(config, tmp_path, plan, 2, fitted)
    assert calibrated.move.predicted_s - default.move.predicted_s == pytest.approx(300.0, rel=0.01)

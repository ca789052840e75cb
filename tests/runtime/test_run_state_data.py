"""Rank 0's run state round-trips through its JSON document exactly: a rebuilt predictor
calibrates and a rebuilt controller decides as the originals do."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus.cost.calibration import Calibration
from nereus.errors import NereusError
from nereus.runtime.run.controller import Controller, Predictor
from nereus.runtime.run.run_state import RunStateData, read_run_state
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig
from nereus.spec.run_folder import StepMetrics
from nereus.spec.trace import Trace

pytestmark = pytest.mark.logic

DATA = Path(__file__).parent.parent / "data"


def metrics(step: int, seconds: float, longest: int) -> StepMetrics:
    stages = {"actor/generation": 0.4 * seconds, "actor/training": 0.3 * seconds, "critic/training": 0.1 * seconds}
    return StepMetrics(
        step=step, reward=0.0, score=0.0, kl=0.0, response_len_mean=longest - 1, response_len_min=1,
        response_len_max=longest, prompt_len=8, actor_loss=0.0, critic_loss=0.0, step_seconds=seconds,
        stage_seconds=stages, state_bytes_per_rank=[1 << 20, 1 << 20],
    )  # fmt: skip


def roundtrip(data: RunStateData, tmp_path: Path) -> RunStateData:
    path = tmp_path / "controller.json"
    path.write_text(data.model_dump_json())
    return read_run_state(path)


def test_predictor_and_controller_continue_identically_after_a_roundtrip(tmp_path: Path) -> None:
    plan = load_document(DATA / "plan-tiny-ppo-2rank.yaml")
    trace = load_document(DATA / "trace-spot-2rank.yaml")
    assert isinstance(plan, Plan) and isinstance(trace, Trace)
    config = RLConfig()
    predictor = Predictor(Calibration(), True, config)
    controller = Controller(plan, trace, "nereus", tmp_path, config, 8, 2, Calibration())
    for step in range(3):
        controller.decide(step)
        predictor.predict(plan, 8, 6 + step)
        record = metrics(step, 1.0 + 0.3 * step, 6 + step)
        predictor.update(plan, record)
        controller.measured(record, predictor.calibration)
    predictor.predict(plan, 8, 9)
    predictor.defer(plan, metrics(3, 2.0, 9))
    data = RunStateData(predictor=predictor.state(), controller=controller.state(), plan_index=1)
    again = roundtrip(data, tmp_path)
    assert again.model_dump_json() == data.model_dump_json()
    rebuilt = Predictor.from_state(again.predictor, config, lambda record: StepMetrics(**record))
    other = Controller(plan, trace, "nereus", tmp_path, config, 8, 2, Calibration())
    assert again.controller is not None
    other.restore(again.controller)
    assert rebuilt.state() == predictor.state() and other.state() == controller.state()
    for twin in (predictor, rebuilt):
        twin.flush()
    assert rebuilt.calibration == predictor.calibration  # bitwise: the same least squares
    for step in range(4, 7):
        assert other.decide(step) == controller.decide(step)
        assert other.policy.log[-1] == controller.policy.log[-1]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[]", "format: must be 'nereus-run-state'"),
        ('{"format": "nereus-run-state", "version": 9}', "version: 9 is not one"),
        ('{"format": "nereus-run-state", "version": 1, "plan_index": 0}', "predictor: Field required"),
        ("{not json", "not valid JSON"),
    ],
)
def test_a_bad_run_state_is_refused_naming_the_field(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "controller.json"
    path.write_text(text)
    with pytest.raises(NereusError, match=expected):
        read_run_state(path)

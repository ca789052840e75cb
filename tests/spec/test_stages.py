"""The model-stage table: names, role facts, labels, and step records read apart by kind."""

from __future__ import annotations

import pytest

from nereus.spec import stages
from nereus.spec.run_config import RLConfig
from nereus.spec.run_folder import step_record

pytestmark = pytest.mark.logic


def test_every_model_stage_splits_into_its_role_and_stage_and_back():
    for name in stages.MODEL_STAGES:
        role, stage = stages.split(name)
        assert (stages.role_of(name), stages.stage_of(name)) == (role, stage)
        assert stages.model_stage(role, stage) == name
        assert stages.is_model_stage(name) and not stages.is_phase(name)
        assert stages.is_trained(name) == (stage == "training")
        assert stages.STAGES[stages.stage_order(name)] == stage
    assert stages.TRAINED_STAGES == (stages.ACTOR_TRAINING, stages.CRITIC_TRAINING)


@pytest.mark.parametrize("name", ["exchange", "actor", "actor/", "actor/rollout", "critic/generation", ""])
def test_anything_else_is_no_model_stage(name):
    assert not stages.is_model_stage(name)
    with pytest.raises(ValueError, match="unknown model-stage"):
        stages.split(name)


def test_a_pair_without_a_model_stage_is_refused():
    with pytest.raises(ValueError, match="'reward' has no 'training' model-stage"):
        stages.model_stage("reward", "training")


def test_every_role_names_a_learning_rate_field_of_the_run_config():
    config = RLConfig()
    for role, info in stages.ROLE_INFO.items():
        assert info.role == role
        assert isinstance(getattr(config, info.lr_field), float)
        assert info.trained == any(stages.role_of(n) == role for n in stages.TRAINED_STAGES)
    assert stages.head_of("critic") == stages.head_of("reward") == "value"
    assert stages.head_of("actor") == stages.head_of("reference") == "lm"


def test_labels_of_the_progress_line():
    shown = [*stages.MODEL_STAGES, *stages.PHASES]
    assert [stages.label(name) for name in shown] == [
        "gen", "act-inf", "ref", "rew", "crit-inf", "act-train", "crit-train",
        "adv", "xchg", "sync", "transition", "restart",
    ]  # fmt: skip


def test_a_step_record_reads_its_model_stages_and_phases_apart():
    seconds = {"actor/generation": 1.0, "exchange": 0.25, "actor/training": 0.5, "transition": 2.0}
    record = step_record(
        "metrics.jsonl: line 1", {"step": 0, "reward": 0.0, "step_seconds": 2.0, "stage_seconds": seconds}
    )
    assert record.stage_seconds == seconds
    assert record.model_stage_seconds == {"actor/generation": 1.0, "actor/training": 0.5}
    assert record.phase_seconds == {"exchange": 0.25, "transition": 2.0}
    assert set(stages.PLAN_CHANGES) <= set(stages.PHASES)

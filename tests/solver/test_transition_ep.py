"""Transitions of plans with expert parallelism: an ep > 1 replica is neither one copy of its
state nor ep copies (non-expert weights replicated, experts split by blocks), so a transition
touching one is refused in one line naming the model-stage and the way out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from nereus.errors import NereusError
from nereus.solver.transition import build_transition
from nereus.spec.io import document_from_data
from nereus.spec.plan import Plan

pytestmark = pytest.mark.logic

ROOT = Path(__file__).resolve().parents[2]
TRAINING = 5  # actor/training in the example plan (tp=1, pp=2, dp=2 on GPUs 0-3)


def _plan(**training: Any) -> Plan:
    data = yaml.safe_load((ROOT / "examples" / "plan-tiny-ppo-4rank.yaml").read_text())
    data.pop("predictions", None)
    data["models"][0]["moe"] = {"num_experts": 4, "experts_per_token": 2, "expert_ffn_dim": 32}
    data["stages"][TRAINING].update(training)
    plan = document_from_data(data, "plan.yaml")
    assert isinstance(plan, Plan)
    return plan


@pytest.mark.parametrize("ep_side", ["source", "target"])
def test_a_transition_touching_ep_is_refused_by_name(ep_side: str) -> None:
    ep2 = _plan(tp=1, pp=1, ep=2, dp=2, emus=[[0, 1], [2, 3]], micro_batches=1)
    dp4 = _plan(tp=1, pp=1, dp=4, emus=[[0], [1], [2], [3]], micro_batches=1)
    source, target = (ep2, dp4) if ep_side == "source" else (dp4, ep2)
    with pytest.raises(NereusError) as raised:
        build_transition(source, target)
    message = str(raised.value)
    assert message == (
        "actor/training: transitions of expert-parallel model-stages (ep=2) are not planned yet; plan both sides "
        "with `nereus plan --expert-parallel off` to move this state"
    )
    assert "\n" not in message


def test_an_moe_plan_at_ep_1_transitions_as_before() -> None:
    dp2 = _plan(tp=1, pp=1, dp=2, emus=[[0], [1]], micro_batches=1)
    dp4 = _plan(tp=1, pp=1, dp=4, emus=[[0], [1], [2], [3]], micro_batches=1)
    result = build_transition(dp2, dp4)
    assert any(p.model_stage == "actor/training" for p in result.primitives)

"""Transitions of plans with context parallelism: a cp > 1 replica is cp copies of its (tp, pp)
boxes (its cp ranks hold the same state), so the DAG moves what the boxes need and no more."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from nereus.solver.transition import build_transition, plan_emus
from nereus.solver.transition.check import check_result
from nereus.solver.transition.schedule import state_replicas
from nereus.spec.io import document_from_data
from nereus.spec.plan import Plan, StagePlan

pytestmark = pytest.mark.logic

ROOT = Path(__file__).resolve().parents[2]
TRAINING = 5  # actor/training in the example plan (tp=1, pp=2, dp=2 on GPUs 0-3)


def _plan(**training: Any) -> Plan:
    data = yaml.safe_load((ROOT / "examples" / "plan-tiny-ppo-4rank.yaml").read_text())
    data.pop("predictions", None)
    data["stages"][TRAINING].update(training)
    plan = document_from_data(data, "plan.yaml")
    assert isinstance(plan, Plan)
    return plan


def test_state_replicas_follow_the_emu_order() -> None:
    """GPU (s, c, r) of an EMU is entry (s * cp + c) * tp + r; cp rank c's copy is its (s, r) grid."""
    entry = StagePlan(
        model_stage="actor/training", pool="all", tp=2, pp=2, cp=2, dp=1, emus=[[10, 11, 12, 13, 14, 15, 16, 17]]
    )
    assert state_replicas(entry) == [[10, 11, 14, 15], [12, 13, 16, 17]]
    plain = entry.model_copy(update={"cp": 1, "pp": 4})
    assert state_replicas(plain) == plain.emus


def test_changing_only_cp_moves_nothing() -> None:
    """tp 1 x cp 2 x dp 2 and tp 1 x cp 1 x dp 4 on the same GPUs hold the same copies."""
    cp2 = _plan(tp=1, pp=1, cp=2, dp=2, emus=[[0, 1], [2, 3]], micro_batches=1)
    dp4 = _plan(tp=1, pp=1, cp=1, dp=4, emus=[[0], [1], [2], [3]], micro_batches=1)
    assert plan_emus(cp2)["actor/training"] == plan_emus(dp4)["actor/training"]
    result = build_transition(cp2, dp4)
    assert [p for p in result.primitives if p.model_stage == "actor/training"] == []


def test_cp_to_tp_merges_the_copies() -> None:
    """tp 1 x cp 2 -> tp 2 on the same GPU pairs: each pair's two whole copies become one tp-2 replica."""
    cp2 = _plan(tp=1, pp=1, cp=2, dp=2, emus=[[0, 1], [2, 3]], micro_batches=1)
    tp2 = _plan(tp=2, pp=1, cp=1, dp=2, emus=[[0, 1], [2, 3]], micro_batches=1)
    for a, b in ((cp2, tp2), (tp2, cp2)):
        result = build_transition(a, b)
        moved = [p for p in result.primitives if p.model_stage == "actor/training"]
        assert moved, "the layout changes: some primitive must reshard actor/training"
        assert check_result(result, a, b) == []

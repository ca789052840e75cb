"""Helpers shared by the transition tests (imported as a sibling module)."""

from __future__ import annotations

from nereus.spec.plan import Plan, StagePlan


def relayout(plan: Plan, model_stage: str, tp: int, pp: int, emus: list[list[int]]) -> Plan:
    """`plan` with one model-stage moved to layout (tp, pp) on `emus`; predictions dropped."""
    stages = [
        StagePlan(
            model_stage=e.model_stage, pool=e.pool, tp=tp, pp=pp, dp=len(emus), emus=emus, micro_batches=e.micro_batches
        )
        if e.model_stage == model_stage
        else e
        for e in plan.stages
    ]
    return plan.model_copy(update={"stages": stages, "predictions": None})

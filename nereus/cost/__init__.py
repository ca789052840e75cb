"""Analytic latency and memory model of model-stages and plans; pure Python + numpy."""

from nereus.cost.calibration import DEFAULT_CALIBRATION, Calibration
from nereus.cost.plan_cost import PlanEvaluation, evaluate_plan, plan_cost_problems
from nereus.spec.check import register_check
from nereus.spec.io import register_kind
from nereus.spec.plan import Plan

register_kind(Calibration)
register_check(Plan, plan_cost_problems)  # type: ignore[arg-type]

__all__ = ["DEFAULT_CALIBRATION", "Calibration", "PlanEvaluation", "evaluate_plan", "plan_cost_problems"]

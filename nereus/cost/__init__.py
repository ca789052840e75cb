"""Analytic latency and memory model of model-stages and plans; pure Python + numpy."""

from nereus.cost.calibration import DEFAULT_CALIBRATION, Calibration
from nereus.cost.plan_cost import PlanEvaluation, evaluate_plan, plan_cost_problems

__all__ = ["DEFAULT_CALIBRATION", "Calibration", "PlanEvaluation", "evaluate_plan", "plan_cost_problems"]

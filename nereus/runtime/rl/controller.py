"""The online controller of `nereus run --trace T --policy P`, on rank 0.

Before each step it builds the policy library's Observation from what the run measured
(response lengths of the last step, measured over predicted step time as the efficiency)
and from the trace's GPU-pool events (GPUs available now, announced changes), asks the
policy, and logs the decision with its inputs to DIR/decisions.jsonl. A transition comes
back as the target plan with its scheduled DAG (built here, once, so every rank walks the
same primitives); a restart as the target plan alone (the ranks move through a checkpoint).
The controller imports no torch: rank 0 broadcasts what it returns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nereus.errors import NereusError
from nereus.runtime.rl.config import RLConfig
from nereus.runtime.rl.setup import Move, plan_problems
from nereus.solver.policy import Observation, Replanner, make_policy, record_to_data
from nereus.spec.plan import Plan
from nereus.spec.trace import Conditions, Trace, trace_conditions
from nereus.spec.workload import ResponseLengths

DECISIONS_NAME = "decisions.jsonl"


def measured_lengths(mean: float, longest: int) -> ResponseLengths:
    """A response-length distribution from one step's mean and maximum (tokens, at least 1)."""
    median = max(1, round(mean))
    return ResponseLengths(median=median, p99=max(median, longest), max=max(median, longest))


class Controller:
    """The policy, the trace and the decision log of one run (lives on rank 0)."""

    def __init__(
        self, plan: Plan, trace: Trace, policy: str, out: Path, config: RLConfig, num_steps: int, num_ranks: int
    ) -> None:
        self.replanner = Replanner(plan)
        self.policy = make_policy(policy, plan, self.replanner)
        self.conditions: list[Conditions] = list(trace_conditions(trace))
        self.plan = plan
        self.config = config
        self.num_steps = num_steps
        self.num_ranks = num_ranks
        self.log_path = out / DECISIONS_NAME
        self.lengths = plan.workload.response_len
        self.efficiency = 1.0

    def measured(self, response_len_mean: float, response_len_max: int, step_seconds: float) -> None:
        """Take in one finished step's measurements."""
        self.lengths = measured_lengths(response_len_mean, response_len_max)
        predicted = self.replanner.step_time(self.plan, self.lengths, 1.0)
        if predicted is not None and step_seconds > 0:
            # Efficiency relative to the calibration, on the policy's grid of (0, 4].
            self.efficiency = min(4.0, max(0.01, predicted / step_seconds))

    def observe(self, step: int) -> Observation:
        conditions = self.conditions[min(step, len(self.conditions) - 1)]
        return Observation(
            step=step,
            gpus=conditions.gpus,
            response_len=self.lengths,
            efficiency=self.efficiency,
            announced_gpus=conditions.announced_gpus,
            announced_step=conditions.announced_step,
            steps_remaining=self.num_steps - step,
        )

    def decide(self, step: int) -> Move | None:
        """The policy's decision before `step`, logged; the move the ranks must make, if any."""
        decision = self.policy.decide(self.observe(step))
        move, refusal = None, None
        if decision.action == "suspend":
            self._log(refusal)
            raise NereusError(f"step {step}: {decision.reason}; no plan fits the GPUs left, the run stops")
        if decision.action in ("transition", "restart"):
            assert self.policy.plan is not None
            # The policy sizes plans for measured lengths; the run keeps its workload's batch shapes.
            target = self.policy.plan.model_copy(update={"workload": self.plan.workload})
            problems = plan_problems(target, self.num_ranks, self.config)
            if problems:  # a layout the engine cannot run: keep the current plan, say why
                refusal = f"runtime refused the target plan: {problems[0]}"
                self.policy.plan = self.plan
            else:
                move = self._move(decision.action, target)
        self._log(refusal)
        return move

    def _move(self, action: str, target: Plan) -> Move:
        from nereus.solver.transition.schedule import build_transition

        primitives: list[Any] = []
        predicted = 0.0
        if action == "transition":
            result = build_transition(self.plan, target, self.replanner.calibration)
            assert result.feasible, "the policy admits only transitions whose DAG passes"
            primitives, predicted = result.primitives, result.makespan_s
        self.plan = target
        return Move(action, target, primitives, predicted)

    def _log(self, refusal: str | None) -> None:
        record = record_to_data(self.policy.log[-1])
        if refusal is not None:
            record["runtime"] = refusal
        with self.log_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

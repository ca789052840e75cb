"""Trace-driven simulation of an adaptation policy: step latencies, transitions, restarts.

Each step, the policy sees the trace's conditions and decides; an admitted transition
costs its DAG's critical path, a restart its checkpoint-and-restart estimate. The step
then takes the cost model's predicted time of the plan in force under the step's
conditions, times optional seeded log-normal noise. A suspended job runs no step (the
step is counted as stalled) until a plan fits again. These are simulator results: the
cost model stands in for measured step times.

Async execution (a workload with `execution: async` and max_staleness >= 1): every step ends
with a weight sync, so every step boundary is a weight-sync boundary and the policy decides
only there. A transition or restart moves state once both pools are idle at that boundary
(generation drained), so the pipeline starts again empty: the first step under a plan (at the
start, after a transition, a restart or a stall) runs generation and then training, the
synchronous composition of its layouts (`Replanner.fill_time`); the steps after it take the
steady state, the slower pool.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nereus.errors import NereusError
from nereus.solver.policy import AdaptationPolicy, Decision, DecisionRecord, Observation
from nereus.solver.policy.replan import max_gpu
from nereus.spec.plan import Plan
from nereus.spec.trace import Conditions, Trace, trace_conditions


@dataclass(frozen=True)
class StepRecord:
    """One simulated step."""

    step: int
    latency_s: float | None
    """Step time of the plan in force (None when stalled)."""
    adaptation_s: float
    """Transition or restart time spent before this step."""
    decision_time_s: float
    """Wall time the policy took to decide (this machine)."""
    gpus_available: int
    gpus_used: int
    mean_response_tokens: float
    pipeline_fill: bool = False
    """Async: the pipeline started empty this step (generation had not run ahead): the step
    took the synchronous composition of the plan's layouts, not the steady state."""


@dataclass
class SimulationResult:
    """Per-step records, the decisions that changed or weighed a plan, and totals."""

    policy: str
    trace: str
    steps: list[StepRecord]
    decisions: list[Decision] = field(default_factory=list)
    """Every decision that was not a plain keep without a replan."""
    log: list[DecisionRecord] = field(default_factory=list, repr=False)
    """The full decision log (every step), for replay."""

    @property
    def step_time_s(self) -> float:
        return sum(r.latency_s for r in self.steps if r.latency_s is not None)

    @property
    def transition_time_s(self) -> float:
        return sum(d.transition_cost_s or 0.0 for d in self.decisions if d.action == "transition")

    @property
    def restart_time_s(self) -> float:
        return sum(d.transition_cost_s or 0.0 for d in self.decisions if d.action == "restart")

    @property
    def total_time_s(self) -> float:
        return self.step_time_s + self.transition_time_s + self.restart_time_s

    @property
    def num_transitions(self) -> int:
        return sum(1 for d in self.decisions if d.action == "transition")

    @property
    def num_restarts(self) -> int:
        return sum(1 for d in self.decisions if d.action == "restart")

    @property
    def num_stalled(self) -> int:
        return sum(1 for r in self.steps if r.latency_s is None)

    @property
    def num_pipeline_fills(self) -> int:
        """Async: steps that started with an empty pipeline (`StepRecord.pipeline_fill`)."""
        return sum(1 for r in self.steps if r.pipeline_fill)

    @property
    def mean_step_latency_s(self) -> float:
        """Average time per executed step, adaptation included (run time / steps run)."""
        ran = len(self.steps) - self.num_stalled
        return self.total_time_s / ran if ran else math.nan

    @property
    def transition_share(self) -> float:
        """Transitions' share of the run time."""
        return self.transition_time_s / self.total_time_s if self.total_time_s else 0.0

    @property
    def mean_decision_time_s(self) -> float:
        return sum(r.decision_time_s for r in self.steps) / len(self.steps) if self.steps else 0.0

    def summary(self) -> dict[str, float | int | str]:
        """The totals as plain data."""
        return {
            "policy": self.policy,
            "trace": self.trace,
            "steps": len(self.steps),
            "mean_step_latency_s": self.mean_step_latency_s,
            "total_time_s": self.total_time_s,
            "step_time_s": self.step_time_s,
            "transition_time_s": self.transition_time_s,
            "restart_time_s": self.restart_time_s,
            "num_transitions": self.num_transitions,
            "num_restarts": self.num_restarts,
            "num_stalled": self.num_stalled,
            "num_pipeline_fills": self.num_pipeline_fills,
            "transition_share": self.transition_share,
            "mean_decision_time_s": self.mean_decision_time_s,
        }


def check_trace_fits(trace: Trace, plan: Plan) -> None:
    """The trace's pools must exist on the plan's cluster and the plan must start on the trace's pool."""
    cluster = plan.cluster.num_gpus
    largest = max([trace.gpus, *(e.gpus for e in trace.events if e.gpus is not None)])
    if largest > cluster:
        raise NereusError(
            f"trace {trace.name!r}: gpus: the pool reaches {largest} GPUs but the plan's cluster has {cluster}; "
            f"plan on a cluster of at least {largest} GPUs"
        )
    if max_gpu(plan) >= trace.gpus:
        raise NereusError(
            f"trace {trace.name!r}: gpus: the plan uses GPU {max_gpu(plan)} but the trace starts with "
            f"{trace.gpus} GPUs; start the trace with at least {max_gpu(plan) + 1}"
        )


def observation_of(conditions: Conditions, num_steps: int) -> Observation:
    return Observation(
        step=conditions.step,
        gpus=conditions.gpus,
        response_len=conditions.response_len,
        efficiency=conditions.efficiency,
        announced_gpus=conditions.announced_gpus,
        announced_step=conditions.announced_step,
        steps_remaining=num_steps - conditions.step,
    )


def simulate(
    trace: Trace,
    policy: AdaptationPolicy,
    *,
    noise: float = 0.0,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> SimulationResult:
    """Run `policy` (holding its initial plan) through `trace`."""
    if noise < 0:
        raise ValueError(f"noise must be >= 0 (log-space standard deviation), got {noise}")
    assert policy.plan is not None, "a policy starts with a plan"
    check_trace_fits(trace, policy.plan)
    rng = random.Random(seed)
    steps: list[StepRecord] = []
    decisions: list[Decision] = []
    primed = False  # async: whether generation has run ahead into this step under the plan in force
    for conditions in trace_conditions(trace):
        observation = observation_of(conditions, trace.num_steps)
        started = time.perf_counter()
        decision = policy.decide(observation)
        spent = time.perf_counter() - started
        if decision.action != "keep" or decision.path != "none":
            decisions.append(decision)
        latency = None
        replaced = decision.action in ("transition", "restart")
        fill = False
        if policy.plan is not None:
            fill = policy.plan.workload.overlaps and (replaced or not primed)
            timing = policy.replanner.fill_time if fill else policy.replanner.step_time
            predicted = timing(policy.plan, conditions.response_len, conditions.efficiency)
            assert predicted is not None and max_gpu(policy.plan) < conditions.gpus, "policy kept an invalid plan"
            latency = predicted * (math.exp(rng.gauss(0.0, noise)) if noise else 1.0)
        primed = policy.plan is not None
        adaptation = (decision.transition_cost_s or 0.0) if replaced else 0.0
        steps.append(
            StepRecord(
                conditions.step, latency, adaptation, spent, conditions.gpus, decision.num_gpus_used,
                conditions.response_len.mean(), fill,
            )
        )  # fmt: skip
        if progress is not None:
            progress(conditions.step + 1, trace.num_steps)
    return SimulationResult(policy.name, trace.name, steps, decisions, list(policy.log))

"""The adaptation policies: Nereus (payback admission) and the fixed, DynaRL-style and periodic baselines.

All share `decide(observation) -> Decision` and the urgent path: when the running plan
is invalid (its GPUs are gone or about to go, or it is predicted to overflow memory) the
policy waives profitability. Among the planner's best few plans and the running layouts
refitted, it takes the move with the least expected time over the payback horizon: a
transition DAG that passes the independent checker (after a loss without notice, built
from the surviving EMUs) or a checkpoint-and-restart. When nothing fits, it suspends.
The policies differ in the opportunistic path: when to replan and what to admit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from nereus.solver.policy.monitor import Monitor
from nereus.solver.policy.replan import Replanner, TransitionVerdict, layout_summary, max_gpu, plan_key, survivors
from nereus.solver.policy.types import Action, Decision, Observation, Path, PolicyConfig
from nereus.solver.traces import scaled_lengths
from nereus.spec.plan import Plan


def admits(savings_per_step_s: float, horizon_steps: float, transition_cost_s: float) -> bool:
    """Opportunistic admission: the per-step saving over the horizon repays the whole transition."""
    return savings_per_step_s > 0 and savings_per_step_s * horizon_steps >= transition_cost_s


@dataclass(frozen=True)
class DecisionRecord:
    """One entry of the decision log: what the policy saw and what it decided."""

    observation: Observation
    decision: Decision


class AdaptationPolicy(ABC):
    """Base class: monitor, urgent path, decision log. Subclasses define the opportunistic path."""

    name = "base"

    def __init__(self, plan: Plan, replanner: Replanner | None = None, config: PolicyConfig | None = None) -> None:
        if config is not None and replanner is not None and config != replanner.config:
            raise ValueError("the policy and its replanner must share one PolicyConfig")
        self.config = config or (replanner.config if replanner else PolicyConfig())
        self.replanner = replanner or Replanner(plan, self.config)
        self.plan: Plan | None = plan
        self.monitor = Monitor(self.config)
        self.log: list[DecisionRecord] = []

    def decide(self, observation: Observation) -> Decision:
        """Observe one step's conditions and decide; the policy assumes its decision is carried out."""
        triggers = tuple(self.monitor.observe(observation))
        urgency = self._urgency(observation)
        if urgency is not None:
            self.monitor.reset_references(observation)
            decision = self._urgent(observation, triggers, urgency)
        else:
            decision = self._routine(observation, triggers)
        self.log.append(DecisionRecord(observation, decision))
        return decision

    # -- shared helpers ---------------------------------------------------------------

    def _usable_gpus(self, observation: Observation) -> int:
        """GPUs a new plan may use: the current pool, less an announced loss."""
        announced = observation.announced_gpus
        return min(observation.gpus, announced) if announced is not None else observation.gpus

    def _refit(self, plan: Plan, gpus: int, observation: Observation) -> Plan | None:
        return self.replanner.refit(plan, gpus, observation.response_len, observation.efficiency)

    def _step_time(self, plan: Plan, observation: Observation) -> float | None:
        return self.replanner.step_time(plan, observation.response_len, observation.efficiency)

    def _urgency(self, observation: Observation) -> str | None:
        if self.plan is None:
            return "no plan is running (suspended)"
        if max_gpu(self.plan) >= observation.gpus:
            return f"the plan uses GPUs lost at this step (pool is {observation.gpus})"
        if max_gpu(self.plan) >= self._usable_gpus(observation):
            return f"GPUs >= {observation.announced_gpus} leave at step {observation.announced_step} (announced)"
        if self._step_time(self.plan, observation) is None:
            return "predicted memory violation under the current response lengths"
        usable = 1.0 - self.replanner.calibration.memory_headroom
        if observation.memory_used is not None and observation.memory_used > usable:
            return f"measured memory {observation.memory_used:.0%} of a GPU, over the usable {usable:.0%}"
        return None

    def _decision(
        self,
        observation: Observation,
        action: Action,
        path: Path,
        reason: str,
        triggers: tuple[str, ...],
        **inputs: object,
    ) -> Decision:
        """Build the record, and adopt the target plan when the action replaces the plan."""
        target = inputs.pop("target", None)
        before = layout_summary(self.plan) if self.plan is not None else ""
        if action in ("transition", "restart"):
            assert isinstance(target, Plan)
            self.plan = target
        elif action == "suspend":
            self.plan = None
        used = sum(len(p.gpus) for p in self.plan.pools) if self.plan is not None else 0
        return Decision(
            step=observation.step,
            action=action,
            path=path,
            reason=reason,
            triggers=triggers,
            current_layout=before,
            target_layout=layout_summary(target) if isinstance(target, Plan) else "",
            num_gpus_used=used,
            **inputs,  # type: ignore[arg-type]
        )

    def _urgent_candidates(self, observation: Observation) -> list[Plan]:
        """Plans to move to, fastest first: the replanned best few, and the current layouts refitted."""
        gpus = self._usable_gpus(observation)
        plans: list[Plan | None] = [*self.replanner.best_plans(gpus, observation.response_len, observation.efficiency)]
        if self.plan is not None:
            plans.append(self._refit(self.plan, gpus, observation))
        return self._runnable(plans, observation)

    def _runnable(self, plans: list[Plan | None], observation: Observation) -> list[Plan]:
        """The memory-feasible plans of `plans`: those the runtime runs first, fastest first."""
        timed = [(t, k, p) for k, p in enumerate(plans) if p is not None and (t := self._step_time(p, observation))]
        ordered = sorted(timed, key=lambda x: (not self.replanner.runs(x[2]), x[0], x[1]))
        return [p for _, _, p in ordered]

    def _urgent(
        self, observation: Observation, triggers: tuple[str, ...], urgency: str, *, may_keep: bool = False
    ) -> Decision:
        """Move off the running plan (`may_keep`: it still runs the measured lengths, and keeping
        it is one more option, taken when it has the least expected time over the horizon)."""
        candidates = self._urgent_candidates(observation)
        if not candidates:
            return self._decision(
                observation, "suspend", "urgent", f"{urgency}; no memory-feasible plan fits "
                f"{self._usable_gpus(observation)} GPUs: checkpoint and wait for GPUs", triggers,
            )  # fmt: skip
        current_time = self._step_time(self.plan, observation) if self.plan is not None else None
        horizon = self.monitor.horizon(observation)
        options = [option for target in candidates for option in self._urgent_options(observation, target, horizon)]
        if may_keep and self.plan is not None and current_time is not None:
            options.insert(0, ("keep", self.plan, 0.0, current_time * max(horizon, 1.0)))  # first: ties keep
        # Profitability is waived (the plan must change), but among the ways to change, pick the
        # one with the least expected time over the horizon: steps plus the move itself.
        # A move the runtime runs beats one it would refuse (taken only when nothing else fits).
        action, target, cost, _ = min(options, key=lambda option: (not self.replanner.runs(option[1]), option[3]))
        if action == "keep":
            reason = f"{urgency}, but it runs the measured lengths and no move is predicted faster over the horizon"
            return self._keep(
                observation, reason, triggers, current_step_time_s=current_time, payback_horizon_steps=horizon
            )
        how = "moving by a checked transition DAG" if action == "transition" else (
            "checkpoint and restart (no DAG passes, or it is slower)" if self.plan is not None
            else "resuming from the checkpoint"
        )  # fmt: skip
        return self._decision(
            observation, action, "urgent", f"{urgency}; {how}", triggers, target=target,
            current_step_time_s=current_time, target_step_time_s=self._step_time(target, observation),
            transition_cost_s=cost, payback_horizon_steps=horizon,
        )  # fmt: skip

    def _surviving_plan(self, observation: Observation) -> Plan | None:
        """The running plan less the EMUs on GPUs that are gone (None if nothing runs or a model-stage lost all)."""
        if self.plan is None or max_gpu(self.plan) < observation.gpus:
            return self.plan
        return survivors(self.plan, observation.gpus)

    def _urgent_options(
        self, observation: Observation, target: Plan, horizon: float
    ) -> list[tuple[Action, Plan, float, float]]:
        """(action, target, its cost, expected seconds over the horizon): a restart, and the DAG when it passes."""
        step_time = self._step_time(target, observation)
        assert step_time is not None
        steps = step_time * max(horizon, 1.0)
        restart = self.replanner.restart_cost(target)
        options: list[tuple[Action, Plan, float, float]] = [("restart", target, restart, restart + steps)]
        source = self._surviving_plan(observation)
        if source is not None:
            verdict = self.replanner.transition(source, target)
            if verdict.passes(frozenset(range(observation.gpus, max_gpu(source) + 1))):
                options.insert(0, ("transition", target, verdict.cost_s, verdict.cost_s + steps))
        return options

    def _keep(self, observation: Observation, reason: str, triggers: tuple[str, ...], **inputs: object) -> Decision:
        path: Path = "opportunistic" if reason else "none"
        return self._decision(observation, "keep", path, reason or "no trigger", triggers, **inputs)

    def _replan(self, observation: Observation, triggers: tuple[str, ...], *, payback: bool) -> Decision:
        """Replan under the observed conditions and decide between the running plan and the result."""
        assert self.plan is not None
        planned = self.replanner.rounded_lengths(observation.response_len)
        if self.replanner.step_time(self.plan, planned, observation.efficiency) is None:
            # A violation the lengths have not reached: moving is weighed against keeping the plan
            # (a plan sized for a length the run never reaches must not cost steps until then).
            reason = f"predicted memory violation within the {self.config.growth_margin:.0%} growth margin"
            return self._urgent(observation, triggers, reason, may_keep=True)
        target = self.replanner.best_plan(observation.gpus, observation.response_len, observation.efficiency)
        return self._switch_if_faster(observation, triggers, target, payback=payback)

    def _switch_if_faster(
        self, observation: Observation, triggers: tuple[str, ...], target: Plan | None, *, payback: bool
    ) -> Decision:
        """Replanned `target` against the running plan: admit when faster (and, with payback, worth it)."""
        assert self.plan is not None
        if target is None or plan_key(target) == plan_key(self.plan):
            return self._keep(observation, "the running plan is still the best", triggers)
        if not self.replanner.runs(target):  # the running plan is valid: no move the runtime refuses
            return self._keep(observation, "no replanned plan the runtime runs", triggers)
        current_time, target_time = self._step_time(self.plan, observation), self._step_time(target, observation)
        assert current_time is not None and target_time is not None
        verdict: TransitionVerdict = self.replanner.transition(self.plan, target)
        savings = current_time - target_time
        horizon = self.monitor.horizon(observation) if payback else None
        inputs = {
            "current_step_time_s": current_time,
            "target_step_time_s": target_time,
            "transition_cost_s": verdict.cost_s,
            "payback_horizon_steps": horizon,
            "savings_per_step_s": savings,
        }
        if savings <= 0:
            return self._keep(observation, "the replanned plan is not predicted faster", triggers, **inputs)
        action: Action = "transition"
        how = "transition"
        restart = self.replanner.restart_cost(target)
        if not verdict.passes():  # no DAG: the only way there is a checkpoint-and-restart
            action, how = "restart", f"restart (its DAG fails: {verdict.problems[0]})"
            inputs["transition_cost_s"] = restart
        elif restart < verdict.cost_s:
            action, how = "restart", f"restart (cheaper than the {verdict.cost_s:.3g} s DAG)"
            inputs["transition_cost_s"] = restart
        cost = inputs["transition_cost_s"]
        assert isinstance(cost, float)
        if horizon is None:
            reason = f"faster; {how}"
        elif admits(savings, horizon, cost):
            reason = f"repays: {savings:.3g} s/step x {horizon:.3g} steps; {how}"
        else:
            trend = self._trend_payback(observation, target, savings)
            if trend is None or not admits(*trend, cost):
                reason = f"payback: {savings:.3g} s/step x {horizon:.3g} steps < {cost:.3g} s {how}"
                return self._keep(observation, reason, triggers, **inputs)
            inputs["savings_per_step_s"], inputs["payback_horizon_steps"] = trend
            reason = f"repays as the lengths drift: {trend[0]:.3g} s/step x {trend[1]:.3g} steps; {how}"
        return self._decision(observation, action, "opportunistic", reason, triggers, target=target, **inputs)

    def _trend_payback(self, observation: Observation, target: Plan, savings: float) -> tuple[float, float] | None:
        """(saving per step, horizon) when the lengths drift and the target stays faster past
        their next crossing: the saving there or now, whichever is smaller, over the horizon
        the other signals allow. None when the lengths are steady or the target's lead ends."""
        assert self.plan is not None
        drift = self.monitor.length_drift()
        if drift == 1.0:
            return None
        lengths = observation.response_len
        ahead = scaled_lengths(lengths, max(1, round(lengths.max * drift)))
        current, moved = (self.replanner.step_time(p, ahead, observation.efficiency) for p in (self.plan, target))
        if current is None or moved is None:
            return None
        return min(savings, current - moved), self.monitor.horizon(observation, past_lengths=True)

    @abstractmethod
    def _routine(self, observation: Observation, triggers: tuple[str, ...]) -> Decision:
        """The decision when the running plan is valid: each policy's opportunistic path."""


class NereusPolicy(AdaptationPolicy):
    """Replan on triggers; admit a transition only when its saving repays it within the horizon."""

    name = "nereus"

    def _routine(self, observation: Observation, triggers: tuple[str, ...]) -> Decision:
        if not triggers:
            return self._keep(observation, "", triggers)
        self.monitor.reset_references(observation)
        return self._replan(observation, triggers, payback=True)


class DynaRLPolicy(AdaptationPolicy):
    """DynaRL-style: replan every step and switch whenever the new plan is predicted faster."""

    name = "dynarl"

    def _routine(self, observation: Observation, triggers: tuple[str, ...]) -> Decision:
        return self._replan(observation, triggers, payback=False)


class PeriodicPolicy(AdaptationPolicy):
    """Replan every `period` steps and switch to the new plan when it is predicted faster."""

    def __init__(self, plan: Plan, period: int, replanner: Replanner | None = None, config: PolicyConfig | None = None):
        if period < 1:
            raise ValueError(f"the period must be at least 1 step, got {period}")
        super().__init__(plan, replanner, config)
        self.period = period
        self.name = f"periodic:{period}"

    def _routine(self, observation: Observation, triggers: tuple[str, ...]) -> Decision:
        if observation.step % self.period:
            return self._keep(observation, "", triggers)
        return self._replan(observation, triggers, payback=False)


class FixedPolicy(AdaptationPolicy):
    """The paper's fixed baseline: the initial tp/pp kept, dp scaled with the pool; under
    memory pressure generation runs in smaller waves (a KV budget of what its GPUs have left,
    slower under continuous batching) and other model-stages in smaller micro-batches.

    Replans (urgent path) only when that cannot run, i.e. not even one maximum-length
    sequence fits; the new layouts are then kept.
    """

    name = "fixed"

    def _urgent_candidates(self, observation: Observation) -> list[Plan]:
        gpus = self._usable_gpus(observation)
        if self.plan is not None:
            scaled = self._runnable([self._refit(self.plan, gpus, observation)], observation)
            if scaled:
                return scaled
        return super()._urgent_candidates(observation)

    def _routine(self, observation: Observation, triggers: tuple[str, ...]) -> Decision:
        assert self.plan is not None
        if not any(t.startswith("gpus ") for t in triggers):
            return self._keep(observation, "", triggers)
        target = self._refit(self.plan, observation.gpus, observation)
        return self._switch_if_faster(observation, triggers, target, payback=False)


POLICY_NAMES = ("nereus", "fixed", "dynarl", "periodic:K")


def make_policy(
    spec: str, plan: Plan, replanner: Replanner | None = None, config: PolicyConfig | None = None
) -> AdaptationPolicy:
    """A policy by name: nereus, fixed, dynarl or periodic:K (K steps between replans)."""
    simple: dict[str, type[AdaptationPolicy]] = {"nereus": NereusPolicy, "fixed": FixedPolicy, "dynarl": DynaRLPolicy}
    if spec in simple:
        return simple[spec](plan, replanner, config)
    name, _, period = spec.partition(":")
    if name == "periodic" and period.isdigit() and int(period) >= 1:
        return PeriodicPolicy(plan, int(period), replanner, config)
    raise ValueError(f"unknown policy {spec!r}; use one of {', '.join(POLICY_NAMES)} (e.g. periodic:3)")

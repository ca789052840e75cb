"""The online controller of `nereus run --trace T --policy P`, on rank 0.

Before each step it builds the policy library's Observation from what the run measured
(response lengths of the last step, measured over predicted step time as the efficiency,
the bytes the fullest rank holds over its memory)
and from the trace's GPU-pool events (GPUs available now, announced changes), asks the
policy, and logs the decision with its inputs to DIR/decisions.jsonl. A transition comes
back as the target plan with its scheduled DAG (built here, once, so every rank walks the
same primitives); a restart as the target plan alone (the ranks move through a checkpoint).
The controller imports no torch: rank 0 broadcasts what it returns.

`Predictor` (every run, rank 0) prices each step with the cost model calibrated on the
steps before it, puts the prediction beside the measurement in metrics.jsonl, and folds
the step into the online calibration: at once, or, when the plan gives rank 0 no part in
generation, during the next step's generation (then the controller plans with the
calibration of all steps but the last).
Both are saved as data (`RunStateData`, JSON) into every checkpoint, so a resumed run predicts
and decides as the uninterrupted one; nothing in a checkpoint is unpickled or evaluated.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nereus.cost.calibration import Calibration
from nereus.cost.fit import engineless_stages, measured_plan, predict
from nereus.cost.online import OnlineCalibrator
from nereus.cost.vllm_engine import Engine
from nereus.errors import NereusError
from nereus.runtime.generation.engine_choice import vllm_plan_problem
from nereus.runtime.rl.update import idle_model_stages
from nereus.runtime.run.folder import append_json_line
from nereus.runtime.run.plans import plan_schedule
from nereus.runtime.run.run_setup import Move
from nereus.runtime.run.run_state import (
    ControllerState,
    PendingState,
    PredictionState,
    PredictorState,
)
from nereus.solver.admission import plan_problems
from nereus.solver.layouts import runtime_choices
from nereus.solver.policy import (
    Observation,
    Replanner,
    make_policy,
    policy_state,
    record_to_data,
    restore_policy,
)
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig
from nereus.spec.run_folder import DECISIONS_NAME
from nereus.spec.stages import is_model_stage, role_of
from nereus.spec.trace import Conditions, Trace, trace_conditions
from nereus.spec.workload import ResponseLengths

#: Steps whose predicted/measured ratios the efficiency is the median of.
EFFICIENCY_WINDOW = 5
#: Relative change of the running plan's predicted step time past which the controller plans
#: with the refitted calibration (smaller refits leave its plans and efficiency history alone).
RECALIBRATE_CHANGE = 0.1


class Predictor:
    """The cost model's prediction of every step, from the calibration of the steps before it."""

    def __init__(self, calibration: Calibration, online: bool, config: RLConfig) -> None:
        self.calibration = calibration
        self.calibrator = OnlineCalibrator(calibration) if online else None
        self.config = config
        # The last prediction and what it priced (plan, sizes, calibration): the online update
        # of the same step linearises around the same point and reuses it.
        self.last: tuple[Plan, int, int, Calibration, dict[str, float]] | None = None
        self.pending: tuple[Plan, Any] | None = None
        """A finished step `defer` queued for the next `flush`."""

    def predict(self, plan: Plan, prompt_len: int, response_len_max: int) -> dict[str, float]:
        """Seconds per model-stage that runs an engine and for the whole `step`, at the sizes the step ran."""
        sizes = (plan, prompt_len, response_len_max, self.calibration)
        predicted = self._priced_at(sizes)
        if predicted is None:  # the cost model runs once per plan, sizes and calibration
            sized = measured_plan(plan, prompt_len, response_len_max, engineless=engineless_stages(plan, self.config))
            predicted = predict(sized, self.calibration)
        self.last = (*sizes, predicted)
        return {name: seconds for name, seconds in predicted.items() if self._priced(plan, name)}

    def update(self, plan: Plan, metrics: Any) -> None:
        """Fold a finished step's StepMetrics into the calibration (online calibration on)."""
        if self.calibrator is None or metrics.step_seconds <= 0:
            return
        stages = {name: seconds for name, seconds in metrics.stage_seconds.items() if self._priced(plan, name)}
        sizes = (plan, metrics.prompt_len, metrics.response_len_max, self.calibration)
        self.calibration = self.calibrator.update(
            plan,
            metrics.step_seconds,
            stages,
            metrics.prompt_len,
            metrics.response_len_max,
            predicted=self._priced_at(sizes),
            engineless=engineless_stages(plan, self.config),
        )

    def _priced_at(self, sizes: tuple[Plan, int, int, Calibration]) -> dict[str, float] | None:
        """The last prediction if it priced these (plan, sizes, calibration), else None."""
        if self.last is None or not all(a is b or a == b for a, b in zip(self.last[:4], sizes, strict=True)):
            return None
        return self.last[4]

    def defer(self, plan: Plan, metrics: Any) -> None:
        """Queue a finished step's `update` for the next `flush`: rank 0 runs it while it
        idles in the next step (no part in generation), else right after that step."""
        self.flush()
        self.pending = (plan, metrics)

    def flush(self) -> None:
        """Fold the queued step in, if any."""
        if self.pending is not None:
            plan, metrics = self.pending
            self.pending = None
            self.update(plan, metrics)

    def state(self) -> PredictorState:
        """The predictor as data (`from_state` rebuilds it)."""
        last = pending = None
        if self.last is not None:
            plan, prompt_len, response_len_max, calibration, predicted = self.last
            last = PredictionState(
                plan=plan,
                prompt_len=prompt_len,
                response_len_max=response_len_max,
                calibration=calibration,
                predicted=dict(predicted),
            )
        if self.pending is not None:
            pending = PendingState(plan=self.pending[0], metrics=dataclasses.asdict(self.pending[1]))
        calibrator = self.calibrator.state() if self.calibrator is not None else None
        return PredictorState(calibration=self.calibration, calibrator=calibrator, last=last, pending=pending)

    @classmethod
    def from_state(
        cls, state: PredictorState, config: RLConfig, metrics_from_data: Callable[[dict[str, Any]], Any]
    ) -> Predictor:
        """The predictor `state` describes; `metrics_from_data` rebuilds a queued step's metrics."""
        predictor = cls(state.calibration, False, config)
        if state.calibrator is not None:
            predictor.calibrator = OnlineCalibrator.from_state(state.calibrator)
        if state.last is not None:
            last = state.last
            predictor.last = (last.plan, last.prompt_len, last.response_len_max, last.calibration, last.predicted)
        if state.pending is not None:
            predictor.pending = (state.pending.plan, metrics_from_data(state.pending.metrics))
        return predictor

    def _priced(self, plan: Plan, name: str) -> bool:
        # A rule-scored reward runs no model: the cost model's reward/inference has nothing to
        # match; nor has actor/inference where training gives the old log-probs.
        if name in idle_model_stages(plan, plan.fusion):
            return False
        return not is_model_stage(name) or self.config.runs_engine(role_of(name))


class Controller:
    """The policy, the trace and the decision log of one run (lives on rank 0)."""

    def __init__(
        self,
        plan: Plan,
        trace: Trace,
        policy: str,
        out: Path,
        config: RLConfig,
        num_steps: int,
        num_ranks: int,
        calibration: Calibration,
        engine: Engine = "nereus",
    ) -> None:
        self.plan = plan
        self.engine = engine
        """The run's generation engine: under vLLM, moves are priced with the engines they
        rebuild and only plans whose generation layout vLLM runs are proposed."""
        self.config = config
        self.num_steps = num_steps
        self.num_ranks = num_ranks
        # Plans are priced with generation in the KV pool the runtime's engine gives them, as
        # each step is predicted and the online calibration fits (one rule, `with_engine_budget`),
        # and only plans the runtime runs are proposed, searching every memory choice.
        self.replanner = Replanner(
            plan,
            calibration=calibration,
            choices=runtime_choices(plan.fusion),
            engineless=engineless_stages(plan, config),
            engine=engine,
            refuses=self.refusal,
        )
        self.policy = make_policy(policy, plan, self.replanner)
        self.conditions: list[Conditions] = list(trace_conditions(trace))
        self.log_path = out / DECISIONS_NAME
        self.lengths = plan.workload.response_len
        self.efficiency = 1.0
        self.memory_used: float | None = None
        self.ratios: deque[float] = deque(maxlen=EFFICIENCY_WINDOW)
        self.recalibrated = False
        """The replanner took a new calibration since the last decision."""
        self.unlogged: dict[str, Any] | None = None
        """The record of the move `decide` returned, logged by `moved` once the ranks made it."""

    def refusal(self, plan: Plan) -> list[str]:
        """Why the runtime would refuse to move to `plan` (`decide` checks its target the same way):
        the admission checks, and under vLLM a generation layout its engines cannot run."""
        target = self.runnable(plan)
        problems = plan_problems(target, self.num_ranks, self.config)
        vllm = vllm_plan_problem(target) if self.engine == "vllm" else None
        return [*problems, f"generation.engine: vllm: {vllm}"] if vllm is not None else problems

    def runnable(self, plan: Plan) -> Plan:
        """`plan` as the run would execute it: the policy sizes plans for measured lengths, the run
        keeps its workload's batch shapes, its fusion block and its models' folders (`weights`:
        replanned plans carry none, and a restart or new vLLM engines load from them)."""
        keep = {"workload": self.plan.workload, "fusion": self.plan.fusion, "weights": self.plan.weights}
        return plan.model_copy(update=keep)

    def state(self) -> ControllerState:
        """The controller as data (`restore` puts it back)."""
        return ControllerState(
            plan=self.plan,
            policy=policy_state(self.policy),
            lengths=self.lengths,
            efficiency=self.efficiency,
            memory_used=self.memory_used,
            ratios=list(self.ratios),
            recalibrated=self.recalibrated,
        )

    def restore(self, state: ControllerState) -> None:
        """Go on from `state` (saved by a controller of the same policy); ValueError when it does not fit."""
        restore_policy(self.policy, state.policy)
        self.plan = state.plan
        self.lengths = state.lengths
        self.efficiency = state.efficiency
        self.memory_used = state.memory_used
        self.ratios = deque(state.ratios, maxlen=EFFICIENCY_WINDOW)
        self.recalibrated = state.recalibrated

    def resumed(self, plan: Plan, out: Path) -> None:
        """Go on from a checkpoint: the plan in force is the one it saved (a restart's
        checkpoint predates the move, which is then decided again)."""
        self.plan = plan
        self.policy.plan = plan
        self.log_path = out / DECISIONS_NAME

    def measured(self, metrics: Any, calibration: Calibration) -> None:
        """Take in one finished step's StepMetrics and the calibration refitted with them."""
        # A response-length distribution from the step's mean and maximum (tokens, at least 1).
        median = max(1, round(metrics.response_len_mean))
        longest = max(median, metrics.response_len_max)
        self.lengths = ResponseLengths(median=median, p99=longest, max=longest)
        held = max(metrics.state_bytes_per_rank, default=0)
        self.memory_used = held / self.plan.cluster.gpu.memory_bytes
        step_seconds = metrics.step_seconds
        if self._changes_prediction(calibration):
            self.replanner.recalibrate(calibration)
            self.ratios.clear()  # measured against the old model
            self.recalibrated = True
        predicted = self.replanner.step_time(self.plan, self.lengths, 1.0)
        if predicted is not None and step_seconds > 0:
            # Efficiency relative to the calibration, on the policy's grid of (0, 4]; the median
            # of the last few steps, so one noisy step (a neighbour's burst) fires no replan.
            self.ratios.append(min(4.0, max(0.01, predicted / step_seconds)))
            self.efficiency = statistics.median(self.ratios)

    def _changes_prediction(self, calibration: Calibration) -> bool:
        """Whether `calibration` moves the running plan's predicted step time by more than RECALIBRATE_CHANGE."""
        if calibration == self.replanner.calibration:
            return False
        before = self.replanner.step_time(self.plan, self.lengths, 1.0)
        after = self.replanner.step_time_under(self.plan, self.lengths, calibration)
        if before is None or after is None:
            return before != after
        return abs(after / before - 1) > RECALIBRATE_CHANGE

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
            memory_used=self.memory_used,
            recalibrated=self.recalibrated,
        )

    def decide(self, step: int) -> Move | None:
        """The policy's decision before `step`, logged; the move the ranks must make, if any."""
        decision = self.policy.decide(self.observe(step))
        self.recalibrated = False
        move, refusal = None, None
        if decision.action == "suspend":
            append_json_line(self.log_path, self._record(refusal))
            raise NereusError(f"step {step}: {decision.reason}; no plan fits the GPUs left, the run stops")
        if decision.action in ("transition", "restart"):
            assert self.policy.plan is not None
            # The replanner proposes only plans this check passes; it stays for what it cannot
            # see (a restored policy's plan).
            target = self.runnable(self.policy.plan)
            problems = self.refusal(target)
            if problems:  # a layout the engine cannot run: keep the current plan, say why
                refusal = f"runtime refused the target plan: {problems[0]}"
                self.policy.plan = self.plan
            else:
                move = self._move(decision.action, target)
        if move is None:
            append_json_line(self.log_path, self._record(refusal))
        else:  # logged with its measured cost once the ranks made it (`moved`)
            self.unlogged = self._record(refusal)
        return move

    def moved(self, measured_s: float) -> None:
        """Log the move `decide` returned with what it cost the slowest rank (`measured_cost_s`,
        beside the policy's predicted `decision.transition_cost_s`): the state moved and, under
        vLLM, the new layout's engines started and loaded."""
        if self.unlogged is None:  # a configured plan switch: no decision of the controller's
            return
        record, self.unlogged = self.unlogged, None
        record["engine"] = self.engine
        record["measured_cost_s"] = measured_s
        append_json_line(self.log_path, record)

    def _move(self, action: str, target: Plan) -> Move:
        from nereus.solver.transition.primitives import Schedule
        from nereus.solver.transition.schedule import build_transition

        primitives: list[Any] = []
        schedule, predicted = Schedule(), 0.0
        if action == "transition":
            result = build_transition(self.plan, target, self.replanner.calibration, self.replanner.engine)
            assert result.feasible, "the policy admits only transitions whose DAG passes"
            primitives, schedule, predicted = result.primitives, result.schedule, result.makespan_s
        self.plan = target
        return Move(action, target, primitives, schedule, predicted, plan_schedule(target))

    def _record(self, refusal: str | None) -> dict[str, Any]:
        record = record_to_data(self.policy.log[-1])
        if refusal is not None:
            record["runtime"] = refusal
        return record

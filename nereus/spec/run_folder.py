"""The folder a `nereus run` writes: its file names, the per-step record, and one reader for
each of its logs (metrics, decisions, timeline), shared by the runtime, `nereus fit`,
`nereus report` and the CLI's summary. Torch-free, like the rest of the spec layer.

A run folder holds:
    config.yaml      the RunConfig the run uses (its `plan` points at plan.yaml)
    plan.yaml        the Plan it runs under (replaced when a resume changes the plan)
    metrics.jsonl    one `StepMetrics` JSON record per finished step
    samples.jsonl    `rl.log_samples` samples of every step (text, ids, log-probs, reward)
    trace.yaml       the controller's trace (runs with a trace only)
    calibration.yaml the cost model's starting calibration (when the config names one)
    timeline/        rank-R.jsonl: every rank's spans (model-stages, transitions, checkpoints)
    decisions.jsonl  the controller's decisions with their inputs (runs with a trace only)
    checkpoints/     step-000010/ ... : every trained model's state after that many steps,
                     the plan in force then, rank 0's run state (controller.json) and
                     state.json: the step and the sha256 of every file beside it (their
                     names, saving, checks and restore: `nereus.runtime.run.checkpoints`)
    damaged-checkpoints/  newer checkpoints a resume from an older one set aside
    failure.log      the full error of a run that failed (written only then)
    world.json       a torchrun job's ranks: node, local rank, pid, shared-memory domain

Every reader refuses a malformed line with one error naming the file and the line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nereus.errors import NereusError
from nereus.spec.io import read_utf8
from nereus.spec.run_config import RunConfig
from nereus.spec.stages import ModelStageName, Phase, model_stage_entries, phase_entries

CONFIG_NAME = "config.yaml"
PLAN_NAME = "plan.yaml"
TRACE_NAME = "trace.yaml"
CALIBRATION_NAME = "calibration.yaml"
METRICS_NAME = "metrics.jsonl"
SAMPLES_NAME = "samples.jsonl"
DECISIONS_NAME = "decisions.jsonl"
TIMELINE_NAME = "timeline"
CHECKPOINTS_NAME = "checkpoints"
FAILURE_NAME = "failure.log"
WORLD_NAME = "world.json"
#: Where a resume from an older checkpoint moves the damaged newer ones (kept for inspection).
DAMAGED_NAME = "damaged-checkpoints"


def switch_plan_name(step: int) -> str:
    """The run folder's copy of the plan a switch moves to."""
    return f"plan-from-step-{step:06d}.yaml"


def timeline_file(out: Path, rank: int) -> Path:
    """Rank `rank`'s span log."""
    return out / TIMELINE_NAME / f"rank-{rank}.jsonl"


def timeline_files(out: Path) -> list[Path]:
    """Every rank's span log, by rank name."""
    return sorted((out / TIMELINE_NAME).glob("rank-*.jsonl"))


# ---------------------------------------------------------------------------------- records

#: `plan_index` of the run's first plan, and of records from runs that did not log it.
FIRST_PLAN = 0


class StepTimes:
    """A step record's times, one mapping on disk (`stage_seconds`), read apart by kind: the
    model-stages' and the phases' (`nereus.spec.stages`)."""

    stage_seconds: dict[str, float]

    @property
    def model_stage_seconds(self) -> dict[ModelStageName, float]:
        """Wall time per model-stage that ran (slowest rank)."""
        return model_stage_entries(self.stage_seconds)

    @property
    def phase_seconds(self) -> dict[Phase, float]:
        """Wall time per phase: the step's (`advantages`, `exchange`, `weight_sync`) and a plan
        change before it (`transition` or `restart`)."""
        return phase_entries(self.stage_seconds)


@dataclass(frozen=True)
class StepMetrics(StepTimes):
    """What one RL step measured (identical on every rank): one line of metrics.jsonl."""

    step: int
    reward: float
    """Mean reward of the sampled responses (the reward model's, under `reward: model`)."""
    score: float
    """Mean rule-based score of the sampled responses (equals `reward` under `reward: rule`)."""
    kl: float
    """Mean k1 KL(actor || reference) per response token, at the sampling policy."""
    response_len_mean: float
    response_len_min: int
    response_len_max: int
    prompt_len: int
    """Tokens of the left-padded prompts (the longest prompt of the step)."""
    actor_loss: float
    """Mean over mini-batches and epochs of the policy loss."""
    critic_loss: float | None
    step_seconds: float
    """Wall time of the whole step (slowest rank)."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per model-stage (slowest rank), plus the phases `advantages`, `exchange` and
    `weight_sync`; also `transition` or `restart` when the plan changed before the step (read
    apart: `model_stage_seconds`, `phase_seconds`). Under vLLM generation engines also the
    engine's phases that happened (`nereus.cost.vllm_engine.ENGINE_PHASES`: `vllm_engine_start`
    at the first step and after a transition that rebuilt the engines, `vllm_weight_load` one
    load's seconds, `vllm_sleep` and `vllm_wake` in a colocated pool on GPUs)."""
    state_bytes_per_rank: list[int] = field(default_factory=list)
    """Bytes of parameters, gradients and optimizer moments every rank's engines hold, by rank."""
    predicted_step_seconds: float | None = None
    """The cost model's step time for the plan in force at the step's sizes, calibrated on the
    steps before it (set by the run loop; None where nothing predicted it)."""
    predicted_stage_seconds: dict[str, float] = field(default_factory=dict)
    """The same prediction per model-stage (and `weight_sync`)."""
    plan_index: int = FIRST_PLAN
    """Which plan is in force: 0 for the run's first, +1 at every transition or restart."""
    grad_norm: dict[str, float] = field(default_factory=dict)
    """Per trained model-stage: the global gradient norm (all shards of the model) before
    clipping, averaged over the step's updates (mini-batches x epochs)."""
    lr: dict[str, float] = field(default_factory=dict)
    """Per trained model-stage: the learning rate the step trained at (`rl.lr_schedule`)."""
    eval_reward: float | None = None
    """Mean reward of the actor's greedy responses to the `data.eval` prompts after this
    step (None: no evaluation at this step)."""
    memory_peak_bytes: list[int] = field(default_factory=list)
    """Each rank's measured peak memory during the step, by rank (CUDA: max_memory_allocated;
    CPU: peak resident set above the idle rank's, docs/memory.md; 0: not tracked)."""
    predicted_memory_peak_bytes: list[int] = field(default_factory=list)
    """The cost model's peak for each rank under the plan in force: the largest of its
    model-stages' (`memory_peak_bytes_by_stage` predicted)."""
    memory_peak_bytes_by_stage: dict[str, list[int]] = field(default_factory=dict)
    """Each model-stage's measured peak on every rank while it ran (0 on ranks it skips)."""
    predicted_memory_peak_bytes_by_stage: dict[str, list[int]] = field(default_factory=dict)
    """The cost model's peak of each model-stage on every rank it runs on (0 elsewhere)."""
    host_memory_bytes: list[int] = field(default_factory=list)
    """Each rank's highest bytes of model state in host memory during the step (offload and
    training-time offload; docs/memory.md)."""
    predicted_host_memory_bytes: list[int] = field(default_factory=list)
    """The cost model's host bytes of each rank (its model-stages' `host_memory_bytes`)."""
    rollout_log_prob_diff_mean: float | None = None
    """Mean |old log-prob - generation engine's log-prob| over the step's response tokens
    (a vLLM engine; None under nereus's own engine, whose samples the trainer scores alike)."""
    rollout_log_prob_diff_max: float | None = None
    """The largest of those differences (NeMo-RL's `token_mult_prob_error`, in log space)."""
    async_step: dict[str, Any] | None = None
    """Under async execution (docs/async.md, "The run loop"): the trained samples' stream
    ranges, their staleness histogram, the queue depth at the take and each pool's busy time
    (None in synchronous runs)."""
    routing_mismatch: float | None = None
    """Mixture-of-experts actors: the share of (real token, MoE layer) pairs, prompts and
    responses, the trainer's own router sends to other experts than the rollout did
    (`moe.routing_mismatch`; None for a dense model or a rollout whose routing is not recorded)."""
    router_aux_loss: float | None = None
    """`rl.router_aux_loss_coef` > 0: the router's auxiliary load-balancing loss (unweighted) of
    the actor's last update of the step, the mean over its micro-batches and data-parallel ranks
    (None without the term; seen by the ranks that train the actor)."""


@dataclass(frozen=True)
class StepRecord(StepTimes):
    """The fields of a metrics.jsonl line that readers after the run (report, timeline) need;
    they accept files written by older releases or by hand, which lack the other fields."""

    step: int
    reward: float
    step_seconds: float
    """Wall time of the step on the slowest rank (without the plan change before it)."""
    stage_seconds: dict[str, float]
    """Per model-stage and phase; `transition`/`restart` when the plan changed before the step."""
    predicted_step_seconds: float | None = None
    """The cost model's step time for the plan in force (None in runs that did not record it)."""
    predicted_stage_seconds: dict[str, float] = field(default_factory=dict)
    plan_index: int = FIRST_PLAN
    """Which plan is in force: 0 for the first, +1 at every transition or restart."""
    memory_peak_bytes_by_stage: dict[str, list[int]] = field(default_factory=dict)
    """Measured peak bytes of each model-stage, by rank (empty in runs that did not record it)."""
    predicted_memory_peak_bytes_by_stage: dict[str, list[int]] = field(default_factory=dict)
    """The cost model's peak bytes of each model-stage, by rank."""


@dataclass(frozen=True)
class Span:
    """One line of timeline/rank-R.jsonl: something rank `rank` did during `step`."""

    rank: int
    step: int
    cat: str
    """stage, phase, transition, primitive, checkpoint, controller, or a later kind."""
    name: str
    start: float
    """time.time() seconds."""
    end: float
    args: dict[str, Any]


@dataclass(frozen=True)
class Decision:
    """One controller decision (decisions.jsonl)."""

    step: int
    action: str
    transition_cost_s: float | None
    refused: str | None
    """Why the runtime refused the policy's target plan (the plan was kept), or None."""


@dataclass(frozen=True)
class RunFolder:
    """Everything read back from a run folder."""

    folder: Path
    config: RunConfig
    steps: list[StepRecord]
    decisions: list[Decision]
    spans: list[Span]
    """Empty when the run wrote no timeline."""


# ---------------------------------------------------------------------------------- fields


def number(value: Any, where: str, key: str) -> float:
    """`value` as a finite float, or one error naming `where` and `key`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise NereusError(f"{where}: {key}: expected a finite number, got {value!r}")
    return float(value)


def integer(value: Any, where: str, key: str) -> int:
    """`value` as an int (not a bool), or one error naming `where` and `key`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise NereusError(f"{where}: {key}: expected an integer, got {value!r}")
    return value


def seconds_map(value: Any, where: str, key: str) -> dict[str, float]:
    """`value` as a name -> seconds mapping, or one error naming `where` and `key`."""
    if not isinstance(value, dict):
        raise NereusError(f"{where}: {key}: expected an object of seconds, got {value!r}")
    return {str(name): number(seconds, where, f"{key}.{name}") for name, seconds in value.items()}


def required(data: dict[str, Any], where: str, key: str, parent: str = "") -> Any:
    """`data[key]`, or one error naming the missing field."""
    if key not in data:
        raise NereusError(f"{where}: missing field {parent + key!r}")
    return data[key]


def json_lines(path: Path, complete_only: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """(where, object) per non-blank line of a JSON-lines log; `where` names the file and line.
    `complete_only`: a last line without its newline (an append a kill cut short) is left out."""
    rows = []
    text = read_utf8(path)
    if complete_only:
        text = text[: text.rfind("\n") + 1]
    for number_, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}: line {number_}"
        try:
            data = json.loads(line)
        except ValueError:
            raise NereusError(f"{where}: not JSON (a truncated or damaged line); fix or delete the line") from None
        if not isinstance(data, dict):
            raise NereusError(f"{where}: expected a JSON object, got {type(data).__name__}")
        rows.append((where, data))
    return rows


# ---------------------------------------------------------------------------------- readers


def read_metrics(out: Path) -> list[dict[str, Any]]:
    """The run's per-step records as written, in order (empty before the first step)."""
    path = out / METRICS_NAME
    return [data for _, data in json_lines(path, complete_only=True)] if path.is_file() else []


def step_record(where: str, data: dict[str, Any]) -> StepRecord:
    """The typed fields of one metrics line."""
    predicted = data.get("predicted_step_seconds")
    return StepRecord(
        step=integer(required(data, where, "step"), where, "step"),
        reward=number(required(data, where, "reward"), where, "reward"),
        step_seconds=number(required(data, where, "step_seconds"), where, "step_seconds"),
        stage_seconds=seconds_map(required(data, where, "stage_seconds"), where, "stage_seconds"),
        predicted_step_seconds=None if predicted is None else number(predicted, where, "predicted_step_seconds"),
        predicted_stage_seconds=seconds_map(
            data.get("predicted_stage_seconds") or {}, where, "predicted_stage_seconds"
        ),
        plan_index=integer(data.get("plan_index", FIRST_PLAN), where, "plan_index"),
        memory_peak_bytes_by_stage=bytes_by_rank(data, where, "memory_peak_bytes_by_stage"),
        predicted_memory_peak_bytes_by_stage=bytes_by_rank(data, where, "predicted_memory_peak_bytes_by_stage"),
    )


def bytes_by_rank(data: dict[str, Any], where: str, key: str) -> dict[str, list[int]]:
    """`data[key]` as a name -> bytes-per-rank mapping (empty when absent), or one error."""
    value = data.get(key) or {}
    if not isinstance(value, dict) or not all(isinstance(v, list) for v in value.values()):
        raise NereusError(f"{where}: {key}: expected an object of per-rank byte lists, got {value!r}")
    return {str(name): [integer(b, where, f"{key}.{name}") for b in per_rank] for name, per_rank in value.items()}


def _span(where: str, data: dict[str, Any]) -> Span:
    args = data.get("args", {})
    if not isinstance(args, dict):
        raise NereusError(f"{where}: args: expected an object, got {args!r}")
    span = Span(
        rank=integer(required(data, where, "rank"), where, "rank"),
        step=integer(required(data, where, "step"), where, "step"),
        cat=str(required(data, where, "cat")),
        name=str(required(data, where, "name")),
        start=number(required(data, where, "start"), where, "start"),
        end=number(required(data, where, "end"), where, "end"),
        args=args,
    )
    if span.end < span.start:
        raise NereusError(f"{where}: end {span.end} is before start {span.start}")
    return span


def _decision(where: str, data: dict[str, Any]) -> Decision:
    decision = required(data, where, "decision")
    if not isinstance(decision, dict):
        raise NereusError(f"{where}: decision: expected an object, got {decision!r}")
    cost = decision.get("transition_cost_s")
    refused = data.get("runtime")
    return Decision(
        step=integer(required(decision, where, "step", "decision."), where, "decision.step"),
        action=str(required(decision, where, "action", "decision.")),
        transition_cost_s=None if cost is None else number(cost, where, "decision.transition_cost_s"),
        refused=None if refused is None else str(refused),
    )


def read_steps(folder: Path) -> list[StepRecord]:
    """The typed step records of metrics.jsonl (empty when there is none yet)."""
    path = folder / METRICS_NAME
    return [step_record(where, data) for where, data in json_lines(path)] if path.is_file() else []


def read_decisions(folder: Path) -> list[Decision]:
    """The controller's decisions (empty for a run without a trace)."""
    path = folder / DECISIONS_NAME
    return [_decision(where, data) for where, data in json_lines(path)] if path.is_file() else []


def read_spans(folder: Path) -> list[Span]:
    """Every rank's spans, by start time (empty when the run wrote no timeline)."""
    spans = [_span(where, data) for path in timeline_files(folder) for where, data in json_lines(path)]
    return sorted(spans, key=lambda span: (span.start, span.rank))


def read_config(folder: Path) -> RunConfig:
    """The run folder's config (one line when `folder` is not a run folder)."""
    from nereus.spec.io import load_document

    if not folder.is_dir():
        raise NereusError(f"{folder}: no such folder; give the output folder of a `nereus run`")
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise NereusError(
            f"{folder}: not a run folder ({CONFIG_NAME} missing); give the output folder of a `nereus run`"
        )
    config = load_document(path)
    if not isinstance(config, RunConfig):
        raise NereusError(f"{path}: kind: expected RunConfig, got {type(config).__name__}; is {folder} a run folder?")
    return config


def read_run_folder(folder: Path, need_steps: bool = True) -> RunFolder:
    """Parse a run folder; with `need_steps`, a run without a finished step is refused."""
    config = read_config(folder)
    steps = read_steps(folder)
    if need_steps and not steps:
        raise NereusError(
            f"{folder / METRICS_NAME}: no finished step recorded yet; report a run once its first step is done"
        )
    return RunFolder(folder, config, steps, read_decisions(folder), read_spans(folder))


class MetricsTail:
    """Follows the records a running run appends to metrics.jsonl, complete lines only."""

    def __init__(self, out: Path, on_step: Callable[[StepMetrics], None] | None = None) -> None:
        self.path = out / METRICS_NAME
        self.on_step = on_step
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.records: list[StepMetrics] = []

    def poll(self) -> None:
        """Read what was appended since the last poll; hand each new record to `on_step`."""
        for metrics in self._new_records():
            self.records.append(metrics)
            if self.on_step is not None:
                self.on_step(metrics)

    def _new_records(self) -> Iterator[StepMetrics]:
        if not self.path.exists():
            return
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            yield StepMetrics(**json.loads(line))


#: The file inside a finished run checkpoint that records the step it was taken after.
CHECKPOINT_STATE_NAME = "state.json"
#: Rank 0's run state (predictor, online calibration, controller) inside a run checkpoint: JSON.
CONTROLLER_STATE_NAME = "controller.json"
#: Where nereus before checkpoints were data pickled the run state: such a checkpoint is refused.
LEGACY_STATE_NAME = "controller.pkl"


def checkpoint_folder(out: Path, step: int) -> Path:
    """Where the checkpoint taken after `step` steps lives."""
    return out / CHECKPOINTS_NAME / f"step-{step:06d}"


def finished_checkpoints(out: Path) -> list[Path]:
    """Finished checkpoint folders, oldest first (temporary folders of an interrupted save are skipped)."""
    root = out / CHECKPOINTS_NAME
    if not root.is_dir():
        return []
    return sorted(path for path in root.iterdir() if path.name.startswith("step-") and path.is_dir())


def latest_checkpoint(out: Path) -> Path | None:
    """The newest finished checkpoint, or None before the first."""
    folders = finished_checkpoints(out)
    return folders[-1] if folders else None

"""The vLLM generation engine in the cost model's terms (imports neither torch nor vllm).

Under `generation: {engine: vllm}` every actor/generation replica is a vLLM engine. Three things
then cost what nereus's own engine does not:

* a new engine (a live transition that changes actor/generation's tp or dp builds one per new
  replica): start-up (`Calibration.vllm_engine_start_s`) plus its weight load, the replica's
  per-GPU weight bytes over `Calibration.vllm_weight_load_bytes_per_s`
  (`engine_rebuild_seconds`; the transition DAG adds it to the primitive that completes the
  replica, `nereus.solver.transition.schedule`);
* a colocated pool's sleep and wake per step (`Calibration.vllm_sleep_s`, `vllm_wake_s`), and
  what the engine keeps on its GPUs and in host memory while the other model-stages run
  (`engine_memory`, `peaks_beside_engine`): asleep, nothing of its KV cache stays on the GPU;
* generation under vLLM's scheduler (`generation_terms`): the continuous batching of
  `nereus.cost.continuous_batching` with the running sequences capped at `max_num_seqs`, and
  chunked prefill, at most `max_num_batched_tokens` prompt tokens per forward pass, each pass
  streaming the weights once; a fixed `vllm_iteration_overhead_s` per scheduler iteration.

`nereus profile` measures the engine's times (`VllmEngineMeasurement`), `nereus fit` fits them
from the step records of run folders (`ENGINE_PHASES`, recorded in `stage_seconds`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from pydantic import Field

from nereus.cost.calibration import Calibration
from nereus.cost.continuous_batching import decode_profile, mean_context
from nereus.cost.plan_cost import (
    _spans_nodes,
    _stage_terms,
    ep_spans_nodes,
    evaluate_plan,
    replica_state_bytes,
    stage_choices,
    stage_cost_model,
)
from nereus.spec.base import StrictModel
from nereus.spec.plan import Plan
from nereus.spec.stages import ACTOR_GENERATION, ModelStageName

Engine = Literal["nereus", "vllm"]
"""The generation engine a run's actor/generation replicas use (RunConfig `generation.engine`,
once `auto` is resolved)."""
ENGINES: tuple[Engine, ...] = ("nereus", "vllm")

SleepLevel = Literal[1, 2]
"""vLLM's sleep levels: 1 frees the KV cache and moves the weights to host memory, 2 frees both."""
SLEEP_LEVELS: tuple[SleepLevel, ...] = get_args(SleepLevel)
#: The level a colocated engine sleeps at (`engine_sleep_level`). The weights are synced from
#: actor/training at the end of every step, after the engine went to sleep and before it generates
#: again: whatever level 1 would keep on the host is overwritten before it is used. Level 1 would
#: copy the weights GPU -> host at every sleep and host -> GPU at every wake (and hold them in host
#: memory between); level 2 drops them, the sync re-maps their memory (`wake_up(tags=["weights"])`)
#: and fills it, so one copy per step (the sync's) is all the weights cost.
SYNCED_SLEEP_LEVEL: SleepLevel = 2

#: Step-record keys (`stage_seconds` of metrics.jsonl) of the vLLM engine's phases, slowest rank.
ENGINE_START_KEY = "vllm_engine_start"
WEIGHT_LOAD_KEY = "vllm_weight_load"
SLEEP_KEY = "vllm_sleep"
WAKE_KEY = "vllm_wake"
ENGINE_PHASES = (ENGINE_START_KEY, WEIGHT_LOAD_KEY, SLEEP_KEY, WAKE_KEY)
#: The Calibration field each phase fits (the weight load fits a rate, bytes per second).
PHASE_FIELDS = {
    ENGINE_START_KEY: "vllm_engine_start_s",
    WEIGHT_LOAD_KEY: "vllm_weight_load_bytes_per_s",
    SLEEP_KEY: "vllm_sleep_s",
    WAKE_KEY: "vllm_wake_s",
}


class VllmEngineMeasurement(StrictModel):
    """A tiny vLLM engine started, loaded and (on GPUs) put to sleep and woken, in-process."""

    model_params: int = Field(gt=0)
    """Parameters of the tiny model the engine ran."""
    engine_start_s: float = Field(ge=0)
    """Seconds from `LLM(...)` to a ready engine with dummy weights (as the runtime starts one:
    its weights arrive by the sync that follows)."""
    weight_bytes: int = Field(gt=0)
    """Bytes of the weights loaded into the engine (one rank's shard)."""
    weight_load_s: float = Field(gt=0)
    """Median seconds to load those weights into the running engine (its weight-loading API)."""
    sleep_s: float | None = Field(default=None, ge=0)
    """Median seconds of `sleep(level=2)`; None where vLLM has no sleep mode (CPUs)."""
    wake_s: float | None = Field(default=None, ge=0)
    """Median seconds of `wake_up` of the weights and of the KV cache, the sync's load between
    them not counted; None where vLLM has no sleep mode (CPUs)."""
    tokens_per_s: float = Field(gt=0)
    """Generated tokens per second of a small batch (a sanity figure, not fitted)."""
    vllm_version: str = Field(min_length=1)
    """The vLLM release measured."""

    @property
    def weight_load_bytes_per_s(self) -> float:
        return self.weight_bytes / self.weight_load_s


def with_measured_engine(calibration: Calibration, measured: VllmEngineMeasurement | None) -> Calibration:
    """`calibration` with the engine times a profile measured (unchanged without a measurement)."""
    if measured is None:
        return calibration
    update: dict[str, float] = {
        "vllm_engine_start_s": measured.engine_start_s,
        "vllm_weight_load_bytes_per_s": measured.weight_load_bytes_per_s,
    }
    if measured.sleep_s is not None:
        update["vllm_sleep_s"] = measured.sleep_s
    if measured.wake_s is not None:
        update["vllm_wake_s"] = measured.wake_s
    return calibration.model_copy(update=update)


# ---- engine start-up and weight load ----


def weight_bytes_per_gpu(plan: Plan, calibration: Calibration, tp: int, pp: int) -> float:
    """Bytes of the actor's weights one GPU of an actor/generation replica of layout (tp, pp) holds."""
    return replica_state_bytes(plan, ACTOR_GENERATION, calibration, tp, pp)


def engine_rebuild_seconds(plan: Plan, calibration: Calibration, tp: int, pp: int, engine: Engine) -> float:
    """Seconds to make a new actor/generation replica of layout (tp, pp) ready to generate, beyond
    moving its weights: nothing for nereus's own engine (it generates with the weights it holds),
    engine start-up plus the weight load for vLLM (its GPUs start and load in parallel)."""
    if engine == "nereus":
        return 0.0
    load = weight_bytes_per_gpu(plan, calibration, tp, pp) / calibration.vllm_weight_load_bytes_per_s
    return calibration.vllm_engine_start_s + load


def colocated_generation(plan: Plan) -> bool:
    """Whether actor/generation shares a GPU with a training model-stage (a colocated pool): its
    engine's memory is then wanted back while training runs."""
    generation = set(plan.stage_plan(ACTOR_GENERATION).gpus)
    return any(entry.stage == "training" and generation & set(entry.gpus) for entry in plan.stages)


def engine_sleep_level(plan: Plan, sleep_mode: bool) -> SleepLevel | None:
    """The level at which `plan`'s vLLM generation engines sleep after each generation, None where
    they stay awake: an engine sleeps only where vLLM has a sleep mode (`sleep_mode`: CUDA GPUs;
    vLLM's CPU backend has none, so there the pool stays allocated) and a training model-stage
    shares its GPUs; then at `SYNCED_SLEEP_LEVEL`, as every step syncs the weights."""
    if not sleep_mode or not colocated_generation(plan):
        return None
    return SYNCED_SLEEP_LEVEL


@dataclass(frozen=True)
class EngineMemory:
    """Bytes per GPU of one actor/generation vLLM engine while the other model-stages run."""

    device: float
    """On the GPU: its weights and KV pool awake, nothing asleep."""
    host: float
    """In host memory: its weights asleep at level 1, nothing otherwise."""


def engine_memory(plan: Plan, calibration: Calibration, sleep_level: SleepLevel | None) -> EngineMemory:
    """What a vLLM engine of `plan`'s actor/generation keeps per GPU between its generations, by
    the level it sleeps at (None: awake, its weights and its whole KV pool; 1: its weights in host
    memory; 2: nothing). The KV pool is the plan's `kv_budget_bytes` (vLLM allocates all of it),
    else the cost model's KV term (every sample at the longest), the weights one GPU's shard. These
    are beside nereus's own actor/generation weights, which the weight sync fills and which the
    cost model already counts resident."""
    entry = plan.stage_plan(ACTOR_GENERATION)
    if sleep_level == 2:
        return EngineMemory(0.0, 0.0)
    weights = weight_bytes_per_gpu(plan, calibration, entry.tp, entry.pp)
    if sleep_level == 1:
        return EngineMemory(0.0, weights)
    if entry.kv_budget_bytes is not None:  # vLLM allocates the whole pool it is given when it starts
        kv_pool = float(entry.kv_budget_bytes)
    else:  # the runtime gives it room for every sample at the longest
        kv_pool = _stage_terms(plan, entry, calibration)[1].get("kv_cache", 0.0)
    return EngineMemory(weights + kv_pool, 0.0)


def peaks_beside_engine(
    plan: Plan, calibration: Calibration, sleep_level: SleepLevel | None
) -> dict[ModelStageName, float]:
    """Predicted peak bytes of every other model-stage on actor/generation's GPUs with the vLLM
    engine beside it (`engine_memory`'s device bytes on top of `evaluate_plan`'s peak, which
    counts the generation KV cache as gone once generation ends: true of an engine asleep)."""
    gpus = set(plan.stage_plan(ACTOR_GENERATION).gpus)
    extra = engine_memory(plan, calibration, sleep_level).device
    stages = evaluate_plan(plan, calibration).predictions.model_stages
    return {
        entry.model_stage: stages[entry.model_stage].peak_memory_bytes + extra
        for entry in plan.stages
        if entry.model_stage != ACTOR_GENERATION and gpus & set(entry.gpus)
    }


def sleep_wake_seconds(calibration: Calibration, engine: Engine, colocated: bool) -> float:
    """Seconds per step an actor/generation engine spends going to sleep and waking up: only vLLM
    engines whose GPUs a training stage shares (a colocated pool) sleep."""
    if engine == "nereus" or not colocated:
        return 0.0
    return calibration.vllm_sleep_s + calibration.vllm_wake_s


# ---- generation under vLLM's scheduler ----


@dataclass(frozen=True)
class VllmScheduler:
    """The vLLM scheduler settings generation time depends on (vLLM's engine arguments)."""

    max_num_batched_tokens: int = 8192
    """Tokens one forward pass may process (chunked prefill cuts prompts to fit)."""
    max_num_seqs: int = 256
    """Sequences running at once, whatever the KV cache holds."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(
                f"max_num_batched_tokens {self.max_num_batched_tokens} and max_num_seqs {self.max_num_seqs} "
                "must both be at least 1"
            )


def sequence_capped_tokens(plan: Plan, max_num_seqs: int) -> float:
    """The KV tokens at which the closed form of continuous batching runs `max_num_seqs` sequences
    at once (its saturated concurrency is (capacity - prompt / 2) over the mean context), so a cap
    on sequences prices as a budget of tokens."""
    w = plan.workload
    prompt = float(w.prompt_len)
    return max_num_seqs * mean_context(w.response_len, prompt) + prompt / 2


def generation_terms(
    plan: Plan, calibration: Calibration, engine: Engine, scheduler: VllmScheduler | None = None
) -> dict[str, float]:
    """Seconds per step of actor/generation by term (its slowest replica) under `engine`.

    nereus: the cost model's own terms (`StageCostModel.time_terms`). vLLM: the same decode
    (continuous batching within the KV budget, at most `max_num_seqs` running), prefill in
    passes of at most `max_num_batched_tokens` tokens, each at least one read of the weights,
    and `vllm_iteration_overhead_s` per scheduler iteration in place of per-layer launches.
    """
    entry = plan.stage_plan(ACTOR_GENERATION)
    if engine == "nereus":
        return _stage_terms(plan, entry, calibration)[0]
    model = stage_cost_model(plan, entry.role, entry.stage, calibration)
    choices = stage_choices(entry)
    pp_inter = any(_spans_nodes(plan.cluster, emu) for emu in entry.emus)
    args = (entry.tp, entry.pp, entry.dp, entry.micro_batches, pp_inter, _spans_nodes(plan.cluster, entry.gpus))
    scheduler = scheduler or VllmScheduler()
    w = plan.workload
    per_token = float(model.kv_bytes_per_token(entry.tp, entry.pp))
    n = float(model.samples_per_replica(entry.dp * entry.ep))  # an ep rank's share of the replica's
    capacity = choices["kv_budget"] / per_token
    if n > scheduler.max_num_seqs:
        capacity = min(capacity, sequence_capped_tokens(plan, scheduler.max_num_seqs))
    budget = {"kv_budget": capacity * per_token, "ep_inter": ep_spans_nodes(plan.cluster, entry)}
    terms = {k: float(v) for k, v in model.time_terms(*args, **{**choices, **budget}).items()}
    prompt = float(w.prompt_len)
    passes = math.ceil(n * prompt / scheduler.max_num_batched_tokens)
    weights = float(model.params_per_gpu(entry.tp, entry.pp, entry.ep)) * model.dtype_bytes
    read = weights / (plan.cluster.gpu.hbm_bytes_per_s * calibration.decode_memory)
    terms["prefill"] = max(terms["prefill"], passes * (2 * entry.pp - 1) * read)
    longest = w.response_len.expected_longest(w.samples_per_step)
    iterations = float(decode_profile(w.response_len, prompt, n, capacity, longest)[0].sum())
    terms["overhead"] = (iterations + passes) * calibration.vllm_iteration_overhead_s + calibration.stage_overhead_s
    return terms


def generation_seconds(
    plan: Plan, calibration: Calibration, engine: Engine, scheduler: VllmScheduler | None = None
) -> float:
    """Seconds per step of actor/generation under `engine` (the sum of `generation_terms`)."""
    return sum(generation_terms(plan, calibration, engine, scheduler).values())


# ---- fitting the engine's phases to run records ----


@dataclass(frozen=True)
class EnginePhaseFit:
    """The engine fields a fit estimated, their values and relative standard errors."""

    values: dict[str, float]
    relative_error: dict[str, float]


def fit_engine_phases(records: Sequence[tuple[float, Mapping[str, Sequence[float]]]]) -> EnginePhaseFit:
    """Each engine field from the phases runs recorded: the median of the times (the weight load:
    of the per-GPU weight bytes over the time), with the standard error of that median
    (1.25 sd / sqrt(n); infinite from one record). `records`: per run, the bytes one engine GPU
    loads and the seconds recorded per phase key (`ENGINE_PHASES`)."""
    samples: dict[str, list[float]] = {}
    for weight_bytes, phases in records:
        for key, seconds in phases.items():
            if key not in PHASE_FIELDS:
                continue
            if key == WEIGHT_LOAD_KEY and weight_bytes <= 0:
                continue  # no generation replica to know the bytes of
            for value in seconds:
                if value <= 0:
                    continue  # a phase that did not happen at that step
                samples.setdefault(key, []).append(weight_bytes / value if key == WEIGHT_LOAD_KEY else value)
    values: dict[str, float] = {}
    errors: dict[str, float] = {}
    for key, points in samples.items():
        name = PHASE_FIELDS[key]
        values[name] = statistics.median(points)
        if len(points) < 2:
            errors[name] = math.inf
        else:
            spread = 1.2533 * statistics.stdev(points) / math.sqrt(len(points))
            errors[name] = spread / max(abs(values[name]), 1e-12)
    return EnginePhaseFit(values, errors)


def phase_times(stage_seconds: Sequence[Mapping[str, float]]) -> dict[str, tuple[float, ...]]:
    """The engine phases' seconds over a run's step records (every step: start-up happens once)."""
    out: dict[str, list[float]] = {}
    for record in stage_seconds:
        for key in ENGINE_PHASES:
            if key in record:
                out.setdefault(key, []).append(float(record[key]))
    return {key: tuple(values) for key, values in out.items()}

"""Predictions for a whole plan: per model-stage time and memory, and the step."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from nereus.cost.calibration import DEFAULT_CALIBRATION, Calibration
from nereus.cost.stage import OFFLOAD_LEVELS, TRAIN_OFFLOADS, StageCostModel, expert_params
from nereus.spec.check import Problem
from nereus.spec.cluster import Cluster
from nereus.spec.plan import RECOMPUTE_LEVELS, Plan, Predictions, StagePlan, StagePrediction, SteadyState
from nereus.spec.stages import (
    ACTOR_GENERATION,
    ACTOR_SYNC_TARGETS,
    ACTOR_TRAINING,
    STAGES,
    ModelStageName,
    Role,
    Stage,
    head_of,
    split,
)
from nereus.spec.workload import DTYPE_BYTES, Workload
from nereus.units import format_bytes

GIB = 2**30
RESIDENT_TERMS = ("parameters", "gradients", "optimizer")


def stage_cost_model(plan_like: Plan, role: Role, stage: Stage, calibration: Calibration) -> StageCostModel:
    model = plan_like.model(plan_like.workload.model_name(role))
    return StageCostModel(model, head_of(role), stage, plan_like.workload, plan_like.cluster, calibration)


def usable_capacity(cluster: Cluster, calibration: Calibration) -> float:
    """Bytes per GPU a plan may fill: device memory less the calibration's headroom. The one
    memory base: every table, message and check compares a GPU's need with it, and the
    workspace is one of the terms of that need (`workspace_bytes`)."""
    return cluster.gpu.memory_bytes * (1 - calibration.memory_headroom)


def workspace_bytes(cluster: Cluster, calibration: Calibration) -> float:
    """The workspace every GPU keeps (runtime, communicators, allocator slack): a memory term of
    every model-stage's peak, shown as `workspace`."""
    return cluster.gpu.memory_bytes * calibration.workspace_fraction


def stage_room(cluster: Cluster, calibration: Calibration) -> float:
    """Bytes per GPU the model-stages' own terms (states, activations, logits, KV cache) may
    fill: the usable capacity less the workspace. The search compares their terms with it;
    what it reports adds the workspace back and compares with `usable_capacity`."""
    return usable_capacity(cluster, calibration) - workspace_bytes(cluster, calibration)


def weight_sync_time(
    cluster: Cluster,
    workload: Workload,
    actor_params: int,
    calibration: Calibration,
    *,
    same_layout: bool,
    tp: int,
    pp: int,
    inter: bool,
    ep: int = 1,
    expert_params: int = 0,
) -> float:
    """Moving updated actor weights into a generation/inference layout: 0 if identical. Each
    destination GPU receives its tp x pp share of the weights, of the `expert_params` expert
    weights only its ep rank's block."""
    if same_layout:
        return 0.0
    bandwidth, latency = calibration.link(cluster, inter)
    received = actor_params - expert_params + expert_params / ep
    return latency + received * DTYPE_BYTES[workload.dtype] / (tp * pp) / bandwidth


@dataclass
class PlanEvaluation:
    """The cost model's verdict on a plan."""

    predictions: Predictions
    memory_problems: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return not self.memory_problems


def _spans_nodes(cluster: Cluster, gpus: list[int]) -> bool:
    return len({cluster.node_of(gpu) for gpu in gpus}) > 1


def cp_spans_nodes(cluster: Cluster, entry: StagePlan) -> bool:
    """Whether some tp x cp group (one pipeline stage of an EMU: its cp ranks' tp groups, whose
    all-to-alls cross it) spans nodes; False without context parallelism."""
    block = entry.tp * entry.cp
    return entry.cp > 1 and any(
        _spans_nodes(cluster, emu[s * block : (s + 1) * block]) for emu in entry.emus for s in range(entry.pp)
    )


def ep_spans_nodes(cluster: Cluster, entry: StagePlan) -> bool:
    """Whether some tp x ep group (one pipeline stage of an EMU: its ep ranks' tp groups, whose
    dispatch and combine all-to-alls cross it) spans nodes; False without expert parallelism."""
    block = entry.tp * entry.cp * entry.ep
    return entry.ep > 1 and any(
        _spans_nodes(cluster, emu[s * block : (s + 1) * block]) for emu in entry.emus for s in range(entry.pp)
    )


def stage_choices(entry: StagePlan) -> dict[str, Any]:
    """The entry's memory-saving choices, and its expert-parallel degree, as the cost model's
    keyword arguments."""
    return {
        "ep": entry.ep,
        "recompute": RECOMPUTE_LEVELS.index(entry.recompute),
        "zero1": entry.zero1,
        "kv_budget": math.inf if entry.kv_budget_bytes is None else float(entry.kv_budget_bytes),
        "full_shard": int(entry.full_shard),
        "train_offload": TRAIN_OFFLOADS.index(entry.train_offload),
    }


def split_resident(memory: dict[str, Any], offload: Any) -> tuple[Any, Any]:
    """(resident, transient) bytes: an offloaded model-stage's states are only there while it runs."""
    states = sum(v for k, v in memory.items() if k in RESIDENT_TERMS)
    rest = sum(v for k, v in memory.items() if k not in RESIDENT_TERMS)
    return np.where(offload, 0.0, states), rest + np.where(offload, states, 0.0)


def resident_share(plan: Plan, entry: StagePlan, calibration: Calibration) -> float:
    """Share of a model-stage's full model state (parameters, gradients, unsharded optimizer)
    that stays on its GPUs between stages, as `evaluate_plan` counts it: 0 when offloaded,
    less than 1 under ZeRO-1, full sharding or training-time offload, 1 otherwise."""
    if entry.offload:
        return 0.0
    model = stage_cost_model(plan, entry.role, entry.stage, calibration)
    params = model.params_per_gpu(entry.tp, entry.pp, entry.ep)
    shards = entry.dp * entry.cp  # the cp ranks share the state out with the replicas
    kept = model.model_state_terms(params, shards, entry.zero1, int(entry.full_shard))
    level = TRAIN_OFFLOADS.index(entry.train_offload)
    if level:  # training-time offload keeps these in host memory, sharded across dp x cp
        kept = model.model_state_terms(params, shards, True, int(entry.full_shard))
        kept = {k: v for k, v in kept.items() if level < OFFLOAD_LEVELS[k]}
    return float(sum(kept.values())) / replica_state_bytes(
        plan, entry.model_stage, calibration, entry.tp, entry.pp, entry.ep
    )


def replica_state_bytes(
    plan: Plan, model_stage: ModelStageName, calibration: Calibration, tp: int = 1, pp: int = 1, ep: int = 1
) -> float:
    """Bytes of one replica's model state on a GPU of its tp x pp layout, nothing sharded
    across replicas: parameters in the workload's dtype, and in training gradients (same dtype)
    and AdamW state (fp32 moments, and fp32 masters of 16-bit weights where the optimizer keeps
    them); `ep`: of its ep rank's block of the experts. tp = pp = ep = 1: the whole replica's state,
    what a transition moves."""
    role, stage = split(model_stage)
    model = stage_cost_model(plan, role, stage, calibration)
    return float(sum(model.model_state_terms(model.params_per_gpu(tp, pp, ep), 1, False).values()))


def one_sequence_bytes(plan: Plan, entry: StagePlan, calibration: Calibration) -> float:
    """KV bytes per GPU of one prompt plus maximum-length response: the least a generation
    model-stage's KV budget must hold for the engine to run at all."""
    model = stage_cost_model(plan, entry.role, entry.stage, calibration)
    w = plan.workload
    return float(math.ceil((w.prompt_len + w.response_len.max) * model.kv_bytes_per_token(entry.tp, entry.pp)))


def one_sequence_shortfall(plan: Plan, entry: StagePlan, calibration: Calibration) -> float:
    """Bytes a generation KV budget lacks for one maximum-length sequence (0: it runs)."""
    if entry.stage != "generation" or entry.kv_budget_bytes is None:
        return 0.0
    return max(0.0, one_sequence_bytes(plan, entry, calibration) - entry.kv_budget_bytes)


def host_bytes(memory: dict[str, Any], host: dict[str, Any], offload: Any) -> dict[str, Any]:
    """Host-memory bytes per GPU by term: training-time offload's (`StageCostModel.host_terms`)
    and, where the model-stage is offloaded, its device states asleep between runs (`asleep`)."""
    asleep = np.where(offload, sum(v for k, v in memory.items() if k in RESIDENT_TERMS), 0.0)
    return {**host, "asleep": asleep} if np.ndim(offload) or offload else dict(host)


def host_problems(plan: Plan, host_per_gpu: dict[str, float]) -> list[str]:
    """Nodes whose host memory the model-stages' offloaded states overflow: each model-stage
    keeps `host_per_gpu[model_stage]` bytes for each of its GPUs on the node."""
    used: dict[int, float] = {}
    for entry in plan.stages:
        for gpu in entry.gpus:
            node = plan.cluster.node_of(gpu)
            used[node] = used.get(node, 0.0) + host_per_gpu[entry.model_stage]
    limit = plan.cluster.host_memory_bytes
    return [
        f"host memory of node {node}: {format_bytes(size)} > {format_bytes(limit)} (the cluster's host_memory_bytes)"
        for node, size in sorted(used.items())
        if size > limit
    ]


def _stage_terms(
    plan: Plan, entry: StagePlan, calibration: Calibration
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(time, device memory, host memory) terms of one model-stage."""
    model = stage_cost_model(plan, entry.role, entry.stage, calibration)
    pp_inter = any(_spans_nodes(plan.cluster, emu) for emu in entry.emus)
    dp_inter = _spans_nodes(plan.cluster, entry.gpus)
    choices = stage_choices(entry)
    cp_inter = cp_spans_nodes(plan.cluster, entry)
    parallel = dict(cp=entry.cp)
    if entry.cp_method == "allgather":  # all-gather KV's cp terms (Ulysses': the defaults)
        parallel["cp_allgather"] = 1
    times = model.time_terms(
        entry.tp,
        entry.pp,
        entry.dp,
        entry.micro_batches,
        pp_inter,
        dp_inter,
        **choices,
        **parallel,
        cp_inter=cp_inter,
        ep_inter=ep_spans_nodes(plan.cluster, entry),
    )
    memory = model.memory_terms(
        entry.tp, entry.pp, entry.dp, entry.micro_batches, token_budget=entry.token_budget or 0, **choices, **parallel
    )
    if entry.offload:
        states = sum(v for k, v in memory.items() if k in RESIDENT_TERMS)
        times["offload"] = model.offload_time(states)
    level = choices["train_offload"]
    host = host_bytes(memory, model.host_terms(entry.tp, entry.pp, entry.dp, level, entry.cp, entry.ep), entry.offload)
    floats = ({k: float(v) for k, v in terms.items()} for terms in (times, memory, host))
    return next(floats), next(floats), next(floats)


def _weight_sync(plan: Plan, entry: StagePlan, calibration: Calibration) -> float:
    train = plan.stage_plan(ACTOR_TRAINING)
    same = (entry.tp, entry.cp, entry.ep, entry.pp, entry.emus) == (train.tp, train.cp, train.ep, train.pp, train.emus)
    train_nodes = {plan.cluster.node_of(g) for g in train.gpus}
    inter = any(plan.cluster.node_of(g) not in train_nodes for g in entry.gpus)
    actor = plan.model(plan.workload.actor)
    return weight_sync_time(
        plan.cluster,
        plan.workload,
        actor.num_params("lm"),
        calibration,
        same_layout=same,
        tp=entry.tp,
        pp=entry.pp,
        inter=inter,
        ep=entry.ep,
        expert_params=expert_params(actor),
    )


def _degrees(entry: StagePlan) -> str:
    """`tp=2, pp=1` (with `, cp=4` or `, ep=8` where context or expert parallelism is in play)."""
    cp = f", cp={entry.cp_label}" if entry.cp > 1 else ""
    ep = f", ep={entry.ep}" if entry.ep > 1 else ""
    return f"tp={entry.tp}{cp}{ep}, pp={entry.pp}"


def evaluate_plan(plan: Plan, calibration: Calibration = DEFAULT_CALIBRATION) -> PlanEvaluation:
    """Predict every model-stage's time and peak memory, and the step's critical path.

    Assumes `plan` passed the semantic checks. Model states of every model-stage on a
    GPU stay resident; a running model-stage adds its transient memory on top.
    """
    terms = {entry.model_stage: _stage_terms(plan, entry, calibration) for entry in plan.stages}
    resident_on: dict[int, float] = {}
    transient_of: dict[str, float] = {}
    for entry in plan.stages:
        _, memory, _ = terms[entry.model_stage]
        resident, transient = (float(x) for x in split_resident(memory, entry.offload))
        transient_of[entry.model_stage] = transient
        for gpu in entry.gpus:
            resident_on[gpu] = resident_on.get(gpu, 0.0) + resident
    workspace = workspace_bytes(plan.cluster, calibration)
    limit = usable_capacity(plan.cluster, calibration)
    stage_predictions: dict[str, StagePrediction] = {}
    problems: list[str] = []
    for entry in plan.stages:
        times, memory, host = terms[entry.model_stage]
        own_resident = float(split_resident(memory, entry.offload)[0])
        busiest = max(entry.gpus, key=lambda g: resident_on[g])
        breakdown = dict(memory, co_resident=resident_on[busiest] - own_resident, workspace=workspace)
        peak = sum(breakdown.values())
        if entry.model_stage in ACTOR_SYNC_TARGETS:
            times["weight_sync"] = _weight_sync(plan, entry, calibration)
        stage_predictions[entry.model_stage] = StagePrediction(
            time_s=sum(v for k, v in times.items() if k != "weight_sync"),
            peak_memory_bytes=int(peak),
            time_breakdown_s=times,
            memory_breakdown_bytes={k: int(v) for k, v in breakdown.items()},
            host_memory_bytes={k: int(v) for k, v in host.items() if v > 0},
        )
        short = one_sequence_shortfall(plan, entry, calibration)
        if short > 0:
            budget = format_bytes(entry.kv_budget_bytes or 0)
            problems.append(
                f"{entry.model_stage} (tp={entry.tp}, pp={entry.pp}) KV budget {budget} "
                f"holds no maximum-length sequence ({format_bytes(short)} short)"
            )
        if peak > limit:
            term, size = max(memory.items(), key=lambda kv: kv[1])
            problems.append(
                f"{entry.model_stage} ({_degrees(entry)}) needs {format_bytes(peak)} on GPU {busiest} "
                f"> {format_bytes(limit)} usable; largest term: {term} {format_bytes(size)}"
            )
    problems += host_problems(plan, {name: sum(t[2].values()) for name, t in terms.items()})
    step = _step_breakdown(plan, stage_predictions, calibration)
    steady = steady_state(plan, step)
    step_time = sum(step.values()) if steady is None else steady_step_time(steady, step)
    predictions = Predictions(
        step_time_s=step_time, model_stages=stage_predictions, step_breakdown_s=step, steady_state=steady
    )
    return PlanEvaluation(predictions, problems)


def generation_alone(plan: Plan) -> bool:
    """Whether actor/generation's GPUs run no other model-stage: async execution overlaps the
    two pools only then."""
    generation = set(plan.stage_plan(ACTOR_GENERATION).gpus)
    return not any(generation & set(e.gpus) for e in plan.stages if e.model_stage != ACTOR_GENERATION)


def steady_state(plan: Plan, phases: dict[str, float]) -> SteadyState | None:
    """An async step's steady state from its phases (`_step_breakdown`): the generation pool's
    time against the training pool's (inference, training, then the weight sync), generation
    running up to `max_staleness` batches ahead so neither waits for the other beyond the slower
    one. None where the step is synchronous: sync execution, max_staleness 0 (the pools take
    turns: the phases add up), or generation sharing GPUs with another model-stage (a plan
    `plan_cost_problems` refuses under async)."""
    if not plan.workload.overlaps or not generation_alone(plan):
        return None
    generation = phases["generation"]
    training = sum(phases[name] for name in TRAINING_POOL_PHASES)
    bound: Literal["generation", "training"] = "generation" if generation >= training else "training"
    return SteadyState(generation_s=generation, training_s=training, bound=bound, max_staleness=plan.workload.staleness)


#: The phases an async step runs on its training pool, one after another.
TRAINING_POOL_PHASES = ("inference", "training", "weight_sync")


def steady_step_time(steady: SteadyState, phases: dict[str, float]) -> float:
    """The step time of a steady state: its slower pool, plus the per-step overhead if any."""
    return max(steady.generation_s, steady.training_s) + phases.get("step_overhead", 0.0)


def _step_breakdown(plan: Plan, stages: dict[str, StagePrediction], calibration: Calibration) -> dict[str, float]:
    """Phases run one after another; in a phase, pools overlap (unless the calibration says
    they do not) and a pool runs serially."""
    phases: dict[str, float] = {}
    for stage in STAGES:
        per_pool: dict[str, float] = {}
        for entry in plan.stages:
            if entry.stage == stage:
                per_pool[entry.pool] = per_pool.get(entry.pool, 0.0) + stages[entry.model_stage].time_s
        times = list(per_pool.values()) or [0.0]
        phases[stage] = max(times) if calibration.concurrent_pools else sum(times)
    phases["weight_sync"] = max(
        (stages[name].time_breakdown_s.get("weight_sync", 0.0) for name in ACTOR_SYNC_TARGETS if name in stages),
        default=0.0,
    )
    if calibration.step_overhead_s > 0:  # absent by default: the phases alone make the step
        phases["step_overhead"] = calibration.step_overhead_s
    return phases


def _stale(stored: float, fresh: float) -> bool:
    return abs(stored - fresh) > 1e-6 * max(abs(fresh), 1e-12)


def plan_cost_problems(plan: Plan, calibration: Calibration = DEFAULT_CALIBRATION) -> Iterator[Problem]:
    """Memory feasibility (errors) and stale stored predictions (warnings) of a plan."""
    evaluation = evaluate_plan(plan, calibration)
    for i, entry in enumerate(plan.stages):
        for message in evaluation.memory_problems:
            if message.startswith(f"{entry.model_stage} "):
                yield Problem(f"stages[{i}]", f"memory: {message}; raise tp or pp, or give it more GPUs")
    if plan.workload.execution == "async" and not generation_alone(plan):
        yield Problem(
            "workload.execution",
            "async overlaps generation with training on disjoint GPUs, but actor/generation shares its GPUs "
            "with another model-stage; give actor/generation a pool of its own (`nereus plan` does) or set "
            "execution: sync",
        )
    for message in evaluation.memory_problems:
        if message.startswith("host memory"):
            fix = "offload less (train_offload, offload) or spread the model-stages over more nodes"
            yield Problem("cluster.host_memory_bytes", f"{message}; {fix}")
    if plan.predictions is None:
        return
    stored, fresh = plan.predictions.model_dump(), evaluation.predictions.model_dump()
    differences = list(_differences(stored, fresh, "predictions"))
    for where, what in differences[:MAX_STALE_REPORTED]:
        yield Problem(where, f"stale: {what}; rerun `nereus plan` or delete the predictions block", "warning")
    if len(differences) > MAX_STALE_REPORTED:
        more = len(differences) - MAX_STALE_REPORTED
        yield Problem("predictions", f"stale: {more} more stored numbers differ from the cost model", "warning")


#: Stale predictions reported one by one; the rest are counted in one more warning.
MAX_STALE_REPORTED = 12


def _differences(stored: Any, fresh: Any, at: str) -> Iterator[tuple[str, str]]:
    """Every place where a stored prediction differs from the recomputed one: (path, what)."""
    if isinstance(stored, dict) and isinstance(fresh, dict):
        for key in sorted(set(stored) | set(fresh)):
            where = f"{at}.{key}"
            if key not in fresh:
                yield where, "stored, but the cost model predicts no such entry"
            elif key not in stored:
                yield where, f"missing; the cost model predicts {_shown(fresh[key])}"
            else:
                yield from _differences(stored[key], fresh[key], where)
    elif isinstance(stored, int) and isinstance(fresh, int):
        if stored != fresh:
            yield at, f"stored {stored}, the cost model predicts {fresh}"
    elif isinstance(stored, float | int) and isinstance(fresh, float | int):
        if _stale(float(stored), float(fresh)):
            yield at, f"stored {stored:.6g}, the cost model predicts {fresh:.6g}"
    elif stored != fresh:
        yield at, f"stored {_shown(stored)}, the cost model predicts {_shown(fresh)}"


def _shown(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else "an entry" if isinstance(value, dict) else repr(value)

"""How each prediction of a plan is derived: inputs, terms and the critical path."""

from __future__ import annotations

from typing import Any

from nereus.cost.calibration import Calibration
from nereus.cost.plan_cost import GIB, evaluate_plan, stage_cost_model
from nereus.cost.stage import StageCostModel
from nereus.spec.plan import Plan, StagePlan
from nereus.spec.stages import STAGES


def _derived(plan: Plan, model_stage: str, calibration: Calibration) -> dict[str, float]:
    entry = plan.stage_plan(model_stage)
    cost = stage_cost_model(plan, entry.role, entry.stage, calibration)
    w = plan.workload
    return {
        "samples_per_replica": float(cost.samples_per_replica(entry.dp)),
        "micro_batch_size": float(cost.micro_batch_size(entry.dp, entry.micro_batches)),
        "mean_sequence_tokens": w.prompt_len + w.response_len.mean(),
        "max_sequence_tokens": float(w.prompt_len + w.response_len.max),
        "longest_response_tokens": w.response_len.expected_longest(w.samples_per_step),
        "params_per_gpu": float(cost.params_per_gpu(entry.tp, entry.pp, entry.ep)),
    }


def cost_of(plan: Plan, entry: StagePlan, calibration: Calibration) -> StageCostModel:
    return stage_cost_model(plan, entry.role, entry.stage, calibration)


def choice_line(entry: StagePlan, cost: StageCostModel) -> str:
    """Every memory-saving choice of the entry, including the ones left off."""
    if entry.stage == "generation":
        full = float(cost.full_kv_bytes(entry.tp, entry.pp, entry.dp, entry.ep))
        kv = (
            f"KV budget {entry.kv_budget_bytes / GIB:.2f} GiB per GPU of the {full / GIB:.2f} GiB the whole "
            f"batch needs (continuous batching)"
            if entry.kv_budget_bytes is not None
            else f"KV cache for the whole batch ({full / GIB:.2f} GiB per GPU)"
        )
        return f"{kv}; offload {'on' if entry.offload else 'off'}"
    sharding = _full_shard_text(entry, cost)
    if entry.stage == "inference":
        return f"{sharding}; offload {'on' if entry.offload else 'off'}"
    zero1 = entry.full_shard or (entry.zero1 if entry.zero1 is not None else cost.workload.optimizer.shard_across_dp)
    batching = f"packed to {entry.token_budget} tokens" if entry.token_budget else "equal rows at the maximum length"
    zero1 = zero1 or entry.train_offload != "none"
    return (
        f"recompute {entry.recompute}; micro-batches {batching}; ZeRO-1 {'on' if zero1 else 'off'}; "
        f"{sharding}; {_train_offload_text(entry)}; offload {'on' if entry.offload else 'off'}"
    )


def _train_offload_text(entry: StagePlan) -> str:
    """Training-time offload and what it keeps in host memory."""
    kept = {
        "none": "off",
        "optimizer": "optimizer (AdamW state and gradients in host memory, the step on the host)",
        "params": "params (parameters, gradients and AdamW state in host memory, the step on the host)",
    }
    return f"training-time offload {kept[entry.train_offload]}"


def _full_shard_text(entry: StagePlan, cost: StageCostModel) -> str:
    """Full sharding and what it gathers while running."""
    if not entry.full_shard:
        return "full sharding off"
    unit = float(cost.gathered_unit_params(entry.tp)) * cost.dtype_bytes
    what = "parameters and gradients" if entry.stage == "training" else "parameters"
    return (
        f"full sharding on ({what} over dp={entry.dp}; gathers {unit / GIB:.2f} GiB units, "
        f"all-gathered every micro-batch)"
    )


def explain_plan(plan: Plan, calibration: Calibration) -> dict[str, Any]:
    """A JSON-ready derivation of every prediction, plus printable `lines`."""
    evaluation = evaluate_plan(plan, calibration)
    predictions = evaluation.predictions
    lines = [
        f"plan for {plan.workload.name} ({plan.workload.algorithm}) on {plan.cluster.name}; "
        f"calibration: gemm {calibration.gemm}, attention {calibration.attention}, "
        f"memory-bound {calibration.decode_memory}, links {calibration.collective_intra}/"
        f"{calibration.collective_inter}"
    ]
    stages: dict[str, Any] = {}
    for entry in plan.stages:
        pred = predictions.model_stages[entry.model_stage]
        derived = _derived(plan, entry.model_stage, calibration)
        stages[entry.model_stage] = {
            "derived": derived,
            "time_s": pred.time_breakdown_s,
            "memory_bytes": pred.memory_breakdown_bytes,
            "host_memory_bytes": pred.host_memory_bytes,
        }
        cp = f" cp={entry.cp}" if entry.cp > 1 else ""
        cp += f" ep={entry.ep}" if entry.ep > 1 else ""
        lines.append(
            f"\n{entry.model_stage}: tp={entry.tp}{cp} pp={entry.pp} dp={entry.dp} "
            f"micro_batches={entry.micro_batches} pool={entry.pool}"
        )
        lines.append("  memory choices: " + choice_line(entry, cost_of(plan, entry, calibration)))
        lines.append("  inputs: " + ", ".join(f"{k}={v:.6g}" for k, v in derived.items()))
        lines.append(
            f"  time {pred.time_s:.4g} s = "
            + " + ".join(f"{k} {v:.4g}" for k, v in pred.time_breakdown_s.items() if k != "weight_sync")
        )
        if "weight_sync" in pred.time_breakdown_s:
            lines.append(f"  weight sync from actor/training: {pred.time_breakdown_s['weight_sync']:.4g} s")
        lines.append(
            f"  peak memory {pred.peak_memory_bytes / GIB:.2f} GiB = "
            + " + ".join(f"{k} {v / GIB:.2f}" for k, v in pred.memory_breakdown_bytes.items())
        )
        if pred.host_memory_bytes:
            lines.append(
                f"  host memory per GPU {sum(pred.host_memory_bytes.values()) / GIB:.2f} GiB = "
                + " + ".join(f"{k} {v / GIB:.2f}" for k, v in pred.host_memory_bytes.items())
            )
    lines.append("\nstep (phases in sequence; within a phase pools overlap, a pool runs its model-stages serially):")
    for phase in STAGES:
        pools: dict[str, float] = {}
        for entry in plan.stages:
            if entry.stage == phase:
                pools[entry.pool] = pools.get(entry.pool, 0.0) + predictions.model_stages[entry.model_stage].time_s
        lines.append(
            f"  {phase}: max over pools of "
            + ", ".join(f"{p} {t:.4g}" for p, t in pools.items())
            + f" = {predictions.step_breakdown_s[phase]:.4g} s"
        )
    lines.append(f"  weight_sync: {predictions.step_breakdown_s['weight_sync']:.4g} s")
    steady = predictions.steady_state
    if steady is not None:  # async: the pools overlap, the phases do not add up
        lines.append(
            f"  async steady state (generation up to {steady.max_staleness} batch(es) ahead): "
            f"max(generation pool {steady.generation_s:.4g}, training pool inference + training + weight_sync "
            f"{steady.training_s:.4g}); bound by the {steady.bound} pool"
        )
    lines.append(f"  step time: {predictions.step_time_s:.4g} s")
    for problem in evaluation.memory_problems:
        lines.append(f"infeasible: {problem}")
    return {
        "step_time_s": predictions.step_time_s,
        "step_breakdown_s": predictions.step_breakdown_s,
        "model_stages": stages,
        "memory_problems": evaluation.memory_problems,
        "lines": lines,
    }

"""What every trainer export shares: the plan as the trainer can run it, what differs, and
what the difference costs by the cost model."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nereus.cost.calibration import DEFAULT_CALIBRATION, Calibration
from nereus.cost.plan_cost import evaluate_plan, usable_capacity
from nereus.spec.plan import CpMethod, Fusion, Plan, Pool, StagePlan

#: A setting's value as the trainers take it (a store-true flag is True).
Value = int | float | str | bool


@dataclass(frozen=True)
class Difference:
    """One thing the plan decides that the trainer cannot express."""

    planned: str
    """What the plan decides, e.g. `actor/inference tp=2 pp=1 on GPUs 0-3`."""
    exported: str
    """What was exported instead, and why."""


@dataclass
class Export:
    """A plan as one trainer's settings, and the plan that those settings really run."""

    trainer: str
    """`verl` or `openrlhf`."""
    version: str
    """The trainer release the settings were checked against."""
    settings: dict[str, Value]
    """Setting name (a dotted config key or a flag name) to value, in the order written."""
    differences: list[Difference]
    """Everything the plan decides that the trainer cannot express."""
    exported_plan: Plan
    """The plan as the trainer will run it (what `nereus fit --from` prices)."""
    planned_step_s: float
    """The cost model's step time of the plan as planned."""
    exported_step_s: float
    """The cost model's step time of the plan as exported."""
    memory_problems: list[str] = field(default_factory=list)
    """Where the plan as exported no longer fits in memory, by the cost model."""

    def warning_lines(self) -> list[str]:
        """The warning block: every difference, then what it costs; empty when none."""
        if not self.differences and not self.memory_problems:
            return []
        lines = [f"{self.trainer} {self.version} cannot express {len(self.differences)} decision(s) of this plan:"]
        lines += [f"  - plan: {d.planned}; exported: {d.exported}" for d in self.differences]
        lines += [f"  - as exported, memory: {problem}" for problem in self.memory_problems]
        change = self.exported_step_s / self.planned_step_s - 1 if self.planned_step_s > 0 else 0.0
        lines.append(
            f"  predicted step time: {self.planned_step_s:.4g} s as planned, "
            f"{self.exported_step_s:.4g} s as exported ({change:+.1%})"
        )
        return lines


def gpu_ranges(gpus: list[int]) -> str:
    """`0-3,8-11` for a GPU list."""
    ordered = sorted(set(gpus))
    parts: list[str] = []
    start = previous = ordered[0]
    for gpu in [*ordered[1:], None]:
        if gpu is not None and gpu == previous + 1:
            previous = gpu
            continue
        parts.append(f"{start}-{previous}" if previous > start else str(start))
        if gpu is not None:
            start = previous = gpu
    return ",".join(parts)


def describe(entry: StagePlan) -> str:
    """`actor/training tp=2 pp=1 dp=2 on GPUs 0-3` (`tp=2 cp=2 pp=1` under context parallelism)."""
    cp = f" cp={entry.cp_label}" if entry.cp > 1 else ""
    cp += f" ep={entry.ep}" if entry.ep > 1 else ""
    return f"{entry.model_stage} tp={entry.tp}{cp} pp={entry.pp} dp={entry.dp} on GPUs {gpu_ranges(entry.gpus)}"


def sharding_difference(planned: StagePlan, exported: StagePlan, how: str) -> Difference | None:
    """The Difference when the trainer shards a model-stage's parameters otherwise than planned
    (full sharding, `StagePlan.full_shard`), or None."""
    if planned.full_shard == exported.full_shard:
        return None
    state = {True: "fully sharded over dp", False: "whole parameters on every replica"}
    return Difference(f"{planned.model_stage} {state[planned.full_shard]}", f"{state[exported.full_shard]} ({how})")


def offload_difference(planned: StagePlan, exported: StagePlan, how: str) -> Difference | None:
    """The Difference when the trainer keeps a model-stage's training states elsewhere than
    planned (training-time offload, `StagePlan.train_offload`), or None."""
    if planned.train_offload == exported.train_offload:
        return None
    where = {
        "none": "training states on the GPU",
        "optimizer": "AdamW state and gradients in host memory, stepped there",
        "params": "parameters, gradients and AdamW state in host memory, stepped there",
    }
    return Difference(
        f"{planned.model_stage} {where[planned.train_offload]}", f"{where[exported.train_offload]} ({how})"
    )


def samples_per_pass(plan: Plan, entry: StagePlan) -> int:
    """Samples one pass of the model-stage covers: a mini-batch in training, the step otherwise."""
    w = plan.workload
    return w.samples_per_step // w.mini_batches if entry.stage == "training" else w.samples_per_step


def per_gpu_micro_batch(plan: Plan, entry: StagePlan) -> int:
    """Sequences per micro-batch on one replica, as the trainers' `*_per_gpu` settings count them."""
    per_replica = math.ceil(samples_per_pass(plan, entry) / entry.dp)
    return max(1, math.ceil(per_replica / entry.micro_batches))


def laid_out(
    plan: Plan,
    entry: StagePlan,
    gpus: list[int],
    tp: int,
    pp: int,
    micro_batch: int,
    pool: str,
    cp: int = 1,
    ep: int = 1,
    cp_method: CpMethod = "ulysses",
) -> StagePlan:
    """`entry` re-laid over `gpus` (ordered) as consecutive EMUs of tp x cp x ep x pp GPUs, with
    as many micro-batches as a per-GPU micro-batch of `micro_batch` sequences makes (`cp_method`:
    the cp method where cp > 1)."""
    size = tp * cp * ep * pp
    if len(gpus) % size:
        shape = f"tp={tp}" + (f" x cp={cp}" if cp > 1 else "") + (f" x ep={ep}" if ep > 1 else "") + f" x pp={pp}"
        raise ValueError(
            f"{entry.model_stage}: {shape} does not divide the {len(gpus)} GPUs the trainer gives it; "
            "plan it with a layout that does"
        )
    dp = len(gpus) // size
    emus = [gpus[k * size : (k + 1) * size] for k in range(dp)]
    per_replica = math.ceil(samples_per_pass(plan, entry) / dp)
    micro_batches = 1 if entry.stage == "generation" else max(1, math.ceil(per_replica / micro_batch))
    return StagePlan(
        model_stage=entry.model_stage,
        pool=pool,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        dp=dp,
        emus=emus,
        micro_batches=micro_batches,
        cp_method=cp_method if cp > 1 else "ulysses",
    )


def finish(
    trainer: str,
    version: str,
    plan: Plan,
    settings: dict[str, Value],
    differences: list[Difference],
    stages: list[StagePlan],
    pools: list[Pool],
    calibration: Calibration = DEFAULT_CALIBRATION,
    exported_plan: Plan | None = None,
) -> Export:
    """The Export of `plan` whose trainer runs `stages` on `pools` (of `exported_plan`, when the
    trainer changes more than the layouts), priced by the cost model."""
    exported = unfused(exported_plan or plan).model_copy(update={"stages": stages, "pools": pools, "predictions": None})
    planned = evaluate_plan(plan, calibration)
    evaluation = evaluate_plan(exported, calibration)
    return Export(
        trainer,
        version,
        settings,
        differences,
        exported,
        planned.predictions.step_time_s,
        evaluation.predictions.step_time_s,
        evaluation.memory_problems,
    )


def free_memory_fraction(plan: Plan, model_stage: str, calibration: Calibration = DEFAULT_CALIBRATION) -> float:
    """The fraction of a GPU's memory a generation engine may take on `model_stage`'s busiest GPU:
    what the co-resident model states, the workspace and the cost model's headroom leave,
    rounded down to a hundredth (vLLM's `gpu_memory_utilization`)."""
    prediction = evaluate_plan(plan, calibration).predictions.model_stages[model_stage]
    memory = plan.cluster.gpu.memory_bytes
    taken = prediction.memory_breakdown_bytes.get("co_resident", 0) + prediction.memory_breakdown_bytes.get(
        "workspace", 0
    )
    free = (usable_capacity(plan.cluster, calibration) - taken) / memory
    return min(0.95, max(0.05, math.floor(free * 100) / 100))


def stage_difference(plan: Plan, planned: StagePlan, exported: StagePlan, reason: str) -> Difference | None:
    """The Difference between a model-stage as planned and as exported, or None if the trainer
    runs it as planned (same layout, context parallelism included, same GPUs, same per-GPU
    micro-batch)."""
    same = (planned.tp, planned.cp, planned.ep, planned.pp, planned.dp, sorted(planned.gpus)) == (
        exported.tp,
        exported.cp,
        exported.ep,
        exported.pp,
        exported.dp,
        sorted(exported.gpus),
    )
    planned_micro = per_gpu_micro_batch(plan, planned)
    exported_micro = per_gpu_micro_batch(plan, exported)
    if same and (planned.stage == "generation" or planned_micro == exported_micro):
        return None
    micro = "" if planned.stage == "generation" else f", {planned_micro} sequences per GPU micro-batch"
    micro_out = "" if planned.stage == "generation" else f", {exported_micro} sequences per GPU micro-batch"
    return Difference(describe(planned) + micro, f"{describe(exported)}{micro_out} ({reason})")


def fusion_differences(plan: Plan, trainer: str) -> list[Difference]:
    """RLHFuse's stage fusions, which neither trainer runs: the export runs stage by stage."""
    out = []
    if plan.fusion.inter_stage:
        out.append(Difference("inter-stage fusion (generation tail migrates)", f"stage by stage ({trainer} has none)"))
    if plan.fusion.intra_stage:
        out.append(Difference("intra-stage fusion (actor and critic in one pipeline)", f"serial training ({trainer})"))
    return out


def unfused(plan: Plan) -> Plan:
    """`plan` without stage fusion (as a trainer without it runs it)."""
    return plan.model_copy(update={"fusion": Fusion()})


def node_shape(plan: Plan, count: int, what: str, how: str) -> tuple[int, int]:
    """(nodes, GPUs per node) of a group of `count` GPUs as the trainers size one: part of one
    node, or whole nodes (else a ValueError naming `what` and the trainer's rule, `how`)."""
    per_node = plan.cluster.gpus_per_node
    if count <= per_node:
        return 1, count
    if count % per_node:
        raise ValueError(
            f"{what}: {count} GPUs are no whole number of {per_node}-GPU nodes, and {how}; plan it on whole nodes"
        )
    return count // per_node, per_node

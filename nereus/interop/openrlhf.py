"""A plan as the command line of OpenRLHF's PPO trainer (`openrlhf.cli.train_ppo_ray`).

OpenRLHF gives each model (actor, reference, reward, critic) its own group of whole nodes
(or a part of one node), trains and infers with DeepSpeed ZeRO data parallelism (one tensor
parallel size and one ring-attention size, `--ds.ring_attn_size`, its context parallelism, for
every DeepSpeed model; no pipeline parallelism) and generates with vLLM engines of one tensor
parallel size. The actor's old log-probs come from the actor's
training group, the critic's values from the critic's. Models share GPUs only through its
colocation flags. Whatever else a plan decides becomes a Difference.

An async plan (`execution: async`) adds OpenRLHF's asynchronous training: `--train.async_enable`,
`--train.async_queue_size` max_staleness (the generator takes a queue slot before it generates a
batch and the trainer frees it when it takes the batch, so generation runs at most that many
batches ahead of training), and `--train.partial_rollout_enable` for partial rollout (vLLM
pauses for the weight broadcast and resumes under the new weights).
"""

from __future__ import annotations

import shlex

from nereus.interop import CHECKED_VERSIONS
from nereus.interop.common import (
    Difference,
    Export,
    Value,
    finish,
    free_memory_fraction,
    fusion_differences,
    laid_out,
    node_shape,
    offload_difference,
    per_gpu_micro_batch,
    sharding_difference,
    stage_difference,
)
from nereus.spec.plan import Plan, Pool, StagePlan
from nereus.spec.stages import (
    ACTOR_GENERATION,
    ACTOR_INFERENCE,
    ACTOR_TRAINING,
    CRITIC_INFERENCE,
    CRITIC_TRAINING,
    REFERENCE_INFERENCE,
    REWARD_INFERENCE,
)

#: OpenRLHF's `--algo.advantage.estimator` per nereus algorithm; ReMax's greedy-rollout
#: baseline has no OpenRLHF estimator.
ADVANTAGE_ESTIMATORS = {"ppo": "gae", "grpo": "group_norm"}
#: The model-stage whose GPUs each OpenRLHF model group gets.
GROUPS = {
    "actor": ACTOR_TRAINING,
    "ref": REFERENCE_INFERENCE,
    "reward": REWARD_INFERENCE,
    "critic": CRITIC_TRAINING,
}
#: Model-stages OpenRLHF runs on another model-stage's workers.
TIED = {ACTOR_INFERENCE: ACTOR_TRAINING, CRITIC_INFERENCE: CRITIC_TRAINING}


def export_openrlhf(plan: Plan) -> Export:
    """`plan` as OpenRLHF flags, the plan OpenRLHF will run and what differs."""
    planned, w = plan, plan.workload
    if w.algorithm not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"algorithm {w.algorithm!r}: OpenRLHF {CHECKED_VERSIONS['openrlhf']} has no {w.algorithm} estimator "
            f"(it offers {', '.join(sorted(set(ADVANTAGE_ESTIMATORS.values())))}); plan ppo or grpo, or export to verl"
        )
    actor = plan.stage_plan(ACTOR_TRAINING)
    ds_tp, ds_cp, stage = actor.tp, actor.cp, zero_stage(plan)
    exported: dict[str, StagePlan] = {
        entry.model_stage: _exported(plan, entry, ds_tp, ds_cp, stage) for entry in plan.stages
    }
    differences = [
        d
        for entry in plan.stages
        if (d := stage_difference(plan, entry, exported[entry.model_stage], _reason(entry, ds_tp, ds_cp))) is not None
    ]
    how = f"--ds.zero_stage {stage}: one ZeRO stage for every DeepSpeed model"
    differences += [
        d for entry in plan.stages if (d := sharding_difference(entry, exported[entry.model_stage], how)) is not None
    ]
    offload_how = "--ds.adam_offload: DeepSpeed's ZeRO-Offload of the Adam state for every trained model"
    differences += [
        d
        for entry in plan.stages
        if (d := offload_difference(entry, exported[entry.model_stage], offload_how)) is not None
    ]
    differences += fusion_differences(plan, "OpenRLHF") + async_differences(plan)
    if w.dtype == "fp32":
        differences.append(Difference("dtype fp32", "--ds.param_dtype bf16 (OpenRLHF trains in bf16 or fp16)"))
        plan = plan.model_copy(update={"workload": w.model_copy(update={"dtype": "bf16"})})
    stages = [exported[entry.model_stage] for entry in plan.stages]
    pools = _pools(stages)
    stages = [s.model_copy(update={"pool": _pool_of(pools, s)}) for s in stages]
    draft = plan.model_copy(update={"stages": stages, "pools": pools, "predictions": None})
    settings = _settings(plan, exported, ds_tp, ds_cp, free_memory_fraction(draft, ACTOR_GENERATION))
    return finish(
        "OpenRLHF", CHECKED_VERSIONS["openrlhf"], planned, settings, differences, stages, pools, exported_plan=plan
    )


def _reason(entry: StagePlan, ds_tp: int, ds_cp: int) -> str:
    if entry.ep > 1:
        return "OpenRLHF cannot express expert parallelism (DeepSpeed and its vLLM engines hold every expert): ep=1"
    if entry.model_stage == ACTOR_INFERENCE:
        return "OpenRLHF computes old log-probs on the actor's training group"
    if entry.model_stage == CRITIC_INFERENCE:
        return "OpenRLHF computes values on the critic's training group, with its micro-batch"
    if entry.stage == "generation":
        return "vLLM engines of OpenRLHF take a tensor parallel size only"
    return (
        f"DeepSpeed in OpenRLHF: no pipeline parallelism, one tensor parallel size ({ds_tp}) and one ring "
        f"attention size ({ds_cp}) for every model"
    )


def zero_stage(plan: Plan) -> int:
    """DeepSpeed's ZeRO stage for the plan: 3 when some training model-stage is fully sharded,
    1 when one shards its optimizer state (or the workload's optimizer says so), else 0."""
    training = [entry for entry in plan.stages if entry.stage == "training"]
    if any(entry.full_shard for entry in training):
        return 3
    sharded = any(entry.zero1 or entry.train_offload != "none" for entry in training)
    return 1 if plan.workload.optimizer.shard_across_dp or sharded else 0


def adam_offload(plan: Plan) -> bool:
    """OpenRLHF's `--ds.adam_offload` (one flag for every trained model): some training
    model-stage keeps its optimizer in host memory."""
    return any(entry.train_offload != "none" for entry in plan.stages if entry.stage == "training")


def _exported(plan: Plan, entry: StagePlan, ds_tp: int, ds_cp: int, stage: int) -> StagePlan:
    if entry.stage == "generation":
        # A vLLM engine of tp x pp GPUs becomes one of tp GPUs: as many engines on the same GPUs.
        return laid_out(plan, entry, sorted(entry.gpus), entry.tp, 1, 1, entry.pool)
    owner = plan.stage_plan(TIED.get(entry.model_stage, entry.model_stage))
    micro_from = owner if entry.model_stage == CRITIC_INFERENCE else entry
    micro = per_gpu_micro_batch(plan, micro_from)
    out = laid_out(
        plan,
        entry,
        sorted(owner.gpus),
        ds_tp,
        1,
        micro,
        owner.pool,
        ds_cp,
        1,
        plan.stage_plan(ACTOR_TRAINING).cp_method,
    )
    # ZeRO-3 shards every DeepSpeed model, the inferring ones too; the stage applies to all. Adam
    # offload (no parameter offload: OpenRLHF has no flag for it) applies to every trained one.
    offloaded = "optimizer" if entry.stage == "training" and adam_offload(plan) else "none"
    return out.model_copy(update={"full_shard": stage == 3, "train_offload": offloaded})


def _pools(stages: list[StagePlan]) -> list[Pool]:
    """One pool per distinct GPU set of the exported model-stages (merging overlapping sets)."""
    groups: list[set[int]] = []
    for entry in stages:
        gpus = set(entry.gpus)
        for other in [g for g in groups if g & gpus]:
            groups.remove(other)
            gpus |= other
        groups.append(gpus)
    groups.sort(key=min)
    return [Pool(name=f"pool{i}", gpus=sorted(g)) for i, g in enumerate(groups)]


def _pool_of(pools: list[Pool], entry: StagePlan) -> str:
    return next(p.name for p in pools if set(entry.gpus) <= set(p.gpus))


def _nodes(plan: Plan, entry: StagePlan) -> tuple[int, int]:
    """OpenRLHF's (num_nodes, num_gpus_per_node) for a group on `entry`'s GPUs."""
    how = "OpenRLHF places a group of more than one node in whole nodes"
    return node_shape(plan, len(entry.gpus), entry.model_stage, how)


def _settings(
    plan: Plan, stages: dict[str, StagePlan], ds_tp: int, ds_cp: int, memory_fraction: float
) -> dict[str, Value]:
    w = plan.workload
    gen = stages[ACTOR_GENERATION]
    out: dict[str, Value] = {}
    for group, name in GROUPS.items():
        if name in stages:
            out[f"--{group}.num_nodes"], out[f"--{group}.num_gpus_per_node"] = _nodes(plan, stages[name])
    out |= {
        "--vllm.num_engines": gen.dp,
        "--vllm.tensor_parallel_size": gen.tp,
        "--vllm.gpu_memory_utilization": memory_fraction,
        "--ds.tensor_parallel_size": ds_tp,
        "--ds.ring_attn_size": ds_cp,
        # ring attention runs on packed samples (OpenRLHF turns packing on for it anyway)
        **({"--ds.packing_samples": True} if ds_cp > 1 else {}),
        "--ds.zero_stage": zero_stage(plan),
        "--ds.param_dtype": plan.workload.dtype,
        **({"--ds.adam_offload": True} if adam_offload(plan) else {}),
        "--rollout.batch_size": w.prompts_per_step,
        "--rollout.n_samples_per_prompt": w.samples_per_prompt,
        "--rollout.micro_batch_size": per_gpu_micro_batch(plan, stages[ACTOR_INFERENCE]),
        "--rollout.max_new_tokens": w.response_len.max,
        "--data.max_len": w.prompt_len + w.response_len.max,
        "--train.batch_size": w.samples_per_step // w.mini_batches,
        "--train.micro_batch_size": per_gpu_micro_batch(plan, stages[ACTOR_TRAINING]),
        "--train.max_epochs": w.ppo_epochs,
        "--algo.advantage.estimator": ADVANTAGE_ESTIMATORS[w.algorithm],
    }
    if w.reference is None:
        out["--algo.kl.init_coef"] = 0.0  # OpenRLHF builds no reference model without a KL term
    elif w.algorithm != "ppo":
        out["--algo.kl.use_loss"] = True
    out |= _colocation(stages)
    return out | async_flags(plan)


def async_flags(plan: Plan) -> dict[str, Value]:
    """OpenRLHF's asynchronous-training flags of an async plan (empty for a synchronous one)."""
    w = plan.workload
    if w.execution != "async":
        return {}
    out: dict[str, Value] = {"--train.async_enable": True, "--train.async_queue_size": max(1, w.staleness)}
    if w.partial_rollout:
        out["--train.partial_rollout_enable"] = True
    return out


def async_differences(plan: Plan) -> list[Difference]:
    """What OpenRLHF's asynchronous training runs otherwise than an async plan says."""
    w = plan.workload
    if w.execution == "async" and w.staleness == 0:
        return [
            Difference(
                "max_staleness 0: generation and training take turns on their pools",
                "--train.async_queue_size 1 (OpenRLHF's smallest queue): generation runs one batch ahead",
            )
        ]
    return []


def _colocation(stages: dict[str, StagePlan]) -> dict[str, Value]:
    def same(a: str, b: str) -> bool:
        return a in stages and b in stages and sorted(stages[a].gpus) == sorted(stages[b].gpus)

    if all(sorted(s.gpus) == sorted(stages[ACTOR_GENERATION].gpus) for s in stages.values()):
        return {"--train.colocate_all": True, "--vllm.enable_sleep": True, "--ds.enable_sleep": True}
    out: dict[str, Value] = {}
    if same(ACTOR_TRAINING, REFERENCE_INFERENCE):
        out["--train.colocate_actor_ref"] = True
    if same(CRITIC_TRAINING, REWARD_INFERENCE):
        out["--train.colocate_critic_reward"] = True
    return out


def as_command_line(export: Export) -> str:
    """The flags as one shell-quoted command line (a store-true flag stands alone)."""
    lines = ["python3 -m openrlhf.cli.train_ppo_ray"]
    for flag, value in export.settings.items():
        lines.append(flag if value is True else f"{flag} {shlex.quote(str(value))}")
    return " \\\n  ".join(lines) + "\n"

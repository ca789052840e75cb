"""A plan as configuration of verl's PPO trainer: its Megatron backend (the `ppo_megatron_trainer`
family, the default) or its FSDP backend (`ppo_trainer`, `backend="fsdp"`).

verl runs every model on one resource pool of all the job's GPUs (its default), one model
after another; the actor's old log-probs come from the actor's training workers, the
critic's values from the critic's training workers, and the rollout engine (vLLM) and the
reward model (served by its own engine) take a tensor and a pipeline size. Context
parallelism (a plan's `cp`) is Megatron's `context_parallel_size` of the actor, the reference
and the critic, so the actor's and the critic's inference run with their training's. Expert
parallelism (a mixture-of-experts plan's `ep`, docs/moe.md) is Megatron's
`expert_model_parallel_size` of those three, with `expert_tensor_parallel_size` = tp (nereus splits
each expert over the tp ranks), and the rollout's vLLM expert parallelism: an engine of tp x ep
GPUs, attention data-parallel over ep (`data_parallel_size` ep, `expert_parallel_size` tp x ep;
vLLM then splits the experts over all tp x ep ranks whole rather than tp-split, the same bytes
per GPU). Whatever else a plan decides becomes a Difference.

verl's FSDP backend runs the actor, the reference and the critic on FSDP workers with no tensor or
pipeline parallelism: each model fully sharded over all its GPUs (the data-parallel replicas and
their Ulysses ranks) and its sequences cut over `ulysses_sequence_parallel_size` ranks, which is
the plan's cp (nereus runs Ulysses too, docs/context-parallel.md); a planned tp or pp becomes a
Difference. Its config is `ppo_trainer`; the async trainers are exported on Megatron only.

An async plan (`execution: async`) exports to verl's experimental async trainers, whose
configs extend `ppo_megatron_trainer` with a rollout pool of its own (`rollout.nnodes`,
`rollout.n_gpus_per_node`) beside the trainer's (`trainer.nnodes`, `trainer.n_gpus_per_node`):
max_staleness 1 without partial rollout is the one-step-off policy
(`python -m verl.experimental.one_step_off_policy.main_ppo --config-name
one_step_off_ppo_megatron_trainer`); anything else the fully async policy
(`python -m verl.experimental.fully_async_policy.fully_async_main --config-name
fully_async_ppo_megatron_trainer`), with `async_training.staleness_threshold`,
`async_training.partial_rollout` and a weight sync every step.
"""

from __future__ import annotations

from typing import Literal

import yaml

from nereus.cost.plan_cost import generation_alone
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

#: verl's `algorithm.adv_estimator` per nereus algorithm.
ADVANTAGE_ESTIMATORS = {"ppo": "gae", "grpo": "grpo", "remax": "remax"}
MEGATRON_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: The config section that sets each trained or inferring model's Megatron layout.
MEGATRON_SECTIONS = {
    ACTOR_TRAINING: "actor_rollout_ref.actor.megatron",
    REFERENCE_INFERENCE: "actor_rollout_ref.ref.megatron",
    CRITIC_TRAINING: "critic.megatron",
}
#: The config section of each model verl runs on FSDP workers (`backend="fsdp"`): its
#: `ulysses_sequence_parallel_size` is the plan's cp, its `fsdp_config` (the critic's `fsdp`) the offload.
FSDP_SECTIONS = {
    ACTOR_TRAINING: ("actor_rollout_ref.actor", "actor_rollout_ref.actor.fsdp_config"),
    REFERENCE_INFERENCE: ("actor_rollout_ref.ref", "actor_rollout_ref.ref.fsdp_config"),
    CRITIC_TRAINING: ("critic", "critic.fsdp"),
}
#: verl's training backends: Megatron (tp x cp x pp, the distributed optimizer) or FSDP (Ulysses).
Backend = Literal["megatron", "fsdp"]
#: Why a model-stage on verl's FSDP workers loses its tensor and pipeline parallelism.
FSDP_REASON = (
    "verl's FSDP workers have no tensor or pipeline parallelism: Ulysses (cp) and data parallel over all {n} GPUs"
)
FSDP_CP_REASON = (
    "verl's FSDP workers split sequences by Ulysses only (ulysses_sequence_parallel_size); all-gather KV "
    "context parallelism runs on its Megatron backend (context_parallel_size)"
)
FSDP_SHARDING = "verl's FSDP workers shard parameters, gradients and optimizer state over all their GPUs"
SHARED_POOL = "global_pool"
#: What verl's `megatron.optimizer_offload` and `param_offload` do with a planned training-time offload.
OFFLOAD_HOW = (
    "verl's megatron optimizer_offload/param_offload keep them in host memory between phases and copy "
    "them back to the GPU for the update: they sleep, as `offload` does"
)
POOL_REASON = "verl's default resource pool hosts every model on all {n} GPUs"
TIED_REASONS = {
    ACTOR_INFERENCE: "verl computes old log-probs on the actor's training workers",
    CRITIC_INFERENCE: "verl computes values on the critic's training workers, with their micro-batch",
}
#: Why a model-stage served by a vLLM engine loses its context parallelism.
SERVED_REASON = "verl serves the reward model with vLLM, which takes a tensor and a pipeline size only"


def export_verl(plan: Plan, backend: Backend = "megatron") -> Export:
    """`plan` as verl settings (dotted config keys) for its Megatron or FSDP backend, the plan verl
    will run and what differs."""
    gpus = list(range(plan.cluster.num_gpus))
    if backend == "fsdp" and plan.workload.execution == "async":
        raise ValueError("verl's async trainers are exported on its Megatron backend; export without --backend fsdp")
    pools = async_pools(plan) or [Pool(name=SHARED_POOL, gpus=gpus)]
    exported = _exported_stages(plan, pools, backend)
    differences = [
        d
        for entry in plan.stages
        if (d := stage_difference(plan, entry, exported[entry.model_stage], _reason(entry, pools, backend))) is not None
    ]
    how = "verl's Megatron trainer shards the optimizer state only (use_distributed_optimizer); its FSDP one all"
    differences += [
        d
        for entry in plan.stages
        if (d := sharding_difference(entry, exported[entry.model_stage], FSDP_SHARDING if backend == "fsdp" else how))
        is not None
    ]
    differences += [
        d
        for entry in plan.stages
        if (d := offload_difference(entry, exported[entry.model_stage], OFFLOAD_HOW)) is not None
    ]
    differences += _batch_differences(plan) + fusion_differences(plan, "verl") + async_differences(plan)
    stages = [exported[entry.model_stage] for entry in plan.stages]
    draft = plan.model_copy(update={"stages": stages, "pools": pools, "predictions": None})
    settings = _settings(plan, exported, free_memory_fraction(draft, ACTOR_GENERATION), backend)
    settings |= async_settings(plan, pools)
    return finish("verl", CHECKED_VERSIONS["verl"], plan, settings, differences, stages, pools)


#: The model-stage whose workers compute each inference (verl's old log-probs and values).
WORKERS_OF = {ACTOR_INFERENCE: ACTOR_TRAINING, CRITIC_INFERENCE: CRITIC_TRAINING}


def _reason(entry: StagePlan, pools: list[Pool], backend: Backend = "megatron") -> str:
    if entry.model_stage == REWARD_INFERENCE and entry.cp > 1:
        return SERVED_REASON
    if backend == "fsdp" and entry.model_stage in FSDP_SECTIONS and entry.cp > 1 and entry.cp_method != "ulysses":
        return FSDP_CP_REASON
    if backend == "fsdp" and entry.model_stage in FSDP_SECTIONS and (entry.tp > 1 or entry.pp > 1):
        return FSDP_REASON.format(n=len(_pool_for(entry, pools).gpus))
    if len(pools) > 1:  # async: verl's rollout pool and trainer pool
        pool = _pool_for(entry, pools)
        return TIED_REASONS.get(entry.model_stage, ASYNC_POOL_REASON.format(pool=pool.name, n=len(pool.gpus)))
    return TIED_REASONS.get(entry.model_stage, POOL_REASON.format(n=len(pools[0].gpus)))


def _pool_for(entry: StagePlan, pools: list[Pool]) -> Pool:
    """The verl pool that hosts a model-stage: the rollout pool generation's, the trainer pool the rest's."""
    if len(pools) == 1:
        return pools[0]
    return pools[0] if entry.model_stage == ACTOR_GENERATION else pools[1]


def _exported_stages(plan: Plan, pools: list[Pool], backend: Backend = "megatron") -> dict[str, StagePlan]:
    # The actor's old log-probs keep their own micro-batch (`log_prob_micro_batch_size_per_gpu`);
    # the critic's values have none of their own.
    micro_of = {CRITIC_INFERENCE: CRITIC_TRAINING}
    out: dict[str, StagePlan] = {}
    for entry in plan.stages:
        layout = plan.stage_plan(WORKERS_OF.get(entry.model_stage, entry.model_stage))
        micro = per_gpu_micro_batch(plan, plan.stage_plan(micro_of.get(entry.model_stage, entry.model_stage)))
        pool = _pool_for(entry, pools)
        # Megatron's context parallelism (or FSDP's Ulysses) where verl runs the model-stage on its
        # training workers; the vLLM engines (generation, the reward model) have none. Expert
        # parallelism: Megatron's on its workers, vLLM's in the rollout (the reward model's engine
        # takes none; verl's FSDP workers have none).
        cp = layout.cp if layout.model_stage in MEGATRON_SECTIONS else 1
        method = layout.cp_method
        ep = 1 if entry.model_stage == REWARD_INFERENCE else layout.ep
        if backend == "fsdp" and layout.model_stage in FSDP_SECTIONS:  # no tp, pp or ep; all sharded
            # verl's FSDP workers run Ulysses only: all-gather KV exports as cp 1 (a Difference).
            ulysses = cp if method == "ulysses" else 1
            exported = laid_out(plan, entry, pool.gpus, 1, 1, micro, pool.name, ulysses)
            out[entry.model_stage] = exported.model_copy(update={"full_shard": True})
        else:
            out[entry.model_stage] = laid_out(
                plan, entry, pool.gpus, layout.tp, layout.pp, micro, pool.name, cp, ep, method
            )
        if entry.train_offload != "none":  # verl's offload puts the states to sleep between phases
            out[entry.model_stage] = out[entry.model_stage].model_copy(update={"offload": True})
    return out


def _batch_differences(plan: Plan) -> list[Difference]:
    w = plan.workload
    if w.prompts_per_step % w.mini_batches:
        return [
            Difference(
                f"{w.mini_batches} mini-batches of {w.samples_per_step // w.mini_batches} samples",
                f"ppo_mini_batch_size={max(1, w.prompts_per_step // w.mini_batches)} prompts "
                "(verl counts mini-batches in whole prompts)",
            )
        ]
    return []


def _settings(
    plan: Plan, stages: dict[str, StagePlan], memory_fraction: float, backend: Backend = "megatron"
) -> dict[str, Value]:
    w = plan.workload
    gen = stages[ACTOR_GENERATION]
    out: dict[str, Value] = {
        "trainer.nnodes": plan.cluster.num_nodes,
        "trainer.n_gpus_per_node": plan.cluster.gpus_per_node,
        "data.train_batch_size": w.prompts_per_step,
        "data.max_prompt_length": w.prompt_len,
        "data.max_response_length": w.response_len.max,
        "algorithm.adv_estimator": ADVANTAGE_ESTIMATORS[w.algorithm],
        "algorithm.use_kl_in_reward": w.reference is not None and w.algorithm == "ppo",
        "actor_rollout_ref.actor.use_kl_loss": w.reference is not None and w.algorithm != "ppo",
        "actor_rollout_ref.actor.ppo_epochs": w.ppo_epochs,
        "actor_rollout_ref.actor.ppo_mini_batch_size": max(1, w.prompts_per_step // w.mini_batches),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": per_gpu_micro_batch(plan, stages[ACTOR_TRAINING]),
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.n": w.samples_per_prompt,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": gen.tp,
        "actor_rollout_ref.rollout.pipeline_model_parallel_size": gen.pp,
        "actor_rollout_ref.rollout.gpu_memory_utilization": memory_fraction,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": per_gpu_micro_batch(
            plan, stages[ACTOR_INFERENCE]
        ),
    }
    experts = any(model.moe is not None for model in plan.models)
    if experts and gen.ep > 1:
        # vLLM's expert parallelism: an engine of tp x ep GPUs runs attention data-parallel over ep
        # (verl asserts expert_parallel_size = tensor_model_parallel_size x data_parallel_size).
        out["actor_rollout_ref.rollout.data_parallel_size"] = gen.ep
        out["actor_rollout_ref.rollout.expert_parallel_size"] = gen.tp * gen.ep
    out |= _fsdp_settings(plan, stages) if backend == "fsdp" else _megatron_settings(plan, stages)
    if REFERENCE_INFERENCE in stages:
        ref = stages[REFERENCE_INFERENCE]
        out["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"] = per_gpu_micro_batch(plan, ref)
    out["critic.enable"] = CRITIC_TRAINING in stages
    if CRITIC_TRAINING in stages:
        out["critic.ppo_mini_batch_size"] = out["actor_rollout_ref.actor.ppo_mini_batch_size"]
        out["critic.ppo_micro_batch_size_per_gpu"] = per_gpu_micro_batch(plan, stages[CRITIC_TRAINING])
    out["reward.reward_model.enable"] = REWARD_INFERENCE in stages
    if REWARD_INFERENCE in stages:
        out["reward.reward_model.rollout.name"] = "vllm"
        out["reward.reward_model.rollout.tensor_model_parallel_size"] = stages[REWARD_INFERENCE].tp
        out["reward.reward_model.rollout.pipeline_model_parallel_size"] = stages[REWARD_INFERENCE].pp
    return out


def _megatron_settings(plan: Plan, stages: dict[str, StagePlan]) -> dict[str, Value]:
    """Each Megatron worker's layout (tp, pp, cp, ep), dtype, distributed optimizer and offload."""
    w = plan.workload
    experts = any(model.moe is not None for model in plan.models)
    out: dict[str, Value] = {}
    for name, section in MEGATRON_SECTIONS.items():
        if name in stages:
            out[f"{section}.tensor_model_parallel_size"] = stages[name].tp
            out[f"{section}.pipeline_model_parallel_size"] = stages[name].pp
            out[f"{section}.context_parallel_size"] = stages[name].cp
            if experts:  # Megatron's experts: split over ep, each tp-split (nereus's expert tp = tp)
                out[f"{section}.expert_model_parallel_size"] = stages[name].ep
                out[f"{section}.expert_tensor_parallel_size"] = stages[name].tp
            out[f"{section}.dtype"] = MEGATRON_DTYPES[w.dtype]
            if name != REFERENCE_INFERENCE:
                planned = plan.stage_plan(name)
                sharded = w.optimizer.shard_across_dp or bool(planned.zero1) or planned.full_shard
                out[f"{section}.use_distributed_optimizer"] = sharded or planned.train_offload != "none"
                if planned.train_offload != "none":
                    out[f"{section}.optimizer_offload"] = True
                    out[f"{section}.param_offload"] = planned.train_offload == "params"
    return out


def _fsdp_settings(plan: Plan, stages: dict[str, StagePlan]) -> dict[str, Value]:
    """Each FSDP worker's Ulysses degree (the plan's cp) and training-time offload."""
    out: dict[str, Value] = {}
    for name, (section, fsdp) in FSDP_SECTIONS.items():
        if name in stages:
            out[f"{section}.ulysses_sequence_parallel_size"] = stages[name].cp
            planned = plan.stage_plan(name)
            if name != REFERENCE_INFERENCE and planned.train_offload != "none":
                out[f"{fsdp}.optimizer_offload"] = True
                out[f"{fsdp}.param_offload"] = planned.train_offload == "params"
    return out


#: verl's async trainers' pools: the rollout's, then the trainer's (every other model).
ROLLOUT_POOL, TRAINER_POOL = "rollout_pool", "trainer_pool"
ASYNC_POOL_REASON = "verl's async trainers host every model but the rollout on the {pool} of {n} GPUs"


def async_pools(plan: Plan) -> list[Pool] | None:
    """An async plan's pools as verl's async trainers have them (rollout, trainer); None for a
    synchronous plan (verl's one resource pool)."""
    if plan.workload.execution != "async":
        return None
    generation = sorted(plan.stage_plan(ACTOR_GENERATION).gpus)
    rest = sorted({g for e in plan.stages if e.model_stage != ACTOR_GENERATION for g in e.gpus})
    if not generation_alone(plan):
        raise ValueError(
            "execution: async but actor/generation shares GPUs with other model-stages; verl's async "
            "trainers need a rollout pool apart from the trainer's: plan it with `nereus plan`"
        )
    return [Pool(name=ROLLOUT_POOL, gpus=generation), Pool(name=TRAINER_POOL, gpus=rest)]


def one_step_off(plan: Plan) -> bool:
    """Whether verl's one-step-off policy runs the async plan (k = 1 without partial rollout);
    else its fully async policy."""
    return plan.workload.staleness == 1 and not plan.workload.partial_rollout


def _nodes(plan: Plan, pool: Pool) -> tuple[int, int]:
    """verl's (nnodes, n_gpus_per_node) for a pool: part of one node, or whole nodes."""
    return node_shape(plan, len(pool.gpus), f"the {pool.name}", "verl sizes a pool as nnodes x n_gpus_per_node")


def async_settings(plan: Plan, pools: list[Pool]) -> dict[str, Value]:
    """verl's async settings of an async plan (empty for a synchronous one): the two pools, and
    for the fully async policy its staleness bound, partial rollout and a weight sync per step."""
    if len(pools) == 1:
        return {}
    rollout, trainer = pools
    out: dict[str, Value] = {}
    out["trainer.nnodes"], out["trainer.n_gpus_per_node"] = _nodes(plan, trainer)
    out["rollout.nnodes"], out["rollout.n_gpus_per_node"] = _nodes(plan, rollout)
    out["actor_rollout_ref.rollout.calculate_log_probs"] = True  # the behaviour policy's log-probs
    if one_step_off(plan):
        return out
    w = plan.workload
    # The fully async trainer takes its batch as require_batches mini-batches of ppo_mini_batch_size
    # prompts, streamed one prompt at a time (data.train_batch_size 0, gen_batch_size 1).
    out |= {
        "data.train_batch_size": 0,
        "data.gen_batch_size": 1,
        "async_training.staleness_threshold": float(w.staleness - 1),
        "async_training.trigger_parameter_sync_step": 1,
        "async_training.require_batches": w.mini_batches,
        "async_training.partial_rollout": w.partial_rollout,
    }
    return out


def async_differences(plan: Plan) -> list[Difference]:
    """What verl's async trainers run otherwise than an async plan says."""
    w = plan.workload
    if w.execution != "async" or one_step_off(plan):
        return []
    return [
        Difference(
            f"max_staleness {w.staleness}: no trained sample more than {w.staleness} policy versions old",
            f"async_training.staleness_threshold={float(w.staleness - 1)} with trigger_parameter_sync_step=1: "
            "verl's fully async rollouter bounds the samples it generates ahead, (1 + threshold) batches per "
            "weight sync, not each sample's version lag",
        )
    ]


def as_overrides(export: Export) -> str:
    """Hydra `key=value` overrides, one per line (append them to the verl command line)."""
    return "".join(f"{key}={_hydra_value(value)}\n" for key, value in export.settings.items())


def _hydra_value(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def as_yaml(export: Export) -> str:
    """The settings as a nested verl config file (merge it over `ppo_megatron_trainer`, or
    `ppo_trainer` for the FSDP backend)."""
    nested: dict[str, object] = {}
    for key, value in export.settings.items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            child = node.setdefault(part, {})
            assert isinstance(child, dict), key
            node = child
        node[leaf] = value
    return yaml.safe_dump(nested, sort_keys=False)

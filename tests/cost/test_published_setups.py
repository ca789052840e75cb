"""Set-ups that verl and OpenRLHF publish as runnable: nereus plans each, and the cost model's
memory for the set-up's own layout (rollout tp, FSDP/ZeRO data parallel training, gradient
checkpointing, the rollout engine's memory fraction, sleeping models) stays under the GPU's."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest

from nereus.cost.calibration import DEFAULT_CALIBRATION
from nereus.cost.plan_cost import evaluate_plan, one_sequence_bytes, stage_cost_model
from nereus.solver.layouts import RUNTIME_CHOICES, MemoryChoices
from nereus.solver.plan_search import PlanRequest
from nereus.solver.planner import make_plan
from nereus.spec.plan import Plan, Pool, StagePlan
from nereus.spec.presets import MODELS, cluster_preset, models_for
from nereus.spec.stages import model_stage
from nereus.spec.workload import ResponseLengths, Workload, model_stages

pytestmark = pytest.mark.logic


@dataclass(frozen=True)
class Setup:
    source: str
    """The example script (repository and path) the row is read from."""
    algorithm: str
    model: str
    reward_model: bool
    gpus: int
    prompts: int
    samples_per_prompt: int
    mini_batches: int
    train_micro_batch: int
    """Samples per training micro-batch on one GPU."""
    prompt_len: int
    response_len: int
    rollout_tp: int
    rollout_memory_fraction: float
    """The rollout engine's share of a GPU for weights and KV cache (gpu_memory_utilization)."""
    sleeping: tuple[str, ...]
    """Model-stages whose states the script offloads or puts to sleep between stages."""
    zero_stage: int = 3
    """3: parameters, gradients and optimizer state sharded over the GPUs (verl's FSDP, DeepSpeed
    ZeRO-3); 1: the optimizer state only."""
    token_budget: int | None = None
    """Training micro-batches packed to this many tokens per GPU (verl's use_dynamic_bsz with
    ppo_max_token_len_per_gpu, OpenRLHF's use_dynamic_batch with train_max_tokens_per_gpu)."""
    reward: str | None = None
    """The reward model when it is not the actor's model."""


SETUPS = (
    # volcengine/verl examples/grpo_trainer/run_qwen2-7b.sh: Qwen2-7B-Instruct, 1 node x 8 GPUs,
    # train_batch_size 1024, rollout.n 5, ppo_mini_batch_size 256, ppo_micro_batch_size 128 (16 per
    # GPU), prompt/response 512/512, rollout tp 2, gpu_memory_utilization 0.6, gradient
    # checkpointing, ref.fsdp_config.param_offload, a rule-based (function) reward.
    Setup(
        "volcengine/verl examples/grpo_trainer/run_qwen2-7b.sh",
        "grpo", "qwen2-7b", False, 8, 1024, 5, 4, 16, 512, 512, 2, 0.6, ("reference/inference",),
    ),
    # OpenRLHF/OpenRLHF examples/scripts/train_ppo_llama_ray_hybrid_engine.sh: Llama-3-8B actor,
    # critic, reference and reward colocated on 1 node x 8 GPUs (--colocate_all_models), vLLM
    # 4 engines x tp 2 at gpu_memory_utilization 0.5, rollout_batch_size 1024, 1 sample per prompt,
    # train_batch_size 128 (8 mini-batches), micro_train_batch_size 8, prompt/generate 1024/1024,
    # gradient checkpointing, vLLM and DeepSpeed sleep (every idle model sleeps).
    Setup(
        "OpenRLHF/OpenRLHF examples/scripts/train_ppo_llama_ray_hybrid_engine.sh",
        "ppo", "llama-3.1-8b", True, 8, 1024, 1, 8, 8, 1024, 1024, 2, 0.5, ("*",),
    ),
    # volcengine/verl examples/grpo_trainer/run_qwen2-7b_seq_balance.sh: Qwen2-7B-Instruct, 1 node x
    # 8 GPUs, GRPO, train_batch_size 1024, rollout.n 5, ppo_mini_batch_size 256, use_dynamic_bsz with
    # ppo_max_token_len_per_gpu 24000, prompt/response 512/1024, rollout tp 2, gpu_memory_utilization
    # 0.6, gradient checkpointing, ref.fsdp_config.param_offload, a rule-based reward.
    Setup(
        "volcengine/verl examples/grpo_trainer/run_qwen2-7b_seq_balance.sh",
        "grpo", "qwen2-7b", False, 8, 1024, 5, 4, 16, 512, 1024, 2, 0.6, ("reference/inference",),
        token_budget=24000,
    ),
    # volcengine/verl examples/ppo_trainer/run_qwen2-7b.sh: Qwen2.5-Math-7B (Qwen2-7B's shapes) actor
    # and critic, 1 node x 8 GPUs, PPO (GAE), train_batch_size 1024, 1 sample, ppo_mini_batch_size 256,
    # ppo_micro_batch_size_per_gpu 16, prompt/response 1024/512, rollout tp 2, gpu_memory_utilization
    # 0.6, gradient checkpointing for actor and critic, ref.fsdp_config.param_offload, rule reward.
    Setup(
        "volcengine/verl examples/ppo_trainer/run_qwen2-7b.sh",
        "ppo", "qwen2-7b", False, 8, 1024, 1, 4, 16, 1024, 512, 2, 0.6, ("reference/inference",),
    ),
    # OpenRLHF/OpenRLHF examples/scripts/train_ppo_ray_hybrid_engine.sh: Llama-3-8B actor, critic,
    # reference and Llama-3-8B reward model colocated on 1 node x 8 GPUs (--colocate_all_models), vLLM 4
    # engines x tp 2 at gpu_memory_utilization 0.5, rollout_batch_size 1024, 1 sample, train_batch_size
    # 128 (8 mini-batches), use_dynamic_batch with train_max_tokens_per_gpu 16384, prompt/generate
    # 1024/1024, zero_stage 3, gradient checkpointing, vLLM and DeepSpeed sleep.
    Setup(
        "OpenRLHF/OpenRLHF examples/scripts/train_ppo_ray_hybrid_engine.sh",
        "ppo", "llama-3.1-8b", True, 8, 1024, 1, 8, 8, 1024, 1024, 2, 0.5, ("*",), token_budget=16384,
    ),
    # volcengine/verl examples/ppo_trainer/run_qwen2-7b_rm_seq_balance.sh: Qwen2-7B-Instruct actor and
    # critic, an FsfairX-LLaMA3-RM (Llama-3-8B) reward model, 1 node x 8 GPUs, PPO, train_batch_size
    # 4096, 1 sample, ppo_mini_batch_size 512 (8 mini-batches), use_dynamic_bsz with
    # ppo_max_token_len_per_gpu 24000, prompt/response 4096/4096, rollout tp 2, gpu_memory_utilization
    # 0.5, gradient checkpointing, ref and reward fsdp_config.param_offload.
    Setup(
        "volcengine/verl examples/ppo_trainer/run_qwen2-7b_rm_seq_balance.sh",
        "ppo", "qwen2-7b", True, 8, 4096, 1, 8, 16, 4096, 4096, 2, 0.5,
        ("reference/inference", "reward/inference"), token_budget=24000, reward="llama-3.1-8b",
    ),
    # OpenRLHF/OpenRLHF examples/scripts/train_grpo_ray_hybrid_engine.sh: Llama-3-8B actor, reference
    # and Llama-3-8B reward model colocated on 1 node x 8 GPUs, group_norm advantages (GRPO) with
    # use_kl_loss, vLLM 2 engines x tp 4 at gpu_memory_utilization 0.6 with vLLM sleep,
    # rollout_batch_size 1024, 1 sample, train_batch_size 128 (8 mini-batches), micro_train_batch_size
    # 8, prompt/generate 1024/1024, zero_stage 3, gradient checkpointing, adam_offload (AdamW state in
    # host memory: counted here as the actor's states sleeping between its runs, which holds more).
    Setup(
        "OpenRLHF/OpenRLHF examples/scripts/train_grpo_ray_hybrid_engine.sh",
        "grpo", "llama-3.1-8b", True, 8, 1024, 1, 8, 8, 1024, 1024, 4, 0.6, ("actor/generation", "actor/training"),
    ),
)  # fmt: skip


def workload_of(row: Setup) -> Workload:
    reward = (row.reward or row.model) if row.reward_model else None
    roles = {"actor": row.model, "reference": row.model, "reward": reward}
    if row.algorithm == "ppo":
        roles["critic"] = row.model
    # a capped response length: the median a third of the cap, the tail at it
    lengths = ResponseLengths(median=row.response_len // 3, p99=row.response_len, max=row.response_len)
    return Workload(
        name=row.source.rsplit("/", 1)[-1],
        algorithm=row.algorithm,  # type: ignore[arg-type]
        prompts_per_step=row.prompts,
        samples_per_prompt=row.samples_per_prompt,
        prompt_len=row.prompt_len,
        response_len=lengths,
        mini_batches=row.mini_batches,
        micro_batch_size=row.train_micro_batch,
        **roles,
    )


def micro_batches(row: Setup, workload: Workload, stage: str, share: int) -> int:
    """Fixed micro-batches of the row's size, or under a token budget: in training as many as it
    packs the share into, in inference (log-probs, values, rewards: the same budget by default in
    verl) rows of the maximum length that fit it, the fixed-row equivalent."""
    if row.token_budget is None:
        return math.ceil(share / row.train_micro_batch)
    if stage == "training":
        tokens = share * (workload.prompt_len + workload.response_len.mean())
        return max(1, math.ceil(tokens / row.token_budget))
    rows = max(1, row.token_budget // (workload.prompt_len + workload.response_len.max))
    return math.ceil(share / rows)


def own_layout(row: Setup) -> Plan:
    """The script's layout: rollout at its tp with its KV share, everything else data parallel
    over all GPUs (fully sharded under FSDP / ZeRO-3), training recomputing."""
    workload = workload_of(row)
    cluster = cluster_preset("h100", row.gpus)
    stages = []
    for role, stage in model_stages(workload):
        name = model_stage(role, stage)
        tp = row.rollout_tp if stage == "generation" else 1
        dp = row.gpus // tp
        share = math.ceil(workload.samples_per_step / (workload.mini_batches if stage == "training" else 1) / dp)
        stages.append(
            StagePlan(
                model_stage=name,
                pool="shared",
                tp=tp,
                pp=1,
                dp=dp,
                emus=[list(range(k * tp, (k + 1) * tp)) for k in range(dp)],  # type: ignore[arg-type]
                micro_batches=1 if stage == "generation" else micro_batches(row, workload, stage, share),
                recompute="full" if stage == "training" else "none",
                token_budget=row.token_budget if stage == "training" else None,
                zero1=True if stage == "training" else None,
                full_shard=row.zero_stage == 3 and stage != "generation",
                offload=name in row.sleeping or ("*" in row.sleeping and stage != "generation"),
            )
        )
    plan = Plan(
        cluster=cluster,
        models=[MODELS[name] for name in sorted({workload.model_name(role) for role in workload.roles()})],
        workload=workload,
        pools=[Pool(name="shared", gpus=list(range(row.gpus)))],
        stages=stages,
    )
    generation = plan.stage_plan("actor/generation")
    weights = stage_cost_model(plan, "actor", "generation", DEFAULT_CALIBRATION).params_per_gpu(tp=row.rollout_tp, pp=1)
    kv = row.rollout_memory_fraction * cluster.gpu.memory_bytes - weights * 2
    assert kv >= one_sequence_bytes(plan, generation, DEFAULT_CALIBRATION)
    budget = generation.model_copy(update={"kv_budget_bytes": int(kv)})
    return plan.model_copy(update={"stages": [budget if s is generation else s for s in plan.stages]})


@pytest.mark.parametrize("row", SETUPS, ids=lambda r: r.source.rsplit("/", 1)[-1])
def test_nereus_plans_the_published_setup(row: Setup) -> None:
    workload = workload_of(row)
    request = PlanRequest(cluster_preset("h100", row.gpus), models_for(workload, None), workload, row.gpus)
    assert make_plan(request).best.predictions is not None


@pytest.mark.parametrize("row", SETUPS, ids=lambda r: r.source.rsplit("/", 1)[-1])
def test_the_setups_own_layout_fits_its_gpus(row: Setup) -> None:
    plan = own_layout(row)
    evaluation = evaluate_plan(plan)
    memory = plan.cluster.gpu.memory_bytes
    peaks = {name: p.peak_memory_bytes for name, p in evaluation.predictions.model_stages.items()}
    assert all(peak < memory for peak in peaks.values()), {n: round(p / 2**30, 1) for n, p in peaks.items()}


def test_full_sharding_is_what_fits_verls_qwen2_7b_grpo() -> None:
    """Counted with whole parameters and gradients per GPU (ZeRO-1), generation's GPUs overflow:
    the actor's training and log-prob states (39 + 14 GiB) sit next to the rollout's KV share."""
    plan = own_layout(SETUPS[0])
    whole = [s.model_copy(update={"full_shard": False}) for s in plan.stages]
    evaluation = evaluate_plan(plan.model_copy(update={"stages": whole}))
    generation = evaluation.predictions.model_stages["actor/generation"]
    assert generation.peak_memory_bytes > plan.cluster.gpu.memory_bytes
    sharded = evaluate_plan(plan).predictions.model_stages["actor/training"]
    assert sharded.memory_breakdown_bytes["gathered"] > 0 and sharded.time_breakdown_s["dp_sync"] > 0


def test_the_planner_shards_fully_where_it_pays_and_so_does_the_runtime_s_own() -> None:
    """verl's Qwen2-7B GRPO with recomputation, fixed rows and nothing offloaded: fully sharding
    some model-stage gives a faster plan than pinning it off. The runtime's own choices are every
    memory choice, the planner's whole space: its plan is `nereus plan`'s."""
    workload = workload_of(SETUPS[0])
    request = PlanRequest(cluster_preset("h100", 8), models_for(workload, None), workload, 8)
    fixed = MemoryChoices(recompute=("full",), token_budget=(False,), offload=(False,))
    searched = make_plan(dataclasses.replace(request, choices=fixed)).best
    pinned = make_plan(dataclasses.replace(request, choices=dataclasses.replace(fixed, full_shard=(False,)))).best
    assert any(s.full_shard for s in searched.stages)
    assert not any(s.full_shard for s in pinned.stages)
    assert searched.predictions is not None and pinned.predictions is not None
    assert searched.predictions.step_time_s < pinned.predictions.step_time_s
    runtime = make_plan(dataclasses.replace(request, choices=RUNTIME_CHOICES))
    # Every memory choice; context and expert parallelism as the runtime searches them (`runtime_choices`).
    space = MemoryChoices(
        context_parallel=RUNTIME_CHOICES.context_parallel, expert_parallel=RUNTIME_CHOICES.expert_parallel
    )
    assert space == RUNTIME_CHOICES
    assert runtime.best.stages == make_plan(dataclasses.replace(request, choices=space)).best.stages

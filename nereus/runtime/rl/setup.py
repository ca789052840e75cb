"""What a plan and a run config must satisfy for `nereus run` to run them: plan problems
(layouts, memory, KV budgets, fusion, algorithm), logging and warm-start checks, and the
world a plan needs. Torch-free: the launcher refuses a bad run before any process exists.

The run's resolution, folder, checkpoints and launch are `nereus.runtime.run`'s.
"""

from __future__ import annotations

from pathlib import Path

from nereus.cost.fit import engineless_stages
from nereus.errors import ArgumentError, NereusError
from nereus.runtime.run.plans import plan_num_ranks
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig, RunConfig


def plan_problems(plan: Plan, world_size: int, config: RLConfig) -> list[str]:
    """Why `plan` cannot run on `world_size` ranks with `config` (empty when it can)."""
    from nereus.runtime.model.fused_schedule import intra_stage_problems
    from nereus.runtime.rl.inter_stage import inter_stage_problems
    from nereus.runtime.rl.tasks import CharTokenizer
    from nereus.runtime.state.shard_layout import layout_problem
    from nereus.runtime.state.sharded_state import RUNTIME_DTYPES

    problems = []
    workload = plan.workload
    num_rows = workload.prompts_per_step * workload.samples_per_prompt
    used = sorted({gpu for entry in plan.stages for gpu in entry.gpus})
    if used and used[-1] >= world_size:
        problems.append(f"the plan uses GPU {used[-1]} but the world has {world_size} ranks (0..{world_size - 1})")
    tokenizer = CharTokenizer()
    for entry in plan.stages:
        name = entry.model_stage
        model = plan.model(workload.model_name(entry.role))
        problem = layout_problem(model, entry.tp, entry.pp)
        if problem:
            problems.append(f"{name}: {problem}")
        if model.vocab_size < tokenizer.vocab_size:
            problems.append(
                f"{name}: model {model.name} has {model.vocab_size} tokens, the tokenizer needs {tokenizer.vocab_size}"
            )
        rows = num_rows // workload.mini_batches if entry.stage == "training" else num_rows
        if rows // entry.dp < entry.micro_batches:
            problems.append(f"{name}: {rows} rows over dp={entry.dp} cannot fill micro_batches={entry.micro_batches}")
    problems += unexecutable_choices(plan)
    problems += sft_problems(plan, config)
    problems += memory_problems(plan, config)
    problems += kv_budget_problems(plan)
    problems += intra_stage_problems(plan)
    problems += [f"fusion.inter_stage: {problem}" for problem in inter_stage_problems(plan, plan.fusion, config)]
    if workload.dtype not in RUNTIME_DTYPES:
        problems.append(f"workload dtype {workload.dtype} is not run (no loss scaling); use bf16 or fp32")
    if workload.algorithm == "grpo" and workload.samples_per_prompt < 2:
        problems.append("grpo needs samples_per_prompt >= 2 (groups of one have no baseline)")
    has_critic = any(entry.role == "critic" for entry in plan.stages)
    if workload.algorithm == "ppo" and not has_critic:
        problems.append("ppo needs critic/inference and critic/training stages")
    if workload.algorithm != "ppo" and has_critic:
        problems.append(f"{workload.algorithm} trains no critic; remove the critic stages")
    return problems


def check_logging(config: RunConfig, where: Path) -> None:
    """Refuse a config asking for TensorBoard events where the package is missing, or for a
    warm-start on the synthetic task's demonstrations in a run that reads a dataset."""
    import importlib.util

    if config.log.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise NereusError(
            f"{where}: log.tensorboard: the tensorboard package is not installed; "
            "`pip install 'nereus[tensorboard]'` or set it to false"
        )
    if config.data is not None and config.rl.sft_steps:
        raise NereusError(
            f"{where}: rl.sft_steps: the warm-start demonstrates rl.task's problems, not a data: file; set it to 0"
        )


def sft_problems(plan: Plan, config: RLConfig) -> list[str]:
    """Why the supervised warm-start cannot run on the plan's actor/training layout."""
    entry = plan.stage_plan("actor/training")
    if config.sft_steps and config.sft_batch // entry.dp < entry.micro_batches:
        return [
            f"rl.sft_batch: {config.sft_batch} demonstrations over actor/training's dp={entry.dp} cannot fill "
            f"micro_batches={entry.micro_batches}; raise sft_batch to at least {entry.dp * entry.micro_batches}"
        ]
    return []


def unexecutable_choices(plan: Plan) -> list[str]:
    """Memory-saving choices of the plan the runtime does not execute yet, each with its pin."""
    found = []
    for entry in plan.stages:
        unsupported = [
            (entry.recompute != "none", "recompute", "--recompute none"),
            (entry.token_budget is not None, "token_budget", "--token-budget off"),
            (entry.full_shard, "full_shard", "--full-shard off"),
            (entry.offload, "offload", "--offload off"),
        ]
        found += [
            f"{entry.model_stage}: {name} is not executed by the runtime yet; replan with `nereus plan {pin}` "
            f"(or --for-runtime)"
            for used, name, pin in unsupported
            if used
        ]
    return found


def state_bytes_by_rank(plan: Plan, config: RLConfig) -> dict[int, int]:
    """Bytes of engine state every rank holds under `plan`, summed over its model-stages:
    parameters in the workload's dtype, and in training the gradients (same dtype), the fp32
    masters of 16-bit weights and both fp32 AdamW moments (their ZeRO-1 rows when sharded)."""
    from nereus.cost.plan_cost import head_of
    from nereus.runtime.state.shard_layout import layout_problem, stage_layout
    from nereus.runtime.state.sharded_state import keeps_masters, stage_dp_sharded, state_dtypes, state_meta

    held: dict[int, int] = {}
    workload = plan.workload
    for entry in plan.stages:
        model = plan.model(workload.model_name(entry.role))
        if not config.runs_engine(entry.role) or layout_problem(model, entry.tp, entry.pp):
            continue  # no engine (rule reward), or a layout reported on its own
        families = ("param", "grad", "exp_avg", "exp_avg_sq") if entry.stage == "training" else ("param",)
        dtypes, layout = state_dtypes(workload, entry.stage), stage_layout(entry)
        metas = [state_meta(model, head_of(entry.role), layout, families, dtypes, stage_dp_sharded(workload, entry))]
        if keeps_masters(workload, entry.stage):  # the 16-bit working weights beside the masters
            metas.append(state_meta(model, head_of(entry.role), layout, ("param",), {"param": dtypes["grad"]}))
        for meta in metas:
            for rank in meta.boxes:
                held[rank] = held.get(rank, 0) + meta.rank_bytes(rank)
    return held


def memory_problems(plan: Plan, config: RLConfig) -> list[str]:
    """Ranks whose predicted peak (the cost model's, `nereus.runtime.observe.memory.predicted_peaks`:
    the running model-stage's memory plus every model state resident on the rank) exceeds a
    rank's memory (`config.rank_memory_bytes`, else the cluster's per-GPU memory): such a plan
    is refused, never attempted."""
    from nereus.runtime.observe.memory import predicted_peaks
    from nereus.units import format_bytes

    capacity = plan.cluster.gpu.memory_bytes if config.rank_memory_bytes is None else config.rank_memory_bytes
    where = f"per GPU of cluster {plan.cluster.name}" if config.rank_memory_bytes is None else "of rl.rank_memory_bytes"
    worst: dict[int, tuple[int, str]] = {}
    for model_stage, by_rank in predicted_peaks(plan, skip=engineless_stages(plan, config)).items():
        for rank, peak in by_rank.items():
            worst[rank] = max(worst.get(rank, (0, "")), (peak, model_stage))
    return [
        f"rank {rank} would hold {format_bytes(peak)} at its peak (while {model_stage} runs), more than the "
        f"{format_bytes(capacity)} {where}; pick a plan that spreads it"
        for rank, (peak, model_stage) in sorted(worst.items())
        if peak > capacity
    ]


def kv_budget_problems(plan: Plan) -> list[str]:
    """Generation KV budgets too small for one sequence of the plan's maximum length: the
    engine could never admit it (its KV cache is fp32, the engine's compute dtype)."""
    from nereus.runtime.generation.kv_cache import BLOCK_TOKENS, one_sequence_bytes

    w = plan.workload
    tokens = w.prompt_len + w.response_len.max
    found = []
    for entry in plan.stages:
        if entry.kv_budget_bytes is None:
            continue
        model = plan.model(w.model_name(entry.role))
        needed = one_sequence_bytes(model, entry.tp, entry.pp, tokens, 4, BLOCK_TOKENS)
        if entry.kv_budget_bytes < needed:
            found.append(
                f"{entry.model_stage}: kv_budget_bytes {entry.kv_budget_bytes} cannot hold one sequence of the "
                f"plan's maximum length ({w.prompt_len} + {w.response_len.max} tokens): it needs {needed} bytes "
                f"per GPU; raise kv_budget_bytes to at least {needed}"
            )
    return found


def _check_plan(plan: Plan, where: str, num_ranks: int, config: RLConfig) -> None:
    needed = plan_num_ranks(plan)
    if needed != num_ranks:
        raise ArgumentError(
            f"{where}: the plan places model-stages on {needed} ranks (GPUs 0..{needed - 1}) but `num_ranks` is "
            f"{num_ranks}; pass `num_ranks` {needed} or a plan for {num_ranks} ranks",
            "num_ranks",
        )
    problems = plan_problems(plan, num_ranks, config)
    if problems:
        raise NereusError(f"{where}: {problems[0]}")


def check_world(plan: Plan, world_size: int, where: str) -> None:
    """Refuse a run whose plan (read from `where`) does not use exactly the ranks of the job it joined."""
    needed = plan_num_ranks(plan)
    if needed != world_size:
        raise NereusError(
            f"{where}: the plan places model-stages on {needed} GPUs "
            f"(ranks 0..{needed - 1}) but the job has {world_size} ranks; launch {needed} ranks in all, or give a "
            f"plan for {world_size}"
        )

"""Admission: everything a plan and a run config must satisfy before `nereus run` spawns a
rank, in one place, for `nereus run` and `nereus check` alike.

`nereus run` calls `check_config` on the config it reads and `check_plan` on every plan it
would run (the first, each plan switch, a replanned resume; the controller vets its targets
with `plan_problems`). `nereus check run.yaml` runs `run_config_problems`: the same config
rules and, for a config naming a plan file, the same plan admission. The dtypes the runtime
computes in are `nereus.spec.capabilities`'s.

The spec layer's own rules (`nereus.spec.check`: a workload's groups and critic, the layout
rules) are shared, not restated. No torch: a refusal takes a fraction of a second.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from nereus.cost.fit import engineless_stages
from nereus.cost.kv_pool import BLOCK_TOKENS, KV_ELEMENT_BYTES
from nereus.cost.plan_cost import generation_alone
from nereus.cost.stage import kv_bytes_per_token
from nereus.errors import ArgumentError, NereusError, SpecError
from nereus.spec.capabilities import RUNTIME_DTYPES
from nereus.spec.check import (
    Problem,
    cp_layout_problem,
    critic_rule,
    group_rule,
    layout_problem,
    model_problems,
    position_problems,
)
from nereus.spec.model import Model
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig, RunConfig
from nereus.spec.stages import ACTOR_GENERATION, ACTOR_TRAINING
from nereus.spec.workload import Workload

if TYPE_CHECKING:
    from nereus.cost.calibration import Calibration


def plan_num_ranks(plan: Plan) -> int:
    """Ranks the plan's GPU ids call for (GPU id = rank)."""
    return 1 + max(gpu for entry in plan.stages for gpu in entry.gpus)


def with_fusion(plan: Plan, config: RunConfig) -> Plan:
    """The plan with the run config's `fusion:` block in force (it replaces the plan's whole;
    the run folder's plan.yaml then shows the fusion the run uses)."""
    return plan if config.fusion is None else plan.model_copy(update={"fusion": config.fusion})


# ---- the run config ----


def config_problems(config: RunConfig) -> list[Problem]:
    """What `nereus run` refuses in a config before it reads any file the config names:
    TensorBoard events without the package, a warm-start on the synthetic task's
    demonstrations in a run that reads a dataset, Hugging Face folders for the critic or the
    reward without the actor's, a reward folder for a rule reward, plan switches beside a
    controller's trace."""
    problems = []
    if config.log.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append(
            Problem(
                "log.tensorboard",
                "the tensorboard package is not installed; `pip install 'nereus[tensorboard]'` or set it to false",
            )
        )
    if config.data is not None and config.rl.sft_steps:
        problems.append(
            Problem("rl.sft_steps", "the warm-start demonstrates rl.task's problems, not a data: file; set it to 0")
        )
    if config.model is None:
        extra = next((field for field in ("critic_model", "reward_model") if getattr(config, field)), None)
        if extra:
            problems.append(Problem(extra, "needs model: (the actor's folder, which every role plays)"))
    elif config.reward_model is not None and config.rl.reward != "model":
        problems.append(Problem("reward_model", "needs rl.reward: model (the rule needs no model)"))
    if config.plan_switches and config.trace is not None:
        problems.append(
            Problem("trace", "plan_switches and trace: give one; the controller decides plan changes itself")
        )
    return problems


def check_config(config: RunConfig, where: Path) -> None:
    """Refuse a run config (read from `where`) with one of `config_problems`."""
    problems = config_problems(config)
    if problems:
        raise NereusError(problems[0].format(str(where)))


def run_config_problems(config: RunConfig, source: Path) -> list[Problem]:
    """What `nereus run CONFIG` refuses before it spawns a rank, as problems of the config
    file at `source`: `config_problems`, a controller's lengths without a trace, a config
    neither naming a plan nor planning itself, and the plan file's own problems and
    admission (`check_plan` on the ranks it places). A config that plans itself is planned
    for the ranks `nereus run --nproc` gives, so only its config rules apply here; the
    Hugging Face folders it names are read and checked by the run."""
    problems = config_problems(config)
    if config.lengths_from_trace and config.trace is None:
        problems.append(Problem("lengths_from_trace", "needs a trace; set trace: there"))
    if config.plan is None:
        if config.model is None:
            problems.append(Problem("plan", "not set; name a Plan YAML there or set model:"))
        return problems
    where = source.parent / config.plan
    if not where.is_file():
        return [*problems, Problem("plan", f"{where} does not exist; give the path of a Plan YAML")]
    from nereus.spec.io import load_document

    try:
        plan = load_document(where)
    except SpecError as error:
        return [*problems, *(Problem("plan", line) for line in error.problems)]
    if not isinstance(plan, Plan):
        return [*problems, Problem("plan", f"{where}: kind: expected Plan, got {type(plan).__name__}")]
    plan = with_fusion(plan, config)
    try:
        check_plan(plan, str(where), plan_num_ranks(plan), config.rl)
    except NereusError as error:
        problems.append(Problem("plan", str(error)))
    return problems


# ---- models and workload ----


def model_fit_problems(models: Iterable[Model], workload: Workload) -> list[str]:
    """What no plan of `workload` over `models` can run: a model that is no network
    (`nereus.spec.check.model_problems`: KV heads not dividing the heads, an odd head width,
    empty llama3 bands) and a sequence longer than a model takes (`position_rule`: prompt_len
    + response_len.max over its max_positions, or the limit its RoPE scaling extends it to).
    `nereus plan` refuses these before it searches, `nereus run` on every plan it would run
    (and `nereus check` a plan file, through the spec's own plan rules)."""
    models = list(models)
    found = [f"model {m.name}: {p.path}: {p.message}" for m in models for p in model_problems(m)]
    return found + [f"workload.{p.path}: {p.message}" for p in position_problems(models, workload)]


# ---- a plan on a number of ranks ----


def check_plan(plan: Plan, where: str, num_ranks: int, config: RLConfig) -> None:
    """Refuse a plan (read from `where`) that does not place its model-stages on exactly
    `num_ranks` ranks, or that `plan_problems` finds the runtime cannot run."""
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


def plan_problems(plan: Plan, world_size: int, config: RLConfig) -> list[str]:
    """Why `plan` cannot run on `world_size` ranks with `config` (empty when it can)."""
    # The runtime's own facts, read from its torch-free modules: the tokenizer's vocabulary
    # and the fusions' feasibility (the fused schedule search, the migration simulator).
    from nereus.runtime.model.fused_schedule import intra_stage_problems
    from nereus.runtime.rl.inter_stage import inter_stage_problems
    from nereus.runtime.rl.tasks import CharTokenizer

    problems = []
    workload = plan.workload
    num_rows = workload.prompts_per_step * workload.samples_per_prompt
    used = sorted({gpu for entry in plan.stages for gpu in entry.gpus})
    if used and used[-1] >= world_size:
        problems.append(f"the plan uses GPU {used[-1]} but the world has {world_size} ranks (0..{world_size - 1})")
    problems += model_fit_problems(plan.models, workload)
    tokenizer = CharTokenizer()
    for entry in plan.stages:
        name = entry.model_stage
        model = plan.model(workload.model_name(entry.role))
        problem = layout_problem(model, entry.tp, entry.pp) or cp_layout_problem(
            model, entry.tp, entry.pp, entry.cp, entry.cp_method
        )
        if problem:
            problems.append(f"{name}: {problem}")
        if model.vocab_size < tokenizer.vocab_size:
            problems.append(
                f"{name}: model {model.name} has {model.vocab_size} tokens, the tokenizer needs {tokenizer.vocab_size}"
            )
        rows = num_rows // workload.mini_batches if entry.stage == "training" else num_rows
        if rows // entry.dp < entry.micro_batches:
            problems.append(f"{name}: {rows} rows over dp={entry.dp} cannot fill micro_batches={entry.micro_batches}")
    problems += expert_parallel_problems(plan)
    problems += offload_problems(plan)
    problems += sft_problems(plan, config)
    problems += router_aux_problems(plan, config)
    problems += memory_problems(plan, config)
    problems += kv_budget_problems(plan)
    problems += token_budget_problems(plan)
    problems += full_shard_problems(plan)
    problems += intra_stage_problems(plan)
    problems += [f"fusion.inter_stage: {problem}" for problem in inter_stage_problems(plan, plan.fusion, config)]
    if workload.dtype not in RUNTIME_DTYPES:
        problems.append(f"workload dtype {workload.dtype} is not run (no loss scaling); use bf16 or fp32")
    if workload.execution == "async":
        problems += async_run_problems(plan)
    group = group_rule(workload)
    if group:
        problems.append(group)
    critic = critic_rule(workload.algorithm, any(entry.role == "critic" for entry in plan.stages), "stages")
    if critic:
        problems.append(critic)
    return problems


def async_run_problems(plan: Plan) -> list[str]:
    """Why the runtime cannot run an async plan's pools (docs/async.md, "The run loop"): its
    generation loop needs actor/generation's ranks to itself, and rank 0 (which records the
    run) in the training pool."""
    generation = plan.stage_plan(ACTOR_GENERATION).gpus
    if not generation_alone(plan):
        return [
            "workload.execution: async runs actor/generation on ranks of its own, but it shares ranks with "
            "another model-stage (one rank cannot be split into two pools); plan for at least 2 GPUs "
            "(`nereus plan` splits them) or set execution: sync"
        ]
    if 0 in generation:
        return [
            "workload.execution: async: actor/generation is on rank 0, which the run loop keeps in the training "
            "pool; put actor/generation on the last ranks (`nereus plan` does)"
        ]
    return []


def expert_parallel_problems(plan: Plan) -> list[str]:
    """Entries with ep > 1 the runtime does not execute: those that pair ep with a memory choice
    its expert-parallel engine does not combine with yet (full sharding, training-time offload,
    token budgets), each with the fix. A run planning for itself keeps ep = 1
    (`nereus.solver.layouts.runtime_choices`): its search would pair ep with those choices."""
    problems = []
    for entry in plan.stages:
        paired = {
            "full_shard": entry.full_shard,
            "train_offload": entry.train_offload != "none",
            "token_budget": entry.token_budget is not None,
        }
        named = [name for name, on in paired.items() if on]
        if entry.ep > 1 and named:
            problems.append(
                f"{entry.model_stage}: ep={entry.ep} with {named[0]}: the runtime's expert parallelism runs without "
                f"{named[0]} for now; replan with `nereus plan --expert-parallel off` or drop {named[0]}"
            )
    return problems


def offload_problems(plan: Plan) -> list[str]:
    """Training-time offload the runtime cannot run on an entry's layout: the parameters' shards
    live in host memory by FSDP2's CPU offload, which shards over dp x cp > 1 ranks."""
    return [
        f"{entry.model_stage}: train_offload params keeps the parameters' shards in host memory (FSDP2's CPU "
        f"offload), which needs full_shard over dp x cp > 1 ranks; this entry has dp={entry.dp} cp={entry.cp}: "
        "use train_offload optimizer"
        for entry in plan.stages
        if entry.stage == "training" and entry.train_offload == "params" and entry.dp * entry.cp < 2
    ]


def sft_problems(plan: Plan, config: RLConfig) -> list[str]:
    """Why the supervised warm-start cannot run on the plan's actor/training layout."""
    entry = plan.stage_plan(ACTOR_TRAINING)
    if config.sft_steps and config.sft_batch // entry.dp < entry.micro_batches:
        return [
            f"rl.sft_batch: {config.sft_batch} demonstrations over {ACTOR_TRAINING}'s dp={entry.dp} cannot fill "
            f"micro_batches={entry.micro_batches}; raise sft_batch to at least {entry.dp * entry.micro_batches}"
        ]
    return []


def router_aux_problems(plan: Plan, config: RLConfig) -> list[str]:
    """Why `rl.router_aux_loss_coef` > 0 cannot run: a dense actor (no router), or an actor
    training layout with pipeline or context parallelism (the loss pools every MoE layer)."""
    if config.router_aux_loss_coef <= 0:
        return []
    entry = plan.stage_plan(ACTOR_TRAINING)
    model = plan.model(plan.workload.model_name(entry.role))
    if model.moe is None:
        return [f"rl.router_aux_loss_coef: {config.router_aux_loss_coef} needs a mixture-of-experts actor; "
                f"model {model.name} is dense, set it to 0"]  # fmt: skip
    if entry.pp > 1 or entry.cp > 1:
        return [f"rl.router_aux_loss_coef: runs with {ACTOR_TRAINING} pp=1 and cp=1, the plan has pp={entry.pp} "
                f"cp={entry.cp}; replan with pp and cp 1 or set it to 0"]  # fmt: skip
    return []


def kv_budget_problems(plan: Plan) -> list[str]:
    """Generation KV budgets too small for one sequence of the plan's maximum length: the
    engine could never admit it (in whole blocks, at its KV dtype, fp32)."""
    w = plan.workload
    tokens = w.prompt_len + w.response_len.max
    found = []
    for entry in plan.stages:
        if entry.kv_budget_bytes is None:
            continue
        model = plan.model(w.model_name(entry.role))
        needed = (
            -(-tokens // BLOCK_TOKENS) * BLOCK_TOKENS * kv_bytes_per_token(model, entry.tp, entry.pp, KV_ELEMENT_BYTES)
        )
        if entry.kv_budget_bytes < needed:
            found.append(
                f"{entry.model_stage}: kv_budget_bytes {entry.kv_budget_bytes} cannot hold one sequence of the "
                f"plan's maximum length ({w.prompt_len} + {w.response_len.max} tokens): it needs {needed} bytes "
                f"per GPU; raise kv_budget_bytes to at least {needed}"
            )
    return found


def token_budget_problems(plan: Plan) -> list[str]:
    """Token budgets the engine cannot pack to: below one row of the plan's maximum length, or
    under intra-stage fusion, whose schedule fixes the micro-batch count a budget would vary."""
    w = plan.workload
    tokens = w.prompt_len + w.response_len.max
    found = []
    for entry in plan.stages:
        if entry.token_budget is None:
            continue
        if entry.token_budget < tokens:
            found.append(
                f"{entry.model_stage}: token_budget {entry.token_budget} cannot hold one row of the plan's maximum "
                f"length ({w.prompt_len} + {w.response_len.max} tokens); raise token_budget to at least {tokens}"
            )
        if plan.fusion.intra_stage:
            found.append(
                f"fusion.intra_stage: the fused schedule fixes {entry.model_stage}'s micro-batch count, which its "
                "token_budget would make depend on the rows' lengths; drop token_budget or the fusion"
            )
    return found


def full_shard_problems(plan: Plan) -> list[str]:
    """Fully sharded model-stages whose replicas (and their cp ranks) are not in ascending GPU
    order at some (stage, tp rank) position of their EMUs: FSDP2 places shard d * cp + c's rows
    (replica d, cp rank c) on that rank of its dp x cp group, whose ranks a process group orders
    ascending (the engine refuses such a layout; a plan or a replan is refused before it)."""
    found = []
    for entry in plan.stages:
        if not entry.full_shard or entry.dp * entry.cp < 2:
            continue
        for stage, tp_rank in itertools.product(range(entry.pp), range(entry.tp)):
            # EMU entry (s * cp + c) * tp + r is stage s, cp rank c, tensor rank r
            at = [(stage * entry.cp + c) * entry.tp + tp_rank for c in range(entry.cp)]
            gpus = [emu[i] for emu in entry.emus for i in at]
            if gpus != sorted(gpus):
                found.append(
                    f"{entry.model_stage}: full_shard places replica d's rows on the d-th of GPUs {sorted(gpus)}, "
                    f"but its EMUs list them as {gpus}; list the EMUs in ascending GPU order"
                )
                break
    return found


# ---- memory ----


def predicted_peaks(
    plan: Plan, calibration: Calibration | None = None, skip: Collection[str] = ()
) -> dict[str, dict[int, int]]:
    """For every model-stage, the predicted peak bytes of each of its ranks while it runs:
    its own memory terms plus the model states of the rank's other model-stages. Model-stages
    in `skip` run no engine (a rule reward): they are neither priced nor resident."""
    from nereus.cost.calibration import DEFAULT_CALIBRATION
    from nereus.cost.plan_cost import evaluate_plan, split_resident

    evaluation = evaluate_plan(plan, calibration or DEFAULT_CALIBRATION)
    own: dict[str, dict[str, float]] = {}
    resident_on: dict[int, float] = {}
    entries = [entry for entry in plan.stages if entry.model_stage not in skip]
    for entry in entries:
        breakdown = evaluation.predictions.model_stages[entry.model_stage].memory_breakdown_bytes
        own[entry.model_stage] = {k: float(v) for k, v in breakdown.items() if k not in ("co_resident", "workspace")}
        resident = float(split_resident(own[entry.model_stage], entry.offload)[0])
        for gpu in entry.gpus:
            resident_on[gpu] = resident_on.get(gpu, 0.0) + resident
    peaks: dict[str, dict[int, int]] = {}
    for entry in entries:
        terms = own[entry.model_stage]
        resident = float(split_resident(terms, entry.offload)[0])
        peaks[entry.model_stage] = {
            gpu: int(sum(terms.values()) + resident_on[gpu] - resident) for gpu in sorted(set(entry.gpus))
        }
    return peaks


def memory_problems(plan: Plan, config: RLConfig) -> list[str]:
    """Ranks whose predicted peak (`predicted_peaks`: the running model-stage's memory plus
    every model state resident on the rank) exceeds a rank's memory (`config.rank_memory_bytes`,
    else the cluster's per-GPU memory): such a plan is refused, never attempted."""
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


def state_bytes_by_rank(plan: Plan, config: RLConfig) -> dict[int, int]:
    """Bytes of engine state every rank holds under `plan`, summed over its model-stages:
    parameters in the workload's dtype, and in training the gradients (same dtype), the fp32
    masters of 16-bit weights and both fp32 AdamW moments (their ZeRO-1 rows when sharded)."""
    # The shard contract (which rank holds which rows of which tensor) is the runtime's; its
    # modules are torch-free.
    from nereus.runtime.state.shard_layout import stage_layout
    from nereus.runtime.state.sharded_state import keeps_masters, stage_dp_sharded, state_dtypes, state_meta
    from nereus.spec.stages import head_of

    held: dict[int, int] = {}
    workload = plan.workload
    for entry in plan.stages:
        model = plan.model(workload.model_name(entry.role))
        if not config.runs_engine(entry.role) or layout_problem(model, entry.tp, entry.pp):
            continue  # no engine (rule reward), or a layout reported on its own
        families = ("param", "grad", "exp_avg", "exp_avg_sq") if entry.stage == "training" else ("param",)
        dtypes, layout = state_dtypes(workload, entry.stage), stage_layout(entry)
        head = head_of(entry.role)
        metas = [state_meta(model, head, layout, families, dtypes, stage_dp_sharded(workload, entry))]
        if keeps_masters(workload, entry.stage):  # the 16-bit working weights beside the masters
            metas.append(state_meta(model, head, layout, ("param",), {"param": dtypes["grad"]}))
        for meta in metas:
            for rank in meta.boxes:
                held[rank] = held.get(rank, 0) + meta.rank_bytes(rank)
    return held

"""`nereus plan` and `nereus plan explain`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nereus.cli.outputs import check_output
from nereus.cli.progress import progress_bar
from nereus.errors import NereusError
from nereus.spec.plan import RECOMPUTE_LEVELS

if TYPE_CHECKING:
    from rich.table import Table

    from nereus.cost.calibration import Calibration
    from nereus.solver.layouts import MemoryChoices
    from nereus.solver.planner import PlanResult
    from nereus.spec.cluster import Cluster
    from nereus.spec.plan import Plan, StagePlan

GIB = 2**30
DEFAULT_CLUSTER = "h100"
#: Most plans `--top` reports: each is searched for and built in full, and the search's work
#: grows faster than linearly with it (measured: 1,000 plans 3 s, 15,756 plans 40 s).
MAX_TOP = 100
plan_app = typer.Typer(
    help="Search the fastest memory-feasible plan, or explain one.", invoke_without_command=True, no_args_is_help=False
)


@plan_app.callback()
def plan(
    ctx: typer.Context,
    gpus: Annotated[
        int | None, typer.Option("--gpus", min=1, help="GPUs to plan for (default: the whole cluster).")
    ] = None,
    cluster: Annotated[
        str | None, typer.Option(help="Cluster preset (h100, a100-80gb-4x8, ...) or Cluster YAML [default: h100].")
    ] = None,
    profile: Annotated[
        Path | None,
        typer.Option(help="Profile YAML from `nereus profile`: plan for the measured machine instead of --cluster."),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Model preset, Model YAML or HF config.json; plays every role.")
    ] = None,
    workload: Annotated[
        str, typer.Option(help="Workload preset (ppo, grpo, grpo-long, remax) or Workload YAML.")
    ] = "ppo",
    seq_len: Annotated[
        int | None,
        typer.Option(help="Maximum response length in tokens (sizes the KV cache); median and p99 scale alike."),
    ] = None,
    calibration: Annotated[Path | None, typer.Option(help="Calibration YAML with measured efficiencies.")] = None,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the best plan to this YAML/JSON file.")
    ] = None,
    top: Annotated[int, typer.Option(min=1, max=MAX_TOP, help="Also report this many best plans in total.")] = 1,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the plan, predictions and search time as JSON.")
    ] = False,
    recompute: Annotated[
        str, typer.Option(help="Activation recomputation of training: none, full, selective, or search (all three).")
    ] = "search",
    token_budget: Annotated[
        str, typer.Option(help="Training micro-batches packed to a token budget: on, off, or search.")
    ] = "search",
    zero1: Annotated[str, typer.Option(help="AdamW state sharded across dp (ZeRO-1): on, off, or search.")] = "search",
    offload: Annotated[
        str, typer.Option(help="Idle model-stages' states sleep in host memory: on, off, or search.")
    ] = "search",
    kv_budget: Annotated[
        str,
        typer.Option(help="Generation into a bounded KV budget with continuous batching: on, off, or search."),
    ] = "search",
    full_shard: Annotated[
        str,
        typer.Option(
            help="Training and inference parameters, gradients and AdamW state sharded across dp "
            "(ZeRO-3 / FSDP full shard): on, off, or search."
        ),
    ] = "search",
    train_offload: Annotated[
        str,
        typer.Option(
            help="Training keeps AdamW state and gradients (optimizer), and the parameters too (params: needs "
            "full sharding), in host memory with the optimizer step on the host: none, optimizer, params, "
            "or search (all three)."
        ),
    ] = "search",
    context_parallel: Annotated[
        str,
        typer.Option(
            help="Training and inference sequences cut over cp > 1 ranks (Ulysses context parallelism, "
            "without pipeline stages): on, off (cp = 1), or search."
        ),
    ] = "search",
    expert_parallel: Annotated[
        str,
        typer.Option(
            help="A mixture of experts' experts split over ep > 1 ranks (expert parallelism, every "
            "model-stage; dense models keep ep = 1): on, off (ep = 1), or search."
        ),
    ] = "search",
) -> None:
    """Choose every model-stage's tp/cp/ep/pp/dp, GPUs and micro-batches for the fastest feasible step."""
    if ctx.invoked_subcommand is not None:
        return
    from nereus.cli.inputs import load_kind, resolve_model, resolve_workload
    from nereus.cost.calibration import Calibration
    from nereus.solver.admission import model_fit_problems
    from nereus.solver.plan_search import PlanRequest
    from nereus.solver.planner import make_plan
    from nereus.spec.io import save_document
    from nereus.spec.presets import models_for
    from nereus.spec.workload import with_max_response

    check_output(output, "-o")
    the_model = resolve_model(model) if model else None
    the_workload = resolve_workload(workload, the_model)
    if seq_len is not None:
        if seq_len < 1:
            raise NereusError(f"--seq-len must be a positive number of tokens, got {seq_len}")
        the_workload = with_max_response(the_workload, seq_len)
    the_cluster = _plan_cluster(cluster, profile, gpus)
    num_gpus = gpus or the_cluster.num_gpus
    if num_gpus > the_cluster.num_gpus:
        raise NereusError(f"--gpus {num_gpus} exceeds the {the_cluster.num_gpus} GPUs of cluster {the_cluster.name}")
    the_calibration = load_kind(str(calibration), Calibration) if calibration else Calibration()
    if profile is not None:  # the host optimizer's throughput as measured there
        from nereus.cost.profile import Profile, calibration_from_profile

        measured = load_kind(str(profile), Profile)
        the_calibration = calibration_from_profile(measured, the_calibration)  # type: ignore[arg-type]
    flags = {"recompute": recompute, "token_budget": token_budget, "zero1": zero1, "offload": offload}
    flags |= {"kv_budget": kv_budget, "full_shard": full_shard, "train_offload": train_offload}
    flags |= {"context_parallel": context_parallel, "expert_parallel": expert_parallel}
    choices = _memory_choices(flags)
    models = models_for(the_workload, the_model)
    unfit = model_fit_problems(models, the_workload)
    if unfit:
        raise NereusError(unfit[0])
    request = PlanRequest(
        the_cluster,
        models,
        the_workload,
        num_gpus,
        the_calibration,  # type: ignore[arg-type]
        choices,
    )
    with progress_bar("searching placements") as progress:
        result = make_plan(request, top_k=top, progress=progress)
    if output:
        save_document(result.best, output)
    if as_json:
        _print_json(result, the_calibration)  # type: ignore[arg-type]
    else:
        _print_table(result, output, the_calibration)  # type: ignore[arg-type]


def _switch(flag: str, value: str, on: object, off: object) -> tuple[object, ...]:
    values = {"on": (on,), "off": (off,), "search": (off, on)}
    if value not in values:
        raise NereusError(f"{flag} {value}: use on, off or search")
    return values[value]


def _memory_choices(flags: dict[str, str]) -> MemoryChoices:
    """The search space the flags leave, by choice name (each flag pins one choice)."""
    from nereus.cost.stage import TRAIN_OFFLOADS
    from nereus.solver.layouts import MemoryChoices

    recompute, token_budget, zero1, offload = (flags[k] for k in ("recompute", "token_budget", "zero1", "offload"))
    kv_budget, full_shard, train_offload = (flags[k] for k in ("kv_budget", "full_shard", "train_offload"))
    if full_shard == "on" and zero1 == "off":
        raise NereusError("--full-shard on shards the optimizer state too, which --zero1 off excludes; drop one")
    if train_offload in ("optimizer", "params") and zero1 == "off":
        raise NereusError(
            f"--train-offload {train_offload} shards the optimizer state across dp, which --zero1 off excludes; "
            "drop one"
        )
    if train_offload == "params" and full_shard == "off":
        raise NereusError("--train-offload params offloads parameter shards, which --full-shard off excludes; drop one")
    recompute_values = {level: (level,) for level in RECOMPUTE_LEVELS} | {"search": RECOMPUTE_LEVELS}
    if recompute not in recompute_values:
        raise NereusError(f"--recompute {recompute}: use none, full, selective or search")
    offload_values = {name: (name,) for name in TRAIN_OFFLOADS} | {"search": TRAIN_OFFLOADS}
    if train_offload not in offload_values:
        raise NereusError(f"--train-offload {train_offload}: use none, optimizer, params or search")
    return MemoryChoices(
        recompute=recompute_values[recompute],
        token_budget=_switch("--token-budget", token_budget, True, False),  # type: ignore[arg-type]
        zero1=_switch("--zero1", zero1, True, False),  # type: ignore[arg-type]
        offload=_switch("--offload", offload, True, False),  # type: ignore[arg-type]
        kv_budget=_switch("--kv-budget", kv_budget, True, False),  # type: ignore[arg-type]
        full_shard=_switch("--full-shard", full_shard, True, False),  # type: ignore[arg-type]
        train_offload=offload_values[train_offload],
        context_parallel=_switch("--context-parallel", flags["context_parallel"], True, False),  # type: ignore[arg-type]
        expert_parallel=_switch("--expert-parallel", flags["expert_parallel"], True, False),  # type: ignore[arg-type]
    )


def _plan_cluster(cluster: str | None, profile: Path | None, gpus: int | None) -> Cluster:
    """The preset or file of --cluster, or the machine a --profile measured (not both)."""
    from nereus.cli.inputs import load_kind, resolve_cluster

    if profile is None:
        return resolve_cluster(cluster or DEFAULT_CLUSTER, gpus)
    if cluster is not None:
        raise NereusError("--cluster and --profile both describe the hardware; give one of them")
    from nereus.cost.profile import Profile, cluster_from_profile

    measured = load_kind(str(profile), Profile)
    try:
        return cluster_from_profile(measured, str(profile), gpus)  # type: ignore[arg-type]
    except ValueError as exc:
        raise NereusError(str(exc)) from None


def _print_json(result: PlanResult, calibration: Calibration) -> None:
    from nereus.cost.plan_cost import usable_capacity, workspace_bytes
    from nereus.spec.io import to_data

    cluster = result.best.cluster
    assert result.best.predictions is not None
    steady = result.best.predictions.steady_state
    payload = {
        "plan": to_data(result.best),
        "search_time_s": result.search_time_s,
        "num_placements": result.num_placements,
        "alternatives": [to_data(p) for p in result.alternatives],
        "usable_bytes_per_gpu": usable_capacity(cluster, calibration),
        "workspace_bytes_per_gpu": workspace_bytes(cluster, calibration),
        "rejections": [r.describe() for r in result.rejections],
        "steady_state": None if steady is None else steady.model_dump(),
    }
    typer.echo(json.dumps(payload, indent=2))


def _stage_table(plan: Plan, title: str, calibration: Calibration) -> Table:
    from rich.table import Table

    from nereus.cost.plan_cost import usable_capacity
    from nereus.render import gpu_ranges

    assert plan.predictions is not None
    usable = usable_capacity(plan.cluster, calibration)
    table = Table(title=title, title_justify="left")
    # ep beside cp wherever a model of the plan has experts (a dense plan's table is as before)
    experts = any(model.moe is not None for model in plan.models)
    columns = (
        "model-stage",
        "pool",
        "tp",
        "cp",
        *(("ep",) if experts else ()),
        "pp",
        "dp",
        "micro",
        "GPUs",
        "memory choices",
        "time (s)",
        "memory/GPU (GiB)",
        "host (GiB)",
    )
    for column in columns:
        table.add_column(
            column, justify="left" if column in ("model-stage", "pool", "GPUs", "memory choices") else "right"
        )
    for entry in plan.stages:
        pred = plan.predictions.model_stages[entry.model_stage]
        table.add_row(
            entry.model_stage,
            entry.pool,
            str(entry.tp),
            entry.cp_label,
            *((str(entry.ep),) if experts else ()),
            str(entry.pp),
            str(entry.dp),
            str(entry.micro_batches),
            gpu_ranges(entry.gpus),
            stage_choice_text(entry) or "-",
            f"{pred.time_s:.2f}",
            f"{pred.peak_memory_bytes / GIB:.1f} / {usable / GIB:.1f}",
            f"{sum(pred.host_memory_bytes.values()) / GIB:.1f}" if pred.host_memory_bytes else "-",
        )
    return table


def stage_choice_text(entry: StagePlan) -> str:
    """The memory-saving choices of one model-stage, e.g. `recompute, tokens<=9216, zero1`
    (`host-opt`, `host-params`: training-time offload of the optimizer, and of the parameters)."""
    parts = []
    if entry.kv_budget_bytes is not None:
        parts.append(f"kv {entry.kv_budget_bytes / GIB:.1f} GiB")
    if entry.recompute != "none":
        parts.append(f"recompute {entry.recompute}")
    if entry.token_budget is not None:
        parts.append(f"tokens<={entry.token_budget}")
    if entry.full_shard:
        parts.append("full shard")
    elif entry.zero1 and entry.train_offload == "none":  # training-time offload shards the optimizer
        parts.append("zero1")
    if entry.train_offload != "none":
        parts.append({"optimizer": "host-opt", "params": "host-params"}[entry.train_offload])
    if entry.offload:
        parts.append("offload")
    return ", ".join(parts)


def _print_table(result: PlanResult, output: Path | None, calibration: Calibration) -> None:
    from rich.console import Console

    console = Console(width=140)
    plan = result.best
    assert plan.predictions is not None
    console.print(
        _stage_table(
            plan,
            f"{plan.workload.name} on {sum(len(p.gpus) for p in plan.pools)} x {plan.cluster.gpu.name}",
            calibration,
        )
    )
    for line in step_lines(plan):
        console.print(line, highlight=False)
    console.print(_memory_base(plan, calibration))
    for rank, alternative in enumerate(result.alternatives, 2):
        assert alternative.predictions is not None
        pools = "+".join(p.name for p in alternative.pools)
        if alternative.predictions.steady_state is not None:  # async: the split and the bounding pool
            sizes = " + ".join(f"{p.name} {len(p.gpus)}" for p in alternative.pools)
            pools = f"{sizes}; {alternative.predictions.steady_state.bound}-bound"
        console.print(f"#{rank}: {alternative.predictions.step_time_s:.2f} s ({pools})")
    console.print(
        f"searched {result.num_placements} placements in {result.search_time_s * 1000:.1f} ms; "
        f"{len(result.rejections)} layouts rejected for memory"
    )
    for rejection in result.rejections[:3]:
        console.print(f"  rejected: {rejection.describe()}")
    if output:
        console.print(f"wrote {output}")


def step_lines(plan: Plan) -> list[str]:
    """The step's composition: its phases in sequence, or under async overlap the two pools and
    the one that bounds the step."""
    from nereus.cost.plan_cost import TRAINING_POOL_PHASES
    from nereus.render import gpu_ranges
    from nereus.spec.stages import ACTOR_GENERATION

    assert plan.predictions is not None
    steps, steady = plan.predictions.step_breakdown_s, plan.predictions.steady_state
    total = f"step {plan.predictions.step_time_s:.2f} s = "
    if steady is None:
        return [total + " + ".join(f"{name} {value:.2f}" for name, value in steps.items())]
    generation = plan.stage_plan(ACTOR_GENERATION)
    training = sorted({g for e in plan.stages if e.model_stage != ACTOR_GENERATION for g in e.gpus})
    training_pools = ", ".join(sorted({e.pool for e in plan.stages if e.model_stage != ACTOR_GENERATION}))
    pools = (
        f"async pools: generation on GPUs {gpu_ranges(generation.gpus)} ({len(generation.gpus)}, pool "
        f"{generation.pool}), training on GPUs {gpu_ranges(training)} ({len(training)}, pool {training_pools}); "
        f"generation runs up to {steady.max_staleness} batch{'es' if steady.max_staleness > 1 else ''} ahead"
    )
    side = " + ".join(f"{name} {steps[name]:.2f}" for name in TRAINING_POOL_PHASES)
    overhead = f" + step_overhead {steps['step_overhead']:.2f}" if "step_overhead" in steps else ""
    composed = f"max(generation {steady.generation_s:.2f}, {side} = {steady.training_s:.2f}){overhead}"
    other = "training" if steady.bound == "generation" else "generation"
    idle = abs(steady.generation_s - steady.training_s) / max(steady.generation_s, steady.training_s, 1e-12)
    bound = f"steady state bound by the {steady.bound} pool (the {other} pool idles {idle:.0%} of each step)"
    return [pools, total + composed, bound]


def _memory_base(plan: Plan, calibration: Calibration) -> str:
    """What the memory column compares: each peak, the workspace included, with the usable capacity."""
    from nereus.cost.plan_cost import usable_capacity, workspace_bytes

    capacity, cluster = plan.cluster.gpu.memory_bytes, plan.cluster
    return (
        f"memory/GPU: peak, the {workspace_bytes(cluster, calibration) / GIB:.1f} GiB workspace included, of "
        f"{usable_capacity(cluster, calibration) / GIB:.1f} GiB usable ({capacity / GIB:.1f} GiB less "
        f"{calibration.memory_headroom:.0%} headroom)"
    )


@plan_app.command("explain")
def explain(
    plan_file: Annotated[Path, typer.Argument(help="A Plan YAML/JSON file.")],
    calibration: Annotated[Path | None, typer.Option(help="Calibration YAML to price with.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the derivation as JSON.")] = False,
) -> None:
    """Show how each prediction of a plan is derived, term by term."""
    from nereus.cli.inputs import load_kind
    from nereus.cost.calibration import Calibration
    from nereus.cost.explain import explain_plan
    from nereus.spec.plan import Plan

    the_plan = load_kind(str(plan_file), Plan)
    the_calibration = load_kind(str(calibration), Calibration) if calibration else Calibration()
    explanation = explain_plan(the_plan, the_calibration)  # type: ignore[arg-type]
    if as_json:
        typer.echo(json.dumps(explanation, indent=2))
        return
    for line in explanation["lines"]:
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.add_typer(
        plan_app, name="plan", help="Search the fastest memory-feasible plan (`plan explain FILE` shows why)."
    )

"""A `nereus run` resolved before it spawns a rank: the config, the plan, the number of
ranks, the run folder, the step a resume starts from, the plan switches with their
transition DAGs and the fused schedule, all in one `RunSetup`.

It imports no torch, so a bad config, a plan that does not fit `num_ranks` or a run folder
in the way is refused in a fraction of a second with one line, before any process exists.
It writes nothing (`folder.prepare_folder` does, once the launcher goes ahead).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from nereus.cost.calibration import Calibration
from nereus.errors import ArgumentError, NereusError
from nereus.runtime.generation.engine_choice import check_generation, switch_engine, vllm_layout_problem
from nereus.runtime.hf.run_setup import HfSources, check_plan_models, hf_sources, plans_for_folder
from nereus.runtime.rl.run_data import check_data_state, prepare_data
from nereus.runtime.run.checkpoints import checkpoint_step, resumable_checkpoint
from nereus.runtime.run.plans import (
    check_same_work,
    load_as,
    plan_schedule,
    replan,
)
from nereus.runtime.run.run_setup import Move, RunSetup, Switch
from nereus.solver.admission import check_config, check_plan, plan_num_ranks, plan_problems, with_fusion
from nereus.spec.cluster import Cluster
from nereus.spec.plan import Plan
from nereus.spec.run_config import RunConfig
from nereus.spec.run_folder import CONFIG_NAME, PLAN_NAME, read_metrics
from nereus.spec.stages import Role
from nereus.spec.trace import Trace


def check_async(config: RunConfig, plan: Plan, where: str) -> None:
    """Refuse, in one line, an async run (`execution: async`) the async run loop does not run
    (`async_loop`): a controller or plan switches (plan changes under async are simulated, not
    run), held-out evaluation, inter-stage fusion. Both nereus's own engine and vLLM
    (`generation.engine: vllm`) generate, and both pause a partial rollout at a weight sync
    (`partial_rollout`: each continues a sample from its prompt and tokens so far)."""
    workload = plan.workload
    if workload.execution != "async":
        return
    refused = {
        "trace": config.trace is not None,
        "plan_switches": bool(config.plan_switches),
        "data.eval": config.data is not None and config.data.eval is not None,
        "fusion.inter_stage": plan.fusion.inter_stage,
    }
    for field, given in refused.items():
        if given:
            raise NereusError(
                f"{where}: {field}: not run under execution: async yet (the async run loop keeps one plan, "
                f"evaluates nothing and fuses no stages); drop {field} or set execution: sync"
            )


def new_run(
    config_path: Path,
    plan_path: Path | None = None,
    num_ranks: int | None = None,
    num_steps: int | None = None,
    out: Path | None = None,
    trace_path: Path | None = None,
    policy: str | None = None,
) -> RunSetup:
    """Check a new run of `config_path` (raises NereusError on any problem); writes nothing."""
    config: RunConfig = load_as(config_path, RunConfig)
    if trace_path is not None:
        config = config.model_copy(update={"trace": str(trace_path.resolve())})
    if policy is not None:
        config = config.model_copy(update={"policy": policy})
    check_config(config, config_path)  # the admission's rules, on the config as overridden
    if config.lengths_from_trace and config.trace is None:
        raise ArgumentError(
            f"{config_path}: lengths_from_trace: needs a trace; set trace: there or pass `trace_path`", "trace_path"
        )
    sources = resolve_sources(config, config_path)
    if sources is not None:  # the run folder's copy names the folders wherever it is read
        where = {field: str(sources.folders[role]) for field, role in SOURCE_FIELDS.items() if getattr(config, field)}
        config = config.model_copy(update=where)
    config = with_absolute_data(config, config_path.parent)
    plan, num_ranks, planned = first_plan(config, config_path, plan_path, num_ranks, sources)
    check_generation(config, plan, str(config_path))
    check_async(config, plan, str(config_path))
    data = prepare_data(config, plan, config_path.parent)
    if num_steps is not None:
        config = config.model_copy(update={"num_steps": num_steps})
    calibration = resolve_calibration(config, config_path.parent)
    switches = resolve_switches(config, config_path.parent, plan, num_ranks, calibration)
    for switch in switches:  # every plan of the run must run on the engine it asks for
        check_generation(config, switch.move.plan, f"{config_path}: plan_switches (step {switch.step})")
    trace = resolve_trace(config, config_path.parent, plan, num_ranks)
    out = out if out is not None else Path("runs") / f"{config_path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ArgumentError(f"{out}: already exists; resume it with `resume` or pass another `out`", "resume", "out")
    schedule = plan_schedule(plan)  # the one search of the run's first plan, after every check
    return RunSetup(
        config, plan, num_ranks, out, 0, None, planned, switches, trace, calibration, data=data, fused_schedule=schedule
    )


def with_absolute_data(config: RunConfig, folder: Path) -> RunConfig:
    """The config with its dataset files and reward module folder made absolute (relative to
    `folder`), so the run folder's copy finds them wherever it is resumed from."""
    from nereus.spec.data_config import PythonReward

    rl = config.rl
    if isinstance(rl.reward, PythonReward):
        reward_folder = (folder / (rl.reward.folder or ".")).resolve()
        rl = rl.model_copy(update={"reward": rl.reward.model_copy(update={"folder": str(reward_folder)})})
    data = config.data
    if data is not None:
        files = {"train": str((folder / data.train).resolve())}
        if data.eval is not None:
            files["eval"] = str((folder / data.eval).resolve())
        data = data.model_copy(update=files)
    return config.model_copy(update={"rl": rl, "data": data})


#: RunConfig fields naming a Hugging Face folder, and the role each gives weights to.
SOURCE_FIELDS: dict[str, Role] = {"model": "actor", "critic_model": "critic", "reward_model": "reward"}


def resolve_sources(config: RunConfig, config_path: Path) -> HfSources | None:
    """The config's Hugging Face folders (relative to it), checked; None without `model:`
    (which folders a config may name is the admission's rule, `check_config`, run before)."""
    folder = config_path.parent
    if config.model is None:
        return None
    critic = None if config.critic_model is None else folder / config.critic_model
    reward = None if config.reward_model is None else folder / config.reward_model
    return hf_sources(folder / config.model, critic, reward)


def first_plan(
    config: RunConfig, config_path: Path, plan_path: Path | None, num_ranks: int | None, sources: HfSources | None
) -> tuple[Plan, int, bool]:
    """The plan a new run starts under, its number of ranks, and whether the run planned it."""
    if plan_path is None and config.plan is None:
        if sources is None:
            raise ArgumentError(
                f"{config_path}: plan: not set; name a Plan YAML there, set model:, or pass `plan_path`", "plan_path"
            )
        if num_ranks is None:
            raise ArgumentError(f"{config_path}: plan: not set, so the run plans itself; pass `num_ranks`", "num_ranks")
        return self_plan(config, config_path.parent, sources, num_ranks), num_ranks, True
    where = plan_path if plan_path is not None else config_path.parent / str(config.plan)
    if not where.is_file():
        given = plan_path is not None
        field = "`plan_path`" if given else f"{config_path}: plan"
        raise ArgumentError(
            f"{field}: {where} does not exist; give the path of a Plan YAML", *(("plan_path",) if given else ())
        )
    plan = with_fusion(load_as(where, Plan), config)
    if sources is not None:
        check_plan_models(plan, sources, str(where))
        plan = sources.for_plan(plan)
    num_ranks = plan_num_ranks(plan) if num_ranks is None else num_ranks
    check_plan(plan, str(where), num_ranks, config.rl)
    return plan, num_ranks, False


def self_plan(config: RunConfig, folder: Path, sources: HfSources, num_ranks: int) -> Plan:
    """The best plan for the config's workload with the folder's model that the runtime can run."""
    from nereus.spec.presets import cluster_preset, workload_preset
    from nereus.spec.workload import Workload

    def document(value: str, kind: type[Any], preset: Any) -> Any:
        return load_as(folder / value, kind) if value.endswith((".yaml", ".yml", ".json")) else preset(value)

    workload = document(config.workload, Workload, lambda name: workload_preset(name, sources.model.name))
    cluster = document(config.cluster, Cluster, cluster_preset)
    plans = [
        with_fusion(plan, config) for plan in plans_for_folder(sources, workload, cluster, num_ranks, config.fusion)
    ]
    problems = [plan_problems(plan, num_ranks, config.rl) for plan in plans]
    if config.generation.engine == "vllm":  # a plan whose generation layout vLLM runs
        layouts = [vllm_layout_problem(plan) for plan in plans]
        problems = [[*found, layout] if layout else found for found, layout in zip(problems, layouts, strict=True)]
    for plan, found in zip(plans, problems, strict=True):
        if not found:
            return plan
    raise NereusError(f"{folder / config.workload}: no plan for {num_ranks} ranks runs: {problems[0][0]}")


def resolve_calibration(config: RunConfig, folder: Path) -> Calibration | None:
    """The calibration the config names (relative to `folder`), loaded and checked."""
    if config.calibration is None:
        return None
    where = folder / config.calibration
    if not where.is_file():
        raise NereusError(f"calibration: {where} does not exist; give a Calibration YAML (`nereus fit` writes one)")
    return load_as(where, Calibration)


def resolve_trace(config: RunConfig, folder: Path, plan: Plan, num_ranks: int) -> Trace | None:
    """The controller's trace, checked against the plan and the ranks; the policy name checked."""
    from nereus.solver.policy import make_policy

    if config.trace is None:
        return None
    try:
        make_policy(config.policy, plan)
    except ValueError as error:
        raise NereusError(f"policy: {error}") from None
    where = folder / config.trace
    trace: Trace = load_as(where, Trace)
    largest = max([trace.gpus, *(e.gpus for e in trace.events if e.gpus is not None)])
    if largest > num_ranks:
        raise NereusError(f"{where}: gpus: the pool reaches {largest} GPUs but the run has {num_ranks} ranks")
    if plan_num_ranks(plan) > trace.gpus:
        raise NereusError(f"{where}: gpus: starts with {trace.gpus} GPUs, the plan uses {plan_num_ranks(plan)}")
    return trace


def resolve_switches(
    config: RunConfig, folder: Path, first: Plan, num_ranks: int, calibration: Calibration | None = None
) -> tuple[Switch, ...]:
    """Load and check every plan switch and build its transition DAG from the plan before it,
    priced with the run's `calibration` (its fitted vLLM engine start-up and weight load, where
    the run generates with vLLM; None: the default calibration)."""
    from nereus.solver.transition.schedule import build_transition

    switches, previous = [], first
    for index, switch in enumerate(config.plan_switches):
        field = f"plan_switches.{index}"
        if switch.step >= config.num_steps:
            raise NereusError(f"{field}.step: {switch.step} is not before the run's last step ({config.num_steps - 1})")
        where = folder / switch.plan
        if not where.is_file():
            raise NereusError(f"{field}.plan: {where} does not exist; give the path of a Plan YAML")
        plan = with_fusion(load_as(where, Plan), config)
        check_same_work(plan, first, where)
        if plan.weights is None:  # the same models: from the same Hugging Face folders
            plan = plan.model_copy(update={"weights": first.weights})
        problems = plan_problems(plan, num_ranks, config.rl)
        if problems:
            raise NereusError(f"{where}: {problems[0]}")
        transition = build_transition(previous, plan, calibration, engine=switch_engine(config, plan))
        if not transition.feasible:
            cycle = " -> ".join(transition.blocking_cycle)
            raise NereusError(f"{field}: no safe transition order from the previous plan (blocking cycle {cycle})")
        move = Move(
            "transition", plan, transition.primitives, transition.schedule, transition.makespan_s, plan_schedule(plan)
        )
        switches.append(Switch(switch.step, move))
        previous = plan
    return tuple(switches)


def resume_run(
    out: Path,
    plan_path: Path | None = None,
    num_ranks: int | None = None,
    num_steps: int | None = None,
    from_previous: bool = False,
) -> RunSetup:
    """Check a resume of the run folder `out`, onto another plan or number of ranks if asked.

    The newest checkpoint must pass `checkpoint_problem`, else DamagedCheckpoint; with
    `from_previous` the newest one that passes is used and the newer ones are set aside."""
    if not (out / CONFIG_NAME).is_file():
        raise NereusError(f"{out}: not a run folder ({CONFIG_NAME} missing); give the output folder of a `nereus run`")
    config: RunConfig = load_as(out / CONFIG_NAME, RunConfig)
    check_config(config, out / CONFIG_NAME)
    stored = with_fusion(load_as(out / PLAN_NAME, Plan), config)
    if num_steps is not None:
        config = config.model_copy(update={"num_steps": num_steps})
    planned = False
    if config.plan_switches and (plan_path is not None or num_ranks is not None):
        raise ArgumentError(
            f"{out}: the run switches plans on its own (plan_switches); resume it without `plan_path` and `num_ranks`",
            "plan_path",
            "num_ranks",
        )
    checkpoint, damaged = resumable_checkpoint(out, from_previous)
    # A run without plan changes of its own ran the checkpoint's plan on exactly its ranks, and
    # that plan may not be the folder's: an elastic restart that replanned may have failed
    # before its first checkpoint. (With switches or a controller the world is the folder plan's.)
    in_force, in_force_at = stored, out / PLAN_NAME
    fixed = not config.plan_switches and config.trace is None
    if checkpoint is not None and fixed and (checkpoint / PLAN_NAME).is_file():
        in_force_at = checkpoint / PLAN_NAME
        in_force = with_fusion(load_as(in_force_at, Plan), config)
    if plan_path is not None:
        plan = with_fusion(load_as(plan_path, Plan), config)
        check_same_work(plan, stored, plan_path)
    elif num_ranks is not None and num_ranks != plan_num_ranks(in_force):
        plan, planned = replan(stored, num_ranks), True
    else:
        plan = in_force
    num_ranks = plan_num_ranks(plan) if num_ranks is None else num_ranks
    where = plan_path or (in_force_at if plan is in_force else out / PLAN_NAME)
    check_plan(plan, str(where), num_ranks, config.rl)
    check_generation(config, plan, str(out / CONFIG_NAME))
    check_async(config, plan, str(out / CONFIG_NAME))
    read_metrics(out)  # a damaged metrics file is refused here, before anything is written
    start_step = 0 if checkpoint is None else checkpoint_step(checkpoint)
    if start_step >= config.num_steps:
        raise ArgumentError(
            f"{out}: already ran {start_step} of {config.num_steps} steps; pass `num_steps` N (N > {start_step}) "
            "to go on",
            "num_steps",
        )
    calibration = resolve_calibration(config, out)
    switches = resolve_switches(config, out, plan, num_ranks, calibration)
    # A checkpoint loads into any layout: resume under the plan in force when it was taken.
    if checkpoint is not None and plan_path is None and not planned and (checkpoint / PLAN_NAME).is_file():
        plan = with_fusion(load_as(checkpoint / PLAN_NAME, Plan), config)
    ahead = tuple(switch for switch in switches if switch.step >= start_step)
    for switch in ahead:
        check_generation(config, switch.move.plan, f"{out / CONFIG_NAME}: plan_switches (step {switch.step})")
    trace = resolve_trace(config, out, plan, num_ranks)
    data = prepare_data(config, plan, out)
    if checkpoint is not None:
        check_data_state(checkpoint, data, start_step, plan.workload.prompts_per_step)
    schedule = plan_schedule(plan)
    return RunSetup(
        config,
        plan,
        num_ranks,
        out,
        start_step,
        checkpoint,
        planned,
        ahead,
        trace,
        calibration,
        damaged,
        data,
        schedule,
    )

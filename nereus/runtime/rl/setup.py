"""Everything `nereus run` settles before it spawns a rank: the config, the plan, the number
of ranks, the run folder and the step a resume starts from.

It imports no torch, so a bad config, a plan that does not fit `--nproc` or a run folder in
the way is refused in a fraction of a second with one line, before any process exists.

The run folder's layout and readers are `nereus.spec.run_folder`'s.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nereus.cost.calibration import Calibration
from nereus.errors import ArgumentError, NereusError
from nereus.runtime.hf.run_setup import HfSources, check_plan_models, hf_sources, plans_for_folder
from nereus.runtime.observe import timeline
from nereus.runtime.rl.datasets import file_sha256
from nereus.runtime.rl.run_data import REWARD_ERRORS_NAME, RunData, check_data_state, prepare_data
from nereus.solver.admission import check_config, check_plan, check_world, plan_num_ranks, plan_problems, with_fusion
from nereus.spec.cluster import Cluster
from nereus.spec.io import keep_json_lines, load_document, save_document, write_text_atomic
from nereus.spec.plan import Plan
from nereus.spec.run_config import RunConfig
from nereus.spec.run_folder import (
    CALIBRATION_NAME,
    CHECKPOINT_STATE_NAME,
    CHECKPOINTS_NAME,
    CONFIG_NAME,
    CONTROLLER_STATE_NAME,
    DAMAGED_NAME,
    DECISIONS_NAME,
    FAILURE_NAME,
    LEGACY_STATE_NAME,
    METRICS_NAME,
    PLAN_NAME,
    SAMPLES_NAME,
    TRACE_NAME,
    finished_checkpoints,
    read_metrics,
    switch_plan_name,
)
from nereus.spec.stages import Role
from nereus.spec.trace import Trace

#: The `format` and `version` of a run checkpoint's state file.
CHECKPOINT_FORMAT = "nereus-run-checkpoint"
CHECKPOINT_VERSION = 2


@dataclass(frozen=True)
class Move:
    """A plan change the ranks carry out before a step, the same on every rank."""

    action: str
    """`transition` (live, through the DAG) or `restart` (through a checkpoint)."""
    plan: Plan
    """The plan in force from then on."""
    primitives: list[Any]
    """The scheduled transition DAG (empty for a restart), built once by one process: every
    rank must walk the very same primitives."""
    schedule: Any
    """The DAG's schedule (`Schedule`; empty for a restart): the order the ranks walk."""
    predicted_s: float
    """The DAG's predicted makespan."""


@dataclass(frozen=True)
class Switch:
    """A checked `plan_switches` entry: before `step`, `move`."""

    step: int
    move: Move


@dataclass(frozen=True)
class RunSetup:
    """A run ready to spawn: what to run, on how many ranks, where, and from which step."""

    config: RunConfig
    """The effective config (`num_steps` as overridden by `--steps`)."""
    plan: Plan
    num_ranks: int
    out: Path
    """The run folder."""
    start_step: int
    """First step to run: 0, or the step of the checkpoint resumed from."""
    checkpoint: Path | None
    """The checkpoint folder a resume loads (None for a new run or one never checkpointed)."""
    planned: bool
    """True when the plan was made by the planner for `num_ranks` (a resume onto other ranks)."""
    switches: tuple[Switch, ...] = ()
    """Plan switches still ahead (from `start_step` on: a checkpoint holds the plan before them)."""
    trace: Trace | None = None
    """GPU-pool events for the online controller (None: no controller)."""
    calibration: Calibration | None = None
    """The cost model's starting calibration (None: the default one)."""
    damaged: tuple[Path, ...] = ()
    """Damaged checkpoints newer than `checkpoint`, moved aside before the run starts."""
    data: RunData | None = None
    """The run's tokenizer and encoded prompts (None: the character tokenizer and the task)."""


def _load(path: Path, kind: type[Any]) -> Any:
    document = load_document(path)
    if not isinstance(document, kind):
        raise NereusError(f"{path}: kind: expected {kind.__name__}, got {type(document).__name__}")
    return document


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
    config: RunConfig = _load(config_path, RunConfig)
    check_config(config, config_path)
    if trace_path is not None:
        config = config.model_copy(update={"trace": str(trace_path.resolve())})
    if policy is not None:
        config = config.model_copy(update={"policy": policy})
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
    data = prepare_data(config, plan, config_path.parent)
    if num_steps is not None:
        config = config.model_copy(update={"num_steps": num_steps})
    switches = resolve_switches(config, config_path.parent, plan, num_ranks)
    trace = resolve_trace(config, config_path.parent, plan, num_ranks)
    calibration = resolve_calibration(config, config_path.parent)
    out = out if out is not None else Path("runs") / f"{config_path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ArgumentError(f"{out}: already exists; resume it with `resume` or pass another `out`", "resume", "out")
    return RunSetup(config, plan, num_ranks, out, 0, None, planned, switches, trace, calibration, data=data)


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
    """The config's Hugging Face folders (relative to it), checked; None without `model:`."""
    folder = config_path.parent
    if config.model is None:
        extra = next((field for field in ("critic_model", "reward_model") if getattr(config, field)), None)
        if extra:
            raise NereusError(f"{config_path}: {extra}: needs model: (the actor's folder, which every role plays)")
        return None
    if config.reward_model is not None and config.rl.reward != "model":
        raise NereusError(f"{config_path}: reward_model: needs rl.reward: model (the rule needs no model)")
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
    plan = with_fusion(_load(where, Plan), config)
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
        return _load(folder / value, kind) if value.endswith((".yaml", ".yml", ".json")) else preset(value)

    workload = document(config.workload, Workload, lambda name: workload_preset(name, sources.model.name))
    cluster = document(config.cluster, Cluster, cluster_preset)
    plans = [with_fusion(plan, config) for plan in plans_for_folder(sources, workload, cluster, num_ranks)]
    problems = [plan_problems(plan, num_ranks, config.rl) for plan in plans]
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
    calibration: Calibration = _load(where, Calibration)
    return calibration


def resolve_trace(config: RunConfig, folder: Path, plan: Plan, num_ranks: int) -> Trace | None:
    """The controller's trace, checked against the plan and the ranks; the policy name checked."""
    from nereus.solver.policy import make_policy

    if config.trace is None:
        return None
    if config.plan_switches:
        raise NereusError("plan_switches and trace: give one; the controller decides plan changes itself")
    try:
        make_policy(config.policy, plan)
    except ValueError as error:
        raise NereusError(f"policy: {error}") from None
    where = folder / config.trace
    trace: Trace = _load(where, Trace)
    largest = max([trace.gpus, *(e.gpus for e in trace.events if e.gpus is not None)])
    if largest > num_ranks:
        raise NereusError(f"{where}: gpus: the pool reaches {largest} GPUs but the run has {num_ranks} ranks")
    if plan_num_ranks(plan) > trace.gpus:
        raise NereusError(f"{where}: gpus: starts with {trace.gpus} GPUs, the plan uses {plan_num_ranks(plan)}")
    return trace


def resolve_switches(config: RunConfig, folder: Path, first: Plan, num_ranks: int) -> tuple[Switch, ...]:
    """Load and check every plan switch and build its transition DAG from the plan before it."""
    from nereus.solver.transition.schedule import build_transition

    switches, previous = [], first
    for index, switch in enumerate(config.plan_switches):
        field = f"plan_switches.{index}"
        if switch.step >= config.num_steps:
            raise NereusError(f"{field}.step: {switch.step} is not before the run's last step ({config.num_steps - 1})")
        where = folder / switch.plan
        if not where.is_file():
            raise NereusError(f"{field}.plan: {where} does not exist; give the path of a Plan YAML")
        plan = with_fusion(_load(where, Plan), config)
        _check_same_work(plan, first, where)
        problems = plan_problems(plan, num_ranks, config.rl)
        if problems:
            raise NereusError(f"{where}: {problems[0]}")
        transition = build_transition(previous, plan)
        if not transition.feasible:
            cycle = " -> ".join(transition.blocking_cycle)
            raise NereusError(f"{field}: no safe transition order from the previous plan (blocking cycle {cycle})")
        switches.append(
            Switch(
                switch.step, Move("transition", plan, transition.primitives, transition.schedule, transition.makespan_s)
            )
        )
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
    config: RunConfig = _load(out / CONFIG_NAME, RunConfig)
    check_config(config, out / CONFIG_NAME)
    stored = with_fusion(_load(out / PLAN_NAME, Plan), config)
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
        in_force = with_fusion(_load(in_force_at, Plan), config)
    if plan_path is not None:
        plan = with_fusion(_load(plan_path, Plan), config)
        _check_same_work(plan, stored, plan_path)
    elif num_ranks is not None and num_ranks != plan_num_ranks(in_force):
        plan, planned = replan(stored, num_ranks), True
    else:
        plan = in_force
    num_ranks = plan_num_ranks(plan) if num_ranks is None else num_ranks
    where = plan_path or (in_force_at if plan is in_force else out / PLAN_NAME)
    check_plan(plan, str(where), num_ranks, config.rl)
    read_metrics(out)  # a damaged metrics file is refused here, before anything is written
    start_step = 0 if checkpoint is None else checkpoint_step(checkpoint)
    if start_step >= config.num_steps:
        raise ArgumentError(
            f"{out}: already ran {start_step} of {config.num_steps} steps; pass `num_steps` N (N > {start_step}) "
            "to go on",
            "num_steps",
        )
    switches = resolve_switches(config, out, plan, num_ranks)
    # A checkpoint loads into any layout: resume under the plan in force when it was taken.
    if checkpoint is not None and plan_path is None and not planned and (checkpoint / PLAN_NAME).is_file():
        plan = with_fusion(_load(checkpoint / PLAN_NAME, Plan), config)
    ahead = tuple(switch for switch in switches if switch.step >= start_step)
    trace = resolve_trace(config, out, plan, num_ranks)
    calibration = resolve_calibration(config, out)
    data = prepare_data(config, plan, out)
    if checkpoint is not None:
        check_data_state(checkpoint, data, start_step, plan.workload.prompts_per_step)
    return RunSetup(
        config, plan, num_ranks, out, start_step, checkpoint, planned, ahead, trace, calibration, damaged, data
    )


def _check_same_work(plan: Plan, stored: Plan, where: Path) -> None:
    """A resumed run keeps its models and workload: only the layouts may change."""
    if plan.models != stored.models:
        raise NereusError(f"{where}: models: differ from the run's; a resume may change layouts, not models")
    if plan.workload != stored.workload:
        old, new = stored.workload, plan.workload
        changed = [name for name in type(new).model_fields if getattr(new, name) != getattr(old, name)]
        raise NereusError(
            f"{where}: workload.{changed[0]}: differs from the run's; a resume may change layouts, not the workload"
        )


def replan(stored: Plan, num_ranks: int) -> Plan:
    """The planner's best plan for the stored plan's models and workload on `num_ranks` ranks."""
    from nereus.solver.layouts import RUNTIME_CHOICES
    from nereus.solver.plan_search import PlanRequest
    from nereus.solver.planner import make_plan

    cluster = stored.cluster.model_copy(update={"num_nodes": 1, "gpus_per_node": num_ranks})
    request = PlanRequest(cluster, tuple(stored.models), stored.workload, num_ranks, choices=RUNTIME_CHOICES)
    return make_plan(request).best.model_copy(update={"fusion": stored.fusion, "weights": stored.weights})


# ---- the run folder ----


def checkpoint_step(folder: Path) -> int:
    """The step a finished checkpoint was taken after (from its state file)."""
    state_path = folder / CHECKPOINT_STATE_NAME
    try:
        step = json.loads(state_path.read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise NereusError(f"{state_path}: unreadable ({error}); the checkpoint is damaged, delete {folder}") from None
    if not isinstance(step, int) or step < 0:
        raise NereusError(f"{state_path}: step: must be an integer >= 0, got {step!r}; delete {folder}")
    return step


class DamagedCheckpoint(ArgumentError):
    """The newest checkpoint fails its checks; `folder` and `problem` say which and why."""

    def __init__(self, folder: Path, problem: str) -> None:
        super().__init__(
            f"{problem}; refusing to resume from the damaged newest checkpoint {folder.name} "
            "(pass `from_previous` to continue from the newest valid one)",
            "from_previous",
        )
        self.folder = folder
        self.problem = problem


def seal_manifest(folder: Path, step: int) -> dict[str, Any]:
    """The state file of a run checkpoint about to be sealed: its step, the sha256 of every
    file beside it and the model checkpoints (sub-folders, which checksum their own shards)."""
    entries = sorted(folder.iterdir())
    files = {path.name: file_sha256(path) for path in entries if path.is_file() and path.name != CHECKPOINT_STATE_NAME}
    models = [path.name for path in entries if path.is_dir()]
    return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "step": step, "files": files, "models": models}


def checkpoint_problem(folder: Path) -> str | None:
    """Why the run checkpoint `folder` cannot be resumed from (None: it can): a pickle in it,
    a missing or unreadable state file, a missing file, a checksum that differs, a model
    checkpoint whose index or shards fail their checks, or a run state that fails its schema."""
    from nereus.runtime.rl.run_state import read_run_state
    from nereus.runtime.state.checkpoint import check_files

    legacy = folder / LEGACY_STATE_NAME
    if legacy.exists():
        return (
            f"{legacy}: a pickled run state (written by nereus before checkpoints were data); it is never "
            "loaded, since unpickling a file can run any code in it"
        )
    state_path = folder / CHECKPOINT_STATE_NAME
    try:
        manifest = json.loads(state_path.read_text())
    except (OSError, ValueError) as error:
        return f"{state_path}: unreadable ({error})"
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        return f"{state_path}: format: must be {CHECKPOINT_FORMAT!r} (a checkpoint of an older nereus, or edited)"
    files, models = manifest.get("files"), manifest.get("models")
    if not isinstance(files, dict) or not isinstance(models, list):
        return f"{state_path}: files and models: missing; the state file is damaged"
    for name, digest in sorted(files.items()):
        path = folder / str(name)
        if not path.is_file():
            return f"{path}: missing (the state file lists it)"
        if file_sha256(path) != digest:
            return f"{path}: sha256 differs from the one in {state_path.name}; the file is corrupted"
    for name in models:
        try:
            check_files(folder / str(name))
        except NereusError as error:
            return str(error)
    if CONTROLLER_STATE_NAME in files:
        try:
            read_run_state(folder / CONTROLLER_STATE_NAME)
        except NereusError as error:
            return str(error)
    return None


def resumable_checkpoint(out: Path, from_previous: bool) -> tuple[Path | None, tuple[Path, ...]]:
    """The checkpoint a resume starts from and the damaged newer ones it passes over (only
    with `from_previous`); DamagedCheckpoint when the newest is damaged and not `from_previous`."""
    damaged: list[Path] = []
    for folder in reversed(finished_checkpoints(out)):
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder, tuple(damaged)
        if not from_previous:
            raise DamagedCheckpoint(folder, problem)
        damaged.append(folder)
    if damaged:
        raise NereusError(f"{out}: no checkpoint is valid (the oldest: {checkpoint_problem(damaged[-1])})")
    return None, ()


def drop_decisions_from(out: Path, step: int) -> None:
    """Drop the controller's decisions before steps >= `step` (a resume decides them again)."""
    keep_json_lines(out / DECISIONS_NAME, lambda record: record["observation"]["step"] < step)


def prepare_folder(setup: RunSetup) -> None:
    """Write the config and plan, drop what a resume will redo (metrics of steps after the
    checkpoint, temporary folders of an interrupted save) and the previous failure log."""
    out = setup.out
    out.mkdir(parents=True, exist_ok=True)
    if setup.start_step == 0:  # a resume keeps the run's files as they are
        switches = [
            switch.model_copy(update={"plan": switch_plan_name(switch.step)}) for switch in setup.config.plan_switches
        ]
        for switch, checked in zip(switches, setup.switches, strict=True):
            save_document(checked.move.plan, out / switch.plan)
        trace = calibration = None
        if setup.trace is not None:
            trace = TRACE_NAME
            save_document(setup.trace, out / TRACE_NAME)
        if setup.calibration is not None:
            calibration = CALIBRATION_NAME
            save_document(setup.calibration, out / CALIBRATION_NAME)
        copies = {"plan": PLAN_NAME, "plan_switches": switches, "trace": trace, "calibration": calibration}
        config = setup.config.model_copy(update=copies)
        save_document(config, out / CONFIG_NAME)
        save_document(setup.plan, out / PLAN_NAME)
    else:
        save_document(setup.config, out / CONFIG_NAME)
        if not setup.config.plan_switches:
            save_document(setup.plan, out / PLAN_NAME)
    kept = [record for record in read_metrics(out) if record["step"] < setup.start_step]
    write_text_atomic(out / METRICS_NAME, "".join(json.dumps(record) + "\n" for record in kept))
    drop_decisions_from(out, setup.start_step)
    keep_json_lines(out / SAMPLES_NAME, lambda record: record["step"] < setup.start_step)
    keep_json_lines(out / REWARD_ERRORS_NAME, lambda record: record["step"] < setup.start_step)
    timeline.drop_steps_from(out, setup.start_step)
    root = out / CHECKPOINTS_NAME
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith("."):
                shutil.rmtree(path, ignore_errors=True)
    set_aside(setup.damaged, out / DAMAGED_NAME)
    (out / FAILURE_NAME).unlink(missing_ok=True)


def set_aside(folders: tuple[Path, ...], into: Path) -> None:
    """Move damaged checkpoints out of the checkpoints folder (a later save may take their step)."""
    for folder in folders:
        into.mkdir(exist_ok=True)
        target = into / folder.name
        suffix = 1
        while target.exists():
            target, suffix = into / f"{folder.name}.{suffix}", suffix + 1
        os.rename(folder, target)


# ---- a run that joins a torchrun job ----


def torchrun_worker() -> bool:
    """Whether this process is a worker of torchrun (or of another env:// launcher)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def torchrun_restart() -> int:
    """How many times torchrun's agent has restarted this job's workers (0: first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def torchrun_restarts_left() -> int:
    """How many more times torchrun's agent restarts this job's workers when they fail."""
    return max(0, int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - torchrun_restart())


def joined_setup(
    world_size: int,
    config_path: Path | None,
    plan_path: Path | None,
    num_steps: int | None,
    out: Path | None,
    resume: Path | None,
    trace_path: Path | None = None,
    policy: str | None = None,
    from_previous: bool = False,
) -> RunSetup:
    """The run a job of `world_size` ranks runs: a new run on exactly that many ranks, or a
    resume (replanned when the world differs from the run's). After torchrun restarted the
    workers (a node left or joined: an elastic pool), a new run in `out` resumes from its last
    checkpoint on the world it now has."""
    restarted = torchrun_restart() > 0 and out is not None and (out / CONFIG_NAME).is_file()
    if resume is None and out is None and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise ArgumentError("a job torchrun may restart must name its run folder: pass `out`", "out")
    if resume is not None or restarted:
        folder = resume if resume is not None else out
        assert folder is not None
        setup = resume_run(folder, plan_path, None if plan_path else world_size, num_steps, from_previous)
        where = str(plan_path or folder / PLAN_NAME)
    else:
        assert config_path is not None, "checked by the caller"
        ranks = world_size if plans_itself(config_path, plan_path) else None
        setup = new_run(config_path, plan_path, ranks, num_steps, out, trace_path, policy)
        where = str(plan_path or (config_path.parent / setup.config.plan if setup.config.plan else config_path))
    check_world(setup.plan, world_size, where)
    return setup


def log_pool_restart(setup: RunSetup, world_size: int, previous: int | None) -> None:
    """Record in decisions.jsonl that the pool changed under the run (torchrun restarted its
    workers) and what the run did: go on from its checkpoint, replanned for `world_size`."""
    event = {"step": setup.start_step, "event": "pool", "restart": torchrun_restart(), "gpus": world_size}
    action = "replan" if setup.planned else "restart"
    record = {
        "observation": {**event, "previous_gpus": previous},
        "decision": {"step": setup.start_step, "action": action, "transition_cost_s": None},
        "runtime": None,
        "checkpoint": None if setup.checkpoint is None else setup.checkpoint.name,
    }
    with (setup.out / DECISIONS_NAME).open("a") as handle:
        handle.write(json.dumps(record) + "\n")


def configured_timeout_s(config_path: Path | None, resume: Path | None) -> float:
    """The collective timeout a joined rank starts its process group with, read before the
    group exists (every rank reads the config itself); the default when the config cannot
    be read: rank 0 then reports what is wrong with it."""
    path = resume / CONFIG_NAME if resume is not None else config_path
    try:
        config = _load(Path(str(path)), RunConfig)
    except (NereusError, OSError):
        return float(RunConfig.model_fields["collective_timeout_s"].default)
    return float(config.collective_timeout_s)


def plans_itself(config_path: Path, plan_path: Path | None) -> bool:
    """Whether a new run of `config_path` plans its layout for its ranks (no plan given)."""
    config: RunConfig = _load(config_path, RunConfig)
    return plan_path is None and config.plan is None

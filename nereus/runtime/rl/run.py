"""`nereus run` as a library: the loop every rank runs, its checkpoints, and the launcher.

Each rank builds the plan's engines, restores the checkpoint a resume starts from (into the
current plan's layouts, whatever layouts saved it), then runs the steps. After each step rank
0 appends the step's record to metrics.jsonl (flushed; made durable by the next checkpoint);
every `checkpoint_every` steps all ranks save the trained models into one checkpoint folder,
atomically. Per-step seeds depend only on (seed, step), so a run resumed from a checkpoint
repeats, bitwise, the steps an uninterrupted run takes after it (same plan and ranks).

The launcher spawns the ranks and reports each finished step to a callback by reading
metrics.jsonl as it grows: what the user sees is what is on disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nereus.cost.calibration import Calibration
from nereus.errors import ArgumentError, NereusError
from nereus.runtime.comm import arena, collectives, shm
from nereus.runtime.comm.heartbeat import (
    GUARD_GRACE_S,
    HEARTBEAT_S,
    Heartbeat,
    describe_unresponsive,
    exit_without_teardown,
    kill_unresponsive_sibling,
)
from nereus.runtime.comm.spawn import spawn, timed_out
from nereus.runtime.comm.world import Peer, device, init_from_env
from nereus.runtime.hf.load import load_engine
from nereus.runtime.observe import memory, timeline
from nereus.runtime.rl.controller import Controller, Predictor, prediction_fields
from nereus.runtime.rl.evaluation import eval_due, evaluate
from nereus.runtime.rl.optimization import with_decay_horizon
from nereus.runtime.rl.reward_model import fit_reward_model
from nereus.runtime.rl.run_data import (
    DATA_STATE_NAME,
    REWARD_ERRORS_NAME,
    append_reward_errors,
    data_state,
    step_inputs,
)
from nereus.runtime.rl.run_state import RunStateData, read_run_state
from nereus.runtime.rl.samples import append_samples
from nereus.runtime.rl.setup import (
    Move,
    RunSetup,
    Switch,
    log_pool_restart,
    prepare_folder,
    seal_manifest,
    torchrun_restart,
    torchrun_restarts_left,
)
from nereus.runtime.rl.stages import ModelStageRuntime, build_stages, engine_state
from nereus.runtime.rl.step import rl_step
from nereus.runtime.rl.tasks import get_task
from nereus.runtime.rl.tensorboard import TensorBoardLog
from nereus.runtime.rl.timing import slowest_rank
from nereus.runtime.rl.update import sync_plans, sync_weights
from nereus.runtime.rl.warm_start import warm_start
from nereus.runtime.state.checkpoint import fsync_path, load_checkpoint, save_checkpoint_distributed
from nereus.runtime.state.sharded_state import gather
from nereus.runtime.state.transition_executor import ReplicaState, execute_transition
from nereus.solver.admission import plan_num_ranks, state_bytes_by_rank
from nereus.spec.io import load_document, save_document, write_text_atomic
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig
from nereus.spec.run_folder import (
    CHECKPOINT_STATE_NAME,
    CHECKPOINTS_NAME,
    CONTROLLER_STATE_NAME,
    FAILURE_NAME,
    METRICS_NAME,
    PLAN_NAME,
    SAMPLES_NAME,
    WORLD_NAME,
    MetricsTail,
    StepMetrics,
    checkpoint_folder,
    finished_checkpoints,
    latest_checkpoint,
)
from nereus.spec.trace import trace_conditions

#: Model-stages whose state (`state_families`) a checkpoint holds: the trained models and the
#: fitted reward model. The others are rebuilt from these (generation and inference by weight
#: sync) or from the init seed (the reference, which never trains).
SAVED_STAGES = ("actor/training", "critic/training", "reward/inference")


def saved_stages(config: RLConfig) -> tuple[str, ...]:
    """`SAVED_STAGES`, and the reference after a supervised warm-start (its weights are the
    warmed-up actor's, which neither the seed nor a folder gives back)."""
    return (*SAVED_STAGES, "reference/inference") if config.sft_steps else SAVED_STAGES


def state_families(model_stage: str, updated: bool = True) -> tuple[str, ...]:
    """What a model-stage's state is between steps: parameters, and AdamW moments in training
    once it has updated (AdamW creates them at the first update; gradients are dropped:
    every step starts from zero gradients)."""
    return ("param", "exp_avg", "exp_avg_sq") if model_stage.endswith("/training") and updated else ("param",)


@dataclass
class RunState:
    """What rank 0 carries from step to step besides the models: the online-calibrated
    predictor, the controller (runs with a trace) and which plan is in force. Saved as JSON
    (RunStateData) into every checkpoint, so a resume predicts and decides as the
    uninterrupted run would."""

    predictor: Predictor
    controller: Controller | None
    plan_index: int = 0

    def data(self) -> RunStateData:
        """The state as the checkpoint's JSON document."""
        controller = self.controller.state() if self.controller is not None else None
        return RunStateData(predictor=self.predictor.state(), controller=controller, plan_index=self.plan_index)

    def calibrate_idle(self) -> None:
        """The deferred online update, while this rank waits for others' generation."""
        if self.predictor.pending is not None:
            with timeline.span("controller", "calibrate (idle)"):
                self.predictor.flush()


def run_rank(rank: int, world_size: int, setup: RunSetup) -> int:
    """The whole run on this rank; returns the number of steps the run has finished."""
    config, plan = setup.config, setup.plan
    torch.manual_seed(config.rl.seed)
    peaks = memory.PeakTracker.for_device(device().type, arena.used_bytes)  # the idle baseline, before any state
    reserve_arena(plan, config.rl, rank)
    stages = build_stages(plan, config.rl)
    syncs = sync_plans(stages)
    load_folders(stages, plan)
    if "reward/inference" in stages and setup.checkpoint is None and "reward" not in (plan.weights or {}):
        fit_reward_model(stages["reward/inference"], get_task(config.rl.task), config.rl)
    if setup.checkpoint is not None:
        restore(stages, setup.checkpoint, rank, config.rl)
        sync_weights(syncs)  # generation and inference engines get the restored weights
    switches = {switch.step: switch for switch in setup.switches}
    state = run_state(setup, plan) if rank == 0 else None
    lengths = step_lengths(setup)
    rl_config = with_decay_horizon(config.rl, config.num_steps)
    inputs = step_inputs(config.rl, setup.data)
    with timeline.recording(timeline.Timeline(setup.out, rank)) as spans:
        if setup.checkpoint is None and config.rl.sft_steps:
            spans.step = 0
            warm_start(stages, config.rl, get_task(config.rl.task), syncs)
        for step in range(setup.start_step, config.num_steps):
            spans.step = step
            start = time.perf_counter()
            move = next_move(setup, state, switches, step)
            if move is not None:
                with timeline.span("transition", move.action, predicted_s=move.predicted_s) as late:
                    stages = apply_move(setup, stages, plan, move, step, rank, state)
                    late["num_primitives"] = len(move.primitives)
                syncs, plan = sync_plans(stages), move.plan
                moved_s = slowest_rank({move.action: time.perf_counter() - start}, [move.action])
            rl = rl_config if lengths is None else rl_config.model_copy(update={"max_new_tokens": lengths[step]})
            samples: list[dict[str, Any]] | None = [] if rank == 0 and rl.log_samples else None
            idle = None if state is None else state.calibrate_idle
            metrics = rl_step(plan, rl, stages, syncs, step, idle=idle, samples=samples, inputs=inputs, peaks=peaks)
            if eval_due(inputs, step, config.num_steps):
                metrics = dataclasses.replace(metrics, eval_reward=evaluate(stages, inputs, rl))
            if samples:
                append_samples(setup.out / SAMPLES_NAME, samples)
            if rank == 0:
                append_reward_errors(setup.out / REWARD_ERRORS_NAME, step, inputs.scorer)
            if move is not None:
                metrics = dataclasses.replace(metrics, stage_seconds={**metrics.stage_seconds, **moved_s})
            if state is not None:
                with timeline.span("controller", "predict + calibrate"):
                    state.predictor.flush()  # the last step's update, if generation left no idle time
                    # A process's first step pays one-off warm-up costs: not a sample of the plan.
                    metrics = measured(state, plan, metrics, move is not None, learn=step > setup.start_step)
                append_metrics(setup.out / METRICS_NAME, metrics)
            done = step + 1
            if done % config.checkpoint_every == 0 or done == config.num_steps:
                with timeline.span("checkpoint", f"step-{done:06d}"):
                    save_run_checkpoint(setup, plan, stages, done, rank, state)
            spans.flush()
    return config.num_steps


def reserve_arena(plan: Plan, config: RLConfig, rank: int) -> None:
    """On CPU ranks, keep engine state in a state arena that the other ranks map (collective):
    transitions and weight syncs then read each moved piece straight out of its holder.
    Room for twice the state the plan puts on the rank (a transition holds both layouts);
    it grows if a later plan needs more."""
    if device().type != "cpu" or not arena.supported():
        return  # pieces are then staged (CPU) or sent by NCCL (GPU)
    if arena.current() is None:
        arena.reserve(max(2 * state_bytes_by_rank(plan, config).get(rank, 0), 1 << 20))
    arena.connect()


def run_state(setup: RunSetup, plan: Plan) -> RunState:
    """Rank 0's predictor and controller: from the checkpoint a resume starts at, else new."""
    calibration = setup.calibration if setup.calibration is not None else Calibration()
    predictor = Predictor(calibration, setup.config.online_calibration, setup.config.rl)
    controller = None
    if setup.trace is not None:
        config = setup.config
        controller = Controller(
            plan, setup.trace, config.policy, setup.out, config.rl, config.num_steps, setup.num_ranks, calibration
        )
    saved = setup.checkpoint / CONTROLLER_STATE_NAME if setup.checkpoint is not None else None
    if saved is None or not saved.is_file():
        return RunState(predictor, controller)
    data = read_run_state(saved)
    if (data.controller is None) != (controller is None):
        raise NereusError(f"{saved}: controller: saved by a run {'without' if controller else 'with'} a trace")
    try:
        predictor = Predictor.from_state(data.predictor, setup.config.rl, lambda record: StepMetrics(**record))
        if controller is not None and data.controller is not None:
            controller.restore(data.controller)
            controller.resumed(plan, setup.out)
    except (TypeError, ValueError) as error:
        raise NereusError(f"{saved}: {error}; the run state does not fit this run") from None
    return RunState(predictor, controller, data.plan_index)


def step_lengths(setup: RunSetup) -> list[int] | None:
    """Each step's longest response under `lengths_from_trace` (None: rl.max_new_tokens)."""
    if not setup.config.lengths_from_trace:
        return None
    assert setup.trace is not None, "checked by new_run"
    conditions = list(trace_conditions(setup.trace))
    return [conditions[min(step, len(conditions) - 1)].response_len.max for step in range(setup.config.num_steps)]


def measured(state: RunState, plan: Plan, metrics: StepMetrics, moved: bool, learn: bool) -> StepMetrics:
    """The step's record with its prediction; then (if `learn`) the step goes into the
    calibration, or is queued for rank 0's idle time in the next step when the plan gives
    rank 0 no part in generation; the controller takes in the step."""
    state.plan_index += int(moved)
    predicted = state.predictor.predict(plan, metrics.prompt_len, metrics.response_len_max)
    metrics = dataclasses.replace(metrics, **prediction_fields(predicted), plan_index=state.plan_index)
    if learn:
        if 0 in plan.stage_plan("actor/generation").gpus:
            state.predictor.update(plan, metrics)
        else:  # rank 0 will idle in the next step's generation
            state.predictor.defer(plan, metrics)
    if state.controller is not None:
        state.controller.measured(metrics, state.predictor.calibration)
    return metrics


def next_move(setup: RunSetup, state: RunState | None, switches: dict[int, Switch], step: int) -> Move | None:
    """The plan change before `step`, the same on every rank (collective when a controller runs)."""
    if step in switches:
        return switches[step].move
    if setup.trace is None:
        return None
    decided: list[Any] = [None]
    if state is not None:
        assert state.controller is not None
        with timeline.span("controller", "decide"):
            decided[0] = state.controller.decide(step)
    collectives.broadcast_object_list(decided, 0)
    move: Move | None = decided[0]
    return move


def load_folders(stages: dict[str, ModelStageRuntime], plan: Plan) -> None:
    """Read every role's Hugging Face folder (`plan.weights`) into its engines on this rank.
    Before a checkpoint restore too: a checkpoint holds the trained models, not the
    reference, which must come back from its folder rather than from the seed."""
    for stage in stages.values():
        if stage.engine is not None and stage.plan.role in (plan.weights or {}):
            load_engine(stage.engine, Path((plan.weights or {})[stage.plan.role]))


def apply_move(
    setup: RunSetup,
    stages: dict[str, ModelStageRuntime],
    plan: Plan,
    move: Move,
    step: int,
    rank: int,
    state: RunState | None,
) -> dict[str, ModelStageRuntime]:
    """Carry out a plan change: live through its transition DAG, or through a checkpoint."""
    if move.action == "transition":
        return switch_plan(stages, plan, move, setup.config.rl, rank, step > 0, setup.config.verify_transitions)
    folder = checkpoint_folder(setup.out, step)
    if not folder.exists():
        save_run_checkpoint(setup, plan, stages, step, rank, state)
    new_stages = build_stages(move.plan, setup.config.rl)
    load_folders(new_stages, move.plan)
    restore(new_stages, folder, rank, setup.config.rl)
    sync_weights(sync_plans(new_stages))
    return new_stages


def switch_plan(
    stages: dict[str, ModelStageRuntime],
    plan: Plan,
    switch: Move,
    config: RLConfig,
    rank: int,
    updated: bool = True,
    verify: bool = False,
) -> dict[str, ModelStageRuntime]:
    """Build the new plan's engines and move every model-stage's state into them through the
    switch's transition DAG (collective); the old engines are dropped. `updated`: the trained
    models have taken an optimizer step (they have AdamW moments). With `verify`, the logical
    state before and after is compared bitwise (a mismatch stops the run)."""
    with timeline.span("transition", "build engines and groups"):
        new_stages = build_stages(switch.plan, config)
    families = {name: state_families(name, updated) for name in stages}
    before = logical_digests(stages, families) if verify else {}
    states: dict[str, ReplicaState] = {}
    for name, stage in stages.items():
        if stage.engine is not None:
            states[name] = (stage.engine.whole_state(families[name]), stage.engine.optimizer_step)
    moved = execute_transition(switch.primitives, switch.schedule, plan, switch.plan, rank, states, families)
    shm.release_segments()  # a one-off move: do not keep its shared-memory staging mapped
    for name, stage in new_stages.items():
        if stage.engine is not None:
            tensors, step = moved.states[name]
            assert step is not None, name
            stage.engine.load_local_state(tensors, step)
    if verify:
        with timeline.span("transition", "verify state") as late:
            after = logical_digests(new_stages, families)
            changed = sorted(name for name in before if before[name] != after.get(name))
            late.update(state_sha256=after, equal=not changed)
        if changed:
            raise RuntimeError(f"the transition changed the logical state of {', '.join(changed)}")
    return new_stages


def cpu_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: tensor.detach().cpu() for key, tensor in tensors.items()}


def logical_digests(stages: dict[str, ModelStageRuntime], families: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """sha256 of every model-stage's logical state and optimizer step, assembled on rank 0
    from every rank's shards (collective; other ranks get {}). Replicas must agree bitwise."""
    mine = {
        name: (cpu_copies(engine_state(stage.engine, families[name])), stage.engine.optimizer_step)
        for name, stage in stages.items()
        if stage.engine is not None and name in families
    }
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    collectives.gather_object(mine, parts if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return {}
    digests = {}
    for name, stage in stages.items():
        if name not in families:
            continue
        meta = stage.meta(families[name])
        logical = gather(meta, {rank: parts[rank][name][0] for rank in meta.boxes})
        digest = hashlib.sha256(repr(sorted({parts[rank][name][1] for rank in meta.boxes})).encode())
        for key in sorted(logical):
            digest.update(key.encode())
            digest.update(logical[key].contiguous().numpy().tobytes())
        digests[name] = digest.hexdigest()
    return digests


def append_metrics(path: Path, metrics: StepMetrics) -> None:
    """One JSON line, flushed (the launcher and a killed run see it); a checkpoint makes the
    lines before it durable (`save_run_checkpoint`), and a resume redoes the steps after it,
    so a per-step fsync would buy nothing."""
    with path.open("a") as handle:
        handle.write(json.dumps(dataclasses.asdict(metrics)) + "\n")
        handle.flush()


def optimizer_steps(plan: Plan, num_rl_steps: int) -> int:
    """AdamW steps each trained model has taken after `num_rl_steps` RL steps."""
    return num_rl_steps * plan.workload.mini_batches * plan.workload.ppo_epochs


def save_run_checkpoint(
    setup: RunSetup, plan: Plan, stages: dict[str, ModelStageRuntime], step: int, rank: int, state: RunState | None
) -> None:
    """Save every trained model, the plan in force and rank 0's run state into
    checkpoints/step-NNNNNN (collective, atomic)."""
    root = setup.out / CHECKPOINTS_NAME
    shared: list[Any] = [None]
    if rank == 0:
        root.mkdir(exist_ok=True)
        shared[0] = tempfile.mkdtemp(prefix=f".step-{step:06d}.tmp-", dir=root)
    collectives.broadcast_object_list(shared, 0)
    folder = Path(shared[0])
    for name in saved_stages(setup.config.rl):
        if name not in stages:
            continue
        stage, families = stages[name], state_families(name, step > 0)
        # Every rank passes the same step to the index: the AdamW steps the model has taken.
        num_optimizer_steps = optimizer_steps(plan, step)
        if stage.plan.role == "reward":  # fitted before the run, or read from a folder as it is
            num_optimizer_steps = 0 if "reward" in (plan.weights or {}) else setup.config.rl.reward_model_steps
        if stage.plan.role == "reference":  # the warm-start's weights; RL starts a fresh optimizer
            num_optimizer_steps = 0
        meta = stage.meta(families)
        tensors = {}
        if stage.engine is not None:
            assert stage.engine.optimizer_step == num_optimizer_steps, (name, stage.engine.optimizer_step, step)
            tensors = engine_state(stage.engine, families)
        save_checkpoint_distributed(folder / stage.plan.role, meta, rank, tensors, num_optimizer_steps)
    if rank == 0:
        save_document(plan, folder / PLAN_NAME)
        position = None if setup.data is None else data_state(setup.data, step, plan.workload.prompts_per_step)
        if position is not None:  # where the next step starts in the dataset, checked on resume
            write_text_atomic(folder / DATA_STATE_NAME, position)
        if state is not None:
            write_text_atomic(folder / CONTROLLER_STATE_NAME, state.data().model_dump_json())
        if (setup.out / METRICS_NAME).exists():  # the steps' records are on disk before their checkpoint
            fsync_path(setup.out / METRICS_NAME)
        _seal(folder, checkpoint_folder(setup.out, step), step)
        for old in finished_checkpoints(setup.out)[: -setup.config.keep_checkpoints]:
            # Out of the checkpoints' names first: an interrupted delete leaves no half checkpoint.
            hidden = old.with_name(f".deleting-{old.name}")
            os.rename(old, hidden)
            shutil.rmtree(hidden)
    collectives.barrier()


def _seal(folder: Path, target: Path, step: int) -> None:
    """Write the state file (the step and every file's checksum), make everything durable,
    and rename the folder into place."""
    write_text_atomic(folder / CHECKPOINT_STATE_NAME, json.dumps(seal_manifest(folder, step), indent=1))
    fsync_path(folder)
    os.rename(folder, target)
    fsync_path(target.parent)


def restore(stages: dict[str, ModelStageRuntime], checkpoint: Path, rank: int, config: RLConfig) -> None:
    """Load every saved model's state from `checkpoint` into this rank's shard of it."""
    for name in saved_stages(config):
        stage = stages.get(name)
        if stage is None or stage.engine is None:
            continue
        loaded = load_checkpoint(checkpoint / stage.plan.role, stage.layout, rank, stage.model, stage.head)
        stage.engine.load_local_state(loaded.tensors, loaded.step)


class RunFailed(ArgumentError):
    """A rank failed; the message says which, where the full error is, and how to resume."""


class RunInterrupted(RunFailed):
    """The run was interrupted (SIGINT, Ctrl-C); exits with the shell's 128 + SIGINT."""

    exit_code = 130


def launch(setup: RunSetup, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
    """Prepare the run folder, spawn the ranks, run to `num_steps`; returns the steps run now.

    `on_step` gets each step's metrics as soon as it is on disk. A failing rank stops every
    rank within seconds; RunFailed then names it and the checkpoint to resume from.
    """
    board = TensorBoardLog(setup.out) if setup.config.log.tensorboard else None
    prepare_folder(setup)
    tail = MetricsTail(setup.out, on_step if board is None else _both(board, on_step))
    timeout = timedelta(seconds=setup.config.collective_timeout_s)
    try:
        spawn(run_rank, setup.num_ranks, setup, on_wait=tail.poll, timeout=timeout)
    except KeyboardInterrupt:
        raise _failed(setup, "interrupted (SIGINT)", RunInterrupted) from None
    except RuntimeError as error:
        # Ctrl-C reaches the ranks too: a rank may report it before the launcher does.
        kind = RunInterrupted if "KeyboardInterrupt" in str(error).splitlines()[0] else RunFailed
        raise _failed(setup, str(error), kind) from None
    finally:
        if board is not None:
            board.close()
    return tail.records


def _both(
    first: Callable[[StepMetrics], None], then: Callable[[StepMetrics], None] | None
) -> Callable[[StepMetrics], None]:
    def call(metrics: StepMetrics) -> None:
        first(metrics)
        if then is not None:
            then(metrics)

    return call


def _failed(setup: RunSetup, error: str, kind: type[RunFailed], restarting: bool = False) -> RunFailed:
    """Write the failure log; the error naming the cause, the log and the checkpoint to resume
    from (or, when torchrun's agent is `restarting` the workers, the one they resume from)."""
    failure_log = setup.out / FAILURE_NAME
    failure_log.write_text(error + "\n")
    checkpoint = latest_checkpoint(setup.out)
    if restarting:
        resume = restart_note(checkpoint)
    elif checkpoint is not None:
        resume = f"resume from {checkpoint.name} with `resume` {setup.out}"
    else:
        resume = "no checkpoint was taken yet"
    named = ("resume",) if checkpoint is not None and not restarting else ()
    what = "interrupted" if kind is RunInterrupted else "failed"
    return kind(f"run {what}: {error.splitlines()[0]} (full error in {failure_log}); {resume}", *named)


# ---- a worker of a torchrun job ----


@dataclass
class JoinedJob:
    """This process as one rank of a job torchrun started: the job's world is the run's world
    (global rank = the plan's GPU id; torchrun numbers ranks node by node). Global rank 0
    does what `launch` does for spawned ranks (check, plan, run folder, metrics, checkpoint
    commits, controller) besides running its own rank."""

    peers: list[Peer]
    heartbeat: Heartbeat
    timeout_s: float

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return len(self.peers)

    def agree(self, make_setup: Callable[[int], RunSetup]) -> RunSetup:
        """Rank 0 checks and prepares the run for the job's world size; every rank gets the same
        setup, or raises the same error. Refused when a node cannot see the run folder."""
        payload: list[Any] = [None]
        if self.rank == 0:
            try:
                setup = make_setup(self.world_size)
                checkpoint = None if setup.checkpoint is None else setup.checkpoint.resolve()
                setup = dataclasses.replace(setup, out=setup.out.resolve(), checkpoint=checkpoint)
                stored = setup.out / PLAN_NAME
                document = load_document(stored) if stored.is_file() else None
                previous = plan_num_ranks(document) if isinstance(document, Plan) else None
                prepare_folder(setup)
                world = [dataclasses.asdict(peer) for peer in self.peers]
                write_text_atomic(setup.out / WORLD_NAME, json.dumps(world, indent=1))
                if torchrun_restart() > 0:
                    log_pool_restart(setup, self.world_size, previous)
                marker = setup.out / f".job-{os.getpid()}-{time.time_ns()}"
                marker.write_text("seen by every rank?\n")
                payload[0] = (setup, marker.name)
            except NereusError as error:
                payload[0] = portable_error(error)
            self.heartbeat.announce("setup")
        else:
            self.heartbeat.wait_for("setup", 0, "the run's setup")
        collectives.broadcast_object_list(payload, 0)
        if isinstance(payload[0], NereusError):
            raise payload[0]
        setup, marker_name = payload[0]
        seen: list[Any] = [None] * self.world_size
        collectives.all_gather_object(seen, (setup.out / marker_name).is_file())
        if self.rank == 0:
            (setup.out / marker_name).unlink()
        blind = sorted({self.peers[rank].node for rank, ok in enumerate(seen) if not ok})
        if blind:
            raise NereusError(
                f"{setup.out}: the run folder is not visible from node {', '.join(blind)}; put it on storage "
                "every node mounts at the same path (a shared filesystem)"
            )
        return setup

    def run(self, setup: RunSetup, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        """Run this rank to `num_steps`; rank 0 hands each step on disk to `on_step`. A failure
        anywhere raises RunFailed on every surviving rank, naming the rank (and node) at fault."""
        import threading

        tail = MetricsTail(setup.out, on_step) if self.rank == 0 else None
        done = threading.Event()

        def follow() -> None:
            while tail is not None and not done.wait(0.2):
                tail.poll()

        follower = threading.Thread(target=follow, name="nereus-metrics", daemon=True)
        follower.start()
        try:
            run_rank(self.rank, self.world_size, setup)
            collectives.barrier()  # no rank tears its communicator down while a peer may still send on it
        except Exception as error:
            failure = self.failed(setup, error)
            exit_without_teardown(getattr(failure, "exit_code", 1))
            raise failure from None
        finally:
            done.set()
            follower.join()
        if tail is not None:
            tail.poll()
        self.heartbeat.close()
        dist.destroy_process_group()
        return [] if tail is None else tail.records

    def failed(self, setup: RunSetup, error: BaseException) -> RunFailed:
        """The error every rank reports: the ranks that stopped responding, when some did (they
        are the cause, the others only waited for them), else this rank's own error."""
        global _reporting
        _reporting = True  # the launcher's SIGTERM must not cut the report short (it waits 30 s)
        quiet = self.heartbeat.silences()  # read now: `unresponsive` waits a few beats first
        silent = self.heartbeat.unresponsive()
        for peer in silent:
            kill_unresponsive_sibling(peer)
        mine = self.peers[self.rank].describe()
        if silent:
            cause = "; ".join(describe_unresponsive(peer) for peer in silent)
            cause += f"; {self.what_the_wait_came_to(error, [quiet.get(peer.rank) for peer in silent])}"
        else:
            cause = f"{mine}: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        cause = self.heartbeat.verdict(cause)
        restarting = torchrun_restarts_left() > 0
        if self.rank == 0:
            return _failed(setup, f"{cause}\n\n{mine}: {type(error).__name__}: {error}", RunFailed, restarting)
        then = f"; {restart_note(latest_checkpoint(setup.out))}" if restarting else ""
        return RunFailed(f"run failed: {cause} (seen from {mine}){then}")

    def what_the_wait_came_to(self, error: BaseException, quiet: list[float | None]) -> str:
        """Why this rank stopped waiting for the silent ranks: its collective timed out, or they
        were gone first. `quiet`: how long each had been silent when this rank failed (None:
        unknown, this rank did not watch). A rank's guard kills it after the timeout plus
        GUARD_GRACE_S without a heartbeat, which can come first when the others reached the
        collective late."""
        if timed_out(str(error)):
            return f"the others waited {self.timeout_s:g} s"
        guard_s, before = self.timeout_s + GUARD_GRACE_S, f"before the others' {self.timeout_s:g} s timeout"
        known = [seconds for seconds in quiet if seconds is not None]
        if known and min(known) >= guard_s - 2 * HEARTBEAT_S:
            return f"killed by its guard after {guard_s:g} s without a heartbeat, {before}"
        if known:
            return f"gone {max(known):.1f} s after its last heartbeat, {before}"
        return f"gone {before}"


def restart_note(checkpoint: Path | None) -> str:
    """What comes next when torchrun's agent restarts the failed workers (restarts remain)."""
    where = checkpoint.name if checkpoint is not None else "the start (no checkpoint was taken yet)"
    restart, left = torchrun_restart(), torchrun_restarts_left()
    return (
        f"torchrun's agent restarts the workers (restart {restart + 1} of {restart + left}); "
        f"they resume from {where} on their own"
    )


class LauncherStopped(NereusError):
    """torchrun's agent stopped this rank (SIGTERM): the job is ending (another node failed,
    or the user stopped it) or restarting (a node left or joined an elastic pool)."""


#: Set once this rank reports a failure: a SIGTERM then waits for the report to be written.
_reporting = False


def _on_sigterm(signum: int, frame: Any) -> None:
    """Turn the agent's SIGTERM into an error the rank reports like any other (naming the ranks
    that went silent, when some did) instead of dying mid-step with nothing said."""
    if not _reporting:
        raise LauncherStopped("stopped by its torchrun agent (SIGTERM)")


def join_job(timeout_s: float) -> JoinedJob:
    """Join the torchrun job this process is a worker of (collective over the whole job)."""
    import signal

    signal.signal(signal.SIGTERM, _on_sigterm)
    peers = init_from_env(timedelta(seconds=timeout_s))
    return JoinedJob(peers, Heartbeat(peers, timeout_s, watch=dist.get_rank() == 0), timeout_s)


def portable_error(error: NereusError) -> NereusError:
    """`error` as a plain NereusError (ArgumentError keeps the arguments it names), so it
    survives being sent to the other ranks whatever its subclass's constructor takes."""
    if isinstance(error, ArgumentError):
        return ArgumentError(str(error), *error.arguments)
    return NereusError(str(error))

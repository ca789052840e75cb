"""The loop every rank of a `nereus run` runs (`run_rank`), and the plan changes it makes.

Each rank builds the plan's engines, restores the checkpoint a resume starts from (into the
current plan's layouts, whatever layouts saved it), then runs the steps. After each step rank
0 appends the step's record to metrics.jsonl (flushed; made durable by the next checkpoint);
every `checkpoint_every` steps all ranks save the trained models into one checkpoint folder,
atomically (`checkpoints`). Per-step seeds depend only on (seed, step), so a run resumed from
a checkpoint repeats, bitwise, the steps an uninterrupted run takes after it (same plan and
ranks). A plan change moves every model-stage's state live through the transition DAG the
setup built (verified bitwise on request), or through a checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nereus.cost.calibration import Calibration
from nereus.cost.fit import STEP_KEY
from nereus.errors import NereusError
from nereus.runtime.comm import arena, collectives, shm
from nereus.runtime.comm.world import device
from nereus.runtime.generation.engine_choice import generation_engine
from nereus.runtime.generation.vllm_engine import VLLMEngine
from nereus.runtime.hf.load import load_engine
from nereus.runtime.observe import memory, timeline
from nereus.runtime.rl.evaluation import eval_due, evaluate
from nereus.runtime.rl.optimization import with_decay_horizon
from nereus.runtime.rl.reward_model import fit_reward_model
from nereus.runtime.rl.rewards import Scorer
from nereus.runtime.rl.rollout import start_rollout_engine
from nereus.runtime.rl.run_data import REWARD_ERRORS_NAME, append_reward_errors, step_inputs
from nereus.runtime.rl.samples import append_samples
from nereus.runtime.rl.stages import ModelStageRuntime, build_stages, engine_state
from nereus.runtime.rl.step import plan_peaks, rl_step
from nereus.runtime.rl.tasks import get_task
from nereus.runtime.rl.timing import slowest_rank
from nereus.runtime.rl.update import WeightSync, sync_plans, sync_weights
from nereus.runtime.rl.warm_start import warm_start
from nereus.runtime.run.checkpoints import restore, save_run_checkpoint, state_families
from nereus.runtime.run.controller import Controller, Predictor
from nereus.runtime.run.folder import append_json_line, log_plan_switch
from nereus.runtime.run.hold import hold_before
from nereus.runtime.run.plans import plan_schedule
from nereus.runtime.run.run_setup import Move, RunSetup, Switch
from nereus.runtime.run.run_state import RunStateData, read_run_state
from nereus.runtime.state.sharded_state import gather
from nereus.runtime.state.transition_executor import ReplicaState, execute_transition
from nereus.solver.admission import state_bytes_by_rank
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig, RunConfig
from nereus.spec.run_folder import CONTROLLER_STATE_NAME, METRICS_NAME, SAMPLES_NAME, StepMetrics, checkpoint_folder
from nereus.spec.schedule import Schedule
from nereus.spec.stages import ACTOR_GENERATION, REWARD_INFERENCE
from nereus.spec.trace import trace_conditions


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
    """The whole run on this rank; returns the number of steps the run has finished (a
    synchronous plan: `rank_entry.rank_main` runs an async plan's loop instead)."""
    config, plan = setup.config, setup.plan
    tracker, stages, syncs, rollout_engine = prepare_rank(rank, setup, partial(start_rollout_engine, config, plan))
    switches = {switch.step: switch for switch in setup.switches}
    state = run_state(setup, plan) if rank == 0 else None
    lengths = step_lengths(setup)
    rl_config = with_decay_horizon(config.rl, config.num_steps)
    inputs = step_inputs(config.rl, setup.data)
    schedule = in_force_schedule(plan, setup.fused_schedule)
    peaks = plan_peaks(plan, stages)
    with timeline.recording(timeline.Timeline(setup.out, rank)) as spans:
        if setup.checkpoint is None and config.rl.sft_steps:
            spans.step = 0
            warm_start(stages, config.rl, get_task(config.rl.task), syncs)
        for step in range(setup.start_step, config.num_steps):
            hold_before(step, rank)
            spans.step = step
            start = time.perf_counter()
            move = next_move(setup, state, switches, step)
            if move is not None:
                with timeline.span("transition", move.action, predicted_s=move.predicted_s) as late:
                    stages = apply_move(setup, stages, plan, move, step, rank, state)
                    late["num_primitives"] = len(move.primitives)
                before, syncs = plan, sync_plans(stages)
                plan, schedule = move.plan, in_force_schedule(move.plan, move.fused_schedule)
                if rollout_engine is not None:  # the new layout's vLLM engines, loaded with the moved weights
                    rollout_engine = carry_rollout_engine(rollout_engine, config, before, plan, stages, syncs)
                peaks = plan_peaks(plan, stages)
                moved_s = slowest_rank({move.action: time.perf_counter() - start}, [move.action])
                if rank == 0 and step in switches:  # a configured switch: no controller decided it
                    log_plan_switch(setup.out, step, move, "vllm" if rollout_engine else "nereus", moved_s[move.action])
                elif state is not None and state.controller is not None:
                    state.controller.moved(moved_s[move.action])
            rl = rl_config if lengths is None else rl_config.model_copy(update={"max_new_tokens": lengths[step]})
            idle = None if state is None else state.calibrate_idle
            result = rl_step(
                plan,
                rl,
                stages,
                syncs,
                step,
                idle=idle,
                inputs=inputs,
                schedule=schedule,
                predicted=peaks,
                peaks=tracker,
            )
            metrics = result.metrics
            if eval_due(inputs, step, config.num_steps):
                metrics = dataclasses.replace(metrics, eval_reward=evaluate(stages, inputs, rl))
            if move is not None:
                metrics = dataclasses.replace(metrics, stage_seconds={**metrics.stage_seconds, **moved_s})
            if state is not None:
                record_step(setup, state, plan, metrics, result.samples, inputs.scorer, move is not None)
            done = step + 1
            if done % config.checkpoint_every == 0 or done == config.num_steps:
                with timeline.span("checkpoint", f"step-{done:06d}"):
                    save_run_checkpoint(setup, plan, stages, done, rank, state)
            spans.flush()
    if rollout_engine is not None:
        rollout_engine.close()
    return config.num_steps


def prepare_rank(
    rank: int, setup: RunSetup, start_engine: Callable[[dict[str, ModelStageRuntime]], VLLMEngine | None]
) -> tuple[memory.PeakTracker, dict[str, ModelStageRuntime], list[WeightSync], VLLMEngine | None]:
    """This rank before its first step (collective): the memory tracker (its idle baseline),
    the arena, the plan's engines with their folders' weights (or a resume's checkpoint's), the
    fitted reward model, the weight syncs and `start_engine`'s vLLM engine (None: nereus's own)."""
    config, plan = setup.config, setup.plan
    torch.manual_seed(config.rl.seed)
    # What a step imports on first use belongs to the idle rank, not to a model-stage: DTensor
    # and FSDP2's modules, and torch._dynamo, which activation checkpointing imports on its
    # first call and FSDP2's `fully_shard` on its first (its hooks are wrapped in
    # `torch._dynamo.disable`; each ~33-45 MB of a CPU rank's private memory in Python objects).
    # Tensor parallelism makes no DTensor (`tensor_parallel`'s meetings are plain all-reduces),
    # so tp > 1 alone imports no torch._dynamo.
    dynamo = any(entry.recompute != "none" or entry.full_shard for entry in plan.stages)
    for module in ("torch.distributed.fsdp", "torch.distributed.tensor", *(["torch._dynamo"] if dynamo else [])):
        importlib.import_module(module)

    # the idle baseline, before any state
    tracker = memory.PeakTracker.for_device(device().type, arena.used_bytes, config.memory_baseline == "step")
    reserve_arena(plan, config.rl, rank)
    stages = build_stages(plan, config.rl)
    syncs = sync_plans(stages)
    load_folders(stages, plan)
    if REWARD_INFERENCE in stages and setup.checkpoint is None and "reward" not in (plan.weights or {}):
        fit_reward_model(stages[REWARD_INFERENCE], get_task(config.rl.task), config.rl)
    engine = start_engine(stages)
    if setup.checkpoint is not None:
        restore(stages, setup.checkpoint, rank, config.rl)
    if setup.checkpoint is not None or engine is not None:
        sync_weights(syncs)  # generation and inference engines get the restored (or the folder's) weights
    return tracker, stages, syncs, engine


def carry_rollout_engine(
    engine: VLLMEngine,
    config: RunConfig,
    before: Plan,
    plan: Plan,
    stages: dict[str, ModelStageRuntime],
    syncs: list[WeightSync],
) -> VLLMEngine | None:
    """This rank's vLLM engine after a plan change from `before` to `plan` (the same on every
    rank): kept, attached to the new stages, when actor/generation's layout is unchanged (the
    move kept its weights, and the transition DAG prices no engine for it); otherwise every
    engine closes and the new plan's starts (vLLM's external launcher builds its groups anew
    over the whole world) and gets the moved weights (collective)."""
    old, new = before.stage_plan(ACTOR_GENERATION), plan.stage_plan(ACTOR_GENERATION)
    if (old.tp, old.pp, old.emus) == (new.tp, new.pp, new.emus):
        stage = stages[ACTOR_GENERATION]
        assert stage.engine is not None
        engine.tp_group = stage.engine.groups.tp.group  # the new stages' group over the same ranks
        stage.rollout_engine = engine
        return engine
    with timeline.span("transition", "restart vLLM engines"):
        engine.close()
        started = start_rollout_engine(config, plan, stages)
        if started is not None:
            sync_weights(syncs)
        return started


def in_force_schedule(plan: Plan, carried: Schedule | None) -> Schedule | None:
    """The fused schedule `plan` trains under: the one the setup or the move carried, searched
    once; a setup or move made by hand carries none, and this rank then searches it, once."""
    return carried if carried is not None else plan_schedule(plan)


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
        engine = generation_engine(config, plan, device().type == "cuda")
        controller = Controller(
            plan,
            setup.trace,
            config.policy,
            setup.out,
            config.rl,
            config.num_steps,
            setup.num_ranks,
            calibration,
            engine,
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
    stages = {name: seconds for name, seconds in predicted.items() if name != STEP_KEY}
    metrics = dataclasses.replace(
        metrics, predicted_step_seconds=predicted[STEP_KEY], predicted_stage_seconds=stages, plan_index=state.plan_index
    )
    if learn:
        if 0 in plan.stage_plan(ACTOR_GENERATION).gpus:
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
    decided = None
    if state is not None:
        assert state.controller is not None
        with timeline.span("controller", "decide"):
            decided = state.controller.decide(step)
    return collectives.broadcast_object(decided, 0)


def load_folders(stages: dict[str, ModelStageRuntime], plan: Plan) -> None:
    """Read every role's Hugging Face folder (`plan.weights`) into its engines on this rank.
    Before a checkpoint restore too: a checkpoint holds the trained models, not the
    reference, which must come back from its folder rather than from the seed."""
    for stage in stages.values():
        if stage.engine is not None and stage.plan.role in (plan.weights or {}):
            load_engine(stage.engine, Path((plan.weights or {})[stage.plan.role]))


def record_step(
    setup: RunSetup,
    state: RunState,
    plan: Plan,
    metrics: StepMetrics,
    samples: list[dict[str, Any]],
    scorer: Scorer,
    moved: bool,
) -> None:
    """Rank 0 after a step: its samples and reward errors, then its prediction and calibration
    (`measured`), and its record appended to metrics.jsonl, flushed (the launcher and a killed
    run see it); a checkpoint makes the lines before it durable (`save_run_checkpoint`), and a
    resume redoes the steps after it, so a per-step fsync would buy nothing."""
    if samples:
        append_samples(setup.out / SAMPLES_NAME, samples)
    append_reward_errors(setup.out / REWARD_ERRORS_NAME, metrics.step, scorer)
    with timeline.span("controller", "predict + calibrate"):
        state.predictor.flush()  # the last step's update, if generation left no idle time
        # A process's first step pays one-off warm-up costs: not a sample of the plan.
        metrics = measured(state, plan, metrics, moved, learn=metrics.step > setup.start_step)
    append_json_line(setup.out / METRICS_NAME, dataclasses.asdict(metrics))


# ---- plan changes ----


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
    moved = execute_transition(switch.primitives, switch.transition_schedule, plan, switch.plan, rank, states, families)
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


def logical_digests(stages: dict[str, ModelStageRuntime], families: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """sha256 of every model-stage's logical state and optimizer step, assembled on rank 0
    from every rank's shards (collective; other ranks get {}). Replicas must agree bitwise."""
    mine = {
        name: (
            {key: tensor.detach().cpu() for key, tensor in engine_state(stage.engine, families[name]).items()},
            stage.engine.optimizer_step,
        )
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

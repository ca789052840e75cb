"""A run's checkpoints and the one manager of their life: where they live, what one holds,
and how it is saved, sealed, pruned, verified and restored.

checkpoints/step-NNNNNN holds, after that many steps: every checkpointed model's state
(`stages.checkpointed_stages`, a `nereus.runtime.state.checkpoint` folder per role), the
plan in force, the dataset position (data.json), rank 0's run state (controller.json) and
the manifest, state.json: the step and the sha256 of every file beside it. A save writes
into a temporary folder, seals it (manifest, fsync) and renames it into place, then prunes
the oldest; a resume verifies the newest (`checkpoint_problem`) before any rank exists and
every rank then restores its shard of each model, into whatever layout the plan gives it.

The checks import no torch (the launcher runs them); saving and restoring do, inside.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nereus.errors import ArgumentError, NereusError
from nereus.runtime.rl.datasets import file_sha256
from nereus.spec.io import save_document, write_text_atomic
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig
from nereus.spec.run_folder import (
    CHECKPOINT_STATE_NAME,
    CHECKPOINTS_NAME,
    CONTROLLER_STATE_NAME,
    LEGACY_STATE_NAME,
    METRICS_NAME,
    PLAN_NAME,
    checkpoint_folder,
    finished_checkpoints,
)
from nereus.spec.stages import checkpointed_stages, is_trained

if TYPE_CHECKING:
    from nereus.runtime.rl.stages import ModelStageRuntime
    from nereus.runtime.run.rank_loop import RunState
    from nereus.runtime.run.run_setup import RunSetup

#: The `format` and `version` of a run checkpoint's state file.
CHECKPOINT_FORMAT = "nereus-run-checkpoint"
CHECKPOINT_VERSION = 2


def state_families(model_stage: str, updated: bool = True) -> tuple[str, ...]:
    """What a model-stage's state is between steps: parameters, and AdamW moments in training
    once it has updated (AdamW creates them at the first update; gradients are dropped:
    every step starts from zero gradients)."""
    return ("param", "exp_avg", "exp_avg_sq") if is_trained(model_stage) and updated else ("param",)


# ---- save, seal, prune ----


def save_run_checkpoint(
    setup: RunSetup,
    plan: Plan,
    stages: dict[str, ModelStageRuntime],
    step: int,
    rank: int,
    state: RunState | None,
    extra: Callable[[Path], None] | None = None,
) -> None:
    """Save every trained model, the plan in force and rank 0's run state into
    checkpoints/step-NNNNNN (collective, atomic); then drop the oldest beyond `keep_checkpoints`.
    `extra`: rank 0 writes more files into the folder before it is sealed (an async run's
    queue), checksummed like the rest."""
    from nereus.runtime.comm import collectives
    from nereus.runtime.rl.run_data import DATA_STATE_NAME, data_state
    from nereus.runtime.rl.stages import engine_state
    from nereus.runtime.state.checkpoint import fsync_path, save_checkpoint_distributed

    root = setup.out / CHECKPOINTS_NAME
    made = None
    if rank == 0:
        root.mkdir(exist_ok=True)
        made = tempfile.mkdtemp(prefix=f".step-{step:06d}.tmp-", dir=root)
    folder = Path(collectives.broadcast_object(made, 0))
    for name in checkpointed_stages(bool(setup.config.rl.sft_steps)):
        if name not in stages:
            continue
        stage, families = stages[name], state_families(name, step > 0)
        # Every rank passes the same step to the index: the AdamW steps the model has taken.
        num_optimizer_steps = step * plan.workload.mini_batches * plan.workload.ppo_epochs
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
        if extra is not None:
            extra(folder)
        if (setup.out / METRICS_NAME).exists():  # the steps' records are on disk before their checkpoint
            fsync_path(setup.out / METRICS_NAME)
        _seal(folder, checkpoint_folder(setup.out, step), step)
        prune(setup.out, setup.config.keep_checkpoints)
    collectives.barrier()


def _seal(folder: Path, target: Path, step: int) -> None:
    """Write the state file (the step and every file's checksum), make everything durable,
    and rename the folder into place."""
    from nereus.runtime.state.checkpoint import fsync_path

    write_text_atomic(folder / CHECKPOINT_STATE_NAME, json.dumps(seal_manifest(folder, step), indent=1))
    fsync_path(folder)
    os.rename(folder, target)
    fsync_path(target.parent)


def seal_manifest(folder: Path, step: int) -> dict[str, Any]:
    """The state file of a run checkpoint about to be sealed: its step, the sha256 of every
    file beside it and the model checkpoints (sub-folders, which checksum their own shards)."""
    entries = sorted(folder.iterdir())
    files = {path.name: file_sha256(path) for path in entries if path.is_file() and path.name != CHECKPOINT_STATE_NAME}
    models = [path.name for path in entries if path.is_dir()]
    return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "step": step, "files": files, "models": models}


def prune(out: Path, keep: int) -> None:
    """Delete all but the newest `keep` finished checkpoints of the run folder `out`."""
    for old in finished_checkpoints(out)[:-keep]:
        # Out of the checkpoints' names first: an interrupted delete leaves no half checkpoint.
        hidden = old.with_name(f".deleting-{old.name}")
        os.rename(old, hidden)
        shutil.rmtree(hidden)


# ---- verify ----


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


def checkpoint_problem(folder: Path) -> str | None:
    """Why the run checkpoint `folder` cannot be resumed from (None: it can): a pickle in it,
    a missing or unreadable state file, a missing file, a checksum that differs, a model
    checkpoint whose index or shards fail their checks, or a run state that fails its schema."""
    from nereus.runtime.run.run_state import read_run_state
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


# ---- restore ----


def restore(stages: dict[str, ModelStageRuntime], checkpoint: Path, rank: int, config: RLConfig) -> None:
    """Load every saved model's state from `checkpoint` into this rank's shard of it."""
    from nereus.runtime.state.checkpoint import load_checkpoint

    for name in checkpointed_stages(bool(config.sft_steps)):
        stage = stages.get(name)
        if stage is None or stage.engine is None:
            continue
        loaded = load_checkpoint(checkpoint / stage.plan.role, stage.layout, rank, stage.model, stage.head)
        stage.engine.load_local_state(loaded.tensors, loaded.step)

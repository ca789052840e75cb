"""A run that joins a torchrun job (or another env:// launcher): whether this process is a
worker, how often its agent restarted the workers, and the run the job's world runs. Torch-
free, like `resolve`: global rank 0 resolves the run before the ranks agree on it
(`joined_job.JoinedJob.agree`).
"""

from __future__ import annotations

import os
from pathlib import Path

from nereus.errors import ArgumentError, NereusError
from nereus.runtime.run.plans import load_as
from nereus.runtime.run.resolve import new_run, resume_run
from nereus.runtime.run.run_setup import RunSetup
from nereus.solver.admission import check_world
from nereus.spec.run_config import RunConfig
from nereus.spec.run_folder import CONFIG_NAME, PLAN_NAME


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
        config: RunConfig = load_as(config_path, RunConfig)
        ranks = world_size if plan_path is None and config.plan is None else None  # the run plans itself
        setup = new_run(config_path, plan_path, ranks, num_steps, out, trace_path, policy)
        where = str(plan_path or (config_path.parent / setup.config.plan if setup.config.plan else config_path))
    check_world(setup.plan, world_size, where)
    return setup


def configured_timeout_s(config_path: Path | None, resume: Path | None) -> float:
    """The collective timeout a joined rank starts its process group with, read before the
    group exists (every rank reads the config itself); the default when the config cannot
    be read: rank 0 then reports what is wrong with it."""
    path = resume / CONFIG_NAME if resume is not None else config_path
    try:
        config = load_as(Path(str(path)), RunConfig)
    except (NereusError, OSError):
        return float(RunConfig.model_fields["collective_timeout_s"].default)
    return float(config.collective_timeout_s)


def restart_note(checkpoint: Path | None) -> str:
    """What comes next when torchrun's agent restarts the failed workers (restarts remain)."""
    where = checkpoint.name if checkpoint is not None else "the start (no checkpoint was taken yet)"
    restart, left = torchrun_restart(), torchrun_restarts_left()
    return (
        f"torchrun's agent restarts the workers (restart {restart + 1} of {restart + left}); "
        f"they resume from {where} on their own"
    )

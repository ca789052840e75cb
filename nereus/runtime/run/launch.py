"""The spawn launcher of `nereus run`: prepare the run folder, spawn the ranks, follow the
steps as they land in metrics.jsonl (what the user sees is what is on disk), and turn a
failed or interrupted run into one error naming the cause, the full log and the checkpoint
to resume from.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from nereus.errors import ArgumentError
from nereus.runtime.comm.spawn import spawn
from nereus.runtime.rl.tensorboard import TensorBoardLog
from nereus.runtime.run.folder import prepare_folder
from nereus.runtime.run.rank_entry import rank_main
from nereus.runtime.run.run_setup import RunSetup
from nereus.runtime.run.torchrun import restart_note
from nereus.spec.run_folder import FAILURE_NAME, MetricsTail, StepMetrics, latest_checkpoint


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
        spawn(rank_main, setup.num_ranks, setup, on_wait=tail.poll, timeout=timeout)
    except KeyboardInterrupt:
        raise run_failure(setup, "interrupted (SIGINT)", RunInterrupted) from None
    except RuntimeError as error:
        # Ctrl-C reaches the ranks too: a rank may report it before the launcher does.
        kind = RunInterrupted if "KeyboardInterrupt" in str(error).splitlines()[0] else RunFailed
        raise run_failure(setup, str(error), kind) from None
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


def run_failure(setup: RunSetup, error: str, kind: type[RunFailed], restarting: bool = False) -> RunFailed:
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

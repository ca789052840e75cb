"""This process as one rank of a torchrun job: joining it, agreeing with the other ranks on
the run (global rank 0 resolves and prepares it), running its rank, and, when anything
fails, diagnosing who is at fault (ranks that went silent, or this rank's own error) and
turning the agent's SIGTERM into a report rather than a silent death.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from nereus.errors import ArgumentError, NereusError
from nereus.runtime.comm import collectives
from nereus.runtime.comm.heartbeat import (
    GUARD_GRACE_S,
    HEARTBEAT_S,
    Heartbeat,
    describe_unresponsive,
    exit_without_teardown,
    kill_unresponsive_sibling,
)
from nereus.runtime.comm.spawn import timed_out
from nereus.runtime.comm.world import Peer, init_from_env
from nereus.runtime.run.folder import log_pool_restart, prepare_folder
from nereus.runtime.run.launch import RunFailed, run_failure
from nereus.runtime.run.rank_entry import rank_main
from nereus.runtime.run.run_setup import RunSetup
from nereus.runtime.run.torchrun import restart_note, torchrun_restart, torchrun_restarts_left
from nereus.solver.admission import plan_num_ranks
from nereus.spec.io import load_document, write_text_atomic
from nereus.spec.plan import Plan
from nereus.spec.run_folder import PLAN_NAME, WORLD_NAME, MetricsTail, StepMetrics, latest_checkpoint


@dataclass
class JoinedJob:
    """This process as one rank of a job torchrun started: the job's world is the run's world
    (global rank = the plan's GPU id; torchrun numbers ranks node by node). Global rank 0
    does what `launch` does for spawned ranks (check, plan, run folder, metrics, checkpoint
    commits, controller) besides running its own rank."""

    peers: list[Peer]
    heartbeat: Heartbeat
    timeout_s: float
    sigterm: OnSigterm
    """The SIGTERM handler `join_job` installed (told when this rank reports a failure)."""

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return len(self.peers)

    def agree(self, make_setup: Callable[[int], RunSetup]) -> RunSetup:
        """Rank 0 checks and prepares the run for the job's world size; every rank gets the same
        setup, or raises the same error. Refused when a node cannot see the run folder."""
        payload: Any = None
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
                payload = (setup, marker.name)
            except NereusError as error:
                payload = portable_error(error)
            self.heartbeat.announce("setup")
        else:
            self.heartbeat.wait_for("setup", 0, "the run's setup")
        payload = collectives.broadcast_object(payload, 0)
        if isinstance(payload, NereusError):
            raise payload
        setup, marker_name = payload
        seen = collectives.all_gathered_objects((setup.out / marker_name).is_file())
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
            rank_main(self.rank, self.world_size, setup)
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
        self.sigterm.reporting = True  # the launcher's SIGTERM must not cut the report short (it waits 30 s)
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
            return run_failure(setup, f"{cause}\n\n{mine}: {type(error).__name__}: {error}", RunFailed, restarting)
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


class LauncherStopped(NereusError):
    """torchrun's agent stopped this rank (SIGTERM): the job is ending (another node failed,
    or the user stopped it) or restarting (a node left or joined an elastic pool)."""


@dataclass
class OnSigterm:
    """This rank's SIGTERM handler: turns the agent's SIGTERM into an error the rank reports
    like any other (naming the ranks that went silent, when some did) instead of dying
    mid-step with nothing said; once the rank is `reporting` a failure, a SIGTERM waits for
    the report to be written."""

    reporting: bool = False
    """Set once this rank reports a failure."""

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.reporting:
            raise LauncherStopped("stopped by its torchrun agent (SIGTERM)")


def join_job(timeout_s: float) -> JoinedJob:
    """Join the torchrun job this process is a worker of (collective over the whole job)."""
    import signal

    sigterm = OnSigterm()
    signal.signal(signal.SIGTERM, sigterm)
    peers = init_from_env(timedelta(seconds=timeout_s))
    return JoinedJob(peers, Heartbeat(peers, timeout_s, watch=dist.get_rank() == 0), timeout_s, sigterm)


def portable_error(error: NereusError) -> NereusError:
    """`error` as a plain NereusError (ArgumentError keeps the arguments it names), so it
    survives being sent to the other ranks whatever its subclass's constructor takes."""
    if isinstance(error, ArgumentError):
        return ArgumentError(str(error), *error.arguments)
    return NereusError(str(error))

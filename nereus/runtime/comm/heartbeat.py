"""Liveness of a joined job's ranks: each rank's heartbeat (a counter in the launcher's store and
a byte to its guard process), naming the rank the others waited for, and ending a stopped or
hung one so that its launcher ends the job."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nereus.errors import NereusError
from nereus.runtime.comm.world import Peer, attempt_store, node_name

#: How often a joined rank's heartbeat thread beats, in seconds.
HEARTBEAT_S = 0.5
#: A rank whose counter has not moved for this long is taken as stopped or dead, in seconds.
SILENT_S = 4 * HEARTBEAT_S
#: How much longer than the collective timeout a rank's guard waits for a heartbeat before
#: it kills the rank: the other ranks time out and name it first, the guard then ends it.
GUARD_GRACE_S = 5.0


class Heartbeat:
    """A joined rank's sign of life: a thread bumps this rank's counter in the launcher's
    key-value store (torchrun's agent store, which outlives a stuck worker) and writes a byte
    to this rank's guard (`nereus.runtime.comm.guard`) every HEARTBEAT_S. A stopped process
    (SIGSTOP) or a dead one stops beating: when a collective times out, the survivors read
    the counters to name the rank they waited for (`unresponsive`), and the stopped rank's
    guard kills it `GUARD_GRACE_S` after the timeout so that its agent ends the job.

    Rank 0, which reports a failure to the user, also watches every rank's counter each beat
    (`last_moved`): it can name the silent rank even after the store has gone (the store's
    host node may be the one that failed)."""

    def __init__(self, peers: list[Peer], timeout_s: float, watch: bool) -> None:
        self.peers = peers
        """Every rank of the job, by global rank (`world.init_from_env`)."""
        self.timeout_s = timeout_s
        self.guard, self.beats = start_guard(timeout_s + GUARD_GRACE_S)
        self.store = attempt_store(timedelta(seconds=5), wait_for_workers=False)
        self.store_lost = False
        self.watched = [peer.rank for peer in self.peers if peer.rank != dist.get_rank()] if watch else []
        now = time.monotonic()
        self.last_moved: dict[int, tuple[int, float]] = {rank: (-1, now) for rank in self.watched}
        self.last_read = now
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="nereus-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        key = f"beat/{dist.get_rank()}"
        while not self.stop.is_set():
            with suppress(OSError):  # a full pipe: the guard is behind, not the rank
                os.write(self.beats, b".")
            if not self.store_lost:
                try:
                    self.store.add(key, 1)
                    self._watch()
                except Exception:  # the store's host went away (its node ended): the guard still hears us
                    self.store_lost = True
            self.stop.wait(HEARTBEAT_S)

    def _watch(self) -> None:
        """Note when each watched rank's counter last moved."""
        counts = {rank: self.store.add(f"beat/{rank}", 0) for rank in self.watched}
        now = time.monotonic()
        for rank, count in counts.items():
            if count != self.last_moved[rank][0]:
                self.last_moved[rank] = (count, now)
        self.last_read = now

    def counts(self, ranks: list[int]) -> dict[int, int] | None:
        """Every rank's counter now (None: the store cannot be reached)."""
        try:
            return {rank: self.store.add(f"beat/{rank}", 0) for rank in ranks}
        except Exception:
            return None

    def unresponsive(self) -> list[Peer]:
        """The other ranks whose counters did not move over a few heartbeats (stopped or dead);
        a watching rank judges by what it saw last while the store could still be read."""
        if self.watched:
            if not self.store_lost:
                time.sleep(SILENT_S)  # a rank stopped a moment ago must show as silent too
            return [self.peers[r] for r, (_, moved) in self.last_moved.items() if self.last_read - moved >= SILENT_S]
        others = [peer.rank for peer in self.peers if peer.rank != dist.get_rank()]
        before = self.counts(others)
        time.sleep(SILENT_S)
        after = self.counts(others)
        if before is None or after is None:
            return []
        return [self.peers[rank] for rank in others if after[rank] == before[rank]]

    def silences(self) -> dict[int, float]:
        """Seconds since each watched rank's counter last moved (empty: this rank does not watch)."""
        now = time.monotonic()
        return {rank: now - moved for rank, (_, moved) in self.last_moved.items()}

    def announce(self, key: str) -> None:
        """Tell every rank waiting in `wait_for` that `key` happened."""
        self.store.set(key, "1")

    def wait_for(self, key: str, rank: int, what: str) -> None:
        """Wait, however long it takes, until `rank` announces `key` (e.g. rank 0's setup,
        which may plan for minutes: longer than any collective may wait); raise NereusError
        when `rank` stops beating first."""
        last, still = -1, 0
        while True:
            try:
                self.store.wait([key], timedelta(seconds=SILENT_S))
                return
            except Exception:  # not yet: is `rank` still alive?
                counts = self.counts([rank])
                beat = -1 if counts is None else counts[rank]
                still = still + 1 if beat == last else 0
                last = beat
            if still >= 2:
                raise NereusError(f"{self.peers[rank].describe()} stopped responding during {what}")

    def verdict(self, mine: str) -> str:
        """The job's one account of a failure: the first rank to offer one sets it, and every
        later rank gets that one back (so ranks that looked at different moments agree);
        `mine` when the store cannot be reached."""
        if self.store_lost:
            return mine
        try:
            agreed = self.store.compare_set("verdict", "", mine)
        except Exception:
            return mine
        return agreed.decode() if isinstance(agreed, bytes) else str(agreed)

    def close(self) -> None:
        """Stop beating and let the guard go (it exits when the pipe closes)."""
        self.stop.set()
        self.thread.join(timeout=2 * HEARTBEAT_S)
        with suppress(OSError):
            os.close(self.beats)
        with suppress(Exception):
            self.guard.wait(timeout=5)


def exit_without_teardown(code: int) -> None:
    """Once the interpreter exits, leave with `code` before the process group's native
    teardown runs: a failed job's group may still have a collective in flight towards a dead
    or stopped peer, and destroying its worker thread aborts the process (SIGABRT)."""

    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    atexit.register(leave)


def start_guard(silence_s: float) -> tuple[Any, int]:
    """Start this rank's guard (`nereus.runtime.comm.guard`); returns it and the pipe end to beat on."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    label = f"rank {dist.get_rank()} (node {node_name()}, pid {os.getpid()})"
    command = [
        sys.executable,
        "-m",
        "nereus.runtime.comm.guard",
        str(os.getpid()),
        str(read_end),
        str(silence_s),
        label,
    ]
    # its own session: a signal to the rank's process group (Ctrl-Z, SIGSTOP) does not stop the guard
    guard = subprocess.Popen(command, pass_fds=(read_end,), start_new_session=True, stdin=subprocess.DEVNULL)
    os.close(read_end)
    return guard, write_end


def describe_unresponsive(peer: Peer) -> str:
    """What became of an unresponsive peer, as far as this rank can see it."""
    here = peer.node == node_name() and _sibling(peer.pid)
    if here and stopped_by_signal(peer.pid):
        return f"{peer.describe()}: stopped by a signal (SIGSTOP) and did not respond"
    if here or peer.node == node_name():
        return f"{peer.describe()}: {'hung (alive, not responding)' if here else 'died'}"
    return f"{peer.describe()}: stopped responding (dead, stopped or hung)"


def kill_unresponsive_sibling(peer: Peer) -> None:
    """SIGKILL a stopped or hung rank started by this rank's own launcher (same node, same
    parent): the launcher's clean-up would otherwise wait for it (a stopped process ignores
    SIGTERM) and the job would outlive the collective timeout by the launcher's grace period."""
    if peer.node == node_name() and _sibling(peer.pid):
        with suppress(ProcessLookupError):
            os.kill(peer.pid, signal.SIGKILL)


def _sibling(pid: int) -> bool:
    """Whether `pid` is alive and a child of this process's parent (another worker of the same agent)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] != "Z" and int(fields[1]) == os.getppid()


def stopped_by_signal(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, or traced)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] in ("T", "t")

"""Devices, backends and process launch: the one module that chooses gloo or NCCL.

`spawn` starts N local ranks that meet through a file in a temporary folder (no port
races between parallel tests); `init_from_env` joins a job started by torchrun. Either
way the rest of the runtime sees an initialised default process group.

`spawn(huge_pages=True)` starts the ranks with torch's allocator putting large CPU tensors
on transparent huge pages (it reads THP_MEM_ALLOC_ENABLE once, before its first
allocation, so the variable goes into the ranks' environment at launch; under torchrun,
set it in the job's environment). It is off by default because it is faster only for
memory the process freed moments ago: on the VM this was measured on, a 400 MB tensor on
recycled huge pages filled in 0.07 s against 0.3 s on 4 KiB pages, but on never-used
memory in 1.7 s against 0.26 s (the hypervisor's free-page reporting hands back free 2 MiB
blocks, so a huge-page fault there is a cold host fault). A value of the variable already
in the environment is always passed on unchanged.

Ranks also start with glibc's non-temporal threshold lowered to 1 MiB (STREAMING_COPY_TUNABLE),
so `shm.copy_bulk` (resharding's staging and local copies) streams its stores past the
cache: the copied state is not read again soon, and a cached store first reads the line
it overwrites. A GLIBC_TUNABLES already in the environment is passed on unchanged (add the
setting to it to keep the speed-up); under torchrun, set it in the job's environment.
Their numpy BLAS gets as many threads as their torch ops (BLAS_THREADS_ENV, unless set), so
two one-thread ranks on two cores really use one core each.
"""

from __future__ import annotations

import itertools
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from nereus.errors import NereusError
from nereus.runtime.comm import shm
from nereus.spec.io import write_bytes_atomic

#: How long a collective may wait before the job is declared hung.
DEFAULT_TIMEOUT = timedelta(seconds=120)
#: The timeout this process's collectives run under (`spawn` sets its ranks').
_collective_timeout = DEFAULT_TIMEOUT


def collective_timeout() -> timedelta:
    """How long a collective of this process may wait for its peers."""
    return _collective_timeout


#: torch's CPU allocator reads this once: "1" advises every allocation of 2 MiB or more
#: MADV_HUGEPAGE (honoured when the kernel's THP mode is "madvise" or "always"; a no-op
#: under "never").
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"

#: glibc reads its tunables once, at start-up: memcpy/memmove of at least 1 MiB use
#: non-temporal (cache-bypassing) stores in the ranks (x86-64 glibc; ignored elsewhere).
TUNABLES_ENV = "GLIBC_TUNABLES"
STREAMING_COPY_TUNABLE = "glibc.cpu.x86_non_temporal_threshold=0x100000"

#: numpy's OpenBLAS reads this once, at import: a rank's BLAS calls (the online calibration's
#: least squares) use as many threads as its torch ops, not a pool sized for the whole host
#: whose spinning workers take the other ranks' cores.
BLAS_THREADS_ENV = "OPENBLAS_NUM_THREADS"


def backend() -> str:
    """NCCL when CUDA is present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    """This rank's device: its local GPU (one rank per GPU), or the CPU."""
    if torch.cuda.is_available():
        local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= count:
            raise NereusError(
                f"local rank {local_rank} has no GPU of its own: this node has {count} GPUs; start at most "
                f"{count} ranks per node (one rank per GPU)"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def node_name() -> str:
    """This rank's node, as messages name it: `shm.NODE_ENV` when set, else the host name."""
    import socket

    return os.environ.get(shm.NODE_ENV) or socket.gethostname()


@dataclass(frozen=True)
class Peer:
    """One rank of a joined job, as every rank sees it (gathered at start)."""

    rank: int
    local_rank: int
    node: str
    pid: int
    memory_domain: str
    """A short digest of `shm.host_token`: ranks with equal digests share memory (same node)."""

    def describe(self) -> str:
        return f"rank {self.rank} (node {self.node}, pid {self.pid})"


#: The ranks of the job this process joined (`init_from_env`), by global rank.
_peers: list[Peer] = []


def peers() -> list[Peer]:
    """Every rank of the joined job, by global rank (empty for `spawn`'s ranks)."""
    return list(_peers)


def init_from_env(timeout: timedelta = DEFAULT_TIMEOUT) -> list[Peer]:
    """Join the job torchrun (or any env:// launcher) started; returns every rank's `Peer`.

    Collectives wait at most `timeout`. On CUDA each rank takes the GPU of its local rank;
    a node with more ranks than GPUs is refused rather than stacking two ranks on one GPU.
    """
    global _collective_timeout
    missing = [key for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
    if missing:
        raise NereusError(f"not launched by torchrun: environment variables {', '.join(missing)} are unset")
    _collective_timeout = timeout
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        # torchrun keeps one store across restarts of the workers: each attempt's group keys go
        # under its own prefix, or a restarted rank may read a dead rank's address from before
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        store = dist.PrefixStore(f"nereus/attempt-{restart}/group", client)
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend(), store=store, rank=rank, world_size=size, timeout=timeout)
    else:
        dist.init_process_group(backend(), init_method="env://", timeout=timeout)
    domain = shm.host_token().hex()[:12]
    mine = Peer(dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), node_name(), os.getpid(), domain)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    _peers[:] = gathered
    return peers()


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

    def __init__(self, timeout_s: float, watch: bool) -> None:
        import threading

        self.timeout_s = timeout_s
        self.guard, self.beats = start_guard(timeout_s + GUARD_GRACE_S)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=5),
            wait_for_workers=False,
        )
        self.store = dist.PrefixStore(f"nereus/attempt-{restart}", client)
        self.store_lost = False
        self.watched = [peer.rank for peer in _peers if peer.rank != dist.get_rank()] if watch else []
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
            return [_peers[r] for r, (_, moved) in self.last_moved.items() if self.last_read - moved >= SILENT_S]
        others = [peer.rank for peer in _peers if peer.rank != dist.get_rank()]
        before = self.counts(others)
        time.sleep(SILENT_S)
        after = self.counts(others)
        if before is None or after is None:
            return []
        return [_peers[rank] for rank in others if after[rank] == before[rank]]

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
                raise NereusError(f"{_peers[rank].describe()} stopped responding during {what}")

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
    import atexit
    import sys

    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    atexit.register(leave)


def start_guard(silence_s: float) -> tuple[Any, int]:
    """Start this rank's guard (`nereus.runtime.comm.guard`); returns it and the pipe end to beat on."""
    import subprocess
    import sys

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
    if here and _stopped(peer.pid):
        return f"{peer.describe()}: stopped by a signal (SIGSTOP) and did not respond"
    if here or peer.node == node_name():
        return f"{peer.describe()}: {'hung (alive, not responding)' if here else 'died'}"
    return f"{peer.describe()}: stopped responding (dead, stopped or hung)"


def kill_unresponsive_sibling(peer: Peer) -> None:
    """SIGKILL a stopped or hung rank started by this rank's own launcher (same node, same
    parent): the launcher's clean-up would otherwise wait for it (a stopped process ignores
    SIGTERM) and the job would outlive the collective timeout by the launcher's grace period."""
    import signal

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


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when its parent dies (torch asks for SIGINT, which a
    rank blocked inside a collective never handles), so a killed launcher leaves no orphans."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # not Linux: nothing to ask
        return
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    # The parent died before the request (this rank was reparented, to init or to a
    # subreaper): go now. Compare with the parent recorded at spawn, not with pid 1.
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)


def _child(
    rank: int,
    world_size: int,
    folder: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    num_threads: int,
    timeout: timedelta,
) -> None:
    global _collective_timeout
    _die_with_parent()
    _collective_timeout = timeout
    torch.set_num_threads(num_threads)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    result_path = Path(folder) / f"result-{rank}.pkl"
    try:
        if torch.cuda.is_available():
            torch.cuda.set_device(device())
        dist.init_process_group(
            backend(),
            init_method=f"file://{folder}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        outcome: tuple[bool, Any, float] = (True, fn(rank, world_size, *args), time.time())
        # No rank tears its communicator down while a peer may still be sending on it.
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # report any failure to the parent, which raises it
        outcome = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", time.time())
    write_bytes_atomic(result_path, pickle.dumps(outcome))  # safe: read only by this rank's launcher
    if not outcome[0]:
        # Exit non-zero without tearing down: the parent then stops every other rank, which
        # may be blocked in a collective waiting for this one.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


#: Seconds the surviving ranks get to exit on their own after one rank fails.
FAILURE_GRACE_S = 2.0


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    num_threads: int = 1,
    on_wait: Callable[[], None] | None = None,
    huge_pages: bool = False,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` local ranks; return each rank's result.

    `fn` must be importable (a module-level function). `on_wait`, when given, is called about
    ten times a second while the ranks run, and once after they end (e.g. to drain a queue
    the ranks report progress on). A rank that raises or dies takes the others down within
    a few seconds, and `spawn` raises RuntimeError naming it, with its traceback when it had one.
    `huge_pages` starts the ranks with HUGE_PAGES_ENV=1 (large CPU tensors on transparent
    huge pages); a value of that variable already in the environment always wins. A
    collective that waits longer than `timeout` fails; a rank the others timed out on (alive,
    but stopped or stuck) is then named as the cause.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="nereus-rdzv-") as folder:
        child_args = (world_size, folder, fn, args, num_threads, timeout)
        with _rank_environment(huge_pages, num_threads):
            context = mp.start_processes(_child, args=child_args, nprocs=world_size, join=False, start_method="spawn")
        failure = None
        stopped: set[int] = set()  # ranks seen stopped (SIGSTOP): torch kills them once another fails
        try:
            for tick in itertools.count():
                if context.join(timeout=0.1, grace_period=FAILURE_GRACE_S):
                    break
                if tick % 10 == 9:
                    stopped |= {rank for rank, process in enumerate(context.processes) if _stopped(process.pid)}
                if on_wait is not None:
                    on_wait()
        except ProcessException as error:
            failure = error
        finally:
            for process in context.processes:  # e.g. on KeyboardInterrupt in the parent
                if process.is_alive():
                    process.kill()
                    process.join()
        if on_wait is not None:
            on_wait()
        outcomes = {rank: _read_outcome(Path(folder), rank) for rank in range(world_size)}
    # The rank that failed first names the cause (its peers then fail on closed connections);
    # a rank that died without a word (a signal) is the cause when there is one.
    raised = sorted((o[2], rank, o[1]) for rank, o in outcomes.items() if o is not None and not o[0])
    failures = [f"rank {rank}: {message}" for _, rank, message in raised]
    if failure is not None and outcomes[failure.error_index] is None:
        failures.insert(0, f"rank {failure.error_index}: {_exit_description(failure)}")
    first = failure.error_index if failure is not None else None
    silent = [rank for rank, outcome in outcomes.items() if outcome is None and rank != first]
    if silent and raised and all(timed_out(message) for _, _, message in raised):
        # The others gave up waiting on these: they are the cause, not the ranks that timed out.
        waited = f"{timeout.total_seconds():g} s"
        failures[:0] = [f"rank {rank}: {_silence(rank in stopped)}; the others waited {waited}" for rank in silent]
    if not failures and None in outcomes.values():
        failures = [f"rank {min(r for r, o in outcomes.items() if o is None)}: ended without a result"]
    if failures:
        raise RuntimeError("\n".join(failures))
    return [outcome[1] for outcome in outcomes.values() if outcome is not None]


@contextmanager
def _rank_environment(huge_pages: bool, num_threads: int) -> Iterator[None]:
    """The environment spawned ranks inherit: HUGE_PAGES_ENV=1 when asked and unset,
    STREAMING_COPY_TUNABLE when GLIBC_TUNABLES is unset, and BLAS threads = `num_threads`
    when unset. Values already set are kept."""
    wanted = {
        TUNABLES_ENV: STREAMING_COPY_TUNABLE,
        BLAS_THREADS_ENV: str(num_threads),
        **({HUGE_PAGES_ENV: "1"} if huge_pages else {}),
    }
    added = [name for name in wanted if name not in os.environ]
    for name in added:
        os.environ[name] = wanted[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _silence(stopped: bool) -> str:
    return "stopped by a signal (SIGSTOP) and did not respond" if stopped else "hung (alive, not responding)"


def _stopped(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] in ("T", "t")


def timed_out(message: str) -> bool:
    """Whether a rank's error is a collective that waited too long."""
    text = message.lower()
    return "timed out" in text or "timeout" in text or "did not arrive within" in text


def _read_outcome(folder: Path, rank: int) -> tuple[bool, Any, float] | None:
    """(succeeded, result or error text, when it ended), or None when the rank left none."""
    path = folder / f"result-{rank}.pkl"
    if not path.is_file():
        return None
    outcome: tuple[bool, Any, float] = pickle.loads(path.read_bytes())  # safe: own ranks' file, private 0700 dir
    return outcome


def _exit_description(error: ProcessException) -> str:
    if isinstance(error, ProcessExitedException) and error.signal_name:
        return f"died from signal {error.signal_name}"
    if isinstance(error, ProcessExitedException):
        return f"exited with code {error.exit_code}"
    return str(error)

"""Start N local ranks (`spawn`): they meet through a file in a temporary folder (no port races
between parallel tests), and a rank that fails or dies takes the others down and is named.

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

import ctypes
import itertools
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from nereus.runtime.comm.heartbeat import stopped_by_signal
from nereus.runtime.comm.world import DEFAULT_TIMEOUT, backend, device, set_collective_timeout
from nereus.spec.io import write_bytes_atomic

#: torch's CPU allocator reads this once: "1" advises every allocation of 2 MiB or more
#: MADV_HUGEPAGE (honoured when the kernel's THP mode is "madvise" or "always"; a no-op
#: under "never").
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"

#: glibc reads its tunables once, at start-up: memcpy/memmove of at least 1 MiB use
#: non-temporal (cache-bypassing) stores in the ranks (x86-64 glibc; ignored elsewhere).
TUNABLES_ENV = "GLIBC_TUNABLES"
STREAMING_COPY_TUNABLE = "glibc.cpu.x86_non_temporal_threshold=0x100000"

#: "forkserver" starts ranks by forking a server process that imported FORKSERVER_PRELOAD once
#: (a rank then starts in a fraction of a second instead of importing torch: 2-5 s on 2 busy
#: cores), when the ranks need no other start-up environment than the server was started
#: with; anything else (unset, "spawn") starts each rank as a fresh interpreter. The test
#: suite sets it; a run's ranks are fresh interpreters unless the user sets it.
START_METHOD_ENV = "NEREUS_SPAWN_START_METHOD"

#: What the forkserver imports before it forks any rank: torch, the distributed modules every
#: rank loads before its idle memory baseline (`rank_loop.prepare_rank`), the rank's own code, and
#: transformers (vLLM's ranks import it); together ~2.5 s of a rank's start on an idle core. Not
#: torch._dynamo (a rank imports it only when its plan needs it: recompute or full sharding) nor vllm,
#: which imports torch._dynamo. A module that is not installed is skipped.
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "nereus.runtime.comm.spawn",
    "nereus.runtime.run.rank_entry",
    "transformers",
]

#: numpy's OpenBLAS reads this once, at import: a rank's BLAS calls (the online calibration's
#: least squares) use as many threads as its torch ops, not a pool sized for the whole host
#: whose spinning workers take the other ranks' cores.
BLAS_THREADS_ENV = "OPENBLAS_NUM_THREADS"


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when its parent dies (torch asks for SIGINT, which a
    rank blocked inside a collective never handles), so a killed launcher leaves no orphans."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # not Linux: nothing to ask
        return
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    # The parent died before the request (this rank was reparented, to init or to a
    # subreaper): go now. Compare with the parent recorded at spawn, not with pid 1.
    # A forkserver's rank has the server as its parent (the signal follows the server, which
    # ends when the launcher does): ask the launcher's sentinel instead.
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():
        os._exit(1)


def _child(
    rank: int,
    world_size: int,
    folder: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    num_threads: int,
    timeout: timedelta,
    environment: dict[str, str] | None = None,
) -> None:
    _die_with_parent()
    if environment is not None:  # forked from the server: the launcher's environment now
        os.environ.clear()
        os.environ.update(environment)
    set_collective_timeout(timeout)
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
        with _rank_environment(huge_pages, num_threads):
            method = _start_method()
            environment = dict(os.environ) if method == "forkserver" else None
            child_args = (world_size, folder, fn, args, num_threads, timeout, environment)
            context = mp.start_processes(_child, args=child_args, nprocs=world_size, join=False, start_method=method)
        failure = None
        stopped: set[int] = set()  # ranks seen stopped (SIGSTOP): torch kills them once another fails
        try:
            for tick in itertools.count():
                if context.join(timeout=0.1, grace_period=FAILURE_GRACE_S):
                    break
                if tick % 10 == 9:
                    stopped |= {
                        rank for rank, process in enumerate(context.processes) if stopped_by_signal(process.pid)
                    }
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


def _start_method() -> str:
    """The ranks' start method: "forkserver" when START_METHOD_ENV asks for it and their start-up
    environment (read by glibc, OpenBLAS and torch's allocator before any rank code runs) is the
    one the server starts with, `_rank_environment`'s defaults for one thread; else "spawn"."""
    if os.environ.get(START_METHOD_ENV) != "forkserver":
        return "spawn"
    start_up = (os.environ.get(TUNABLES_ENV), os.environ.get(BLAS_THREADS_ENV), os.environ.get(HUGE_PAGES_ENV))
    if start_up != (STREAMING_COPY_TUNABLE, "1", None):
        return "spawn"
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    forkserver.ensure_running()  # started now, in this environment, if it is not running yet
    return "forkserver"


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

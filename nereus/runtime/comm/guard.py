"""A joined rank's guard: a small process beside each rank of a torchrun job that SIGKILLs
the rank once its heartbeat has been silent for a while (the rank was stopped by SIGSTOP,
or hangs holding the interpreter). torchrun's agent sees a stopped worker as running and
would wait for it forever; a killed one it sees as failed, and it ends or restarts the job.

torchrun's own watchdog (TORCHELASTIC_ENABLE_FILE_TIMER) is not used: after killing a
worker it kills its agent too, and that agent may host the job's key-value store, which
every other node then loses before its rank 0 can report what happened.

The guard imports nothing heavy (it starts in a fraction of a second) and exits as soon as
its rank does: the rank holds the only writing end of the heartbeat pipe, so the guard
reads end-of-file when the rank exits however it ends.
"""

from __future__ import annotations

import os
import select
import signal
import sys


def watch(pid: int, beats: int, silence_s: float, label: str) -> int:
    """Read `pid`'s heartbeats from file descriptor `beats`; SIGKILL `pid` after `silence_s`
    seconds without one. Returns the exit status (0 either way: the guard did its job)."""
    while True:
        ready, _, _ = select.select([beats], [], [], silence_s)
        if not ready:
            break
        if not os.read(beats, 4096):
            return 0  # the rank exited: nothing left to guard
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return 0
    print(
        f"nereus: {label} sent no heartbeat for {silence_s:g} s (stopped or hung): killed it so that its "
        "launcher ends the job",
        file=sys.stderr,
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]))

"""This rank's world: its device and backend (the one place that chooses gloo or NCCL), its
node, joining a job torchrun (or any env:// launcher) started, and how long collectives wait.

`nereus.runtime.comm.spawn` starts local ranks instead; either way the rest of the runtime
sees an initialised default process group.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nereus.errors import NereusError
from nereus.runtime.comm import shm

#: How long a collective may wait before the job is declared hung.
DEFAULT_TIMEOUT = timedelta(seconds=120)
#: The timeout this process's collectives run under. Process-wide on purpose: it is the default
#: process group's own setting, fixed where the process joins its world (`init_from_env`, a
#: `spawn`ed rank), and the process groups of rank sets (`collectives.subgroup`) wait as long.
_collective_timeout = DEFAULT_TIMEOUT


def collective_timeout() -> timedelta:
    """How long a collective of this process may wait for its peers."""
    return _collective_timeout


def set_collective_timeout(timeout: timedelta) -> None:
    """Set by whatever initialises this process's default process group, with the group's timeout."""
    global _collective_timeout
    _collective_timeout = timeout


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


def attempt_store(timeout: timedelta, wait_for_workers: bool = True) -> Any:
    """A client of the launcher's store (torchrun's agent store, kept across restarts of the
    workers) whose keys go under this restart attempt's own prefix, `nereus/attempt-N`: a
    restarted rank never reads what a dead rank wrote before (e.g. its address)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    client = dist.TCPStore(address, port, is_master=False, timeout=timeout, wait_for_workers=wait_for_workers)
    return dist.PrefixStore(f"nereus/attempt-{restart}", client)


def init_from_env(timeout: timedelta = DEFAULT_TIMEOUT) -> list[Peer]:
    """Join the job torchrun (or any env:// launcher) started; returns every rank's `Peer`.

    Collectives wait at most `timeout`. On CUDA each rank takes the GPU of its local rank;
    a node with more ranks than GPUs is refused rather than stacking two ranks on one GPU.
    """
    missing = [key for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
    if missing:
        raise NereusError(f"not launched by torchrun: environment variables {', '.join(missing)} are unset")
    set_collective_timeout(timeout)
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        store = dist.PrefixStore("group", attempt_store(timeout))
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend(), store=store, rank=rank, world_size=size, timeout=timeout)
    else:
        dist.init_process_group(backend(), init_method="env://", timeout=timeout)
    domain = shm.host_token().hex()[:12]
    mine = Peer(dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), node_name(), os.getpid(), domain)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered

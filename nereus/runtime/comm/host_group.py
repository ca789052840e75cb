"""A c10d backend for the CPU ranks of one host: gloo, with the small collectives through shared memory.

gloo's collectives cost 0.4-1.5 ms a call on this kind of host for any tensor up to a few
hundred KiB (its TCP loopback and worker-thread hand-offs, not the bytes), and tensor
parallelism makes several per decoder layer, so on CPU ranks gloo's latency, not the math,
set the speed of every tensor-parallel step (benchmarks/README.md, "Collectives on the host
backend"). The process groups `collectives.subgroup` makes on CPU ranks are therefore this
backend, `HostGroup`: a `torch.distributed.ProcessGroup` whose all-reduce (sum, max),
all-gather and broadcast of CPU tensors go through one shared segment per group when every
rank of the group shares a host (equal `shm.host_token`), and whose every other operation
(point-to-point, reduce-scatter, all-to-all, barrier, and these when the ranks do not share
memory) is gloo's, which the group registers as its CPU backend. DTensor's functional
collectives, FSDP2 and `torch.distributed`'s calls reach it like any backend.

The protocol: each rank copies its chunk into its own slot, announces it by raising its
`arrived` counter to the call's sequence number, waits for the others' counters and reads
every slot in rank order, so every rank computes the very same bits; it then raises its
`done` counter. Slots alternate between two sets, so a call waits only for the readers of the
call before last. Waiting polls briefly, yielding the core between polls, then sleeps on a futex on the counter
(ranks that outnumber the cores do not starve the one they wait for), and fails after the group's timeout
naming the rank that did not arrive. Collectives run in the calling thread and return
completed work. Linux on x86-64 only (the futex call and its ordering of stores); elsewhere, or
with NEREUS_HOST_COLLECTIVES=0, the group is gloo throughout.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import secrets
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from nereus.runtime.comm import shm

if TYPE_CHECKING:
    import torch

#: The backend's name in `torch.distributed` (`new_group(..., backend=NAME)`).
NAME = "nereus_host"
#: Set to 0 to make every process group plain gloo (to compare, or to debug).
ENABLE_ENV = "NEREUS_HOST_COLLECTIVES"
#: Bytes of one rank's slot: larger tensors go through it chunk by chunk.
SLOT_BYTES = 1 << 20
#: One counter per cache line, so ranks raising their own counters do not contend.
_LINE = 64
#: Polls of a counter before sleeping on it, each followed by `sched_yield` (which hands the
#: core to a runnable peer and returns at once on an idle one): measured on 2 cores, a tiny
#: tp=2 training step took 30-43 ms (40-49 ms polling without yielding, 62 ms on gloo), and the
#: README's main job (4 ranks on 2 cores) 84 s (108 s without yielding, 120 s on gloo).
_SPINS = 2000
#: How long one futex sleep lasts before the counter is read again, in nanoseconds.
_SLEEP_NS = 2_000_000
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # x86-64


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def supported() -> bool:
    """Whether shared-memory collectives can run in this process (else every group is gloo)."""
    return sys.platform == "linux" and platform.machine() == "x86_64" and os.environ.get(ENABLE_ENV, "1") != "0"


def _absent(rank: int, size: int, timeout_s: float) -> RuntimeError:
    """The error of a collective whose group rank `rank` did not arrive (`spawn.timed_out` reads it)."""
    return RuntimeError(
        f"{NAME}: rank {rank} of a {size}-rank process group did not arrive within {timeout_s:g} s "
        "at a collective (it may have stopped or died)"
    )


class _Channel:
    """One group's segment: per rank an `arrived` and a `done` counter, and a slot per set."""

    def __init__(self, data: torch.Tensor, size: int, index: int, timeout_s: float) -> None:
        import numpy as np

        self.data = data
        """The whole segment as bytes (keeps the mapping alive)."""
        self.size, self.index, self.timeout_s = size, index, timeout_s
        header = 2 * size * _LINE
        self.counters: np.ndarray = data[:header].numpy().view(np.int32)[:: _LINE // 4]
        """arrived[r] at r, done[r] at size + r."""
        self.addresses = [ctypes.c_void_p(data.data_ptr() + k * _LINE) for k in range(2 * size)]
        self.slots = [
            [data[header + (parity * size + r) * SLOT_BYTES :][:SLOT_BYTES] for r in range(size)] for parity in (0, 1)
        ]
        self.others = [r for r in range(size) if r != index]
        self.seq = 0
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.sleep = _Timespec(0, _SLEEP_NS)

    def _raise(self, which: int, value: int) -> None:
        self.counters[which] = value
        self.libc.syscall(_SYS_FUTEX, self.addresses[which], _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    def _wait_others(self, offset: int, value: int) -> None:
        counters = self.counters
        for rank in self.others:
            if counters[offset + rank] < value:
                self._wait(offset + rank, value)

    def _wait(self, which: int, value: int) -> None:
        counters = self.counters
        for _ in range(_SPINS):
            if counters[which] >= value:
                return
            os.sched_yield()
        deadline = time.monotonic() + self.timeout_s
        while (seen := int(counters[which])) < value:
            if time.monotonic() > deadline:
                raise _absent(which % self.size, self.size, self.timeout_s)
            # sleeps only while the counter still holds `seen`: a raise in between returns at once
            self.libc.syscall(_SYS_FUTEX, self.addresses[which], _FUTEX_WAIT, seen, ctypes.byref(self.sleep), None, 0)

    def _chunked(
        self, flat: torch.Tensor, read: Callable[[int, torch.Tensor, list[torch.Tensor]], object], write: bool
    ) -> None:
        """Run `flat` through the slots a chunk at a time: each rank writes its chunk into its slot
        (when `write`) and announces it, waits for every rank's, calls `read(start, chunk, every
        rank's slot in rank order)`, `start` the chunk's offset in `flat`, then says it has read."""
        step = max(SLOT_BYTES // flat.element_size(), 1)
        for start in range(0, flat.numel(), step):
            chunk = flat[start : start + step]
            nbytes = chunk.numel() * chunk.element_size()
            self.seq += 1
            seq = self.seq
            slots = [slot[:nbytes].view(chunk.dtype) for slot in self.slots[seq & 1]]
            self._wait_others(self.size, seq - 2)  # this set of slots was last read in call seq - 2
            if write:
                slots[self.index].copy_(chunk)
            self._raise(self.index, seq)
            self._wait_others(0, seq)
            read(start, chunk, slots)
            self._raise(self.size + self.index, seq)

    def _in_place(
        self, tensor: torch.Tensor, read: Callable[[int, torch.Tensor, list[torch.Tensor]], object], write: bool
    ) -> None:
        """`_chunked` over `tensor` made flat, whose chunks `read` overwrites: a strided tensor
        goes through a contiguous copy, written back at the end."""
        flat = tensor.contiguous().view(-1)
        self._chunked(flat, read, write)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))

    def all_reduce(self, tensor: torch.Tensor, maximum: bool) -> None:
        """Sum (or max) `tensor` in place, in rank order on every rank."""
        import torch

        combine = torch.maximum if maximum else torch.add

        def reduce(_: int, chunk: torch.Tensor, slots: list[torch.Tensor]) -> None:
            combine(slots[0], slots[1], out=chunk)
            for slot in slots[2:]:
                combine(chunk, slot, out=chunk)

        self._in_place(tensor, reduce, write=True)

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """`parts[r]` (contiguous, `tensor`'s size) receives rank r's `tensor`."""
        outputs = [part.view(-1) for part in parts]

        def read(start: int, chunk: torch.Tensor, slots: list[torch.Tensor]) -> None:
            for output, slot in zip(outputs, slots, strict=True):
                output[start : start + chunk.numel()].copy_(slot)

        self._chunked(tensor.contiguous().view(-1), read, write=True)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """`tensor` becomes group rank `root`'s on every rank (only the root writes)."""
        mine = root == self.index
        self._in_place(tensor, lambda _, chunk, slots: None if mine else chunk.copy_(slots[root]), write=mine)


#: Every other operation: gloo's, by the ProcessGroup method torch's bindings call -> the gloo
#: Backend method it calls. Through the Backend binding, which drops the GIL while gloo queues
#: the work: left to ProcessGroup's own binding, a Python subclass keeps the GIL there and
#: deadlocks with gloo's worker thread, which takes the GIL to free a finished work's tensors
#: while holding the queue's lock (seen in all-to-all).
_TO_GLOO = {
    "all_to_all_single": "alltoall_base",
    "alltoall_base": "alltoall_base",
    "alltoall": "alltoall",
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv_anysource",
    "barrier": "barrier",
    "monitored_barrier": "monitored_barrier",
    "gather": "gather",
    "scatter": "scatter",
    "reduce": "reduce",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "_reduce_scatter_base",
    "_reduce_scatter_base": "_reduce_scatter_base",
    "allreduce_coalesced": "allreduce_coalesced",
    "allgather_coalesced": "allgather_coalesced",
}


@functools.cache
def _class() -> type:
    """`HostGroup`, defined on first use (it subclasses torch's ProcessGroup: torch is imported then)."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, BroadcastOptions

    work: Any = dist._Work
    process_group: Any = dist.ProcessGroup

    class Done(work):
        """A collective that finished in the calling thread."""

        def __init__(self, tensors: list[torch.Tensor]) -> None:
            super().__init__()
            self.tensors = tensors

        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

        def get_future(self) -> torch.futures.Future:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(self.tensors)
            return future

    def _pairwise(collective: Callable[..., Any], outputs: Any, inputs: Any, opts: Any) -> Any:
        """`collective(output, input, opts)` for each pair, every work waited on."""
        for work in [collective(out, tensor, opts) for out, tensor in zip(outputs, inputs, strict=True)]:
            work.wait()
        return Done(outputs)

    class HostGroup(process_group):
        """gloo, with all-reduce, all-gather and broadcast of CPU tensors through shared memory."""

        def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
            super().__init__(rank, size)
            self.gloo: Any = dist.ProcessGroupGloo(store, rank, size, timeout)
            self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.gloo)
            self._store, self._timeout = store, timeout

        @functools.cached_property
        def channel(self) -> _Channel | None:
            """The group's shared segment, opened by its first shared-memory collective (every
            rank's, in the same order), so a group that never runs one maps none; None: gloo."""
            if self.size() == 1 or not supported():
                return None
            return _open_channel(self._store, self.rank(), self.size(), self._timeout)

        def getBackendName(self) -> str:
            return NAME

        @property
        def group_name(self) -> str:
            return str(dist.distributed_c10d._world.pg_names[self])

        def _channel(self, tensors: list[torch.Tensor]) -> _Channel | None:
            """The channel when one CPU tensor can go through it, else None (gloo)."""
            return self.channel if len(tensors) == 1 and tensors[0].device.type == "cpu" else None

        def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
            opts = opts or AllreduceOptions()
            op, channel = opts.reduceOp.op, self._channel(tensors)
            if channel is None or op not in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                return self.gloo.allreduce(tensors, opts)
            channel.all_reduce(tensors[0], maximum=op == dist.ReduceOp.MAX)
            return Done(tensors)

        def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
            opts = opts or AllgatherOptions()
            channel = self._channel(inputs)
            if channel is None or not all(out.is_contiguous() for out in outputs[0]):
                return self.gloo.allgather(outputs, inputs, opts)
            channel.all_gather(outputs[0], inputs[0])
            return Done(outputs[0])

        def all_gather_single(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> Any:
            """`all_gather_into_tensor` (torch 2.13 calls it so; `_allgather_base` before)."""
            opts = opts or AllgatherOptions()
            channel = self._channel([tensor])
            if channel is None or not output.is_contiguous():
                return self.gloo._allgather_base(output, tensor, opts)
            channel.all_gather(list(output.view(-1).chunk(self.size())), tensor)
            return Done([output])

        _allgather_base = all_gather_single

        def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
            opts = opts or BroadcastOptions()
            channel = self._channel(tensors)
            if channel is None:
                return self.gloo.broadcast(tensors, opts)
            channel.broadcast(tensors[0], opts.rootRank)
            return Done(tensors)

        def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any) -> Any:
            """The functional reduce-scatter's call (FSDP2, DTensor), one pair at a time."""
            return _pairwise(self.gloo._reduce_scatter_base, outputs, inputs, opts)

        reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

        def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any) -> Any:
            """The functional all-gather's call (FSDP2), one pair at a time."""
            return _pairwise(self.all_gather_single, outputs, inputs, opts)

        allgather_into_tensor_coalesced = all_gather_single_coalesced

    def to_gloo(method: str) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.gloo, method)(*args, **kwargs)

        return call

    for name, method in _TO_GLOO.items():
        setattr(HostGroup, name, to_gloo(method))
    return HostGroup


def _open_channel(store: Any, rank: int, size: int, timeout: timedelta) -> _Channel | None:
    """The group's shared segment, set up through the group's store (its ranks call this
    together, inside `new_group`); None when they do not share a host or /dev/shm is full."""
    token = shm.host_token().hex()
    store.set(f"token/{rank}", token)
    for other in range(size):
        try:
            theirs = store.get(f"token/{other}").decode()
        except RuntimeError as error:  # the store's timeout: that rank never reached this collective
            raise _absent(other, size, timeout.total_seconds()) from error
        if theirs != token:
            return None
    nbytes = 2 * size * _LINE + 2 * size * SLOT_BYTES
    if rank == 0:
        name = f"nereus-pg-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            shm.create_file(name, nbytes)
        except OSError:
            name = ""
        store.set("segment", name)
    name = store.get("segment").decode()
    if not name:
        return None
    data = shm.map_file(shm.SHM_ROOT / name, nbytes)
    store.add("mapped", 1)
    if rank == 0:  # every rank has mapped it: the mappings outlive the name
        deadline = time.monotonic() + timeout.total_seconds()
        while store.add("mapped", 0) < size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{NAME}: the group's ranks did not map its segment within {timeout}")
            time.sleep(0.001)
        (shm.SHM_ROOT / name).unlink()
        shm.forget_unopened(name)
    return _Channel(data, size, rank, timeout.total_seconds())


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    return _class()(store, rank, size, timeout)


def backend() -> str | None:
    """The backend for a new process group of this world's ranks: this one on a gloo world
    (CPU ranks) where shared-memory collectives run, else None (the world's own)."""
    import torch.distributed as dist

    if not supported() or dist.get_backend() != "gloo":
        return None
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
    return NAME

"""All-reduce, all-gather and broadcast (of tensors and of pickled objects) among the ranks of one
host through shared memory.

gloo's all-reduce costs about 2 ms a call on a VM's loopback for any tensor up to a few
hundred KiB, and tensor parallelism runs two per decoder layer, so on CPU ranks it, not
the math, set the speed of every tensor-parallel layout. When every rank of a process
group shares a host (equal `shm.host_token`), the group instead gets one shared segment:
each rank copies its tensor into its own slot, announces it by raising its counter, waits
for the others' counters and combines every slot in rank order, so every rank computes the
very same bits. A rank then raises a second counter to say it has read the slots; slots
alternate between two sets, so the next call need not wait for slow readers of this one.

Waiting spins for a moment and then sleeps on a futex on the counter, so ranks that
outnumber the cores (tests run 8 ranks on 2) do not starve the one they wait for. Groups
whose ranks do not share a host, CUDA tensors and hosts other than x86-64 Linux (whose
ordering of stores this relies on) use the `torch.distributed` call of the same name, as
does everything when NEREUS_HOST_COLLECTIVES=0, and every rank of a group together when a
gather, broadcast or object outgrows a slot (all-reduces go slot by slot instead).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import platform
import secrets
import struct
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from nereus.runtime.comm import shm

if TYPE_CHECKING:
    import numpy as np
    import torch

#: Set to 0 to send every collective through the process group (to compare, or to debug).
ENABLE_ENV = "NEREUS_HOST_COLLECTIVES"
#: Bytes of one rank's slot: larger tensors are reduced in chunks of this size.
SLOT_BYTES = 1 << 20
#: One counter per cache line, so ranks raising their own counters do not contend.
_LINE = 64
_INT32_PER_LINE = _LINE // 4
#: How long a rank polls a counter before it sleeps on it, in polls (~0.1 us each). Waking a
#: sleeping rank costs a VM hundreds of microseconds and peers often arrive a few ms apart,
#: so ranks that each have a core poll for ~2 ms (a colocated dp=2 RL step: 8% faster than
#: polling for 0.2 ms); ranks that outnumber the cores sleep almost at once.
_SPINS_OWN_CORE, _SPINS_SHARED_CORE = 20_000, 16
#: How long one futex sleep may last before the counter is read again (a missed wake-up
#: costs at most this), in nanoseconds.
_SLEEP_NS = 2_000_000
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1

Op = Literal["sum", "max"]
#: The length prefix of a pickled message in its slot (-1: it did not fit).
_LENGTH = struct.Struct("<q")


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_SLEEP = _Timespec(0, _SLEEP_NS)


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _supported() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


#: libc, loaded once for the futex syscalls (None where unsupported); never changes.
_LIBC = _libc() if _supported() else None


class _Channel:
    """One process group's segment: per rank an `arrived` and a `done` counter (raised to
    the call's sequence number) and, per slot set, a slot."""

    def __init__(self, num_ranks: int, index: int, data: torch.Tensor, timeout_s: float) -> None:
        import numpy as np

        self.num_ranks = num_ranks
        self.index = index
        """This rank's index in the group."""
        self.data = data
        """The whole segment as bytes (keeps the mapping alive)."""
        header = _header_bytes(num_ranks)
        self.counters: np.ndarray = data[:header].numpy().view(np.int32)[::_INT32_PER_LINE]
        """arrived[r] at r, done[r] at num_ranks + r (one cache line each)."""
        base = data.data_ptr()
        self.addresses = [ctypes.c_void_p(base + k * _LINE) for k in range(2 * num_ranks)]
        self.slots = [
            [data[header + (parity * num_ranks + r) * SLOT_BYTES :][:SLOT_BYTES] for r in range(num_ranks)]
            for parity in (0, 1)
        ]
        self.views: dict[tuple[Any, int], list[list[torch.Tensor]]] = {}
        """(dtype, elements) -> `slot_views` (shapes recur call after call)."""
        self.others = [r for r in range(num_ranks) if r != index]
        self.seq = 0
        self.timeout_s = timeout_s
        self.spins = _SPINS_OWN_CORE if _local_ranks(num_ranks) <= len(os.sched_getaffinity(0)) else _SPINS_SHARED_CORE

    def slot_views(self, chunk: torch.Tensor) -> list[list[torch.Tensor]]:
        """Per parity, every rank's slot as a tensor like `chunk` (flat)."""
        key = (chunk.dtype, chunk.numel())
        views = self.views.get(key)
        if views is None:
            nbytes = chunk.numel() * chunk.element_size()
            views = self.views[key] = [[slot[:nbytes].view(chunk.dtype) for slot in slots] for slots in self.slots]
            if len(self.views) > 64:  # shapes that stopped recurring
                del self.views[next(iter(self.views))]
        return views

    def raise_counter(self, which: int, value: int) -> None:
        self.counters[which] = value
        assert _LIBC is not None
        _LIBC.syscall(_SYS_FUTEX, self.addresses[which], _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    def wait_others(self, offset: int, value: int) -> None:
        """Until every other rank's counter (arrived: offset 0, done: offset num_ranks) reaches `value`."""
        counters = self.counters
        for rank in self.others:
            which = offset + rank
            if counters[which] < value:
                self._wait(which, value)

    def _wait(self, which: int, value: int) -> None:
        counters = self.counters
        for _ in range(self.spins):
            if counters[which] >= value:
                return
        assert _LIBC is not None
        deadline = time.monotonic() + self.timeout_s
        while True:
            seen = int(counters[which])
            if seen >= value:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"host collective: rank {which % self.num_ranks} of the group did not arrive within "
                    f"{self.timeout_s:g} s (it may have died)"
                )
            # Sleeps only while the counter still holds `seen`: a raise in between returns at once.
            _LIBC.syscall(_SYS_FUTEX, self.addresses[which], _FUTEX_WAIT, seen, ctypes.byref(_SLEEP), None, 0)


def _local_ranks(num_ranks: int) -> int:
    """Ranks on this host: the launcher's LOCAL_WORLD_SIZE (torchrun and `spawn` set it), at
    least the group's."""
    return max(num_ranks, int(os.environ.get("LOCAL_WORLD_SIZE", "0")))


def _header_bytes(num_ranks: int) -> int:
    return 2 * num_ranks * _LINE


#: Per process group (held, so its id is not reused): its channel, or None for the process group's own all-reduce.
#: Process-wide on purpose, like the process groups themselves: a channel is opened collectively
#: once per group (every rank maps one segment) and its call counter must stay in step on every rank.
_CHANNELS: dict[int, tuple[Any, _Channel | None]] = {}


def all_reduce(tensor: torch.Tensor, group: Any = None, op: Op = "sum") -> None:
    """Reduce `tensor` in place over `group` (default: the world), like
    `torch.distributed.all_reduce`; every rank of the group must call it with a tensor of
    the same shape and dtype."""
    import torch.distributed as dist

    channel = _channel(group) if tensor.device.type == "cpu" else None
    if channel is None:
        dist.all_reduce(tensor, op=_dist_op(op), group=group)
        return
    flat = tensor.contiguous().view(-1)
    step = SLOT_BYTES // flat.element_size()
    for start in range(0, flat.numel(), step):
        _reduce_chunk(channel, flat[start : start + step], op)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))


def all_gather(parts: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
    """`torch.distributed.all_gather`: `parts[r]` receives rank r's `tensor` (every rank's of
    the same shape and dtype)."""
    import torch.distributed as dist

    channel, flat = _one_slot(tensor, group)
    if channel is None:
        dist.all_gather(parts, flat.view_as(tensor), group=group)  # the process group needs it contiguous
        return

    def gather(slots: list[torch.Tensor]) -> None:
        for part, slot in zip(parts, slots, strict=True):
            part.copy_(slot.view_as(part))

    _rendezvous(channel, channel.slot_views(flat), lambda slot: slot.copy_(flat), gather)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None) -> None:
    """`torch.distributed.broadcast`: every rank's `tensor` becomes global rank `src`'s."""
    import torch.distributed as dist

    channel, flat = _one_slot(tensor, group)
    if channel is None:
        dist.broadcast(tensor, src=src, group=group)
        return
    root = _group_index(group, src)
    if root != channel.index:
        # Only the root's slot is read: the others announce their arrival without copying.
        _rendezvous(channel, channel.slot_views(flat), None, lambda slots: tensor.copy_(slots[root].view_as(tensor)))
    else:
        _rendezvous(channel, channel.slot_views(flat), lambda slot: slot.copy_(flat), lambda slots: None)


def _one_slot(tensor: torch.Tensor, group: Any) -> tuple[_Channel | None, torch.Tensor]:
    """The group's channel when `tensor` fits one slot (None: use the process group), and
    `tensor` flat."""
    flat = tensor.contiguous().view(-1)
    fits = tensor.device.type == "cpu" and flat.numel() * flat.element_size() <= SLOT_BYTES
    return (_channel(group) if fits else None), flat


def _group_index(group: Any, global_rank: int) -> int:
    import torch.distributed as dist

    return global_rank if group is None else dist.get_group_rank(group, global_rank)


def all_gather_object(gathered: list[Any], obj: Any, group: Any = None) -> None:
    """`torch.distributed.all_gather_object`: `gathered[r]` becomes rank r's `obj` (pickled)."""
    import torch.distributed as dist

    channel = _channel(group)
    messages = None if channel is None else _exchange_bytes(channel, pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))
    if messages is None:  # every rank takes this path together: some payload needed more than a slot
        dist.all_gather_object(gathered, obj, group=group)
        return
    gathered[:] = [pickle.loads(message) for message in messages]  # safe: messages of this run's own ranks


def broadcast_object_list(objects: list[Any], src: int, group: Any = None) -> None:
    """`torch.distributed.broadcast_object_list`: `objects` becomes global rank `src`'s list."""
    import torch.distributed as dist

    channel = _channel(group)
    root = _group_index(group, src)
    mine = b"" if channel is None or root != channel.index else pickle.dumps(objects, pickle.HIGHEST_PROTOCOL)
    messages = None if channel is None else _exchange_bytes(channel, mine)
    if messages is None:
        dist.broadcast_object_list(objects, src=src, group=group)
        return
    objects[:] = pickle.loads(messages[root])  # safe: a message of this run's own root rank


def _exchange_bytes(channel: _Channel, message: bytes) -> list[bytes] | None:
    """Every rank's `message`, in rank order; None on every rank when one did not fit a slot."""
    import torch

    fits = len(message) <= SLOT_BYTES - _LENGTH.size
    framed = _LENGTH.pack(len(message) if fits else -1) + (message if fits else b"")
    messages: list[bytes] | None = []

    def write(slot: torch.Tensor) -> None:
        slot[: len(framed)].copy_(torch.frombuffer(bytearray(framed), dtype=torch.uint8))

    def read(slots: list[torch.Tensor]) -> None:
        nonlocal messages
        lengths = [_LENGTH.unpack(slot[: _LENGTH.size].numpy().tobytes())[0] for slot in slots]
        if min(lengths) < 0:
            messages = None
            return
        start = _LENGTH.size
        messages = [slot[start : start + length].numpy().tobytes() for slot, length in zip(slots, lengths, strict=True)]

    _rendezvous(channel, channel.slots, write, read)
    return messages


def _reduce_chunk(channel: _Channel, chunk: torch.Tensor, op: Op) -> None:
    import torch

    combine = torch.add if op == "sum" else torch.maximum

    def reduce(slots: list[torch.Tensor]) -> None:
        combine(slots[0], slots[1], out=chunk)
        for other in slots[2:]:
            combine(chunk, other, out=chunk)

    _rendezvous(channel, channel.slot_views(chunk), lambda slot: slot.copy_(chunk), reduce)


def _rendezvous(
    channel: _Channel,
    slot_sets: list[list[torch.Tensor]],
    write: Callable[[torch.Tensor], object] | None,
    read: Callable[[list[torch.Tensor]], object],
) -> None:
    """`write` this rank's slot (unless None), wait for every rank's, `read` all the slots
    (in rank order), then say so. `slot_sets` holds the slots of each parity."""
    channel.seq += 1
    seq, num_ranks = channel.seq, channel.num_ranks
    slots = slot_sets[seq & 1]
    # This parity's slots were last read in call seq - 2: wait until every rank is done with them.
    channel.wait_others(num_ranks, seq - 2)
    if write is not None:
        write(slots[channel.index])
    channel.raise_counter(channel.index, seq)
    channel.wait_others(0, seq)
    read(slots)
    channel.raise_counter(num_ranks + channel.index, seq)


def _dist_op(op: Op) -> Any:
    import torch.distributed as dist

    return dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX


def _channel(group: Any) -> _Channel | None:
    """The group's channel, made collectively on its first call here (None: not shareable)."""
    import torch.distributed as dist

    group = dist.group.WORLD if group is None else group
    cached = _CHANNELS.get(id(group))
    if cached is not None and cached[0] is group:
        return cached[1]
    channel = _open_channel(group)
    _CHANNELS[id(group)] = (group, channel)
    return channel


def _open_channel(group: Any) -> _Channel | None:
    import torch.distributed as dist

    from nereus.runtime.comm.world import collective_timeout

    num_ranks, index = dist.get_world_size(group), dist.get_rank(group)
    if num_ranks == 1:
        return None
    usable = _supported() and os.environ.get(ENABLE_ENV, "1") != "0"
    tokens: list[Any] = [None] * num_ranks
    dist.all_gather_object(tokens, shm.host_token() if usable else shm.private_token(), group=group)
    if len(set(tokens)) != 1:
        return None
    nbytes = _header_bytes(num_ranks) + 2 * num_ranks * SLOT_BYTES
    name = [_create_segment(nbytes) if index == 0 else None]
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    if not name[0]:  # /dev/shm could not hold it: every rank stays on the process group
        return None
    path = shm.SHM_ROOT / name[0]
    data = shm.map_file(path, nbytes)
    dist.barrier(group=group)
    if index == 0:  # every rank has mapped it: the mappings outlive the name
        path.unlink()
        shm.forget_unopened(name[0])
    return _Channel(num_ranks, index, data, collective_timeout().total_seconds())


def _create_segment(nbytes: int) -> str:
    """The name of a new segment of `nbytes`, or "" when /dev/shm cannot hold it."""
    name = f"nereus-ar-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        shm.create_file(name, nbytes)
    except OSError:
        return ""
    return name

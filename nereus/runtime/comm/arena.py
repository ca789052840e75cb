"""A rank's state arena: CPU tensors in shared memory that peer ranks on the host read directly.

Resharding through a staging segment copies every moved byte twice (sender into the
segment, receiver out of it). When the sender's state already lives in shared memory
that the receiver has mapped, the receiver copies each piece straight out of the
sender's tensor: one copy, the bound for CPU memory. `reserve` gives a process such an
arena (anonymous memfd chunks, mapped with their pages populated, so tensors carved
from it take no page faults); `connect` maps every same-host peer's chunks once, the
way a GPU job registers buffers before its first transfer. While an arena is reserved,
`nereus.runtime.state.reshard.execute` allocates its results in it and senders offer their
arena pieces by location instead of staging them.

A tensor from `StateArena.empty` keeps its block until the last tensor sharing its
storage is gone; the block then returns to the free list (coalesced with free
neighbours) at the next allocation. Chunks are never unmapped while the arena lives,
and a peer opens a chunk through /proc/PID/fd, so nothing is left in /dev/shm when a
rank dies.
"""

from __future__ import annotations

import bisect
import ctypes
import math
import mmap
import os
import secrets
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nereus.runtime.comm import shm

if TYPE_CHECKING:
    import torch

#: Blocks start on a cache line, so bulk copies of them run at full speed.
ALIGN = shm.ALIGN
#: A chunk added when the arena runs out holds what it has so far, at most this much (bigger
#: requests get their size).
GROWTH_BYTES = 256 << 20


@dataclass(frozen=True)
class Location:
    """Where a tensor's first element lies, as a process on the same host finds it."""

    pid: int
    fd: int
    chunk_id: int
    """Random per chunk: tells a chunk from a later one that reused the same descriptor number."""
    chunk_bytes: int
    offset: int
    """Byte offset of the tensor's first element in the chunk."""


@dataclass
class _Chunk:
    fd: int
    nbytes: int
    buffer: mmap.mmap
    base: int
    chunk_id: int = field(default_factory=lambda: secrets.randbits(62))
    free_offsets: list[int] = field(default_factory=list)
    """Offsets of the free blocks, sorted; `free_sizes` holds their lengths."""
    free_sizes: dict[int, int] = field(default_factory=dict)

    def take(self, nbytes: int) -> int | None:
        """First fit: the offset of a block of `nbytes` now in use, or None when none is free."""
        for index, offset in enumerate(self.free_offsets):
            size = self.free_sizes[offset]
            if size >= nbytes:
                del self.free_offsets[index], self.free_sizes[offset]
                if size > nbytes:
                    self.free_offsets.insert(index, offset + nbytes)
                    self.free_sizes[offset + nbytes] = size - nbytes
                return offset
        return None

    def give_back(self, offset: int, nbytes: int) -> None:
        index = bisect.bisect_left(self.free_offsets, offset)
        following = self.free_offsets[index] if index < len(self.free_offsets) else None
        if following == offset + nbytes:  # merge with the free block after it
            nbytes += self.free_sizes.pop(following)
            del self.free_offsets[index]
        if index and self.free_offsets[index - 1] + self.free_sizes[self.free_offsets[index - 1]] == offset:
            self.free_sizes[self.free_offsets[index - 1]] += nbytes  # and with the one before it
            return
        self.free_offsets.insert(index, offset)
        self.free_sizes[offset] = nbytes


def _map_populated(fd: int, nbytes: int) -> tuple[mmap.mmap, int]:
    """`fd` mapped shared with every page table entry filled now, and the mapping's address."""
    buffer = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    anchor = ctypes.c_char.from_buffer(buffer)
    address = ctypes.addressof(anchor)
    del anchor  # only the address is needed; the export would pin the mapping
    return buffer, address


def _new_chunk(nbytes: int) -> _Chunk:
    """A memfd of `nbytes` with its memory reserved (a full host fails here, not with SIGBUS later)."""
    fd = os.memfd_create("nereus-arena", os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        buffer, base = _map_populated(fd, nbytes)
    except OSError:
        os.close(fd)
        raise
    chunk = _Chunk(fd, nbytes, buffer, base)
    chunk.free_offsets, chunk.free_sizes = [0], {0: nbytes}
    weakref.finalize(chunk, os.close, fd)  # the memory goes back once the mapping is gone too
    return chunk


class StateArena:
    """Shared-memory chunks that CPU state tensors are carved from."""

    def __init__(self, nbytes: int):
        if nbytes <= 0:
            raise ValueError(f"an arena needs a positive size, got {nbytes} bytes")
        self.chunks: list[_Chunk] = [_new_chunk(shm.aligned(nbytes, mmap.PAGESIZE))]
        # Blocks whose last tensor died; returned at the next allocation, not inside the
        # finalizer, which may run in the middle of one.
        self._released: list[tuple[_Chunk, int, int]] = []

    @property
    def reserved_bytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks)

    @property
    def free_bytes(self) -> int:
        self._return_released()
        return sum(sum(chunk.free_sizes.values()) for chunk in self.chunks)

    def empty(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor in the arena (a new chunk is added when none fits)."""
        numel = math.prod(shape)
        nbytes = shm.aligned(max(numel * dtype.itemsize, 1))
        self._return_released()
        for chunk in self.chunks:
            offset = chunk.take(nbytes)
            if offset is not None:
                return self._tensor(chunk, offset, nbytes, numel, shape, dtype)
        growth = min(GROWTH_BYTES, self.reserved_bytes)  # doubles while small, then steps of GROWTH_BYTES
        self.chunks.append(_new_chunk(shm.aligned(max(nbytes, growth), mmap.PAGESIZE)))
        offset = self.chunks[-1].take(nbytes)
        assert offset == 0, "a new chunk starts free"
        return self._tensor(self.chunks[-1], offset, nbytes, numel, shape, dtype)

    def _tensor(
        self, chunk: _Chunk, offset: int, nbytes: int, numel: int, shape: Any, dtype: torch.dtype
    ) -> torch.Tensor:
        import torch

        window = (ctypes.c_char * nbytes).from_buffer(chunk.buffer, offset)
        weakref.finalize(window, self._released.append, (chunk, offset, nbytes))
        flat = torch.frombuffer(window, dtype=torch.uint8)  # holds `window` until its storage dies
        return flat[: numel * dtype.itemsize].view(dtype).view(tuple(shape))

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of the CPU tensor `tensor` in the arena."""
        result = self.empty(tuple(tensor.shape), tensor.dtype)
        result.copy_(tensor)
        return result

    def locate(self, tensor: torch.Tensor) -> Location | None:
        """Where `tensor`'s first element lies, or None when it is not in this arena."""
        if tensor.device.type != "cpu" or not tensor.numel():
            return None
        address = tensor.data_ptr()
        for chunk in self.chunks:
            if chunk.base <= address < chunk.base + chunk.nbytes:
                return Location(os.getpid(), chunk.fd, chunk.chunk_id, chunk.nbytes, address - chunk.base)
        return None

    def locations(self) -> list[Location]:
        """One location per chunk (its start): what a peer maps in `connect`."""
        return [Location(os.getpid(), chunk.fd, chunk.chunk_id, chunk.nbytes, 0) for chunk in self.chunks]

    def _return_released(self) -> None:
        while self._released:
            chunk, offset, nbytes = self._released.pop()
            chunk.give_back(offset, nbytes)


# Process-wide on purpose: an arena is this process's shared memory, which peers map by its
# pid and descriptors, so a process has at most one (`reserve` refuses a second); what a peer
# mapped of it, and which peers did, are facts about the process too.
#: This process's arena (`reserve`, `release`).
_current: StateArena | None = None
#: Peers' chunks this process has mapped, by (pid, fd, chunk id), as uint8 tensors.
_peer_chunks: dict[tuple[int, int, int], torch.Tensor] = {}
#: Ranks that mapped this process's chunks at the last `connect`.
_readers: set[int] = set()


def supported() -> bool:
    """Whether this platform has what an arena needs (Linux: memfd_create, MAP_POPULATE, /proc)."""
    return hasattr(os, "memfd_create") and hasattr(mmap, "MAP_POPULATE") and os.path.isdir("/proc/self/fd")


def reserve(nbytes: int) -> StateArena:
    """Give this process an arena of `nbytes` (more chunks are added as needed); returns it."""
    global _current
    if not supported():
        raise ValueError("a state arena needs Linux (memfd_create, MAP_POPULATE and /proc)")
    if _current is not None:
        raise ValueError("this process already has a state arena; call release() first")
    _current = StateArena(nbytes)
    return _current


def current() -> StateArena | None:
    """This process's arena, or None when it has none (resharding then stages its pieces)."""
    return _current


def used_bytes() -> int:
    """Bytes of this process's arena that live tensors hold (0 without an arena): the state it
    keeps in shared memory, which memory readings count in place of the shared pages."""
    return 0 if _current is None else _current.reserved_bytes - _current.free_bytes


@contextmanager
def suspended() -> Iterator[None]:
    """Run the body as if this process had no arena (e.g. to measure the staged path)."""
    global _current
    kept, _current = _current, None
    try:
        yield
    finally:
        _current = kept


def release() -> None:
    """Forget this process's arena and the peers' chunks it mapped; their memory returns once
    no tensor uses it."""
    global _current
    _current = None
    _peer_chunks.clear()
    _readers.clear()


def peer_tensor(
    location: Location, shape: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """A view of a peer's tensor at `location` (mapped once per chunk, its pages populated)."""
    assert location.offset % dtype.itemsize == 0, "arena blocks are aligned to their element size"
    return _peer_chunk(location).view(dtype).as_strided(shape, strides, location.offset // dtype.itemsize)


def _peer_chunk(location: Location) -> torch.Tensor:
    """The whole chunk `location` lies in, as uint8: mapped (pages populated) on first use, then cached."""
    import torch

    key = (location.pid, location.fd, location.chunk_id)
    chunk = _peer_chunks.get(key)
    if chunk is None:
        descriptor = os.open(f"/proc/{location.pid}/fd/{location.fd}", os.O_RDWR)
        try:
            buffer, _ = _map_populated(descriptor, location.chunk_bytes)
        finally:
            os.close(descriptor)
        chunk = _peer_chunks[key] = torch.frombuffer(buffer, dtype=torch.uint8)
    return chunk


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.empty`, in this process's arena when it has one and `device` is the CPU."""
    import torch

    if _current is not None and device.type == "cpu":
        return _current.empty(shape, dtype)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def adopt(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself, or a copy in this process's arena when it has one, `tensor` is on the
    CPU and not in it yet."""
    if _current is None or tensor.device.type != "cpu" or _current.locate(tensor) is not None:
        return tensor
    return _current.copy(tensor)


def connect(group: Any = None) -> set[int]:
    """Map the chunks of every rank of `group` that shares this host and has an arena, and
    learn which ranks mapped this rank's (a collective: every rank of the group calls it).
    Returns the ranks whose arenas this rank reads. A rank that cannot map a peer's chunks
    (e.g. another PID namespace) is not its reader, so the peer stages what it sends there.
    Chunks a peer adds later are mapped on first use."""
    import torch.distributed as dist

    from nereus.runtime.comm import collectives

    me = dist.get_rank()
    mine = (me, shm.host_token(), _current.locations() if _current is not None else [])
    everyone = collectives.all_gathered_objects(mine, group)
    sources = set()
    for rank, token, locations in everyone:
        if rank == me or token != shm.host_token() or not locations:
            continue
        try:
            for location in locations:
                _peer_chunk(location)
        except OSError:
            continue
        sources.add(rank)
    read_by = collectives.all_gathered_objects((me, sources), group)
    _readers.clear()
    _readers.update(rank for rank, theirs in read_by if me in theirs)
    return sources


def readers() -> set[int]:
    """The ranks that mapped this rank's arena at `connect`: pieces for them go by location."""
    return set(_readers)

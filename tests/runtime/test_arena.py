"""The state arena's allocator (pure, one process) and a peer process reading its tensors."""

from __future__ import annotations

import gc
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.runtime.comm import arena
from nereus.runtime.comm.arena import ALIGN, StateArena

pytestmark = pytest.mark.one_rank


def test_empty_is_carved_from_the_arena_and_freed_when_its_last_view_dies() -> None:
    pool = StateArena(1 << 20)
    assert pool.reserved_bytes == 1 << 20 and pool.free_bytes == 1 << 20
    tensor = pool.empty((3, 5), torch.float32)
    assert tensor.shape == (3, 5) and tensor.dtype == torch.float32 and tensor.is_contiguous()
    location = pool.locate(tensor)
    assert location is not None and location.pid == os.getpid() and location.offset == 0
    assert pool.locate(tensor[1]) == arena.Location(location.pid, location.fd, location.chunk_id, 1 << 20, 20)
    assert pool.locate(torch.empty(4)) is None
    view = torch.nn.Parameter(tensor[1:])
    del tensor
    gc.collect()
    assert pool.free_bytes == (1 << 20) - ALIGN  # the parameter still holds the block
    del view
    assert pool.free_bytes == 1 << 20


def test_freed_neighbours_coalesce_and_the_arena_grows_when_full() -> None:
    pool = StateArena(4096)
    first, second, third = (pool.empty((256,), torch.float32) for _ in range(3))  # 1 KiB each
    del first, third
    assert pool.free_bytes == 3072 and pool.chunks[0].free_offsets == [0, 2048]
    del second
    assert pool.free_bytes == 4096 and pool.chunks[0].free_offsets == [0]
    big = pool.empty((2048,), torch.float32)  # 8 KiB: a new chunk of its size (more than the 4 KiB so far)
    assert len(pool.chunks) == 2 and pool.reserved_bytes == 4096 + 8192
    tiny = pool.empty((1,), torch.float32)  # a small one fits the first chunk
    small = pool.empty((1024,), torch.float32)  # 4 KiB, none free: the arena doubles (12 KiB more)
    assert pool.reserved_bytes == 2 * (4096 + 8192) and tiny.numel() == 1
    assert pool.locate(small).chunk_id == pool.chunks[2].chunk_id  # type: ignore[union-attr]
    assert pool.locate(big) is not None and pool.locate(big).chunk_id == pool.chunks[1].chunk_id  # type: ignore[union-attr]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 600), st.booleans()), min_size=1, max_size=40))
def test_live_blocks_never_overlap_and_everything_returns(steps: list[tuple[int, bool]]) -> None:
    pool = StateArena(16384)
    live: list[tuple[int, torch.Tensor]] = []
    for number, (numel, drop) in enumerate(steps):
        if drop and live:
            live.pop(len(live) // 2)
        tensor = pool.empty((numel,), torch.float32)
        live.append((number, tensor.fill_(number)))
        del tensor
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for _, t in live if pool.locate(t) is not None)
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    assert all(torch.all(t == number) for number, t in live)  # no block was overwritten
    live.clear()
    assert pool.free_bytes == pool.reserved_bytes
    assert all(chunk.free_offsets == [0] for chunk in pool.chunks)


def _arena_descriptors() -> int:
    """How many of this process's open descriptors are arena memfds."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:nereus-arena")
        except OSError:
            continue  # closed meanwhile (e.g. the descriptor listdir itself used)
    return count


def test_reserve_once_per_process_and_reject_a_bad_size() -> None:
    try:
        pool = arena.reserve(8192)
        assert arena.current() is pool
        with pytest.raises(ValueError, match="already has a state arena"):
            arena.reserve(8192)
    finally:
        arena.release()
    assert arena.current() is None
    gc.collect()
    before = _arena_descriptors()
    for _ in range(3):
        arena.reserve(8192).empty((4,), torch.float32)
        arena.release()
    gc.collect()
    assert _arena_descriptors() == before  # released arenas close their memfds
    with pytest.raises(ValueError, match="positive size"):
        StateArena(0)


#: Run in another process: view the tensor at the location transposed, print it, overwrite it.
PEER_SCRIPT = """
import sys, torch
from nereus.runtime.comm import arena
location = arena.Location(*map(int, sys.argv[1:]))
view = arena.peer_tensor(location, (2, 3), (1, 2), torch.float32)
print(view.tolist())
view.fill_(-1.0)
"""


def test_a_peer_process_reads_and_writes_the_same_memory_by_location() -> None:
    pool = StateArena(1 << 16)
    before = pool.empty((5,), torch.float32)  # so the tensor does not start the chunk
    tensor = pool.empty((3, 2), torch.float32)
    tensor.copy_(torch.arange(6, dtype=torch.float32).view(3, 2))
    location = pool.locate(tensor)
    assert location is not None and location.offset == ALIGN
    fields = [location.pid, location.fd, location.chunk_id, location.chunk_bytes, location.offset]
    peer = subprocess.run(
        [sys.executable, "-c", PEER_SCRIPT, *map(str, fields)], capture_output=True, text=True, timeout=120
    )
    assert peer.returncode == 0, peer.stderr[-2000:]
    assert json.loads(peer.stdout) == [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]
    assert torch.all(tensor == -1.0) and before.numel() == 5

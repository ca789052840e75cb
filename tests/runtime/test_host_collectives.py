"""Same-host all-reduce, all-gather and object collectives through shared memory
(multi-process gloo tier).

One spawned 4-rank world runs every case: sums and maxima of several dtypes and shapes
(0-d, non-contiguous, several slots long) over the world, over two disjoint pairs at once
and over an odd pair, interleaved; every result must equal the reduction of all ranks'
inputs in rank order, bitwise. All-gathers, object gathers and object broadcasts (small,
and over a slot) must deliver every rank's value. Groups whose ranks sit on different
(pretend) hosts, or made with NEREUS_HOST_COLLECTIVES=0, must take the process group's
path: the same bits as its own all-reduce.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nereus.runtime.comm import host_collectives, shm
from nereus.runtime.comm.spawn import spawn

pytestmark = pytest.mark.one_rank

WORLD = 4
#: (shape, dtype, transpose before reducing); the last spans several slots.
TENSORS = [
    ((), torch.float32, False),
    ((3, 5), torch.float64, False),
    ((6, 4), torch.float32, True),
    ((7,), torch.int64, False),
    ((4, 33), torch.bfloat16, False),
    ((host_collectives.SLOT_BYTES // 4 * 5 // 2,), torch.float32, False),
]


def make(rank: int, case: int) -> torch.Tensor:
    shape, dtype, transpose = TENSORS[case]
    generator = torch.Generator().manual_seed(100 * case + rank)
    if dtype == torch.int64:
        tensor = torch.randint(-1000, 1000, shape, generator=generator)
    else:
        tensor = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    return tensor.t() if transpose else tensor


def expected(ranks: list[int], case: int, op: str) -> torch.Tensor:
    inputs = [make(rank, case) for rank in ranks]
    result = inputs[0].clone()
    for other in inputs[1:]:
        result = result + other if op == "sum" else torch.maximum(result, other)
    return result


def _reduce_everywhere(rank: int, groups: dict[str, tuple[Any, list[int]]], through_gloo: bool = False) -> list[str]:
    """Every case over every group this rank is in, interleaved; the mismatches against the
    rank-order reduction (or, `through_gloo`, against the process group's own all-reduce)."""
    wrong = []
    for case in range(len(TENSORS)):
        for op in ("sum", "max"):
            for name, (group, ranks) in groups.items():
                if rank not in ranks:
                    continue
                tensor = make(rank, case)
                host_collectives.all_reduce(tensor, group, op=op)  # type: ignore[arg-type]
                if through_gloo:
                    wanted = make(rank, case)
                    dist.all_reduce(wanted, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
                else:
                    wanted = expected(ranks, case, op)
                if not torch.equal(tensor, wanted):
                    wrong.append(f"{name} case {case} {op}")
    return wrong


def _gathered(rank: int, group: Any, ranks: list[int]) -> bool:
    tensor = make(rank, 1)
    parts = [torch.empty_like(tensor) for _ in ranks]
    host_collectives.all_gather(parts, tensor, group)
    return all(torch.equal(part, make(other, 1)) for part, other in zip(parts, ranks, strict=True))


def _objects(rank: int, world_size: int, pair: tuple[Any, list[int]]) -> list[str]:
    """Object gathers and broadcasts, small and over a slot (the process group's path then)."""
    wrong = []
    for size in (0, 100, host_collectives.SLOT_BYTES):
        mine = {"rank": rank, "blob": bytes([rank]) * size}
        gathered: list[Any] = [None] * world_size
        host_collectives.all_gather_object(gathered, mine)
        if gathered != [{"rank": r, "blob": bytes([r]) * size} for r in range(world_size)]:
            wrong.append(f"all_gather_object {size}")
        group, ranks = pair
        shared = [mine] if rank == ranks[1] else [None]
        host_collectives.broadcast_object_list(shared, ranks[1], group)
        if shared != [{"rank": ranks[1], "blob": bytes([ranks[1]]) * size}]:
            wrong.append(f"broadcast_object_list {size}")
    return wrong


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    odd = dist.new_group([1, 3])
    groups = {
        "world": (None, list(range(world_size))),
        "pair": (pairs[rank // 2], [0, 1] if rank < 2 else [2, 3]),
        "odd pair": (odd, [1, 3]),
    }
    outcome: dict[str, Any] = {"one host": _reduce_everywhere(rank, groups)}
    mine = [group for group, ranks in groups.values() if rank in ranks]
    outcome["shared"] = [host_collectives._channel(group) is not None for group in mine]
    outcome["gathered"] = _gathered(rank, None, list(range(world_size)))
    outcome["objects"] = _objects(rank, world_size, groups["pair"])
    # Ranks 0-1 and 2-3 on pretend hosts: a fresh world-wide group cannot share memory.
    saved = shm._HOST_TOKEN
    shm._HOST_TOKEN = bytes([rank // 2 + 1]) * shm.TOKEN_BYTES
    split = dist.new_group(list(range(world_size)))
    outcome["two hosts"] = _reduce_everywhere(rank, {"split world": (split, list(range(world_size)))}, True)
    outcome["split shared"] = host_collectives._channel(split) is not None
    shm._HOST_TOKEN = saved
    os.environ[host_collectives.ENABLE_ENV] = "0"
    disabled = dist.new_group(list(range(world_size)))
    outcome["disabled"] = _reduce_everywhere(rank, {"disabled": (disabled, list(range(world_size)))}, True)
    outcome["disabled shared"] = host_collectives._channel(disabled) is not None
    del os.environ[host_collectives.ENABLE_ENV]
    outcome["timeout"] = _peer_never_arrives(rank, pairs[0])
    outcome["leftovers"] = sorted(path.name for path in shm.SHM_ROOT.glob(f"nereus-ar-{os.getpid()}-*"))
    return outcome


def _peer_never_arrives(rank: int, pair: Any) -> str:
    """Rank 0 waits for a counter rank 1 never raises: a clear error after the timeout."""
    if rank != 0:
        return ""
    channel = host_collectives._channel(pair)
    assert channel is not None
    channel.timeout_s = 0.2
    try:
        channel._wait(1, channel.seq + 1000)
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
def test_host_all_reduce_matches_the_rank_order_reduction_bitwise_in_every_group() -> None:
    outcomes = spawn(_worker, WORLD)
    for rank, outcome in enumerate(outcomes):
        assert outcome["one host"] == [], rank
        assert outcome["shared"] == [True] * len(outcome["shared"]), rank
        assert outcome["gathered"], rank
        assert outcome["objects"] == [], rank
        assert outcome["two hosts"] == [] and not outcome["split shared"], rank
        assert outcome["disabled"] == [] and not outcome["disabled shared"], rank
        assert outcome["leftovers"] == [], rank
    assert "rank 1 of the group did not arrive within 0.2 s" in outcomes[0]["timeout"]

"""The host backend (`nereus.runtime.comm.host_group`): its shared-memory collectives give what
gloo gives, to the bit, on every rank; what it does not carry goes to gloo; a rank that never
arrives fails the collective within the timeout; ranks of different nodes stay on gloo."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nereus.runtime.comm import collectives, host_group
from nereus.runtime.comm.spawn import spawn, timed_out

pytestmark = pytest.mark.multiprocess

needs_host = pytest.mark.skipif(not host_group.supported(), reason="shared-memory collectives need Linux on x86-64")


def _data(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(numel, generator=generator).to(dtype)


def collectives_worker(rank: int, world: int) -> dict[str, Any]:
    """Every shared-memory operation on the host group against gloo's on a plain group."""
    host = collectives.subgroup(range(world))
    gloo = dist.new_group(list(range(world)))
    assert host.getBackendName() == host_group.NAME and host.channel is not None
    mismatches = []
    seen = [host.channel.seq]

    def shared(name: str) -> None:
        """The last operation went through shared memory."""
        if host.channel.seq == seen[0]:
            mismatches.append(f"{name} went to gloo")
        seen[0] = host.channel.seq

    # sizes below, at and above one slot (1 MiB), five dtypes
    cases = [(1, torch.float32), (1000, torch.bfloat16), (300_001, torch.float32), (1 << 18, torch.float64)]
    cases += [(70_000, torch.int64), (5, torch.float16)]
    for seed, (numel, dtype) in enumerate(cases):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            mine, theirs = _data(rank, numel, dtype, seed), _data(rank, numel, dtype, seed)
            dist.all_reduce(mine, op=op, group=host)
            shared(f"all_reduce {op}")
            dist.all_reduce(theirs, op=op, group=gloo)
            expected = torch.stack([_data(r, numel, dtype, seed) for r in range(world)])
            expected = expected.sum(0, dtype=dtype) if op == dist.ReduceOp.SUM else expected.amax(0)
            if world == 2 and not torch.equal(mine, theirs):
                mismatches.append(f"all_reduce {op} {numel} {dtype} differs from gloo")
            if not torch.allclose(mine.double(), expected.double(), rtol=1e-2, atol=1e-2):
                mismatches.append(f"all_reduce {op} {numel} {dtype} is not the sum")
        tensor = _data(rank, numel, dtype, seed)
        parts = [torch.empty_like(tensor) for _ in range(world)]
        seen[0] = host.channel.seq
        dist.all_gather(parts, tensor, group=host)
        shared("all_gather")
        if not all(torch.equal(part, _data(r, numel, dtype, seed)) for r, part in enumerate(parts)):
            mismatches.append(f"all_gather {numel} {dtype}")
        flat = torch.empty(world * numel, dtype=dtype)
        dist.all_gather_into_tensor(flat, tensor, group=host)
        shared("all_gather_into_tensor")
        if not torch.equal(flat, torch.cat([_data(r, numel, dtype, seed) for r in range(world)])):
            mismatches.append(f"all_gather_into_tensor {numel} {dtype}")
        root = world - 1
        dist.broadcast(tensor, src=root, group=host)
        shared("broadcast")
        if not torch.equal(tensor, _data(root, numel, dtype, seed)):
            mismatches.append(f"broadcast {numel} {dtype}")
    strided = torch.arange(12.0).reshape(3, 4).t() * (rank + 1)  # not contiguous
    dist.all_reduce(strided, group=host)
    shared("strided all_reduce")
    if not torch.equal(strided, torch.arange(12.0).reshape(3, 4).t() * sum(range(1, world + 1))):
        mismatches.append("strided all_reduce")
    # what the host group hands to gloo: point-to-point, reduce-scatter, all-to-all, objects, barrier
    if rank == 0:
        dist.send(torch.arange(4.0), 1, group=host)
    elif rank == 1:
        got = torch.empty(4)
        dist.recv(got, 0, group=host)
        if not torch.equal(got, torch.arange(4.0)):
            mismatches.append("recv")
    out = torch.empty(world)
    dist.all_to_all_single(out, torch.full((world,), float(rank)), group=host)
    if not torch.equal(out, torch.arange(float(world))):
        mismatches.append("all_to_all_single")
    objects: list[Any] = [None] * world
    dist.all_gather_object(objects, {"rank": rank}, group=host)
    if objects != [{"rank": r} for r in range(world)]:
        mismatches.append("all_gather_object")
    dist.barrier(group=host)
    # DTensor's functional collectives on a mesh over the host group
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = DeviceMesh.from_group(host, "cpu")
    summed = DTensor.from_local(torch.full((2, 3), rank + 1.0), mesh, [Partial()]).redistribute(mesh, [Replicate()])
    shared("DTensor's all_reduce")
    if not torch.equal(summed.to_local(), torch.full((2, 3), float(sum(range(1, world + 1))))):
        mismatches.append("DTensor Partial -> Replicate")
    whole = DTensor.from_local(torch.full((1, 3), float(rank)), mesh, [Shard(0)]).full_tensor()
    if not torch.equal(whole, torch.arange(float(world)).repeat_interleave(3).reshape(world, 3)):
        mismatches.append("DTensor Shard -> Replicate")
    return mismatches


@needs_host
@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_collectives_give_what_gloo_gives(world: int) -> None:
    assert spawn(collectives_worker, world) == [[]] * world


def absent_worker(rank: int, world: int, opened: bool) -> str:
    host = collectives.subgroup(range(world))
    if opened:  # one collective together first: the segment is open when rank 1 goes missing
        dist.all_reduce(torch.ones(1), group=host)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # never joins the all-reduce below; meets rank 0 at spawn's closing barrier once it has failed
        store.wait(["failed"], timedelta(seconds=120))
        return "absent"
    try:
        dist.all_reduce(torch.ones(4), group=host)
    except RuntimeError as error:
        return str(error)
    finally:
        store.set("failed", "1")
    return "returned"


@needs_host
@pytest.mark.parametrize("opened", [True, False])
def test_a_rank_that_never_arrives_fails_the_collective_within_the_timeout(opened: bool) -> None:
    results = spawn(absent_worker, 2, opened, timeout=timedelta(seconds=3))
    assert "rank 1 of a 2-rank process group did not arrive within 3 s at a collective" in results[0]
    assert timed_out(results[0])  # what spawn and the run's failure lines read as a timeout


def nodes_worker(rank: int, world: int) -> tuple[str, bool, float]:
    host_group.shm._HOST_TOKEN = os.urandom(32)  # as on two nodes: the ranks share no memory
    host = collectives.subgroup(range(world))
    tensor = torch.full((3,), rank + 1.0)
    dist.all_reduce(tensor, group=host)
    return host.getBackendName(), host.channel is None, float(tensor[0])


@needs_host
def test_ranks_of_different_nodes_use_gloo() -> None:
    results = spawn(nodes_worker, 2)
    assert results == [(host_group.NAME, True, 3.0)] * 2


def switched_off_worker(rank: int, world: int) -> str:
    group = collectives.subgroup(range(world))
    return dist.get_backend(group)


def test_the_switch_leaves_every_group_on_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_group.ENABLE_ENV, "0")
    assert spawn(switched_off_worker, 2) == ["gloo", "gloo"]

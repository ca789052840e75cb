"""Where the tensor ranks meet (`nereus.runtime.model.tensor_parallel`): `replicated`, `summed`
and `gather_last_dim` give what DTensor's own redistributions give (the reference: `Replicate()`
with a `Partial()` gradient, `Partial()` to `Replicate()`, `Shard(-1)` to `Replicate()`), to the
bit, outputs and gradients, on 2 and 3 ranks, contiguous or strided, fp32 and bf16."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nereus.runtime.comm import collectives
from nereus.runtime.comm.spawn import spawn

pytestmark = pytest.mark.multiprocess


def _reference(kind: str, tensor: torch.Tensor, mesh: Any) -> torch.Tensor:
    """DTensor's own meeting for `kind`."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if kind == "replicated":
        return DTensor.from_local(tensor, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    if kind == "summed":
        return DTensor.from_local(tensor, mesh, [Partial()], run_check=False).full_tensor()
    return DTensor.from_local(tensor, mesh, [Shard(tensor.dim() - 1)], run_check=False).full_tensor()


def meetings_worker(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import DeviceMesh

    from nereus.runtime.model.tensor_parallel import TensorParallel, gather_last_dim, replicated, summed

    group = collectives.subgroup(range(world))
    mesh = DeviceMesh.from_group(group, "cpu")
    tp = TensorParallel(size=world, rank=rank, group=group)
    ours = {
        "replicated": lambda t: replicated(t, group),
        "summed": lambda t: summed(t, group),
        "gathered": lambda t: gather_last_dim(t, tp),
    }
    mismatches = []
    for dtype in (torch.float32, torch.bfloat16):
        for strided in (False, True):
            for kind, meet in ours.items():
                # `replicated` takes the same input on every rank, the others each rank's own;
                # the gradient arriving from above differs per rank, so its sum is tested
                same = torch.Generator().manual_seed(7)
                own = torch.Generator().manual_seed(8 + rank)
                base = torch.randn(10, 6, generator=same if kind == "replicated" else own).to(dtype)
                upstream = torch.randn(6, 10 * (world if kind == "gathered" else 1), generator=own).to(dtype)
                results = []
                for function in (meet, lambda t, kind=kind: _reference(kind, t, mesh)):
                    leaf = base.clone().requires_grad_(kind != "gathered")
                    x = leaf.t() if strided else leaf.t().contiguous()  # [6, 10], strided or not
                    y = function(x)
                    if kind != "gathered":
                        (y * upstream).sum().backward()
                    results.append((y.detach(), leaf.grad))
                label = f"{kind} {dtype} {'strided' if strided else 'contiguous'}"
                (mine, my_grad), (theirs, their_grad) = results
                if not torch.equal(mine, theirs):
                    mismatches.append(f"{label}: output differs from DTensor's")
                if kind != "gathered" and not torch.equal(my_grad, their_grad):
                    mismatches.append(f"{label}: gradient differs from DTensor's")
    return mismatches


@pytest.mark.parametrize("world", [2, 3])
def test_meetings_equal_dtensors_redistributions_to_the_bit(world: int) -> None:
    for mismatches in spawn(meetings_worker, world):
        assert mismatches == []

"""The runtime's one collectives interface: every collective over a process group goes through here.

`all_reduce`, `all_gather`, `broadcast`, `reduce_scatter`, `all_to_all`, the object collectives
(`all_gathered_objects`, `broadcast_object`, `gather_object`), `barrier`, and `subgroup`,
the process group of a set of ranks. Every call takes `group` (None: the world) and
behaves like the `torch.distributed` call of the same name, on the group's own backend:
NCCL on GPUs; on CPU ranks the world is gloo and every `subgroup` is the host backend
(`host_group`: gloo, with all-reduce, all-gather and broadcast through shared memory among
the ranks of one host). Point-to-point sends and receives (pipeline links, resharding) call
`torch.distributed` directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist

from nereus.runtime.comm import host_group
from nereus.runtime.comm.world import collective_timeout

if TYPE_CHECKING:
    import torch

Op = Literal["sum", "max"]


def all_reduce(tensor: torch.Tensor, group: Any = None, op: Op = "sum") -> None:
    """Reduce `tensor` in place over `group`: every rank gets the sum (or max), bitwise equal."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)


def all_gather(parts: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
    """`parts[r]` receives group rank r's `tensor` (every rank's of one shape and dtype)."""
    dist.all_gather(parts, tensor.contiguous(), group=group)


def all_gathered(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank of `group`'s `tensor` (one shape and dtype on all), in group rank order."""
    tensor = tensor.contiguous()
    parts = [tensor.new_empty(tensor.shape) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


def broadcast(tensor: torch.Tensor, src: int, group: Any = None) -> None:
    """Every rank's `tensor` becomes global rank `src`'s."""
    dist.broadcast(tensor, src=src, group=group)


def reduce_scatter(flat: torch.Tensor, group: Any, parts: int, index: int) -> torch.Tensor:
    """Part `index` of the sum over `group` of `flat` (`parts` equal parts). NCCL reduce-
    scatters; gloo has no reduce-scatter, so on CPU `flat` is all-reduced in place and the
    part kept (the same sums)."""
    import torch

    size = flat.numel() // parts
    if flat.is_cuda:
        out = torch.empty(size, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_tensor(out, flat, group=group)
        return out
    all_reduce(flat, group)
    return flat[index * size : (index + 1) * size]


def all_to_all(
    output: torch.Tensor, tensor: torch.Tensor, output_sizes: list[int], input_sizes: list[int], group: Any
) -> None:
    """Split `tensor` along dim 0 into `input_sizes` runs, send run r to group rank r; `output`
    receives group rank r's run for this rank in its r-th run of `output_sizes` (gloo and NCCL)."""
    dist.all_to_all_single(output, tensor.contiguous(), output_sizes, input_sizes, group=group)


def all_gathered_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank of `group`'s `obj`, in group rank order (pickled: objects of this run's own ranks)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def broadcast_object(obj: Any, src: int, group: Any = None) -> Any:
    """Global rank `src`'s `obj`, on every rank (the others' `obj` is ignored)."""
    objects = [obj]
    dist.broadcast_object_list(objects, src=src, group=group)
    return objects[0]


def gather_object(obj: Any, gathered: list[Any] | None, dst: int = 0, group: Any = None) -> None:
    """Global rank `dst`'s `gathered[r]` becomes group rank r's `obj` (the others pass None)."""
    dist.gather_object(obj, gathered, dst=dst, group=group)


def barrier(group: Any = None) -> None:
    """Return once every rank of `group` has called it."""
    dist.barrier(group=group)


#: The process groups `subgroup` made, by their ranks, for the world `_subgroups_world`. Process-wide
#: on purpose: a process group is a communicator of the world, created collectively (every rank, same
#: order) and never freed by torch, so each rank set gets one group per world, reused by every layout
#: and engine that needs it, rather than one per caller.
_subgroups: dict[tuple[int, ...], Any] = {}
_subgroups_world: Any = None


def subgroup(ranks: Sequence[int]) -> Any:
    """The process group of `ranks` (None for a single rank), made on first use. A collective
    on first use: every world rank must ask for the same rank sets in the same order."""
    global _subgroups_world
    if len(ranks) == 1:
        return None
    if _subgroups_world is not dist.group.WORLD:  # a new world (a spawned test's next run)
        _subgroups_world = dist.group.WORLD
        _subgroups.clear()
    key = tuple(sorted(ranks))
    if key not in _subgroups:
        # torch gives a new group its backend's default timeout (30 min for gloo), not the world's
        # on CPU ranks the host backend (gloo with shared-memory collectives), else the world's
        _subgroups[key] = dist.new_group(list(key), timeout=collective_timeout(), backend=host_group.backend())
    return _subgroups[key]

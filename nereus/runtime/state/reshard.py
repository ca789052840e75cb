"""Move a model's state from one RankLayout to another by box overlap: `execute` runs a plan
of `reshard_plan.plan_reshard` (which pieces move where) with `piece_exchange` (how they travel).

`execute` runs a plan on every rank of a torch.distributed job, either straight from each
piece's source ("p2p") or as a binomial-tree broadcast ("broadcast", `reshard_plan.broadcast_rounds`).
Same-host pairs holding CPU state exchange pieces through shared memory, other pairs as one
process-group message per piece (`piece_exchange`). While this process has a state arena
(`nereus.runtime.comm.arena`), `execute` allocates its results in it, so the next reshard reads
them directly too. The two layouts may use different or overlapping ranks; a rank in neither
returns at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nereus.runtime.comm import arena, shm
from nereus.runtime.state.piece_exchange import (
    Moved,
    Transport,
    dst_view,
    exchange,
    shared_memory_peers,
    src_view,
    wait_all,
)
from nereus.runtime.state.reshard_plan import Hop, Method, ReshardPlan, broadcast_rounds, peers_of
from nereus.runtime.state.shard_layout import box_shape
from nereus.runtime.state.sharded_state import check_rank_state, torch_dtype

if TYPE_CHECKING:
    import torch


@dataclass
class ReshardResult:
    """One rank's outcome of `execute`."""

    tensors: dict[str, torch.Tensor]
    """The rank's state in the target layout (empty when it is not in the target layout)."""
    step: int | None
    """The optimizer step (None when the rank is not in the target layout)."""
    bytes_sent: int
    bytes_received: int
    bytes_received_shared_memory: int = 0
    """The part of `bytes_received` that came through same-host shared memory."""
    bytes_received_direct: int = 0
    """The part of `bytes_received_shared_memory` copied straight out of the sender's arena (not staged)."""


def execute(
    plan: ReshardPlan,
    rank: int,
    tensors: dict[str, torch.Tensor],
    step: int | None,
    method: Method = "p2p",
    device: torch.device | None = None,
    transport: Transport = "auto",
    out: dict[str, torch.Tensor] | None = None,
) -> ReshardResult:
    """Run `plan` on this rank; every rank in either layout must call it with the same
    plan, method and transport.

    `tensors` is the rank's state in the source layout (empty if it is not in it) and
    `step` its optimizer step (None if it is not in the source layout). New tensors are
    allocated on `device` (default: the device of the rank's tensors, else the CPU; on
    the CPU in this process's state arena when it has one); a tensor whose box is the
    same in both layouts is passed through, not copied.
    `out`, when given, is the rank's state in the target layout to overwrite in place
    instead (e.g. an engine's live tensors, or the result of the previous reshard), so a
    repeated reshard allocates nothing; it must not share memory with `tensors`, except
    that a kept tensor may be the very same object in both, and sets the device.
    """

    in_source, in_target = rank in plan.source.boxes, rank in plan.target.boxes
    if not in_source and not in_target:
        return ReshardResult({}, None, 0, 0)
    if in_source:
        check_rank_state(plan.source, rank, tensors)
        if step is None:
            raise ValueError(f"rank {rank} is in the source layout and must pass its optimizer step")
    new, device = _target_tensors(plan, rank, tensors, device, out)

    def copy_local_pieces() -> None:
        for transfer in plan.transfers:
            if transfer.local and transfer.dst == rank and new[transfer.key] is not tensors[transfer.key]:
                shm.copy_bulk(dst_view(new, transfer), src_view(tensors, transfer))

    rounds: list[list[Hop]] = [[(None, t) for t in plan.moved()]] if method == "p2p" else broadcast_rounds(plan)
    cpu_only = device.type == "cpu" and all(tensor.device.type == "cpu" for tensor in tensors.values())
    shared = shared_memory_peers(peers_of(rounds, rank), transport == "auto" and cpu_only)
    moved = Moved()
    for number, hops in enumerate(rounds or [[]]):
        exchange(hops, rank, tensors, new, copy_local_pieces if number == 0 else lambda: None, shared, moved)
    new_step = _share_step(plan, rank, step, device)
    return ReshardResult(
        new, new_step if in_target else None, moved.sent, moved.received, moved.received_shared, moved.received_direct
    )


def _target_tensors(
    plan: ReshardPlan,
    rank: int,
    tensors: dict[str, torch.Tensor],
    device: torch.device | None,
    out: dict[str, torch.Tensor] | None,
) -> tuple[dict[str, torch.Tensor], torch.device]:
    """The tensors the rank's target state goes into, and their device."""
    import torch

    # A tensor whose box is the same in both layouts is handed over as is, not copied.
    kept = {t.key for t in plan.transfers if t.local and t.dst == rank and t.piece == t.src_box == t.dst_box}
    if out is not None:
        _check_out(plan, rank, tensors, out, kept, device)
        return dict(out), next(iter(out.values())).device if out else device or torch.device("cpu")
    if device is None:
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    new = {
        key: tensors[key]
        if key in kept and tensors[key].device == device
        else arena.empty(box_shape(box), torch_dtype(plan.target.tensors[key].dtype), device)
        for key, box in plan.target.rank_boxes(rank).items()
    }
    return new, device


def _check_out(
    plan: ReshardPlan,
    rank: int,
    tensors: dict[str, torch.Tensor],
    out: dict[str, torch.Tensor],
    kept: set[str],
    device: torch.device | None,
) -> None:
    """Raise ValueError unless `out` is exactly the rank's target state and overwriting it spares the source."""
    check_rank_state(plan.target, rank, out)
    sources = {tensor.untyped_storage().data_ptr(): key for key, tensor in tensors.items() if tensor.numel()}
    for key, tensor in out.items():
        shared = sources.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None
        if shared is not None and not (shared == key and key in kept and tensor is tensors[key]):
            raise ValueError(f"rank {rank}: out[{key!r}] shares memory with the source tensor {shared!r}")
    devices = {tensor.device for tensor in out.values()} | ({device} if device is not None else set())
    if len(devices) > 1:
        raise ValueError(f"rank {rank}: out tensors and device disagree: {sorted(map(str, devices))}")


def _share_step(plan: ReshardPlan, rank: int, step: int | None, device: torch.device) -> int | None:
    """Send the optimizer step from the step source to target ranks that were not in the source."""
    import torch
    import torch.distributed as dist

    newcomers = sorted(set(plan.target.boxes) - set(plan.source.boxes))
    if rank == plan.step_source and newcomers:
        value = torch.tensor([step], dtype=torch.int64, device=device)
        wait_all(dist.batch_isend_irecv([dist.P2POp(dist.isend, value, newcomer) for newcomer in newcomers]))
    if rank in newcomers:
        value = torch.empty(1, dtype=torch.int64, device=device)
        wait_all(dist.batch_isend_irecv([dist.P2POp(dist.irecv, value, plan.step_source)]))
        return int(value.item())
    return step

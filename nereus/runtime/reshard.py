"""Move a model's state from one RankLayout to another by box overlap.

`plan_reshard` is pure Python: for every rank of the target layout and every key it must
hold, it cuts the target box by the distinct source boxes of that key (in one layout the
distinct boxes of a key tile the tensor, replicas repeat a box). A piece the rank already
holds is copied locally; any other piece comes from one of its holders, preferring the
same node, then the least-loaded sender. The bytes that cross ranks are compared with the
lower bound: the bytes each target rank must hold but does not hold yet.

`execute` runs a plan on every rank of a torch.distributed job over `batch_isend_irecv`
(one message per piece; contiguous pieces go without a copy), either straight from each
piece's source ("p2p") or as a binomial-tree broadcast ("broadcast"): a piece that one
source sends to several ranks is relayed by the ranks that already received it, so the
source sends it about log2(receivers + 1) times instead of once per receiver.
The two layouts may use different or overlapping ranks; a rank in neither returns at once.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from nereus.runtime.shard_layout import Box, box_numel, box_shape, intersect
from nereus.runtime.sharded_state import StateMeta, box_slices, check_rank_state, torch_dtype

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

#: How the executor moves pieces between ranks.
Method = Literal["p2p", "broadcast"]


@dataclass(frozen=True)
class Transfer:
    """One piece of one tensor going from a source rank to a target rank."""

    src: int
    """Rank that holds the piece in the source layout (equal to dst for a local copy)."""
    dst: int
    """Rank that holds the piece in the target layout."""
    key: str
    piece: Box
    """The piece, in global coordinates."""
    src_box: Box
    """The box the source rank holds of `key` in the source layout."""
    dst_box: Box
    """The box the target rank holds of `key` in the target layout."""
    nbytes: int

    @property
    def local(self) -> bool:
        return self.src == self.dst


#: One message: (how the sender got the piece: None for its source, the receiver's transfer).
Hop = tuple[Transfer | None, Transfer]


@dataclass(frozen=True)
class ReshardPlan:
    """Every piece each target rank gets, and how many bytes cross ranks."""

    source: StateMeta
    target: StateMeta
    transfers: tuple[Transfer, ...]
    step_source: int
    """The source rank that tells target ranks new to the job the optimizer step."""
    bytes_moved: int
    """Bytes sent between different ranks."""
    lower_bound: int
    """Bytes the target ranks must hold and do not hold yet: no plan moves fewer."""

    def moved(self) -> list[Transfer]:
        return [transfer for transfer in self.transfers if not transfer.local]


def lower_bound(source: StateMeta, target: StateMeta) -> int:
    """Bytes every target rank must end up holding that it does not hold in the source layout."""
    total = 0
    for rank, boxes in target.boxes.items():
        held = source.rank_boxes(rank)
        for key, box in boxes.items():
            own = held.get(key)
            overlap = intersect(box, own) if own is not None else None
            missing = box_numel(box) - (box_numel(overlap) if overlap is not None else 0)
            total += missing * target.tensors[key].itemsize
    return total


def _check_compatible(source: StateMeta, target: StateMeta) -> None:
    if source.model != target.model or source.head != target.head:
        raise ValueError(
            f"cannot reshard {source.model.name} ({source.head} head) into {target.model.name} ({target.head} head)"
        )
    missing = [family for family in target.families if family not in source.families]
    if missing:
        raise ValueError(f"the target layout needs families {missing} that the source state does not have")
    for key, meta in target.tensors.items():
        if source.tensors[key].dtype != meta.dtype:
            raise ValueError(f"{key} is {source.tensors[key].dtype} in the source and {meta.dtype} in the target")


def plan_reshard(source: StateMeta, target: StateMeta, ranks_per_node: int | None = None) -> ReshardPlan:
    """The transfers that turn `source` into `target` (same model; target families a subset).

    `ranks_per_node` groups consecutive global ranks into nodes (None: one node), so a
    piece comes from a holder on the target's node when one exists.
    """
    _check_compatible(source, target)

    def node(rank: int) -> int:
        return 0 if ranks_per_node is None else rank // ranks_per_node

    load: dict[int, int] = defaultdict(int)
    transfers: list[Transfer] = []
    for key, meta in target.tensors.items():
        holders_by_box: dict[Box, list[int]] = defaultdict(list)
        for rank, box in source.holders(key).items():
            holders_by_box[box].append(rank)
        for dst, dst_box in sorted(target.holders(key).items()):
            own = source.rank_boxes(dst).get(key)
            for src_box, holders in holders_by_box.items():
                piece = intersect(dst_box, src_box)
                if piece is None:
                    continue
                nbytes = box_numel(piece) * meta.itemsize
                if src_box == own:
                    src = dst
                else:
                    src = min(holders, key=lambda rank: (node(rank) != node(dst), load[rank], rank))
                    load[src] += nbytes
                transfers.append(Transfer(src, dst, key, piece, src_box, dst_box, nbytes))
    moved = sum(transfer.nbytes for transfer in transfers if not transfer.local)
    return ReshardPlan(source, target, tuple(transfers), min(source.layout.ranks), moved, lower_bound(source, target))


@dataclass
class ReshardResult:
    """One rank's outcome of `execute`."""

    tensors: dict[str, torch.Tensor]
    """The rank's state in the target layout (empty when it is not in the target layout)."""
    step: int | None
    """The optimizer step (None when the rank is not in the target layout)."""
    bytes_sent: int
    bytes_received: int


def execute(
    plan: ReshardPlan,
    rank: int,
    tensors: dict[str, torch.Tensor],
    step: int | None,
    method: Method = "p2p",
    device: torch.device | None = None,
) -> ReshardResult:
    """Run `plan` on this rank; every rank in either layout must call it with the same plan.

    `tensors` is the rank's state in the source layout (empty if it is not in it) and
    `step` its optimizer step (None if it is not in the source layout). New tensors are
    allocated on `device` (default: the device of the rank's tensors, else the CPU); a
    tensor whose box is the same in both layouts is passed through, not copied.
    """
    import torch

    in_source, in_target = rank in plan.source.boxes, rank in plan.target.boxes
    if not in_source and not in_target:
        return ReshardResult({}, None, 0, 0)
    if in_source:
        check_rank_state(plan.source, rank, tensors)
        if step is None:
            raise ValueError(f"rank {rank} is in the source layout and must pass its optimizer step")
    if device is None:
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    # A tensor whose box is the same in both layouts is handed over as is, not copied.
    kept = {t.key for t in plan.transfers if t.local and t.dst == rank and t.piece == t.src_box == t.dst_box}
    new = {
        key: tensors[key]
        if key in kept and tensors[key].device == device
        else torch.empty(box_shape(box), dtype=torch_dtype(plan.target.tensors[key].dtype), device=device)
        for key, box in plan.target.rank_boxes(rank).items()
    }

    def copy_local_pieces() -> None:
        for transfer in plan.transfers:
            if transfer.local and transfer.dst == rank and new[transfer.key] is not tensors[transfer.key]:
                _dst_view(new, transfer).copy_(_src_view(tensors, transfer))

    mover = _broadcast if method == "broadcast" else _point_to_point
    sent, received = mover(plan, rank, tensors, new, copy_local_pieces)
    new_step = _share_step(plan, rank, step, device)
    return ReshardResult(new, new_step if in_target else None, sent, received)


def _src_view(tensors: dict[str, torch.Tensor], transfer: Transfer) -> torch.Tensor:
    return tensors[transfer.key][box_slices(transfer.piece, transfer.src_box)]


def _dst_view(tensors: dict[str, torch.Tensor], transfer: Transfer) -> torch.Tensor:
    return tensors[transfer.key][box_slices(transfer.piece, transfer.dst_box)]


def _receive_buffer(view: torch.Tensor, pending: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """A tensor to receive into: the view itself when contiguous, else a buffer copied in later."""
    if view.is_contiguous():
        return view
    buffer = view.new_empty(view.shape)
    pending.append((view, buffer))
    return buffer


def _point_to_point(
    plan: ReshardPlan,
    rank: int,
    tensors: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    meanwhile: Callable[[], None],
) -> tuple[int, int]:
    """Send every piece straight from its source; run `meanwhile` while the messages fly."""
    hops: list[Hop] = [(None, transfer) for transfer in plan.moved()]
    return _exchange(hops, rank, tensors, new, meanwhile)


def _exchange(
    hops: list[Hop],
    rank: int,
    tensors: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    meanwhile: Callable[[], None],
) -> tuple[int, int]:
    """Post this rank's sends and receives of `hops`, run `meanwhile`, wait; (bytes sent, received)."""
    import torch.distributed as dist

    ops: list[dist.P2POp] = []
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    sent = received = 0
    for got, transfer in hops:
        sender = transfer.src if got is None else got.dst
        if sender == rank:
            data = _src_view(tensors, transfer) if got is None else _dst_view(new, got)
            ops.append(dist.P2POp(dist.isend, data.contiguous(), transfer.dst))
            sent += transfer.nbytes
        elif transfer.dst == rank:
            ops.append(dist.P2POp(dist.irecv, _receive_buffer(_dst_view(new, transfer), pending), sender))
            received += transfer.nbytes
    requests = dist.batch_isend_irecv(ops) if ops else []
    meanwhile()
    for request in requests:
        request.wait()
    for view, buffer in pending:
        view.copy_(buffer)
    return sent, received


def _run(ops: list[dist.P2POp]) -> None:
    import torch.distributed as dist

    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def _fan_out_groups(plan: ReshardPlan) -> list[list[Transfer]]:
    """Moved transfers grouped by (source, key, piece): the receivers of one identical piece."""
    groups: dict[tuple[int, str, Box], list[Transfer]] = defaultdict(list)
    for transfer in plan.moved():
        groups[(transfer.src, transfer.key, transfer.piece)].append(transfer)
    return list(groups.values())


def broadcast_rounds(plan: ReshardPlan) -> list[list[Hop]]:
    """The hops of every round: each rank holding a piece passes it on once per round.

    A piece one source sends to k ranks then leaves the source about log2(k + 1) times
    instead of k times; receivers relay what they got in earlier rounds.
    """
    rounds: list[list[Hop]] = []
    for group in _fan_out_groups(plan):
        holders: list[Transfer | None] = [None]
        waiting = list(group)
        for number in itertools.count():
            if not waiting:
                break
            if number == len(rounds):
                rounds.append([])
            hops = [(got, waiting.pop(0)) for got in holders[: len(waiting)]]
            rounds[number] += hops
            holders += [transfer for _, transfer in hops]
    return rounds


def _broadcast(
    plan: ReshardPlan,
    rank: int,
    tensors: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    meanwhile: Callable[[], None],
) -> tuple[int, int]:
    """Move every piece by a binomial-tree broadcast over point-to-point sends, round by round."""
    sent = received = 0
    rounds = broadcast_rounds(plan) or [[]]
    for number, hops in enumerate(rounds):
        round_sent, round_received = _exchange(hops, rank, tensors, new, meanwhile if number == 0 else _nothing)
        sent, received = sent + round_sent, received + round_received
    return sent, received


def _nothing() -> None:
    return None


def _share_step(plan: ReshardPlan, rank: int, step: int | None, device: torch.device) -> int | None:
    """Send the optimizer step from the step source to target ranks that were not in the source."""
    import torch
    import torch.distributed as dist

    newcomers = sorted(set(plan.target.boxes) - set(plan.source.boxes))
    if rank == plan.step_source and newcomers:
        value = torch.tensor([step], dtype=torch.int64, device=device)
        _run([dist.P2POp(dist.isend, value, newcomer) for newcomer in newcomers])
    if rank in newcomers:
        value = torch.empty(1, dtype=torch.int64, device=device)
        _run([dist.P2POp(dist.irecv, value, plan.step_source)])
        return int(value.item())
    return step

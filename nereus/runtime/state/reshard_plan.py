"""Planning a reshard (pure Python): which pieces of a model's state move from one RankLayout to
another, by box overlap, and the order they travel in.

For every rank of the target layout and every key it must hold, `plan_reshard` cuts the
target box by the distinct source boxes of that key (in one layout the distinct boxes of a
key tile the tensor, replicas repeat a box). A piece the rank already holds is copied
locally; any other piece comes from one of its holders, preferring the same node, then the
least-loaded sender. The bytes that cross ranks are compared with the lower bound: the
bytes each target rank must hold but does not hold yet. `broadcast_rounds` orders the moved
pieces as a binomial-tree broadcast (receivers relay what they got); `nereus.runtime.state.
reshard.execute` runs a plan.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

from nereus.runtime.state.shard_layout import Box, box_numel, intersect
from nereus.runtime.state.sharded_state import StateMeta

#: How the executor routes pieces: each straight from its source, or relayed along a binomial tree.
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


def sender_of(hop: Hop) -> int:
    got, transfer = hop
    return transfer.src if got is None else got.dst


def peers_of(rounds: list[list[Hop]], rank: int) -> list[int]:
    """Every rank this rank sends a piece to or receives one from, in any round."""
    peers = set()
    for hops in rounds:
        for hop in hops:
            sender, receiver = sender_of(hop), hop[1].dst
            if rank in (sender, receiver):
                peers.add(receiver if sender == rank else sender)
    return sorted(peers)


def broadcast_rounds(plan: ReshardPlan) -> list[list[Hop]]:
    """The hops of every round: each rank holding a piece passes it on once per round.

    A piece one source sends to k ranks then leaves the source about log2(k + 1) times
    instead of k times; receivers relay what they got in earlier rounds.
    """
    # The receivers of one identical piece: moved transfers grouped by (source, key, piece).
    groups: dict[tuple[int, str, Box], list[Transfer]] = defaultdict(list)
    for transfer in plan.moved():
        groups[(transfer.src, transfer.key, transfer.piece)].append(transfer)
    rounds: list[list[Hop]] = []
    for waiting in groups.values():
        holders: list[Transfer | None] = [None]
        for number in itertools.count():
            if not waiting:
                break
            if number == len(rounds):
                rounds.append([])
            hops = [(got, waiting.pop(0)) for got in holders[: len(waiting)]]
            rounds[number] += hops
            holders += [transfer for _, transfer in hops]
    return rounds

"""Move a model's state from one RankLayout to another by box overlap.

`plan_reshard` is pure Python: for every rank of the target layout and every key it must
hold, it cuts the target box by the distinct source boxes of that key (in one layout the
distinct boxes of a key tile the tensor, replicas repeat a box). A piece the rank already
holds is copied locally; any other piece comes from one of its holders, preferring the
same node, then the least-loaded sender. The bytes that cross ranks are compared with the
lower bound: the bytes each target rank must hold but does not hold yet.

`execute` runs a plan on every rank of a torch.distributed job, either straight from each
piece's source ("p2p") or as a binomial-tree broadcast ("broadcast"): a piece that one
source sends to several ranks is relayed by the ranks that already received it, so the
source sends it about log2(receivers + 1) times instead of once per receiver.
Two ranks on one host holding CPU state exchange their pieces through shared memory
(`nereus.runtime.comm.shm`: one copy into a pooled segment, one copy out, no sockets); a
piece that lies in the sender's state arena (`nereus.runtime.comm.arena`) is not staged: the
receiver copies it straight out of the sender's tensor. While this process has an
arena, `execute` allocates its results in it, so the next reshard reads them directly too.
Other pairs (other hosts, GPUs under NCCL) send one process-group message per piece
(contiguous pieces go without a copy). Pairs swap host tokens first, so the choice is
made per pair and automatically. `out` lets a repeated reshard fill the previous
result (or an engine's live tensors) instead of allocating fresh memory.
The two layouts may use different or overlapping ranks; a rank in neither returns at once.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import astuple, dataclass, field, fields
from typing import TYPE_CHECKING, Literal

from nereus.runtime.comm import arena, shm
from nereus.runtime.state.shard_layout import Box, box_numel, box_shape, intersect
from nereus.runtime.state.sharded_state import StateMeta, box_slices, check_rank_state, torch_dtype

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

#: How the executor routes pieces: each straight from its source, or relayed along a binomial tree.
Method = Literal["p2p", "broadcast"]
#: How pieces travel between two ranks. "auto": through a shared-memory segment when both
#: ranks are on one host and hold CPU state under gloo, else as process-group messages
#: (gloo over TCP, NCCL on GPUs); "process_group": always as process-group messages.
Transport = Literal["auto", "process_group"]


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
                shm.copy_bulk(_dst_view(new, transfer), _src_view(tensors, transfer))

    rounds: list[list[Hop]] = [[(None, t) for t in plan.moved()]] if method == "p2p" else broadcast_rounds(plan)
    cpu_only = device.type == "cpu" and all(tensor.device.type == "cpu" for tensor in tensors.values())
    shared = _shared_memory_peers(_peers(rounds, rank), transport == "auto" and cpu_only)
    moved = Moved()
    for number, hops in enumerate(rounds or [[]]):
        _exchange(hops, rank, tensors, new, copy_local_pieces if number == 0 else _nothing, shared, moved)
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


def _sender(hop: Hop) -> int:
    got, transfer = hop
    return transfer.src if got is None else got.dst


def _peers(rounds: list[list[Hop]], rank: int) -> list[int]:
    """Every rank this rank sends a piece to or receives one from, in any round."""
    peers = set()
    for hops in rounds:
        for hop in hops:
            sender, receiver = _sender(hop), hop[1].dst
            if rank in (sender, receiver):
                peers.add(receiver if sender == rank else sender)
    return sorted(peers)


def _shared_memory_peers(peers: list[int], usable: bool) -> dict[int, bytes]:
    """The peers this rank shares a host's memory with, by their process nonce.

    Every pair that exchanges pieces swaps host tokens first (one small message each
    way); both sides then decide alike. Only CPU state under gloo takes part: NCCL moves
    device tensors itself, and a rank that must not share sends a token nobody has.
    """
    import torch
    import torch.distributed as dist

    if not peers or dist.get_backend() != "gloo":
        return {}
    token = shm.host_token() if usable else shm.private_token()
    mine = torch.frombuffer(bytearray(token + shm.PROCESS_NONCE), dtype=torch.uint8)
    theirs = {peer: torch.empty_like(mine) for peer in peers}
    requests = [_post(dist.isend, mine, peer, HELLO_TAG) for peer in peers]
    _wait(requests + [_post(dist.irecv, theirs[peer], peer, HELLO_TAG) for peer in peers])
    shared = {}
    for peer, hello in theirs.items():
        raw = hello.numpy().tobytes()
        if usable and raw[: shm.TOKEN_BYTES] == token:
            shared[peer] = raw[shm.TOKEN_BYTES :]
    return shared


#: Message tags that keep the shared-memory path's messages apart from the pieces' messages.
HELLO_TAG, HEADER_TAG, DONE_TAG, FALLBACK_TAG, WHERE_TAG = 17, 18, 19, 20, 21
#: How a piece to a shared-memory peer travels: staged in the segment, read straight out of
#: the sender's arena, or (no segment could be made) as a process-group message.
STAGED, DIRECT, MESSAGE = 0, 1, 2
#: One row per piece: how, then where in the sender's arena (the fields of arena.Location)
#: and the piece's strides (up to MAX_DIMS; a piece of more dims is staged).
MAX_DIMS = 4
LOCATION_FIELDS = len(fields(arena.Location))
WHERE_WIDTH = 1 + LOCATION_FIELDS + MAX_DIMS


@dataclass
class Moved:
    """Bytes one rank moved in `execute`, summed over rounds."""

    sent: int = 0
    received: int = 0
    received_shared: int = 0
    received_direct: int = 0


def _wait(requests: list[dist.Work]) -> None:
    for request in requests:
        request.wait()


def _post(operation: Callable[..., dist.Work | None], tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
    """Post one asynchronous control message (gloo returns a request for each)."""
    request = operation(tensor, peer, tag=tag)
    assert request is not None, "a point-to-point message in this process returned no request"
    return request


@dataclass
class Sorted:
    """One rank's pieces of one round, by how they travel."""

    ops: list[dist.P2POp] = field(default_factory=list)
    """Process-group messages, one per piece."""
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(strided target view, contiguous receive buffer): copied in once the messages arrive."""
    staged: dict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    """Pieces to stage in shared memory, by receiving peer, in hop order."""
    unstaged: dict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    """Target views to fill from shared memory, by sending peer, in hop order."""


def _sort_hops(
    hops: list[Hop],
    rank: int,
    tensors: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    shared: dict[int, bytes],
    moved: Moved,
) -> Sorted:
    import torch.distributed as dist

    pieces = Sorted()
    for hop in hops:
        sender, (got, transfer) = _sender(hop), hop
        if sender == rank:
            data = _src_view(tensors, transfer) if got is None else _dst_view(new, got)
            if transfer.dst in shared:
                pieces.staged[transfer.dst].append(data)
            else:
                pieces.ops.append(dist.P2POp(dist.isend, data.contiguous(), transfer.dst))
            moved.sent += transfer.nbytes
        elif transfer.dst == rank:
            view = _dst_view(new, transfer)
            if sender in shared:
                pieces.unstaged[sender].append(view)
            else:
                pieces.ops.append(dist.P2POp(dist.irecv, _receive_buffer(view, pieces.pending), sender))
            moved.received += transfer.nbytes
    return pieces


def _exchange(
    hops: list[Hop],
    rank: int,
    tensors: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    meanwhile: Callable[[], None],
    shared: dict[int, bytes],
    moved: Moved,
) -> None:
    """Move this rank's pieces of `hops`, running `meanwhile` while they travel.

    Pieces to and from `shared` peers go by shared memory: the sender tells the receiver
    where each piece is (its own arena, or a segment it copied the rest into) and the
    receiver copies them out and answers, so the sender may change its tensors or reuse
    the segment. Other pieces are messages of the process group (gloo or NCCL), one per piece.
    """
    import torch
    import torch.distributed as dist

    pieces = _sort_hops(hops, rank, tensors, new, shared, moved)
    requests = dist.batch_isend_irecv(pieces.ops) if pieces.ops else []
    headers = {peer: torch.empty(shm.NAME_BYTES, dtype=torch.uint8) for peer in pieces.unstaged}
    wheres = {peer: torch.empty(len(views), WHERE_WIDTH, dtype=torch.int64) for peer, views in pieces.unstaged.items()}
    arrivals = {
        peer: (_post(dist.irecv, headers[peer], peer, HEADER_TAG), _post(dist.irecv, wheres[peer], peer, WHERE_TAG))
        for peer in pieces.unstaged
    }
    answers = {peer: _post(dist.irecv, torch.empty(1, dtype=torch.uint8), peer, DONE_TAG) for peer in pieces.staged}
    names = {peer: _stage(peer, staged, shared[peer], requests) for peer, staged in sorted(pieces.staged.items())}
    meanwhile()
    for peer, views in sorted(pieces.unstaged.items()):
        _wait(list(arrivals[peer]))
        name = shm.decode_name(headers[peer].numpy().tobytes())
        _unstage(peer, name, wheres[peer].tolist(), views, requests, pieces.pending, moved)
    for peer, answer in answers.items():
        answer.wait()
        shm.forget_unopened(names[peer])  # the receiver has mapped and unlinked it (if there was one)
    _wait(requests)
    for view, buffer in pieces.pending:
        view.copy_(buffer)


def _where(piece: torch.Tensor, peer: int) -> list[int] | None:
    """The row telling `peer` where `piece` lies in this process's arena, or None when it
    must be staged (no arena, not in it, or `peer` did not map it at `arena.connect`)."""
    state_arena = arena.current()
    if state_arena is None or peer not in arena.readers() or piece.dim() > MAX_DIMS:
        return None
    location = state_arena.locate(piece)
    if location is None:
        return None
    strides = list(piece.stride()) + [0] * (MAX_DIMS - piece.dim())
    return [DIRECT, *astuple(location), *strides]


def _stage(peer: int, pieces: list[torch.Tensor], nonce: bytes, requests: list[dist.Work]) -> str:
    """Tell `peer` where each of `pieces` is, copying those not in this rank's arena into its
    segment for `peer` first; return the segment's name ("" when none was used).

    When no segment can be made (e.g. /dev/shm is full) those pieces follow as
    process-group messages instead.
    """
    import torch
    import torch.distributed as dist

    rows = [_where(piece, peer) for piece in pieces]
    staged = [piece for piece, row in zip(pieces, rows, strict=True) if row is None]
    try:
        segment = shm.outgoing_segment(peer, nonce, _staged_bytes(staged)) if staged else None
    except OSError:
        segment = None
    fallback = [0] * (WHERE_WIDTH - 1)
    how = [row or [STAGED if segment is not None else MESSAGE, *fallback] for row in rows]
    if segment is not None:
        for piece, place in zip(staged, _places(segment, staged), strict=True):
            shm.copy_bulk(place, piece)
    name = "" if segment is None else segment.name
    header = torch.frombuffer(bytearray(shm.encode_name(name)), dtype=torch.uint8)
    requests.append(_post(dist.isend, header, peer, HEADER_TAG))
    requests.append(_post(dist.isend, torch.tensor(how, dtype=torch.int64).view(-1, WHERE_WIDTH), peer, WHERE_TAG))
    if segment is None:
        requests += [_post(dist.isend, piece.contiguous(), peer, FALLBACK_TAG) for piece in staged]
    return name


def _unstage(
    peer: int,
    name: str,
    rows: list[list[int]],
    views: list[torch.Tensor],
    requests: list[dist.Work],
    pending: list[tuple[torch.Tensor, torch.Tensor]],
    moved: Moved,
) -> None:
    """Fill `views` as `rows` say: from `peer`'s arena, its segment `name` or its messages;
    then tell the peer it may change its tensors and reuse the segment."""
    import torch
    import torch.distributed as dist

    staged = [view for view, row in zip(views, rows, strict=True) if row[0] == STAGED]
    places = iter(_places(shm.incoming_segment(peer, name, _staged_bytes(staged)), staged) if staged else [])
    for view, (how, *where) in zip(views, rows, strict=True):
        nbytes = view.numel() * view.element_size()
        if how == MESSAGE:
            requests.append(_post(dist.irecv, _receive_buffer(view, pending), peer, FALLBACK_TAG))
            continue
        if how == DIRECT:
            location, strides = arena.Location(*where[:LOCATION_FIELDS]), where[LOCATION_FIELDS:]
            piece = arena.peer_tensor(location, tuple(view.shape), tuple(strides[: view.dim()]), view.dtype)
            moved.received_direct += nbytes
        else:
            piece = next(places)
        shm.copy_bulk(view, piece)
        moved.received_shared += nbytes
    requests.append(_post(dist.isend, torch.ones(1, dtype=torch.uint8), peer, DONE_TAG))


def _staged_bytes(pieces: list[torch.Tensor]) -> int:
    return sum(shm.aligned(piece.numel() * piece.element_size()) for piece in pieces)


def _places(segment: shm.Segment, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """Where each piece lies in `segment`: one after another, cache-line aligned, in hop order."""
    places, offset = [], 0
    for piece in pieces:
        nbytes = piece.numel() * piece.element_size()
        places.append(segment.data[offset : offset + nbytes].view(piece.dtype).view(piece.shape))
        offset += shm.aligned(nbytes)
    return places


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

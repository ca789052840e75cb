"""Moving one round of a reshard's pieces between ranks: process-group messages (gloo over TCP,
NCCL on GPUs), or, between two ranks on one host holding CPU state, shared memory.

Pairs swap host tokens first (`shared_memory_peers`), so the choice is made per pair. To a
same-host peer a piece goes by location when it lies in the sender's state arena (the
receiver copies it straight out of the sender's tensor: one copy) and is otherwise staged in
a pooled segment (`nereus.runtime.comm.shm`: one copy in, one copy out, no sockets); the
sender says where each piece is, the receiver copies them out and answers, so the sender may
change its tensors or reuse the segment.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import astuple, dataclass, fields
from typing import TYPE_CHECKING, Literal

from nereus.runtime.comm import arena, shm
from nereus.runtime.state.reshard_plan import Hop, Transfer, sender_of
from nereus.runtime.state.sharded_state import box_slices

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

#: How pieces travel between two ranks. "auto": through a shared-memory segment when both
#: ranks are on one host and hold CPU state under gloo, else as process-group messages
#: (gloo over TCP, NCCL on GPUs); "process_group": always as process-group messages.
Transport = Literal["auto", "process_group"]


def src_view(tensors: dict[str, torch.Tensor], transfer: Transfer) -> torch.Tensor:
    return tensors[transfer.key][box_slices(transfer.piece, transfer.src_box)]


def dst_view(tensors: dict[str, torch.Tensor], transfer: Transfer) -> torch.Tensor:
    return tensors[transfer.key][box_slices(transfer.piece, transfer.dst_box)]


def receive_buffer(view: torch.Tensor, pending: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """A tensor to receive into: the view itself when contiguous, else a buffer copied in later."""
    if view.is_contiguous():
        return view
    buffer = view.new_empty(view.shape)
    pending.append((view, buffer))
    return buffer


def shared_memory_peers(peers: list[int], usable: bool) -> dict[int, bytes]:
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
    wait_all(requests + [_post(dist.irecv, theirs[peer], peer, HELLO_TAG) for peer in peers])
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


def wait_all(requests: list[dist.Work]) -> None:
    """Wait for every request (asynchronous point-to-point messages) in turn."""
    for request in requests:
        request.wait()


def _post(operation: Callable[..., dist.Work | None], tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
    """Post one asynchronous control message (gloo returns a request for each)."""
    request = operation(tensor, peer, tag=tag)
    assert request is not None, "a point-to-point message in this process returned no request"
    return request


def exchange(
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

    ops: list[dist.P2POp] = []  # process-group messages, one per piece
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (strided view, its receive buffer), copied in at the end
    staged: dict[int, list[torch.Tensor]] = defaultdict(list)  # pieces to stage, by receiving peer, in hop order
    unstaged: dict[int, list[torch.Tensor]] = defaultdict(list)  # views to fill, by sending peer, in hop order
    for hop in hops:
        sender, (got, transfer) = sender_of(hop), hop
        if sender == rank:
            data = src_view(tensors, transfer) if got is None else dst_view(new, got)
            if transfer.dst in shared:
                staged[transfer.dst].append(data)
            else:
                ops.append(dist.P2POp(dist.isend, data.contiguous(), transfer.dst))
            moved.sent += transfer.nbytes
        elif transfer.dst == rank:
            view = dst_view(new, transfer)
            if sender in shared:
                unstaged[sender].append(view)
            else:
                ops.append(dist.P2POp(dist.irecv, receive_buffer(view, pending), sender))
            moved.received += transfer.nbytes
    requests = dist.batch_isend_irecv(ops) if ops else []
    headers = {peer: torch.empty(shm.NAME_BYTES, dtype=torch.uint8) for peer in unstaged}
    wheres = {peer: torch.empty(len(views), WHERE_WIDTH, dtype=torch.int64) for peer, views in unstaged.items()}
    arrivals = {
        peer: (_post(dist.irecv, headers[peer], peer, HEADER_TAG), _post(dist.irecv, wheres[peer], peer, WHERE_TAG))
        for peer in unstaged
    }
    answers = {peer: _post(dist.irecv, torch.empty(1, dtype=torch.uint8), peer, DONE_TAG) for peer in staged}
    names = {peer: _stage(peer, pieces, shared[peer], requests) for peer, pieces in sorted(staged.items())}
    meanwhile()
    for peer, views in sorted(unstaged.items()):
        wait_all(list(arrivals[peer]))
        name = shm.decode_name(headers[peer].numpy().tobytes())
        _unstage(peer, name, wheres[peer].tolist(), views, requests, pending, moved)
    for peer, answer in answers.items():
        answer.wait()
        shm.forget_unopened(names[peer])  # the receiver has mapped and unlinked it (if there was one)
    wait_all(requests)
    for view, buffer in pending:
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
            requests.append(_post(dist.irecv, receive_buffer(view, pending), peer, FALLBACK_TAG))
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

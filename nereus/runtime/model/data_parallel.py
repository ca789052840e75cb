"""Data-parallel synchronisation in bounded buckets: gradients summed over the replicas
(all-reduced, or under ZeRO-1 reduce-scattered into each replica's rows) and ZeRO-1's updated
rows all-gathered, through flat buffers of at most GRAD_BUCKET_ELEMENTS per replica; a tensor
larger than that goes in row blocks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from nereus.runtime.comm import collectives
from nereus.runtime.state.sharded_state import even_split

#: Most gradient elements reduced in one collective: the flat staging buffer a reduction
#: needs is at most this (4 bytes each in fp32), however large the model.
GRAD_BUCKET_ELEMENTS = 1 << 22


T = TypeVar("T")

#: One tensor's piece in a bucket: its rows on each replica (one view: a tensor kept whole).
Piece = list[torch.Tensor]


def row_pieces(views: Piece) -> list[Piece]:
    """`views` (one tensor's rows on each replica) cut into blocks of rows of at most
    GRAD_BUCKET_ELEMENTS elements per replica, block j of every replica together: so a
    tensor larger than a bucket (a large vocabulary's embedding) is staged block by block."""
    if views[0].dim() == 0:
        return [views]
    largest = max(view.numel() for view in views)
    parts = max(1, min(min(view.shape[0] for view in views), -(-largest // GRAD_BUCKET_ELEMENTS)))
    bounds = [even_split(view.shape[0], parts) for view in views]
    return [[view[a:b] for view, (a, b) in zip(views, block, strict=True)] for block in zip(*bounds, strict=True)]


def bucketed(items: Iterable[T], numel: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """Consecutive runs of `items` of at most `limit` elements each (by `numel`; a larger item alone)."""
    bucket: list[T] = []
    size = 0
    for item in items:
        count = numel(item)
        if bucket and size + count > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += count
    if bucket:
        yield bucket


def buckets(pieces: Iterable[Piece]) -> list[list[Piece]]:
    """Consecutive runs of `pieces` of at most GRAD_BUCKET_ELEMENTS elements per replica each."""
    return list(bucketed(pieces, lambda piece: max(view.numel() for view in piece), GRAD_BUCKET_ELEMENTS))


def _pack(flat: torch.Tensor, views: Iterable[torch.Tensor]) -> None:
    """Copy `views` one after another into the start of `flat` (in its dtype)."""
    offset = 0
    for view in views:
        flat[offset : offset + view.numel()] = view.reshape(-1)
        offset += view.numel()


def _unpack(flat: torch.Tensor, views: Iterable[torch.Tensor]) -> None:
    """Fill `views` one after another from the start of `flat` (in their dtype)."""
    offset = 0
    for view in views:
        view.copy_(flat[offset : offset + view.numel()].view_as(view))
        offset += view.numel()


def all_reduce_bucket(bucket: list[torch.Tensor], group: Any, dtype: torch.dtype) -> None:
    """Sum one bucket of gradients over `group` in `dtype` (the precision's reduction dtype)."""
    flat = torch.cat([g.reshape(-1).to(dtype) for g in bucket])
    collectives.all_reduce(flat, group)
    _unpack(flat, bucket)


def reduce_scatter_bucket(bucket: list[Piece], group: Any, me: int, dtype: torch.dtype, device: torch.device) -> None:
    """ZeRO-1: sum one bucket over the replicas of `group` into replica `me`'s rows only (the
    other rows keep this replica's own, unreduced contribution: the optimizer reads just its rows)."""
    dp = len(bucket[0])
    size = max(sum(piece[d].numel() for piece in bucket) for d in range(dp))
    flat = torch.zeros(dp * size, dtype=dtype, device=device)
    for d in range(dp):
        _pack(flat[d * size :], (piece[d] for piece in bucket))
    _unpack(collectives.reduce_scatter(flat, group, dp, me), (piece[me] for piece in bucket))


def all_gather_rows(bucket: list[Piece], group: Any, me: int, device: torch.device) -> None:
    """Fill every replica's rows of `bucket` from that replica, given replica `me`'s own
    (collective over `group`; one dtype per bucket)."""
    dp = len(bucket[0])
    size = max(sum(piece[d].numel() for piece in bucket) for d in range(dp))
    local = torch.zeros(size, dtype=bucket[0][0].dtype, device=device)
    # this replica's rows straight into the send buffer (no concatenated copy)
    _pack(local, (piece[me] for piece in bucket))
    for d, part in enumerate(collectives.all_gathered(local, group)):
        _unpack(part, (piece[d] for piece in bucket))

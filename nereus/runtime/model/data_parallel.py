"""Data-parallel synchronisation in bounded buckets: gradients summed over the replicas
(all-reduced, or under ZeRO-1 reduce-scattered into each replica's rows) and ZeRO-1's updated
rows all-gathered, through flat buffers of at most GRAD_BUCKET_ELEMENTS per replica; a tensor
larger than that goes in row blocks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from nereus.runtime.comm import collectives
from nereus.runtime.state.sharded_state import even_split

#: Most gradient elements reduced in one collective: the flat staging buffer a reduction
#: needs is at most this (4 bytes each in fp32), however large the model.
GRAD_BUCKET_ELEMENTS = 1 << 22


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


def buckets(pieces: Iterable[Piece]) -> list[list[Piece]]:
    """Consecutive runs of `pieces` of at most GRAD_BUCKET_ELEMENTS elements per replica each."""
    runs: list[list[Piece]] = [[]]
    size = 0
    for piece in pieces:
        numel = max(view.numel() for view in piece)
        if runs[-1] and size + numel > GRAD_BUCKET_ELEMENTS:
            runs.append([])
            size = 0
        runs[-1].append(piece)
        size += numel
    return [run for run in runs if run]


def all_reduce_bucket(bucket: list[torch.Tensor], group: Any, dtype: torch.dtype) -> None:
    """Sum one bucket of gradients over `group` in `dtype` (the precision's reduction dtype)."""
    flat = torch.cat([g.reshape(-1).to(dtype) for g in bucket])
    collectives.all_reduce(flat, group)
    offset = 0
    for g in bucket:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def reduce_scatter_bucket(bucket: list[Piece], group: Any, me: int, dtype: torch.dtype, device: torch.device) -> None:
    """ZeRO-1: sum one bucket over the replicas of `group` into replica `me`'s rows only (the
    other rows keep this replica's own, unreduced contribution: the optimizer reads just its rows)."""
    dp = len(bucket[0])
    size = max(sum(piece[d].numel() for piece in bucket) for d in range(dp))
    flat = torch.zeros(dp * size, dtype=dtype, device=device)
    for d in range(dp):
        offset = d * size
        for piece in bucket:
            flat[offset : offset + piece[d].numel()] = piece[d].reshape(-1)
            offset += piece[d].numel()
    summed = collectives.reduce_scatter(flat, group, dp, me)
    offset = 0
    for piece in bucket:
        piece[me].copy_(summed[offset : offset + piece[me].numel()].view_as(piece[me]))
        offset += piece[me].numel()


def all_gather_rows(bucket: list[Piece], group: Any, me: int, device: torch.device) -> None:
    """Fill every replica's rows of `bucket` from that replica, given replica `me`'s own
    (collective over `group`; one dtype per bucket)."""
    dp = len(bucket[0])
    size = max(sum(piece[d].numel() for piece in bucket) for d in range(dp))
    local = torch.zeros(size, dtype=bucket[0][0].dtype, device=device)
    offset = 0
    for piece in bucket:  # this replica's rows straight into the send buffer (no concatenated copy)
        local[offset : offset + piece[me].numel()] = piece[me].reshape(-1)
        offset += piece[me].numel()
    for d, part in enumerate(collectives.all_gathered(local, group)):
        offset = 0
        for piece in bucket:
            piece[d].copy_(part[offset : offset + piece[d].numel()].view_as(piece[d]))
            offset += piece[d].numel()

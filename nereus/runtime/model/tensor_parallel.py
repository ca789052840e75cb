"""Tensor parallelism on DTensor's placements: each tensor rank's weights are its boxes, the
ranks meet through two autograd functions over torch's all-reduce.

A rank holds its box of every weight (`shard_layout.local_box`) as a plain tensor: those boxes
are the placements DTensor gives the weights under torchtitan's plan (ColwiseParallel
`Shard(0)`, RowwiseParallel `Shard(1)`; tests/runtime/test_tp_placements.py), so checkpoints,
resharding and live transitions move them as they are. Where the ranks meet, activations
between blocks are replicated: a column-parallel linear's input goes through `replicated`
(DTensor's `Replicate()` input whose gradient comes back `Partial()`: identity forward, the
gradient summed over the tensor ranks) and its output is this rank's `Shard(-1)` columns; a
row-parallel linear's output goes through `summed` (DTensor's `Partial()` -> `Replicate()`:
summed forward, the gradient passed through); the vocabulary-split embedding is DTensor's
masked partial sum, computed on this rank's rows. The LM head's log-probs and entropy come
from `chunked_head`, a chunk of tokens at a time over this rank's vocabulary rows (DTensor's
`loss_parallel` would need a whole micro-batch's logits at once).

Why not DTensor's own `from_local(...).to_local(grad_placements=...)` and `full_tensor()` at
the meeting points (what this module did first): the same collectives in the same order, the
same numbers, but DTensor's Python (spec building, redistribute planning, functional
collective wrapping) costs ~0.3 ms per meeting on a CPU rank, against ~0.1 ms for the
all-reduce and the autograd function around it, and a tiny model's tp=2 training step has ~20
meetings (benchmarks/README.md, "Tensor-parallel meeting points"). `gather_last_dim`
(generation's vocabulary columns, once per decoded token) likewise all-gathers directly rather
than through a `Shard(-1)` DTensor.

Every function takes a `TensorParallel`; with one tensor rank it is plain single-device math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from nereus.runtime.comm import collectives

if TYPE_CHECKING:
    from typing import Self


@dataclass(frozen=True)
class GroupPlace:
    """This rank's place among the ranks of one parallelism (tensor, context or expert)."""

    size: int
    """Ranks in the group."""
    rank: int
    """This rank's index inside the group."""
    group: Any = None
    """The torch process group of those ranks (None when size is 1)."""

    @classmethod
    def single(cls) -> Self:
        return cls(size=1, rank=0)


@dataclass(frozen=True)
class TensorParallel(GroupPlace):
    """This rank's place in its tensor-parallel group."""

    kv_group: Any = None
    """The process group of the tensor ranks holding the same replicated KV head (None when KV
    heads are split)."""


def _summed_copy(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """A new contiguous tensor: the sum over `group` of every rank's `tensor`."""
    total = tensor.clone(memory_format=torch.contiguous_format)
    collectives.all_reduce(total, group)
    return total


class _Replicated(torch.autograd.Function):
    """Identity forward; the gradient summed over the group."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _summed_copy(grad, ctx.group), None


class _Summed(torch.autograd.Function):
    """The sum over the group forward; the gradient passed through."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        return _summed_copy(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def replicated(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """`tensor` (the same on every rank of `group`), whose gradient is summed over `group`
    (None: no other rank)."""
    return tensor if group is None else _Replicated.apply(tensor, group)


def summed(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum over `group` of every rank's `tensor` (None: no other rank); its gradient
    reaches each rank unchanged."""
    return tensor if group is None else _Summed.apply(tensor, group)


def local_ids(ids: torch.Tensor, vocab_start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Vocabulary ids as indices into the `rows` rows from `vocab_start` that a tensor rank holds
    (0 where outside them), and where they are outside."""
    local = ids - vocab_start
    outside = (local < 0) | (local >= rows)
    return local.masked_fill(outside, 0), outside


def gather_last_dim(tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Concatenate the tensor ranks' slices along the last dim (no gradient; inference only)."""
    if tp.group is None:
        return tensor
    return torch.cat(collectives.all_gathered(tensor, tp.group), dim=-1)


class ColumnParallelLinear(nn.Module):
    """y[..., local out] = x W_local^T (+ b_local); x is replicated over the tensor ranks."""

    def __init__(self, in_features: int, local_out: int, bias: bool, tp: TensorParallel, weight_group: Any = None):
        super().__init__()
        self.tp = tp
        self.weight_group = weight_group
        """Ranks holding a replica of this slice (replicated KV heads): their gradients are summed."""
        self.weight = nn.Parameter(torch.empty(local_out, in_features))
        self.bias = nn.Parameter(torch.empty(local_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.on_replicated(replicated(x, self.tp.group))

    def on_replicated(self, x: torch.Tensor) -> torch.Tensor:
        """The forward for an input already through `replicated`: linears sharing one input
        (q/k/v, gate/up) sum their input gradients locally and all-reduce them once."""
        weight = replicated(self.weight, self.weight_group)
        bias = None if self.bias is None else replicated(self.bias, self.weight_group)
        return F.linear(x, weight, bias)


class RowParallelLinear(nn.Module):
    """y = sum over tensor ranks of x_local W_local^T; x is split along its last dim."""

    def __init__(self, local_in: int, out_features: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return summed(F.linear(x, self.weight), self.tp.group)


class VocabParallelEmbedding(nn.Module):
    """Each tensor rank holds a contiguous slice of the vocabulary's rows (`Shard(0)`)."""

    def __init__(self, vocab_size: int, hidden_dim: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(vocab_size // tp.size, hidden_dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Each rank looks the tokens up in its rows (zeros for the others' tokens) and the ranks'
        rows are summed: DTensor's masked partial embedding, done on the local rows, because
        `F.embedding` on the `Shard(0)` DTensor differentiates into a `Replicate()` gradient of
        the whole vocabulary's rows on every rank (2.2 GB in fp32 for a 152k x 3584 embedding)."""
        group = self.tp.group
        if group is None:
            return F.embedding(tokens, self.weight)
        rows = self.weight.shape[0]
        local, outside = local_ids(tokens, self.tp.rank * rows, rows)
        embedded = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return summed(embedded, group)

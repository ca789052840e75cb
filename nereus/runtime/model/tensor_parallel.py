"""Megatron-style tensor parallelism: the collectives as autograd functions, and the layers.

Activations between blocks are replicated on every tensor rank. A column-parallel linear
splits its output features (its input passes through `copy_to_group`, whose backward sums
the input gradient over the tensor ranks); a row-parallel linear splits its input features
and sums the partial outputs (`reduce_from_group`). The vocabulary is split the same way in
the embedding, the LM head and the cross-entropy, so full logits are never materialised.

Every function takes a `TensorParallel`; with one tensor rank it is plain single-device math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from nereus.runtime.comm import collectives


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group."""

    size: int
    """Tensor ranks in the group."""
    rank: int
    """This rank's index inside the group."""
    group: Any = None
    """The torch process group of the tensor ranks (None when size is 1)."""
    kv_group: Any = None
    """The tensor ranks holding the same replicated KV head (None when KV heads are split)."""

    @classmethod
    def single(cls) -> TensorParallel:
        return cls(size=1, rank=0)


def _all_reduce(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    tensor = tensor.clone()
    collectives.all_reduce(tensor, group)
    return tensor


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """Sum over the group forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_group(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    if group is None:
        return tensor
    result: torch.Tensor = _CopyToGroup.apply(tensor, group)
    return result


def reduce_from_group(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    if group is None:
        return tensor
    result: torch.Tensor = _ReduceFromGroup.apply(tensor, group)
    return result


def gather_last_dim(tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Concatenate the tensor ranks' slices along the last dim (no gradient; inference only)."""
    if tp.size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(tp.size)]
    collectives.all_gather(parts, tensor, tp.group)
    return torch.cat(parts, dim=-1)


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
        weight = copy_to_group(self.weight, self.weight_group)
        bias = None if self.bias is None else copy_to_group(self.bias, self.weight_group)
        return F.linear(copy_to_group(x, self.tp.group), weight, bias)


class RowParallelLinear(nn.Module):
    """y = sum over tensor ranks of x_local W_local^T; x is split along its last dim."""

    def __init__(self, local_in: int, out_features: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_group(F.linear(x, self.weight), self.tp.group)


class VocabParallelEmbedding(nn.Module):
    """Each tensor rank holds a contiguous slice of the vocabulary's rows."""

    def __init__(self, vocab_size: int, hidden_dim: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.local_vocab = vocab_size // tp.size
        self.vocab_start = tp.rank * self.local_vocab
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden_dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embed(tokens, self.weight, self.vocab_start, self.tp)


def vocab_parallel_embed(
    tokens: torch.Tensor, weight: torch.Tensor, vocab_start: int, tp: TensorParallel
) -> torch.Tensor:
    """Look up `tokens` in this rank's rows `weight` (starting at `vocab_start`); sum over ranks."""
    if tp.size == 1:
        return F.embedding(tokens, weight)
    local = tokens - vocab_start
    outside = (local < 0) | (local >= weight.shape[0])
    embedded = F.embedding(local.masked_fill(outside, 0), weight)
    embedded = embedded.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_group(embedded, tp.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocabulary-split logits, without gathering them."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group: Any) -> torch.Tensor:
        # One fp32 working copy of the logits: the shift promotes 16-bit logits to fp32 as it
        # subtracts, and the exponent and the softmax are taken in place.
        row_max = logits.max(dim=-1).values.float()
        if group is not None:
            collectives.all_reduce(row_max, group, op="max")
        shifted = logits - row_max.unsqueeze(-1)
        local = targets - vocab_start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            collectives.all_reduce(target_logit, group)
            collectives.all_reduce(sum_exp, group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        hit = (~outside).to(grad_logits.dtype)
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, tp: TensorParallel
) -> torch.Tensor:
    """Per-token -log p(target) from this rank's logit columns [..., local vocab]."""
    loss: torch.Tensor = _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, tp.group)
    return loss

"""Attention kernels and their masks: causal attention over packed rows (`Packing`: each row's
real tokens first, so no [b, 1, t, t] mask is built), the queries x keys mask of a cached
decode step, short sequences by two matmuls, and where a layer keeps generation's keys and
values (`KVStore`, `LayerCache`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.nn import functional as F

if TYPE_CHECKING:
    from nereus.runtime.model.context_parallel import SequenceSplit


def attention_mask_4d(key_mask: torch.Tensor, num_queries: int) -> torch.Tensor:
    """[batch, 1, queries, keys] bool: causal (queries are the last keys) and no padded keys.

    Only a cached decode step builds one: its few queries make it queries x keys, never the
    keys x keys mask of a whole sequence (`Packing` handles those).
    """
    num_keys = key_mask.shape[-1]
    query_slot = torch.arange(num_keys - num_queries, num_keys, device=key_mask.device)
    causal = torch.arange(num_keys, device=key_mask.device).unsqueeze(0) <= query_slot.unsqueeze(1)
    allowed = causal.unsqueeze(0) & key_mask.bool().unsqueeze(1)
    # A padded query row would see no key at all (NaN softmax); let it see itself.
    allowed[:, torch.arange(num_queries), query_slot] = True
    return allowed.unsqueeze(1)


@dataclass(frozen=True)
class Packing:
    """Each row's real tokens moved to the front, in order, pads after them.

    A whole sequence then needs no attention mask: under the causal mask a real token sees
    exactly the real tokens before it (pads come after every real token), so torch's
    scaled-dot-product attention runs in its causal form (`is_causal`, no t x t tensor) and
    left padding costs two gathers per pipeline stage instead of a [b, 1, t, t] mask. RoPE
    positions travel with the tokens, so every real token keeps its position.
    """

    order: torch.Tensor
    """[b, t] source column of every packed column."""
    restore: torch.Tensor
    """[b, t] packed column of every source column (the inverse permutation)."""

    @staticmethod
    def of(mask: torch.Tensor) -> Packing | None:
        """The packing of `mask` [b, t] (True: real token); None when every row already has its
        real tokens first (no padding, or right padding only)."""
        mask = mask.bool()
        if not bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            return None
        order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
        return Packing(order, order.argsort(dim=1))

    def pack(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return _permute_columns(x, self.order, self.restore, dim)

    def unpack(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return _permute_columns(x, self.restore, self.order, dim)


def _gather_columns(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """x with its `dim` axis (the sequence) permuted per row by `index` [b, t]."""
    shape = [index.shape[0]] + [1] * (x.dim() - 1)
    shape[dim] = index.shape[1]
    return x.gather(dim, index.view(shape).expand(*x.shape[:dim], index.shape[1], *x.shape[dim + 1 :]))


def _permute_columns(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, dim: int) -> torch.Tensor:
    """`_gather_columns(x, index, dim)` whose backward keeps no copy of `x`: torch's `gather`
    saves its input for the backward's scatter, but a permutation's gradient is the gradient
    gathered by the inverse permutation (`inverse` [b, t]), which needs only the two indices.
    Under context parallelism every layer packs its queries, keys and values and unpacks its
    output, so a saved input per call would keep four tensors per layer that nothing else holds."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return _gather_columns(x, index, dim)
    return _PermuteColumns.apply(x, index, inverse, dim)


class _PermuteColumns(torch.autograd.Function):
    """`_permute_columns` under autograd: gather by `index`, the backward by `inverse`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)  # [b, t] indices: the packing's own tensor, not a copy
        ctx.dim = dim
        return _gather_columns(x, index, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (inverse,) = ctx.saved_tensors
        return _gather_columns(grad, inverse, ctx.dim), None, None, None


#: Longest whole sequence whose inference runs `masked_attention` under a causal bias: up to
#: about this length its two matmuls beat torch's fused kernel on CPU (1 thread, heads of 16-32
#: dims: 28 tokens 0.76x its time, 64 tokens 2.5x), beyond it the t x t scores cost more.
MATMUL_ATTENTION_MAX_TOKENS = 32


def causal_bias(num_tokens: int, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[group * tokens, tokens] additive causal mask of whole sequences in `masked_attention`'s row order."""
    return torch.full((num_tokens, num_tokens), float("-inf"), dtype=dtype, device=device).triu_(1).repeat(group, 1)


@dataclass(frozen=True)
class AttentionPlan:
    """How one forward's attention treats padding: causal over packed rows (whole sequences),
    or a queries x keys mask (a cached decode step, whose queries are the last keys)."""

    decode_mask: torch.Tensor | None = None
    """[b, 1, queries, keys] bool (`attention_mask_4d`) of a decode step, which attends over the
    cache's context; None: causal, queries are all the keys."""
    bias: torch.Tensor | None = None
    """`causal_bias` of short whole sequences without autograd (`masked_attention`); None: torch's kernel."""
    packing: Packing | None = None
    """The forward's packing of whole sequences (cache writes undo it); None: unpacked."""
    split: SequenceSplit | None = None
    """Context parallelism: the forward runs this rank's columns of whole sequences and the
    core attends over every column (`SequenceSplit.attention`, which packs); None: no cut."""


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [b, t, heads, d], k/v [b, keys, kv_heads, d] -> [b, t, heads * d] by torch's kernel;
    causal when `mask` is None."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
    return out.transpose(1, 2).flatten(2)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Attention of q [b, t, heads, d] over k/v [b, keys, kv_heads, d] under an additive
    `bias` -> [b, t, heads * d]: two batched matmuls with the query heads of a KV head stacked
    as rows (query head h reads KV head h // group, as `enable_gqa` does). Short sequences run
    it faster than torch's fused kernel (see MATMUL_ATTENTION_MAX_TOKENS)."""
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    rows = q.view(batch, seq, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, group * seq, dim)
    scores = torch.matmul(rows * (1.0 / math.sqrt(dim)), k.permute(0, 2, 3, 1))
    out = torch.matmul(torch.softmax(scores + bias, dim=-1), v.transpose(1, 2))
    return out.view(batch, kv_heads, group, seq, dim).permute(0, 3, 1, 2, 4).reshape(batch, seq, heads * dim)


class KVStore(Protocol):
    """Where one layer's attention keeps the keys and values of generation's earlier tokens."""

    def extend(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' [b, t, kv heads, d] keys and values (at column `start`), and
        return the keys and values attention reads, [b, keys, kv heads, d]."""
        ...


@dataclass
class LayerCache:
    """One layer's keys and values for generation: [batch, local kv heads, capacity, head_dim]."""

    keys: torch.Tensor
    values: torch.Tensor

    def extend(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = keys.shape[1]
        self.keys[:, :, start : start + seq] = keys.transpose(1, 2)
        self.values[:, :, start : start + seq] = values.transpose(1, 2)
        return self.keys[:, :, : start + seq].transpose(1, 2), self.values[:, :, : start + seq].transpose(1, 2)

"""Log-probs and entropy of an LM head, computed from the final hidden states in chunks of tokens.

The logits of a long response do not fit: 32k tokens of a 152k-token vocabulary are 20 GB in
fp32. So the last stage hands its final hidden states [tokens, hidden] and this tensor rank's
rows of the LM head weight [vocab / tp, hidden] (`HeadShard`) to `token_log_probs` (or
`token_log_probs_and_entropy`, both in the same pass), which walk the tokens in chunks of
`chunk_tokens`. A chunk's logits (this rank's vocabulary columns, promoted to fp32) are made by
one matmul, reduced to per-token numbers, and dropped before the next chunk's are made:

* m, the row's largest logit (all-reduced with max over the tensor ranks), and the shifted
  logits z - m;
* S = sum exp(z - m), the target's shifted logit and, for the entropy, W = sum exp(z - m) (z - m),
  each summed over the tensor ranks' vocabulary slices in one all-reduce;
* log p(target) = (z_target - m) - log S, entropy = log S - W / S.

The backward makes each chunk's logits again from the saved hidden states and weight (one more
matmul per chunk, as activation recompute does for a layer), with p = exp(z - m - log S) from
the saved per-token numbers turns them into the chunk's logit gradient
g_lp (onehot - p) - g_ent p (z - m - W / S), and adds that chunk's share to the hidden states'
gradient (summed over the tensor ranks: each saw only its vocabulary slice) and the weight's.
So no [tokens, vocab] tensor exists, forward or backward: at most one chunk's logits and their
gradient (`nereus.cost.stage.LOGIT_CHUNK_TOKENS` is the default chunk, and what the cost
model's `logits` term prices). The per-token math is the unchunked one's; only the matmuls are
cut by rows, so results agree with `F.cross_entropy` on whole logits to rounding (1e-6 in fp32,
tests/runtime/test_chunked_head.py).

Plain tensors only: the caller passes its local weight rows and its
tensor-parallel process group (None on one rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from nereus.runtime.comm import collectives
from nereus.runtime.model.tensor_parallel import local_ids


@dataclass(frozen=True)
class HeadShard:
    """This tensor rank's part of an LM head: its rows of the weight, i.e. its logit columns."""

    weight: torch.Tensor
    """[vocab / tp, hidden]: the rows of vocabulary ids vocab_start .. vocab_start + rows - 1."""
    vocab_start: int
    """The vocabulary id of the weight's first row."""
    group: Any = None
    """The tensor ranks' process group, which holds the other rows (None: one rank holds all)."""


def token_log_probs(hidden: torch.Tensor, targets: torch.Tensor, shard: HeadShard, chunk_tokens: int) -> torch.Tensor:
    """[...] fp32 log p(target) per token from the final hidden states [..., hidden]."""
    return _run(hidden, targets, shard, chunk_tokens, entropy=False)[0]


def token_log_probs_and_entropy(
    hidden: torch.Tensor, targets: torch.Tensor, shard: HeadShard, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_log_probs` and the fp32 entropy of the softmax over the whole vocabulary per
    token, from one pass over the chunks (one matmul per chunk each way instead of two)."""
    return _run(hidden, targets, shard, chunk_tokens, entropy=True)


def _run(
    hidden: torch.Tensor, targets: torch.Tensor, shard: HeadShard, chunk_tokens: int, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies) per token of `hidden` [..., hidden]; entropies empty unless asked for."""
    if chunk_tokens < 1:
        raise ValueError(f"logit_chunk_tokens must be a positive token count, not {chunk_tokens}")
    leading = hidden.shape[:-1]
    assert targets.shape == leading, (tuple(targets.shape), tuple(hidden.shape))
    log_probs, entropies = _ChunkedHead.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        shard.weight,
        targets.reshape(-1),
        shard.vocab_start,
        shard.group,
        chunk_tokens,
        entropy,
    )
    return log_probs.view(leading), entropies.view(leading) if entropy else entropies


def _sum_over_ranks(tensor: torch.Tensor, group: Any, op: collectives.Op = "sum") -> None:
    if group is not None:
        collectives.all_reduce(tensor, group, op=op)


class _ChunkedHead(torch.autograd.Function):
    """(log-probs, entropies) [tokens] of hidden [tokens, hidden] under weight [local vocab, hidden],
    chunk by chunk (module docstring). Entropies not asked for (entropy False) are an empty tensor."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        group: Any,
        chunk_tokens: int,
        entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, rows = hidden.shape[0], weight.shape[0]
        stats = torch.zeros(3, tokens, dtype=torch.float32, device=hidden.device)  # S, target logit, W
        row_max = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        for start in range(0, tokens, chunk_tokens):
            stop = min(tokens, start + chunk_tokens)
            logits = F.linear(hidden[start:stop], weight).float()
            peak = logits.max(dim=-1).values
            _sum_over_ranks(peak, group, "max")
            row_max[start:stop] = peak
            shifted = logits.sub_(peak.unsqueeze(-1))
            local, outside = local_ids(targets[start:stop], vocab_start, rows)
            picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
            stats[1, start:stop] = picked.masked_fill(outside, 0.0)
            if entropy:  # sum exp(z) z as a row-by-row dot product: no third chunk-sized tensor
                exp = shifted.exp()
                stats[0, start:stop] = exp.sum(dim=-1)
                stats[2, start:stop] = torch.bmm(exp.unsqueeze(1), shifted.unsqueeze(2)).view(-1)
                del exp
            else:
                stats[0, start:stop] = shifted.exp_().sum(dim=-1)
            del logits, shifted
        _sum_over_ranks(stats, group)
        log_sum = stats[0].log()
        mean_shifted = stats[2] / stats[0]
        log_probs = stats[1] - log_sum
        entropies = log_sum - mean_shifted if entropy else hidden.new_empty(0, dtype=torch.float32)
        ctx.save_for_backward(hidden, weight, targets, row_max, log_sum, mean_shifted)
        ctx.vocab_start, ctx.group, ctx.chunk_tokens, ctx.entropy = vocab_start, group, chunk_tokens, entropy
        if not entropy:
            ctx.mark_non_differentiable(entropies)
        return log_probs, entropies

    @staticmethod
    def backward(
        ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropies: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        hidden, weight, targets, row_max, log_sum, mean_shifted = ctx.saved_tensors
        g_lp = grad_log_probs
        g_ent = grad_entropies if ctx.entropy and grad_entropies is not None else None
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        if g_lp is None and g_ent is None:
            return grad_hidden, grad_weight, None, None, None, None, None
        tokens, rows, chunk = hidden.shape[0], weight.shape[0], ctx.chunk_tokens
        for start in range(0, tokens, chunk):
            stop = min(tokens, start + chunk)
            part = hidden[start:stop]
            shifted = F.linear(part, weight).float().sub_(row_max[start:stop].unsqueeze(-1))  # z - m
            if g_ent is None:  # dz = g_lp (onehot - p): p made in place
                grad = shifted.sub_(log_sum[start:stop].unsqueeze(-1)).exp_()
                assert g_lp is not None
                grad.mul_(-g_lp[start:stop].float().unsqueeze(-1))
            else:  # dz = g_lp onehot - p (g_lp + g_ent (z - m - W / S))
                grad = (shifted - log_sum[start:stop].unsqueeze(-1)).exp_()
                factor = shifted.sub_(mean_shifted[start:stop].unsqueeze(-1))
                factor.mul_(g_ent[start:stop].float().unsqueeze(-1))
                if g_lp is not None:
                    factor.add_(g_lp[start:stop].float().unsqueeze(-1))
                grad.mul_(factor).neg_()
                del factor
            if g_lp is not None:
                local, outside = local_ids(targets[start:stop], ctx.vocab_start, rows)
                hit = g_lp[start:stop].float().masked_fill(outside, 0.0)
                grad.scatter_add_(-1, local.unsqueeze(-1), hit.unsqueeze(-1))
            del shifted
            grad_logits = grad.to(weight.dtype)
            del grad
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[start:stop])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), part)
            del grad_logits
        if grad_hidden is not None:
            _sum_over_ranks(grad_hidden, ctx.group)  # each rank saw only its vocabulary columns
        return grad_hidden, grad_weight, None, None, None, None, None

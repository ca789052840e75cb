"""Qwen3-MoE's sparse MLP: a linear router and a stack of SwiGLU experts, with expert and
tensor parallelism.

Routing is transformers' `Qwen3MoeTopKRouter`: router logits x R^T (R [experts, hidden], no
bias), a softmax in float32, the `experts_per_token` largest probabilities (`torch.topk`, so
the chosen experts come best first), renormalised to sum to one when `norm_topk_prob`, cast
back to the activations' dtype. A token's output is the sum over its chosen experts of the
routing weight times the expert's SwiGLU, down(act(gate(x)) * up(x)).

Routing replay (`Routes.replay`): given each token's chosen experts (from a rollout), the
layer uses those experts instead of the router's top-k; their weights are still the router's
softmax probabilities at those experts (so the router keeps its gradient), renormalised over
the given experts when `norm_topk_prob`, exactly as the top-k's would be. With replayed
experts equal to the router's own choice the layer computes bitwise what it computes without.

Parallelism (docs/moe.md, "ep contract"): the experts of a layer are stacked, expert index
first (`gate_proj`/`up_proj` [experts, expert_ffn, hidden], `down_proj` [experts, hidden,
expert_ffn]); ep rank e holds the contiguous block of experts [e E/ep, (e+1) E/ep), each
expert's SwiGLU tensor-split like the dense MLP (gate/up by rows of the weight, i.e. output
columns; down by its input columns). The router is replicated. Every token's rows reach the
ep rank of their expert in one of two ways (`ExpertParallel.dispatch`):
- `all_to_all` (training and log-probs: the ep ranks hold different sequences): the
  (token, expert) pairs are sorted by expert, their counts exchanged, their hidden rows sent
  by `all_to_all_single` over the ep group (dispatch), the experts' outputs returned by the
  reverse all-to-all (combine); the backward of each all-to-all is the reverse all-to-all of
  the gradients (`_AllToAll`).
- `replicated` (generation: the ep ranks step the same tokens): each ep rank computes its own
  experts' share of every token and the shares are summed over the ep group (the experts a
  rank does not hold contribute zero), which is the same sum in another order.
The tensor ranks' partial down projections are summed before the routing weights apply, so
the router's gradient is whole on every tensor rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from nereus.runtime.comm import collectives
from nereus.runtime.model.attention import Packing
from nereus.runtime.model.tensor_parallel import GroupPlace, TensorParallel, replicated, summed
from nereus.spec.model import Activation, Model

#: How tokens reach the ep rank holding their expert (module docstring).
Dispatch = Literal["all_to_all", "replicated"]

#: The batch field of replayed routing: [rows, seq, MoE layers, experts_per_token] long, the
#: experts each token went to in every sparse layer (in layer order, `sparse_layers`).
ROUTES_FIELD = "routed_experts"


def sparse_layers(model: Model) -> list[int]:
    """The model's MoE layers, in order (the third dim of a `ROUTES_FIELD` tensor)."""
    moe = model.moe
    return [] if moe is None else [layer for layer in range(model.num_layers) if moe.is_sparse(layer)]


def routing_mismatch(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """The fraction of (real token, MoE layer) pairs routed to different sets of experts by two
    `ROUTES_FIELD` tensors (`mask` [rows, seq]: True for the tokens that count)."""
    same = (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)  # [rows, seq, layers]
    counted = mask.bool().unsqueeze(-1).expand_as(same)
    total = int(counted.sum())
    return 0.0 if total == 0 else float((~same & counted).sum()) / total


@dataclass(frozen=True)
class ExpertParallel(GroupPlace):
    """This rank's place among the ep ranks of its (stage, tensor rank) position, which split the
    experts: it holds experts [rank E/size, (rank+1) E/size). They meet through plain collectives
    on `group` (the all-to-alls, the replicated dispatch's sum), never a DTensor."""


@dataclass
class Routes:
    """Routing of one forward pass, by MoE layer: the experts to use (replay) and those used.

    A model's forward (`DecoderPipelineStage`, `ReferenceModel`) takes and fills them in the
    batch's layout, [batch, seq, ...] by column of its input; a layer (`MoEMLP`) sees them in
    its own token order, flattened (`in_layer_order`, `record_batch_layout`)."""

    replay: dict[int, torch.Tensor] = field(default_factory=dict)
    """Layer -> [..., experts_per_token] long: use these experts instead of the router's top-k."""
    chosen: dict[int, torch.Tensor] = field(default_factory=dict)
    """Layer -> [..., experts_per_token] long: the experts each token went to (filled by the forward)."""
    router_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    """Layer -> [..., experts] router logits (filled when `keep_logits`: the auxiliary loss)."""
    keep_logits: bool = False

    def in_layer_order(self, packing: Packing | None) -> Routes:
        """These batch-layout routes as the layers see them: rows packed (`Packing`), flattened."""
        replay = {}
        for layer, experts in self.replay.items():
            packed = experts if packing is None else packing.pack(experts)
            replay[layer] = packed.reshape(-1, packed.shape[-1])
        return Routes(replay=replay, keep_logits=self.keep_logits)

    def record_batch_layout(self, inner: Routes, packing: Packing | None, shape: tuple[int, int]) -> None:
        """Fill `chosen` (and `router_logits`) from a forward's layer-order `inner` routes,
        back in the batch's [batch, seq] layout."""
        for found, into in ((inner.chosen, self.chosen), (inner.router_logits, self.router_logits)):
            for layer, flat in found.items():
                rows = flat.view(*shape, flat.shape[-1])
                into[layer] = rows if packing is None else packing.unpack(rows)


def route(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, replay: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, k] in the logits' dtype, experts [tokens, k] long) from router logits
    [tokens, experts]: transformers' softmax-then-top-k, or the replayed experts' probabilities."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    if replay is None:
        weights, experts = torch.topk(probs, top_k, dim=-1)
    else:
        if replay.shape != (logits.shape[0], top_k):
            raise ValueError(
                f"replayed routing has shape {list(replay.shape)}, the layer needs [{logits.shape[0]}, {top_k}]"
            )
        experts = replay.to(device=logits.device, dtype=torch.long)
        weights = probs.gather(-1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def load_balancing_loss(
    router_logits: list[torch.Tensor], num_experts: int, top_k: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (Switch Transformer's auxiliary loss): over the
    tokens of every MoE layer together, E x sum_e (fraction of (token, slot) pairs routed to e)
    x (mean router probability of e). `token_mask` [tokens] (True for real tokens, the same for
    every layer) restricts both means to real tokens."""
    logits = torch.cat([layer.float() for layer in router_logits], dim=0)
    probs = F.softmax(logits, dim=-1)
    _, chosen = torch.topk(probs, top_k, dim=-1)
    expert_mask = F.one_hot(chosen, num_experts).float()  # [n, k, E]
    if token_mask is None:
        tokens_per_expert = expert_mask.mean(dim=0)
        prob_per_expert = probs.mean(dim=0)
    else:
        weight = token_mask.float().repeat(len(router_logits))
        total = weight.sum()
        tokens_per_expert = (expert_mask * weight[:, None, None]).sum(dim=0) / total
        prob_per_expert = (probs * weight[:, None]).sum(dim=0) / total
    return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * num_experts


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows whose backward is the reverse all-to-all of the gradients."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], receive: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _exchange(rows, send, receive, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        return _exchange(grad.contiguous(), ctx.receive, ctx.send, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, send: list[int], receive: list[int], group: Any) -> torch.Tensor:
    """`rows` [sum(send), ...] sent `send[r]` rows to ep rank r; the [sum(receive), ...] rows received."""
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    collectives.all_to_all(out, rows, receive, send, group)
    return out


class Experts(nn.Module):
    """This rank's experts of one layer (a contiguous block), each SwiGLU tensor-split."""

    def __init__(self, model: Model, tp: TensorParallel, ep: ExpertParallel):
        super().__init__()
        moe = model.moe
        assert moe is not None
        assert moe.num_experts % ep.size == 0, (moe.num_experts, ep.size)
        assert moe.expert_ffn_dim % tp.size == 0, (moe.expert_ffn_dim, tp.size)
        self.local_experts = moe.num_experts // ep.size
        self.first_expert = ep.rank * self.local_experts
        local_ffn = moe.expert_ffn_dim // tp.size
        self.gate_proj = nn.Parameter(torch.empty(self.local_experts, local_ffn, model.hidden_dim))
        self.up_proj = nn.Parameter(torch.empty(self.local_experts, local_ffn, model.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.local_experts, model.hidden_dim, local_ffn))
        self.activation: Activation = model.activation

    def partial(self, rows: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        """This tensor rank's partial expert outputs [n, hidden] of rows [n, hidden], row i going
        to local expert `local_expert[i]` (rows sorted by expert)."""
        counts = torch.bincount(local_expert, minlength=self.local_experts).tolist()
        pieces, start = [], 0
        for j, count in enumerate(counts):
            if count:
                x = rows[start : start + count]
                gate, up = F.linear(x, self.gate_proj[j]), F.linear(x, self.up_proj[j])
                pieces.append(F.linear(activate(gate, self.activation) * up, self.down_proj[j]))
                start += count
        out = torch.cat(pieces, dim=0) if pieces else rows.new_zeros((0, self.down_proj.shape[1]))
        unused = [j for j, count in enumerate(counts) if count == 0]
        if unused and torch.is_grad_enabled():  # every parameter gets a gradient (zero for an idle expert)
            idle = torch.tensor(unused, device=rows.device)
            weights = (self.gate_proj[idle].sum() + self.up_proj[idle].sum() + self.down_proj[idle].sum()).to(out.dtype)
            out = out + 0.0 * weights
        return out


def activate(x: torch.Tensor, activation: Activation) -> torch.Tensor:
    """An MLP's gate activation (dense or expert)."""
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_pytorch_tanh" else "none")


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_dim))


class MoEMLP(nn.Module):
    """A sparse layer's MLP on one rank: the router (whole) and this rank's experts."""

    def __init__(self, model: Model, layer: int, tp: TensorParallel, ep: ExpertParallel):
        super().__init__()
        moe = model.moe
        assert moe is not None and moe.is_sparse(layer), layer
        self.layer = layer
        self.top_k = moe.experts_per_token
        self.norm_topk_prob = moe.norm_topk_prob
        self.tp = tp
        self.ep = ep
        self.router = Router(moe.num_experts, model.hidden_dim)
        self.experts = Experts(model, tp, ep)

    def forward(self, x: torch.Tensor, routes: Routes | None = None, dispatch: Dispatch = "all_to_all") -> torch.Tensor:
        shape = x.shape
        hidden = x.reshape(-1, shape[-1])
        logits = F.linear(hidden, self.router.weight)
        replay = None if routes is None else routes.replay.get(self.layer)
        weights, experts = route(logits, self.top_k, self.norm_topk_prob, replay)
        if routes is not None:
            routes.chosen[self.layer] = experts.detach()
            if routes.keep_logits:
                routes.router_logits[self.layer] = logits
        # (token, slot) pairs sorted by expert (stable: token order inside an expert)
        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        token_of = order // self.top_k
        sorted_experts = flat_experts[order]
        rows = replicated(hidden, self.tp.group)[token_of]  # gradient summed over the tensor ranks
        if self.ep.size == 1:
            outputs = summed(self.experts.partial(rows, sorted_experts), self.tp.group)
        elif dispatch == "all_to_all":
            outputs = self._all_to_all(rows, sorted_experts)
        else:
            outputs = self._replicated(rows, sorted_experts)
        weighted = outputs * weights.reshape(-1)[order].unsqueeze(-1)
        combined = hidden.new_zeros(hidden.shape).index_add(0, token_of, weighted)
        return combined.view(shape)

    def _all_to_all(self, rows: torch.Tensor, sorted_experts: torch.Tensor) -> torch.Tensor:
        """Expert outputs of rows sorted by expert, computed on the ep ranks holding them."""
        local = self.experts.local_experts
        send_counts = torch.bincount(sorted_experts // local, minlength=self.ep.size)
        group, ones = self.ep.group, [1] * self.ep.size
        send, receive = send_counts.tolist(), _exchange(send_counts, ones, ones, group).tolist()
        arrived = _AllToAll.apply(rows, send, receive, group)
        arrived_experts = _exchange(sorted_experts.unsqueeze(-1), send, receive, group).squeeze(-1)
        # arrived rows come by source rank, each source's sorted by expert: sort them by expert
        local_expert = arrived_experts - self.experts.first_expert
        order = torch.argsort(local_expert, stable=True)
        partial = self.experts.partial(arrived[order], local_expert[order])
        done = torch.empty_like(partial).index_copy(0, order, summed(partial, self.tp.group))
        return _AllToAll.apply(done, receive, send, group)

    def _replicated(self, rows: torch.Tensor, sorted_experts: torch.Tensor) -> torch.Tensor:
        """Expert outputs of rows sorted by expert: this rank's experts' rows computed here,
        the others zero, summed over the ep ranks (every ep rank has the same rows).

        Only forward passes without gradients use this dispatch (generation, log-probs, routing): the ep
        sum is a plain in-place all-reduce of the fresh buffer, not a DTensor's: DTensor's
        constructor imports torch._dynamo on its first call, ~35 MB of Python objects in a CPU
        rank's private memory that its first ep > 1 pass would otherwise leave behind."""
        assert not torch.is_grad_enabled(), "the replicated dispatch runs without gradients"
        first = self.experts.first_expert
        mine = (sorted_experts >= first) & (sorted_experts < first + self.experts.local_experts)
        index = mine.nonzero().squeeze(-1)
        partial = self.experts.partial(rows[index], sorted_experts[index] - first)
        local = rows.new_zeros((rows.shape[0], partial.shape[-1])).index_copy(0, index, partial)
        total = summed(local, self.tp.group)
        collectives.all_reduce(total, self.ep.group)
        return total

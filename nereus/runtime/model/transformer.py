"""Llama-style decoders (RMSNorm, RoPE, SwiGLU, GQA) with an LM head or a scalar value head.

Every number that changes the network (RoPE theta and scaling, RMSNorm eps, the MLP's
activation, max positions) comes from the Model document, so a model read from a Hugging
Face config computes what transformers computes for it.

`DecoderPipelineStage` is what one rank runs: the layers of its pipeline stage, with its tensor
rank's slices of every weight (the boxes `shard_layout.local_box` names), so its
`named_parameters()` are exactly the contract's names and shapes. `ReferenceModel` is
the whole model in one process, written plainly (full weights, `F.cross_entropy`): the
tests hold the sharded engine to it.

Positions come from an attention mask (True for real tokens), so left-padded prompts and
padded batches get the RoPE positions and the attention of the unpadded sequences.
Attention is torch's scaled-dot-product attention in its causal form: a padded batch is
packed (each row's real tokens first, `Packing`) rather than masked, so no [b, 1, t, t]
mask is ever built; only a cached decode step masks its few queries against its keys.

Activation recompute (`Recompute`) runs under autograd only, by torch's non-reentrant
checkpoint: `full` keeps each layer's input and reruns the whole layer in its backward,
`selective` keeps every linear layer's input and output and reruns only the attention core
(scores, softmax, weighted sum of the values) and the MLP's gate activation. The rerun
computes the same operations on the same inputs, so the gradients are bitwise those without
recompute.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from nereus.cost.stage import LOGIT_CHUNK_TOKENS
from nereus.runtime.model import chunked_head
from nereus.runtime.model.attention import (
    MATMUL_ATTENTION_MAX_TOKENS,
    AttentionPlan,
    KVStore,
    LayerCache,
    Packing,
    attention_mask_4d,
    causal_bias,
    grouped_attention,
    masked_attention,
)
from nereus.runtime.model.moe import Dispatch, ExpertParallel, MoEMLP, Routes, activate, route
from nereus.runtime.model.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    replicated,
)
from nereus.runtime.state.shard_layout import param_infos, stage_layers
from nereus.spec.model import Activation, Head, Model

if TYPE_CHECKING:
    from nereus.runtime.model.context_parallel import SequenceSplit


@dataclass(frozen=True)
class Batch:
    """Rows of token sequences plus the per-token tensors an objective needs."""

    tokens: torch.Tensor
    """[batch, seq] token ids."""
    attention_mask: torch.Tensor | None = None
    """[batch, seq] bool, True for real tokens; None means no padding."""
    fields: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Extra [batch, ...] tensors by name (e.g. `loss_mask`, `value_targets`); those shaped
    [batch, seq, ...] are per-token (column i belongs to token i)."""
    first_column: int = 0
    """The column of the batch this one was cut from (`columns`) that its column 0 is."""

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def mask(self) -> torch.Tensor:
        if self.attention_mask is None:
            return torch.ones_like(self.tokens, dtype=torch.bool)
        return self.attention_mask.bool()

    def rows(self, start: int, stop: int) -> Batch:
        return self.take(slice(start, stop))

    def take(self, index: torch.Tensor | slice) -> Batch:
        """The rows at `index` (a 1-D long tensor, in its order, or a slice)."""
        mask = None if self.attention_mask is None else self.attention_mask[index]
        fields = {k: v[index] for k, v in self.fields.items()}
        return Batch(self.tokens[index], mask, fields, self.first_column)

    def columns(self, start: int, stop: int) -> Batch:
        """Columns [start, stop) of the tokens, the mask and every per-token field (the others
        as they are); meant for cutting off columns that hold no row's real token."""
        seq = int(self.tokens.shape[1])
        mask = None if self.attention_mask is None else self.attention_mask[:, start:stop]
        fields = {k: v[:, start:stop] if v.dim() >= 2 and v.shape[1] == seq else v for k, v in self.fields.items()}
        return Batch(self.tokens[:, start:stop], mask, fields, self.first_column + start)

    def field(self, name: str) -> torch.Tensor:
        if name not in self.fields:
            raise ValueError(f"batch has no field {name!r} (it has {sorted(self.fields) or 'none'})")
        return self.fields[name]


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """RoPE position of every token: how many real tokens precede it (pads get 0)."""
    return (mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def _run_packed(
    run: Callable[[torch.Tensor, torch.Tensor, Routes | None], torch.Tensor],
    inputs: torch.Tensor,
    positions: torch.Tensor,
    packing: Packing | None,
    routes: Routes | None,
) -> torch.Tensor:
    """`run(inputs, positions, routes)` on the rows packed by `packing` (None: as they are), its
    output unpacked; `routes` (`moe.Routes`, the batch's layout) reach it in the layers' order
    and the experts it chose come back in the batch's layout."""
    layer_routes = None if routes is None else routes.in_layer_order(packing)
    if packing is not None:
        inputs, positions = packing.pack(inputs), packing.pack(positions)
    output = run(inputs, positions, layer_routes)
    if routes is not None and layer_routes is not None:
        routes.record_batch_layout(layer_routes, packing, (int(inputs.shape[0]), int(inputs.shape[1])))
    return output if packing is None else packing.unpack(output)


def rope_inv_freq(model: Model) -> torch.Tensor:
    """The [head_dim / 2] RoPE frequencies (float64): theta^(-2i/d), then the model's scaling
    (a module computes them once, at construction: every forward needs them)."""
    head_dim = model.head_dim
    inv_freq = 1.0 / (model.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    scaling = model.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths longer than the pre-training context / low_freq_factor are divided
    # by `factor`, shorter than context / high_freq_factor kept, those between blended
    # linearly in (context / wavelength).
    context = scaling.original_max_positions
    ratio = context / (2 * math.pi / inv_freq)  # pre-training context over wavelength
    blend = ((ratio - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0, 1)
    return (1 - blend) * inv_freq / scaling.factor + blend * inv_freq


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [batch, seq, 1, head_dim] for rotate-half RoPE on [batch, seq, heads,
    head_dim] tensors (the layout a projection's output has, so q and k need no transpose before
    it): the sin table's first half negated, so `apply_rope` rotates with one roll instead of a
    negate and a cat. `inv_freq`: the model's `rope_inv_freq`."""
    inv_freq = inv_freq.to(positions.device)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    sin = angles.sin()
    signed_sin = torch.cat([-sin, sin], dim=-1).unsqueeze(2)
    cos = torch.cat([angles, angles], dim=-1).unsqueeze(2).cos()
    return cos.to(dtype), signed_sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]: [x2, x1] times the signed sin
    (negating a product's factor gives the same bits as negating the product)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op (same values as the expression below)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    variance = x.float().pow(2).mean(dim=-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def check_positions(model: Model, num_positions: int) -> None:
    """Refuse a sequence longer than the model takes (its RoPE was never trained past it)."""
    if num_positions > model.position_limit():
        raise ValueError(
            f"a sequence of {num_positions} tokens is longer than the {model.position_limit()} positions model "
            f"{model.name} takes (max_positions {model.max_positions}); shorten the prompts or responses"
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, grad_group: object = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.grad_group = grad_group
        """Tensor ranks whose partial gradients must be summed (per-head norms see only local heads)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, replicated(self.weight, self.grad_group), self.eps)


#: What a training forward recomputes in its backward (`StagePlan.recompute`).
Recompute = Literal["none", "full", "selective"]


def _checkpointed(recompute: bool, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """`fn(*args)`, under autograd with `recompute` by torch's non-reentrant checkpoint: nothing
    `fn` computes is kept, its backward reruns it."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def _attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """Scores, softmax and the weighted sum of the values: [b, t, heads * d]."""
    if plan.split is not None:
        return plan.split.attention(q, k, v)
    if plan.bias is not None:
        return masked_attention(q, k, v, plan.bias)
    return grouped_attention(q, k, v, plan.decode_mask)


class Attention(nn.Module):
    def __init__(self, model: Model, tp: TensorParallel, recompute_core: bool = False):
        super().__init__()
        self.recompute_core = recompute_core
        """Selective recompute: the attention core keeps nothing and reruns in the backward."""
        self.head_dim = model.head_dim
        self.local_heads = model.num_heads // tp.size
        self.local_kv_heads = max(1, model.num_kv_heads // tp.size)
        kv_out = self.local_kv_heads * model.head_dim
        self.q_proj = ColumnParallelLinear(model.hidden_dim, self.local_heads * model.head_dim, model.qkv_bias, tp)
        self.k_proj = ColumnParallelLinear(model.hidden_dim, kv_out, model.qkv_bias, tp, tp.kv_group)
        self.v_proj = ColumnParallelLinear(model.hidden_dim, kv_out, model.qkv_bias, tp, tp.kv_group)
        if model.qk_norm:
            self.q_norm = RMSNorm(model.head_dim, model.rms_norm_eps, tp.group)
            self.k_norm = RMSNorm(model.head_dim, model.rms_norm_eps, tp.group)
        self.qk_norm = model.qk_norm
        self.o_proj = RowParallelLinear(self.local_heads * model.head_dim, model.hidden_dim, tp)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        cache: KVStore | None,
        cache_start: int,
    ) -> torch.Tensor:
        # Projections stay in their [b, t, heads, d] output layout: RoPE and the cache take it
        # as it is, and only attention's inputs are transposed (views). Submodules are called
        # through `forward` (no hooks are ever registered: the hook machinery is pure overhead).
        batch, seq, _ = x.shape
        x = replicated(x, self.q_proj.tp.group)  # one all-reduce of the input gradient for q, k and v
        q = self.q_proj.on_replicated(x).view(batch, seq, self.local_heads, self.head_dim)
        k = self.k_proj.on_replicated(x).view(batch, seq, self.local_kv_heads, self.head_dim)
        v = self.v_proj.on_replicated(x).view(batch, seq, self.local_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            # The cache keeps source columns (decode steps index it by column); a whole
            # sequence attends over its own packed keys, a decode step over the cache's.
            packing = plan.packing
            new_keys, new_values = (k, v) if packing is None else (packing.unpack(k), packing.unpack(v))
            context = cache.extend(new_keys, new_values, cache_start)
            if plan.decode_mask is not None:
                k, v = context
        return self.o_proj.forward(_checkpointed(self.recompute_core, _attention_core, q, k, v, plan))


def _gated(gate: torch.Tensor, up: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The MLP's gated activation, activation(gate) * up."""
    return activate(gate, activation) * up


class MLP(nn.Module):
    def __init__(self, model: Model, tp: TensorParallel, recompute_gate: bool = False):
        super().__init__()
        local_ffn = model.ffn_dim // tp.size
        self.gate_proj = ColumnParallelLinear(model.hidden_dim, local_ffn, False, tp)
        self.up_proj = ColumnParallelLinear(model.hidden_dim, local_ffn, False, tp)
        self.down_proj = RowParallelLinear(local_ffn, model.hidden_dim, tp)
        self.activation = model.activation
        self.recompute_gate = recompute_gate
        """Selective recompute: activation(gate) is not kept; the backward reruns it from `gate`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = replicated(x, self.gate_proj.tp.group)  # one all-reduce of the input gradient for gate and up
        gate, up = self.gate_proj.on_replicated(x), self.up_proj.on_replicated(x)
        return self.down_proj.forward(_checkpointed(self.recompute_gate, _gated, gate, up, self.activation))


class Block(nn.Module):
    def __init__(self, model: Model, tp: TensorParallel, recompute: Recompute, layer: int, ep: ExpertParallel):
        super().__init__()
        self.attn_norm = RMSNorm(model.hidden_dim, model.rms_norm_eps)
        self.attn = Attention(model, tp, recompute_core=recompute == "selective")
        self.mlp_norm = RMSNorm(model.hidden_dim, model.rms_norm_eps)
        sparse = model.moe is not None and model.moe.is_sparse(layer)
        self.mlp: MLP | MoEMLP = (
            MoEMLP(model, layer, tp, ep) if sparse else MLP(model, tp, recompute_gate=recompute == "selective")
        )
        self.recompute_all = recompute == "full"
        """Full recompute: the layer keeps only its input and reruns its forward in the backward."""

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        cache: KVStore | None = None,
        cache_start: int = 0,
        routes: Routes | None = None,
        dispatch: Dispatch = "all_to_all",
    ) -> torch.Tensor:
        def layer(x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn.forward(self.attn_norm.forward(x), rope, plan, cache, cache_start)
            if isinstance(self.mlp, MoEMLP):
                return x + self.mlp.forward(self.mlp_norm.forward(x), routes, dispatch)
            return x + self.mlp.forward(self.mlp_norm.forward(x))

        return _checkpointed(self.recompute_all and cache is None, layer, x)


class DecoderPipelineStage(nn.Module):
    """One pipeline stage of a decoder on one tensor rank.

    Stage 0 embeds token ids; later stages take the previous stage's hidden states. The
    last stage returns its head's output: this rank's logit columns [b, t, vocab / tp] or
    values [b, t]; the others return hidden states [b, t, hidden]. Given a `reduce`, the last
    stage of an LM head instead hands its final hidden states to it, inside the forward, and
    `token_log_probs` / `token_log_probs_and_entropy` compute from them in chunks of tokens (`chunked_head`):
    the engine's training and log-prob passes never make the whole logits.
    """

    def __init__(
        self,
        model: Model,
        head: Head,
        tp: TensorParallel,
        pp: int,
        stage: int,
        recompute: Recompute = "none",
        logit_chunk_tokens: int = LOGIT_CHUNK_TOKENS,
        ep: ExpertParallel | None = None,
    ):
        super().__init__()
        self.model = model
        self.ep = ep or ExpertParallel.single()
        """This rank's place among the ep ranks splitting the experts (`moe`)."""
        self.head = head
        self.logit_chunk_tokens = logit_chunk_tokens
        """Tokens per chunk of the LM head's log-probs and entropy (`chunked_head`)."""
        self.inv_freq = rope_inv_freq(model)
        self.tp = tp
        self.is_first = stage == 0
        self.is_last = stage == pp - 1
        self.layer_ids = stage_layers(model, pp, stage)
        tied = head == "lm" and model.tied_embeddings
        if self.is_first or (self.is_last and tied):
            self.embed = VocabParallelEmbedding(model.vocab_size, model.hidden_dim, tp)
        self.layers = nn.ModuleDict({str(i): Block(model, tp, recompute, i, self.ep) for i in self.layer_ids})
        if self.is_last:
            self.final_norm = RMSNorm(model.hidden_dim, model.rms_norm_eps)
            if head == "value":
                self.value_head = nn.Linear(model.hidden_dim, 1)
            elif not tied:
                self.lm_head = ColumnParallelLinear(model.hidden_dim, model.vocab_size // tp.size, False, tp)

    def forward(
        self,
        inputs: torch.Tensor,
        key_mask: torch.Tensor,
        positions: torch.Tensor,
        caches: Mapping[int, KVStore] | None = None,
        cache_start: int = 0,
        split: SequenceSplit | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        routes: Routes | None = None,
        dispatch: Dispatch | None = None,
    ) -> torch.Tensor:
        """`inputs`: token ids (first stage) or hidden states; `key_mask` [b, keys] covers the cache.

        A whole sequence (no cached columns) runs packed (`Packing`) under causal attention;
        a decode step after `cache_start` cached columns masks its queries x keys only.
        Under context parallelism (`split`) `inputs` and `positions` are this rank's columns
        of whole sequences and `key_mask` the whole rows' (`context_parallel`).
        `reduce` (last stage): what the forward returns instead of the head's output, computed
        from it inside the forward (so full sharding holds the gathered head weight while it
        runs); an LM head then passes its final hidden states [b, t, hidden], not logits.
        `routes`: the MoE layers' replayed and chosen experts (`moe.Routes`), [b, t, k] per
        layer by column of `inputs` (not under context parallelism); `dispatch`: how tokens
        reach their experts' ep ranks (`moe`; default: `replicated` for a cached generation
        pass, whose ep ranks step the same rows, `all_to_all` otherwise).
        """
        check_positions(self.model, key_mask.shape[-1])
        if dispatch is None:
            dispatch = "replicated" if caches is not None else "all_to_all"
        hidden_only = reduce is not None and self.head == "lm"
        if split is not None:
            if routes is not None:
                raise ValueError("routing replay and recording run without context parallelism; set cp to 1")
            output = self._layers_and_head(inputs, positions, AttentionPlan(split=split), None, 0, hidden_only)
            return output if reduce is None or not self.is_last else reduce(output)
        num_queries = inputs.shape[1]
        if cache_start == 0 and key_mask.shape[-1] == num_queries:
            bias = None
            if num_queries <= MATMUL_ATTENTION_MAX_TOKENS and not torch.is_grad_enabled():
                group = self.model.num_heads // max(self.model.num_kv_heads, self.tp.size)  # query heads per KV head
                dtype = self.embed.weight.dtype if self.is_first else inputs.dtype
                bias = causal_bias(num_queries, group, dtype, key_mask.device)
            plan = AttentionPlan(bias=bias, packing=Packing.of(key_mask))
        else:
            plan = AttentionPlan(decode_mask=attention_mask_4d(key_mask, num_queries))

        def layers(x: torch.Tensor, positions: torch.Tensor, layer_routes: Routes | None) -> torch.Tensor:
            return self._layers_and_head(x, positions, plan, caches, cache_start, hidden_only, layer_routes, dispatch)

        output = _run_packed(layers, inputs, positions, plan.packing, routes)
        return output if reduce is None or not self.is_last else reduce(output)

    def _layers_and_head(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        caches: Mapping[int, KVStore] | None,
        cache_start: int,
        hidden_only: bool = False,
        routes: Routes | None = None,
        dispatch: Dispatch = "all_to_all",
    ) -> torch.Tensor:
        x = self.embed.forward(inputs) if self.is_first else inputs
        rope = rope_tables(positions, self.inv_freq, x.dtype)
        for layer_id, block in zip(self.layer_ids, self.layers.values(), strict=True):
            cache = None if caches is None else caches[layer_id]
            x = block.forward(x, rope, plan, cache, cache_start, routes, dispatch)
        if not self.is_last:
            return x
        x = self.final_norm.forward(x)
        if hidden_only:
            return x
        if self.head == "value":
            return self.value_head(x).squeeze(-1)
        if hasattr(self, "lm_head"):
            return self.lm_head.forward(x)
        return F.linear(replicated(x, self.tp.group), self.embed.weight)

    def head_shard(self) -> chunked_head.HeadShard:
        """This rank's rows of the LM head weight (the tied embedding's without an LM head)."""
        weight = self.lm_head.weight if hasattr(self, "lm_head") else self.embed.weight
        return chunked_head.HeadShard(weight, self.tp.rank * (self.model.vocab_size // self.tp.size), self.tp.group)

    def token_log_probs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """fp32 log p(target) per token from the final hidden states (a `reduce`'s input)."""
        return chunked_head.token_log_probs(hidden, targets, self.head_shard(), self.logit_chunk_tokens)

    def token_log_probs_and_entropy(
        self, hidden: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`token_log_probs` and the fp32 next-token entropy per token, in one pass over the chunks."""
        return chunked_head.token_log_probs_and_entropy(hidden, targets, self.head_shard(), self.logit_chunk_tokens)

    def new_caches(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> dict[int, LayerCache]:
        shape = (batch, max(1, self.model.num_kv_heads // self.tp.size), capacity, self.model.head_dim)
        return {
            i: LayerCache(
                torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
            )
            for i in self.layer_ids
        }


class ReferenceModel(nn.Module):
    """The whole model in one process, with full weights under the contract's names."""

    def __init__(self, model: Model, head: Head = "lm"):
        super().__init__()
        self.model = model
        self.head = head
        self.inv_freq = rope_inv_freq(model)
        self.weights = nn.ParameterDict()
        for info in param_infos(model, head):
            self.weights[info.name.replace(".", "__")] = nn.Parameter(torch.empty(info.global_shape))

    def param(self, name: str) -> torch.Tensor:
        return self.weights[name.replace(".", "__")]

    def named_logical_parameters(self) -> dict[str, nn.Parameter]:
        return {name.replace("__", "."): p for name, p in self.weights.items()}

    def _optional(self, name: str) -> torch.Tensor | None:
        """A parameter the model may lack (biases, the untied LM head)."""
        return self.weights.get(name.replace(".", "__"))

    def _attention(self, i: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Causal attention of layer `i` over packed rows."""
        m, p = self.model, f"layers.{i}.attn."
        batch, seq, _ = x.shape

        def project(proj: str, heads: int) -> torch.Tensor:
            out = F.linear(x, self.param(p + f"{proj}_proj.weight"), self._optional(p + f"{proj}_proj.bias"))
            return out.view(batch, seq, heads, m.head_dim)

        q, k, v = project("q", m.num_heads), project("k", m.num_kv_heads), project("v", m.num_kv_heads)
        if m.qk_norm:
            q = rms_norm(q, self.param(p + "q_norm.weight"), m.rms_norm_eps)
            k = rms_norm(k, self.param(p + "k_norm.weight"), m.rms_norm_eps)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return F.linear(grouped_attention(q, k, v, None), self.param(p + "o_proj.weight"))

    def forward(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None, routes: Routes | None = None
    ) -> torch.Tensor:
        """Full logits [b, t, vocab] or values [b, t] (rows packed as the stages pack them);
        `routes`: the MoE layers' replayed and chosen experts (`moe.Routes`), [b, t, k] per layer."""
        check_positions(self.model, tokens.shape[1])
        mask = torch.ones_like(tokens, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        return _run_packed(self._packed_forward, tokens, positions_from_mask(mask), Packing.of(mask), routes)

    def _moe(self, i: int, h: torch.Tensor, routes: Routes | None) -> torch.Tensor:
        """Sparse layer `i`'s MLP, plainly: every expert on the tokens routed to it."""
        moe = self.model.moe
        assert moe is not None
        p = f"layers.{i}.mlp."
        hidden = h.reshape(-1, h.shape[-1])
        logits = F.linear(hidden, self.param(p + "router.weight"))
        replay = None if routes is None else routes.replay.get(i)
        weights, experts = route(logits, moe.experts_per_token, moe.norm_topk_prob, replay)
        if routes is not None:
            routes.chosen[i] = experts.detach()
            if routes.keep_logits:
                routes.router_logits[i] = logits
        out = torch.zeros_like(hidden)
        gate_w, up_w, down_w = (self.param(p + f"experts.{n}") for n in ("gate_proj", "up_proj", "down_proj"))
        for e in range(moe.num_experts):
            token, slot = torch.where(experts == e)
            x = hidden[token]
            y = F.linear(activate(F.linear(x, gate_w[e]), self.model.activation) * F.linear(x, up_w[e]), down_w[e])
            out = out.index_add(0, token, y * weights[token, slot, None])
        return out.view(h.shape)

    def _packed_forward(self, tokens: torch.Tensor, positions: torch.Tensor, routes: Routes | None) -> torch.Tensor:
        m = self.model
        x = F.embedding(tokens, self.param("embed.weight"))
        rope = rope_tables(positions, self.inv_freq, x.dtype)
        for i in range(m.num_layers):
            p = f"layers.{i}."
            x = x + self._attention(i, rms_norm(x, self.param(p + "attn_norm.weight"), m.rms_norm_eps), rope)
            h = rms_norm(x, self.param(p + "mlp_norm.weight"), m.rms_norm_eps)
            if m.moe is not None and m.moe.is_sparse(i):
                x = x + self._moe(i, h, routes)
                continue
            gate = F.linear(h, self.param(p + "mlp.gate_proj.weight"))
            up = F.linear(h, self.param(p + "mlp.up_proj.weight"))
            x = x + F.linear(activate(gate, m.activation) * up, self.param(p + "mlp.down_proj.weight"))
        x = rms_norm(x, self.param("final_norm.weight"), m.rms_norm_eps)
        if self.head == "value":
            return F.linear(x, self.param("value_head.weight"), self.param("value_head.bias")).squeeze(-1)
        lm = self._optional("lm_head.weight")
        return F.linear(x, self.param("embed.weight") if lm is None else lm)

    def token_log_probs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(target) per token from the whole logits (this model's forward output)."""
        flat = -F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="none")
        return flat.view(targets.shape)

    def token_log_probs_and_entropy(
        self, logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`token_log_probs` and the entropy per token from the whole logits: -sum p log p."""
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return picked, -(log_probs.exp() * log_probs).sum(dim=-1)

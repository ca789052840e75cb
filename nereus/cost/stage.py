"""Latency and peak memory of one model-stage under one layout.

Every function takes tp, pp, dp and micro-batch counts as numbers or as numpy
arrays of equal shape, so the planner prices thousands of layouts in one call.
The formulas, per GPU of the busiest pipeline stage:

* model states (ZeRO, Rajbhandari et al.): parameters and gradients in the
  training dtype; AdamW keeps fp32 master weights and two fp32 moments (12 bytes per
  parameter; 8 without master weights), divided by dp x cp when sharded (across the ranks
  holding the same weights: the replicas and their cp ranks).
* activations (Korthikanti et al., sequence parallel with flash attention):
  34 * s * b * h / tp bytes per layer for 16-bit activations; the first 1F1B stage
  holds min(pp, micro-batches) micro-batches; a tied embedding's backward holds two extra
  gradient-sized copies (`tied_gradient_bytes`).
* logits (`logits_bytes`): training and inference take the LM head's log-probs a chunk of
  `LOGIT_CHUNK_TOKENS` tokens at a time (nereus.runtime.model.chunked_head), so one fp32
  chunk of logits exists, 4 * min(s * b, chunk) * V / tp, whatever the sequence length (as
  before the chunking, a 16-bit model's 16-bit logits beside it are not priced, nor the
  entropy bonus's second chunk); generation samples from the whole fp32 logits of each row's
  last position, 4 * b * V / tp.
* activation recomputation (`recompute` 1, full): a layer keeps only its 2 * s * b * h input
  (Korthikanti et al.'s full recomputation) plus one layer's working set while it reruns,
  which reuses the logits' room (the head's backward has freed them by then), and the
  backward pass reruns the forward: 4 passes of compute instead of 3. Selective
  (`recompute` 2): the attention core and the MLP's gate activation rerun in the backward
  from kept inputs, so a layer drops the activation's output, 2 * s * b * ffn / tp (with
  fused attention the core keeps no s^2 scores either way, and its output is the output
  projection's kept input), and the attention FLOPs take 4 passes, the dense ones 3.
* one micro-batch per rank (`micro_batches` 1, no token budget, no full recompute, no
  training-time offload): the engine sets the gradients to None before the step, so none
  exists while the forward's activations are kept; the peak is the larger of the LM head's
  backward (activations, one logits chunk, the head's weight gradient) and the backward's end
  (every gradient, a tied embedding's copies), not their sum (`_one_pass_terms`). With more
  micro-batches the earlier ones' gradients are held beside the later ones' activations, and
  full recompute peaks in the backward (a rerun layer beside nearly every gradient): the terms
  add up.
* token-budget micro-batches (`token_budget` > 0 tokens): a micro-batch is packed to at
  most that many tokens, so activations are sized by the budget rather than by rows of
  the maximum length (verl's `ppo_max_token_len_per_gpu`).
* ZeRO-1 (`zero1` 1): AdamW state sharded across dp x cp; the gradient all-reduce becomes a
  reduce-scatter plus an all-gather of the updated parameters (the same ring bytes).
* KV cache: 2 * kv_heads_per_rank * head_dim * bytes per token and layer, for every
  sample of a replica at prompt + maximum response length, or a budget of bytes
  (`kv_budget`) the engine batches continuously into (nereus.cost.continuous_batching).
* decode: per token step, max(FLOPs / compute, bytes read / HBM bandwidth): memory
  bound until the batch passes the ridge point; the step count follows the longest
  response of the batch, and the active batch shrinks as responses finish, or under a
  binding budget, the batch runs at the budget's concurrency until the queue drains.
* full sharding (`full_shard` 1, ZeRO-3 / FSDP FULL_SHARD): parameters, and in training
  gradients and AdamW state, divided by dp x cp; a running model-stage also holds the gathered
  unit (the largest of a layer and the embedding, on its tp rank) twice (the one computing
  and the one prefetched) and in training one unit's unsharded gradients. Every micro-batch
  all-gathers the parameters in its forward, again in its backward, and reduce-scatters the
  gradients: 3 ring halves of an all-reduce of the parameters per micro-batch in training
  (1 in inference) instead of one all-reduce per mini-batch, not overlapped with compute.
* offload (sleep): a model-stage's resident states move to host memory between its runs,
  over the host link (the cluster's `host_link`), once in and once out per step.
* training-time offload (`train_offload` 1: optimizer, 2: params; DeepSpeed's ZeRO-Offload,
  FSDP2's CPUOffloadPolicy): the AdamW state and the gradients, sharded across dp x cp (both
  systems shard them: ZeRO-Offload is built on ZeRO-2), live in host memory and the optimizer
  step runs on the host, at the calibration's `host_adam_params_per_s` shared by the node's
  GPUs; 2 also keeps the (fully sharded) parameters there. The GPU holds one unit of gradients
  on their way out (within full sharding's gathered units when fully sharded). Per optimizer
  step the host link carries each micro-batch's gradient shard out and the updated parameter
  shard in (1), or per micro-batch the forward and backward gathers' shards in and the
  gradient shard out (2), not overlapped with compute.
* pipelines run 1F1B: (micro-batches + pp - 1) slots; the pp - 1 extra slots are bubbles.
* context parallelism (`cp`, training and inference; Ulysses, docs/context-parallel.md): each of a
  replica's cp ranks holds 1/cp of every sequence's tokens, so activations and logits (and the
  compute, the tp all-reduces and the pipeline sends) are divided by cp; a Ulysses layer trained
  without recompute keeps its attention output twice, the kernel's (heads layout) and the output
  projection's input (sequence layout), one output-sized tensor more than unsplit
  (`attention_output_bytes`). The cp ranks hold the
  same weights, so they join the dp replicas wherever state is shared out: the gradient
  all-reduce, and the shards of ZeRO-1, full sharding and training-time offload, run over the
  dp x cp ranks of a (stage, tp rank) position (torchtitan's dp_shard x cp mesh); unsharded
  parameters, gradients and optimizer state are held whole by every cp rank. Around each
  layer's attention core 4 all-to-alls (q, k, v out; the output back) move a rank's
  tokens x heads-per-tp-rank, (cp - 1) / cp of them leaving the rank, per forward pass (the
  backward is two passes' worth), over the intra- or inter-node link by where the tp x cp
  group sits; KV heads that cp does not split (cp beyond the KV heads after tp) are repeated
  per query head before the all-to-all and move as such (`ulysses_bytes`). The all-gather
  method (`cp_allgather`, Llama 3's context parallelism) splits no heads: per layer each rank
  all-gathers the keys and values of the whole sequence (its tp rank's KV heads) in every
  forward, reruns included, and reduce-scatters their gradients in the backward, (cp - 1) / cp
  of the bytes moved (`allgather_kv_bytes`); the gathered keys and values of a layer are
  transient, and saved for the backward unless the attention core is recomputed (`cp_kv`). Its
  columns are cut zigzag (rank c holds runs c and 2 cp - 1 - c of 2 cp), so under the causal
  mask every cp rank computes 1 / cp of the attention (`cp_attention_share`).
* expert parallelism (`ep`, mixture-of-experts models; Megatron's semantics, docs/moe.md): a
  replica's ep ranks hold the same non-expert weights and take 1/ep of its sequences each (its
  attention is data-parallel over dp x ep), so activations, logits and KV cache are divided by ep;
  the experts of every sparse layer are split over them, so the expert parameters (and their
  gradients and optimizer state) are divided by ep (and by tp, each expert's width being
  tp-split), the other parameters are not. FLOPs are those of the active parameters (a token's
  routed experts), the expert ones times `EXPERT_LOAD_IMBALANCE` where ep > 1 (the busiest rank's
  experts get more than the mean share of tokens). Per MoE layer and forward pass, two
  all-to-alls among the ep ranks (dispatch and combine) each move a rank's tokens x
  experts-per-token x hidden x dtype bytes, (ep - 1) / ep of them leaving the rank (the backward
  is two passes' worth), over the intra- or inter-node link by where the tp x ep group sits
  (`ep_comm`). Gradients of the non-expert weights are all-reduced over dp x ep ranks, those of
  the experts over dp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from nereus.cost.calibration import Calibration
from nereus.cost.continuous_batching import binds, decode_profile
from nereus.spec.cluster import Cluster
from nereus.spec.model import Head, Model
from nereus.spec.stages import Stage
from nereus.spec.workload import DTYPE_BYTES, Workload

Array = Any  # a float, an int or a numpy array: the functions broadcast

#: The model-state terms training-time offload keeps in host memory, by the least `train_offload`
#: level (1: optimizer, 2: params) that moves each.
OFFLOAD_LEVELS = {"parameters": 2, "gradients": 1, "optimizer": 1}
#: `StagePlan.train_offload` by the cost model's level.
TRAIN_OFFLOADS = ("none", "optimizer", "params")

#: Bytes per parameter of AdamW state: fp32 master copy + two fp32 moments.
ADAM_BYTES_MIXED = 12
ADAM_BYTES_FP32 = 8
KORTHIKANTI_BYTES_PER_SBH = 34
#: Bytes per s * b * h a layer keeps under full recomputation: its input only.
RECOMPUTE_BYTES_PER_SBH = 2
#: Bytes per s * b * ffn / tp a layer drops under selective recomputation: its gate
#: activation's 16-bit output, which the backward recomputes from the kept gate projection;
#: at most the 8 * s * b * h / tp Korthikanti et al. count for the activation's output (their
#: 34 assumes an ffn of 4h and does not grow with it).
SELECTIVE_SAVED_BYTES_PER_SBF = 2
SELECTIVE_SAVED_MAX_BYTES_PER_SBH = 8
#: `recompute` codes of the cost arrays (`nereus.spec.plan.RECOMPUTE_LEVELS` indexes them).
RECOMPUTE_FULL, RECOMPUTE_SELECTIVE = 1, 2
#: Tokens per chunk of the LM head's log-probs and entropy in training and inference: the
#: runtime makes one chunk's logits at a time (`nereus.runtime.model.chunked_head`; its
#: `EngineConfig.logit_chunk_tokens` defaults to this), so the `logits` term prices one fp32
#: chunk: what the log-probs hold, forward and backward (measured on CPU, 1.0 chunk in fp32:
#: tests/runtime/test_chunked_head.py). A 16-bit model's logits before their promotion add half
#: a chunk and an entropy bonus (`rl.entropy_coef` > 0) a second chunk, which the term leaves
#: out, as the whole-logits term before it left out the 16-bit logits.
LOGIT_CHUNK_TOKENS = 1024
#: Share of a token budget that first-fit packing of variable-length rows fills.
PACKING_FILL = 0.9
#: Expert work on the busiest ep rank over the mean, where experts are split over ep > 1 ranks
#: (a router never balances exactly, and every rank waits for the busiest in the all-to-all).
#: 1.25 is the capacity factor Switch Transformers train with (Fedus, Zoph and Shazeer, "Switch
#: Transformers", JMLR 2022, Sec. 2.2 and Table 1: capacity factor 1.25, each expert given room
#: for 1.25x its even share of tokens), the bound a capacity-limited router keeps the busiest
#: expert under; Megatron-Core's `moe_expert_capacity_factor` is set the same way.
EXPERT_LOAD_IMBALANCE = 1.25


def _uses(flag: Array) -> bool:
    """Whether a choice is in play: on for one layout, or an array of layouts (some may use it)."""
    return bool(np.ndim(flag)) or bool(flag)


def expert_params(model: Model) -> int:
    """Parameters of every expert of `model` (routers excluded; 0 for a dense model)."""
    moe = model.moe
    return 0 if moe is None else model.sparse_layers() * moe.num_experts * moe.expert_params(model.hidden_dim)


def _splits_experts(model: Model, ep: Array) -> bool:
    """Whether expert parallelism is in play: a model with experts, and ep > 1 for one layout or
    an array of layouts (a dense model's ep is 1 whatever the caller passes)."""
    return model.moe is not None and _uses(np.greater(ep, 1))


@overload
def kv_bytes_per_token(model: Model, tp: int, pp: int, element_bytes: int) -> int: ...
@overload
def kv_bytes_per_token(model: Model, tp: np.ndarray, pp: np.ndarray, element_bytes: int) -> np.ndarray: ...
def kv_bytes_per_token(model: Model, tp: Any, pp: Any, element_bytes: int) -> Any:
    """KV bytes one token takes on a rank of a tp x pp replica: keys and values of its pipeline
    stage's layers (pp divides them) for its whole KV heads (tp divides them; beyond their
    count every rank holds one replicated head), `element_bytes` each (the engine's cache:
    `kv_pool.KV_ELEMENT_BYTES`; the cost model prices the workload's dtype). Elementwise on arrays."""
    heads = max(1, model.num_kv_heads // tp) if np.ndim(tp) == 0 else np.maximum(model.num_kv_heads // tp, 1)
    return 2 * heads * model.head_dim * (model.num_layers // pp) * element_bytes


@dataclass(frozen=True)
class StageCostModel:
    """Prices one model-stage (a model with its head, in one stage) on one cluster."""

    model: Model
    head: Head
    stage: Stage
    workload: Workload
    cluster: Cluster
    calibration: Calibration

    # ---- sizes --------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.workload.dtype]

    def expert_params_per_layer(self) -> float:
        """Expert parameters per block, averaged over the blocks (0 for a dense model): every
        expert of the sparse blocks, without their routers (which every ep rank holds)."""
        return expert_params(self.model) / self.model.num_layers

    def expert_params_per_gpu(self, tp: Array, pp: Array, ep: Array = 1) -> Array:
        """Expert parameters on one GPU: its pipeline stage's share of the experts, each split
        over tp (its width) and the experts over ep."""
        return self.expert_params_per_layer() / (tp * ep) * (self.model.num_layers / pp)

    def layer_params_per_rank(self, tp: Array, ep: Array = 1) -> Array:
        """Parameters of one block on one tp rank (KV heads replicate beyond their count) and ep
        rank (its block of the experts)."""
        m = self.model
        q_dim = m.num_heads * m.head_dim
        kv_heads_rank = np.maximum(m.num_kv_heads / tp, 1.0)
        kv_dim_rank = m.head_dim * kv_heads_rank
        attention = 2 * m.hidden_dim * q_dim / tp + 2 * m.hidden_dim * kv_dim_rank
        if m.qkv_bias:
            attention = attention + q_dim / tp + 2 * kv_dim_rank
        if m.qk_norm:
            attention = attention + 2 * m.head_dim
        experts = self.expert_params_per_layer()
        # tp splits each expert's width, ep splits the experts; the rest of the MLP (routers,
        # dense blocks) is held by every ep rank.
        mlp = m.mlp_params() / tp if not experts else (m.mlp_params() - experts) / tp + experts / (tp * ep)
        return attention + mlp + 2 * m.hidden_dim

    def params_per_gpu(self, tp: Array, pp: Array, ep: Array = 1) -> Array:
        """Parameters on the busiest GPU: its layers plus the embedding or the final norm and head."""
        m = self.model
        layers = self.layer_params_per_rank(tp, ep) * (m.num_layers / pp)
        embedding = m.vocab_size * m.hidden_dim / tp
        head: Array
        if self.head == "value":
            head = 2.0 * m.hidden_dim + 1
        elif m.tied_embeddings:
            head = m.hidden_dim + np.where(pp > 1, embedding, 0.0)  # the last stage needs its own copy
        else:
            head = m.hidden_dim + embedding
        first = layers + embedding + np.where(pp == 1, head, 0.0)
        last = layers + head
        return np.maximum(first, last)

    def kv_bytes_per_token(self, tp: Array, pp: Array) -> Array:
        """KV-cache bytes per token on one GPU (its layers, its KV heads) in the workload's dtype."""
        return kv_bytes_per_token(self.model, tp, pp, self.dtype_bytes)

    def dense_flops_per_token(self, pp: Array = 1, ep: Array = 1) -> Array:
        """Forward GEMM FLOPs per token (2 per multiply-add) on the busiest pipeline stage: of
        the parameters a token computes with (a mixture of experts' routed experts only, their
        share times `EXPERT_LOAD_IMBALANCE` where ep > 1 splits the experts over ranks).

        The last stage carries the output head besides its layers; with a large
        vocabulary it is the slowest stage and sets the pipeline's pace.
        """
        m = self.model
        head = m.vocab_size * m.hidden_dim if self.head == "lm" else m.hidden_dim
        flops = 2.0 * ((m.num_layers / pp) * (m.layer_params(active=True) - 2 * m.hidden_dim) + head)
        if m.moe is None or not _splits_experts(m, ep):
            return flops
        active_experts = self.expert_params_per_layer() * m.moe.experts_per_token / m.moe.num_experts
        extra = 2.0 * (m.num_layers / pp) * active_experts * (EXPERT_LOAD_IMBALANCE - 1.0)
        return flops + np.where(np.greater(ep, 1), extra, 0.0)

    def dispatch_bytes(self, tokens: Array) -> Array:
        """Bytes one ep rank puts through one MoE layer's dispatch (or its combine) all-to-all in
        one forward pass: each of its `tokens` tokens to its experts_per_token experts, hidden
        wide, in the workload's dtype."""
        moe = self.model.moe
        k = 0 if moe is None else moe.experts_per_token
        return tokens * k * self.model.hidden_dim * self.dtype_bytes

    def attention_flops(self, query_tokens: Array, context: Array) -> Array:
        """Forward FLOPs of QK^T and AV for `query_tokens` attending to `context` keys."""
        m = self.model
        return 4.0 * query_tokens * context * m.num_heads * m.head_dim * m.num_layers

    def samples_per_replica(self, dp: Array) -> Array:
        return np.ceil(self.workload.samples_per_step / dp)

    # ---- primitive times --------------------------------------------------------------
    def _flop_rate(self) -> float:
        return self.cluster.gpu.bf16_flops * (1.0 if self.dtype_bytes == 2 else 0.5)

    def compute_time(self, dense_flops: Array, attention_flops: Array, gpus: Array, decode: bool = False) -> Array:
        rate = self._flop_rate() * gpus
        c = self.calibration
        gemm = c.decode_gemm if decode and c.decode_gemm is not None else c.gemm
        return dense_flops / (rate * gemm) + attention_flops / (rate * c.attention)

    def link(self, inter: Array) -> tuple[Array, Array]:
        """(bytes/s, latency) of the intra- or inter-node link, calibrated."""
        if np.ndim(inter) == 0:  # one layout (the common case outside the planner): no arrays
            return self.calibration.link(self.cluster, bool(inter))
        (intra_bw, intra_latency), (inter_bw, inter_latency) = (
            self.calibration.link(self.cluster, False),
            self.calibration.link(self.cluster, True),
        )
        return np.where(inter, inter_bw, intra_bw), np.where(inter, inter_latency, intra_latency)

    def allreduce_time(self, nbytes: Array, ranks: Array, inter: Array) -> Array:
        """Ring all-reduce: 2 (n - 1) / n of the bytes over the link, 2 (n - 1) hops."""
        bandwidth, latency = self.link(inter)
        steps = 2.0 * (ranks - 1)
        return np.where(ranks > 1, steps * latency + steps / ranks * nbytes / bandwidth, 0.0)

    def all_to_all_time(self, nbytes: Array, ranks: Array, inter: Array) -> Array:
        """All-to-all of `nbytes` per rank: (n - 1) / n of them leave it, one message per peer."""
        bandwidth, latency = self.link(inter)
        return np.where(ranks > 1, (ranks - 1) * latency + (ranks - 1) / ranks * nbytes / bandwidth, 0.0)

    def ulysses_bytes(self, tokens: Array, tp: Array, cp: Array = 1) -> Array:
        """Bytes one rank puts through a layer's 4 Ulysses all-to-alls in one forward pass: for
        its `tokens` tokens, the query and output heads of its tp rank and its KV heads (keys and
        values; KV heads replicate beyond their count over tp, as `kv_bytes_per_token` says).
        Where cp does not split the tp rank's KV heads, the runtime repeats them per query head
        before the all-to-all (`SequenceSplit.attention`): keys and values then move as many
        heads as the queries."""
        m = self.model
        kv_heads = np.maximum(m.num_kv_heads // np.asarray(tp), 1)
        kv_heads = np.where(kv_heads % np.asarray(cp) == 0, kv_heads, m.num_heads / np.asarray(tp))
        heads = 2.0 * m.num_heads / tp + 2.0 * kv_heads
        return tokens * heads * m.head_dim * self.dtype_bytes

    def allgather_kv_bytes(self, tokens: Array, tp: Array) -> Array:
        """Bytes of one layer's keys and values of `tokens` tokens (a whole sequence's) on one tp
        rank: what the all-gather method gathers on each cp rank (and reduce-scatters back)."""
        kv_heads = np.maximum(self.model.num_kv_heads // np.asarray(tp), 1)
        return tokens * 2.0 * kv_heads * self.model.head_dim * self.dtype_bytes

    @staticmethod
    def cp_attention_share(cp: Array, allgather: Array) -> Array:
        """The slowest cp rank's attention work over the balanced 1 / cp share: 1 for both
        methods. Ulysses computes whole sequences on 1/cp of the heads; the all-gather method
        cuts each sequence into 2 cp runs and gives rank c runs c and 2 cp - 1 - c (the runtime's
        zigzag, `ContextParallel.runs`), whose causal work (keys before each query) sums to the
        same on every rank."""
        return np.ones(np.broadcast(np.asarray(cp), np.asarray(allgather)).shape)

    def p2p_time(self, nbytes: Array, inter: Array) -> Array:
        bandwidth, latency = self.link(inter)
        return latency + nbytes / bandwidth

    # ---- memory ----------------------------------------------------------------------
    def micro_batch_size(self, dp: Array, micro_batches: Array) -> Array:
        """Sequences per micro-batch: training splits a replica's mini-batch share."""
        if self.stage == "training":
            per_replica = np.ceil(self.workload.samples_per_step / self.workload.mini_batches / dp)
            return np.ceil(per_replica / micro_batches)
        return np.ceil(self.samples_per_replica(dp) / micro_batches)

    def model_state_terms(
        self, params: Array, shards: Array, zero1: Array | None = None, full_shard: Array = 0
    ) -> dict[str, Array]:
        """Resident bytes per GPU holding `params` parameters: parameters, and in training
        gradients and optimizer state (the optimizer sharded across the `shards` ranks holding
        the same weights, dp x cp, under ZeRO-1, None: as the workload's optimizer says; all of
        them under full sharding)."""
        shard = np.where(full_shard, shards, 1)
        terms: dict[str, Array] = {"parameters": params * self.dtype_bytes / shard}
        if self.stage == "training":
            optimizer = self.workload.optimizer
            adam = ADAM_BYTES_MIXED if self.dtype_bytes == 2 and optimizer.master_weights else ADAM_BYTES_FP32
            terms["gradients"] = params * self.dtype_bytes / shard
            terms["optimizer"] = params * adam / np.where(self._zero1(zero1, full_shard), shards, 1)
        return terms

    def _zero1(self, zero1: Array | None, full_shard: Array = 0) -> Array:
        """Whether the optimizer state is sharded across dp (full sharding implies it)."""
        return np.logical_or(self.workload.optimizer.shard_across_dp if zero1 is None else zero1, full_shard)

    def gathered_unit_params(self, tp: Array, ep: Array = 1) -> Array:
        """Parameters full sharding gathers at once on one tp (and ep) rank: a layer, or the
        embedding (or output head) when that is larger."""
        m = self.model
        return np.maximum(self.layer_params_per_rank(tp, ep), m.vocab_size * m.hidden_dim / tp)

    def gathered_bytes(self, tp: Array, full_shard: Array, ep: Array = 1) -> Array:
        """Transient bytes of full sharding: two gathered units of parameters (computing and
        prefetched), plus in training one unit of unsharded gradients before its reduce-scatter."""
        copies = 3.0 if self.stage == "training" else 2.0
        return np.where(full_shard, copies * self.gathered_unit_params(tp, ep) * self.dtype_bytes, 0.0)

    def full_kv_bytes(self, tp: Array, pp: Array, dp: Array, ep: Array = 1) -> Array:
        """KV bytes per GPU for every sample of a replica (of its ep rank's 1/ep share of them)
        at the maximum length at once."""
        max_len = self.workload.prompt_len + self.workload.response_len.max
        return self.samples_per_replica(dp * ep) * max_len * self.kv_bytes_per_token(tp, pp)

    def micro_batch_tokens(self, dp: Array, micro_batches: Array, token_budget: Array = 0) -> Array:
        """Tokens one micro-batch's activations are sized for: rows at the maximum length,
        or the token budget when micro-batches are packed to one."""
        max_len = self.workload.prompt_len + self.workload.response_len.max
        rows = self.micro_batch_size(dp, micro_batches) * max_len
        return np.where(np.asarray(token_budget) > 0, token_budget, rows)

    def packed_token_budget(self, dp: Array, micro_batches: Array) -> Array:
        """The token budget that packs a replica's mini-batch share into `micro_batches`
        micro-batches at the mean length (never below one maximum-length row)."""
        w = self.workload
        share = np.ceil(w.samples_per_step / w.mini_batches / dp) * (w.prompt_len + w.response_len.mean())
        return np.maximum(w.prompt_len + w.response_len.max, np.ceil(share / micro_batches / PACKING_FILL))

    def memory_terms(
        self,
        tp: Array,
        pp: Array,
        dp: Array,
        micro_batches: Array,
        *,
        recompute: Array = 0,
        token_budget: Array = 0,
        zero1: Array | None = None,
        kv_budget: Array = math.inf,
        full_shard: Array = 0,
        train_offload: Array = 0,
        cp: Array = 1,
        ep: Array = 1,
        cp_allgather: Array = 0,
    ) -> dict[str, Array]:
        """Peak bytes per GPU by term. Model states are resident; the rest is transient. Bytes
        training-time offload keeps in host memory are not among them (`host_terms`). `cp`: each
        rank holds 1/cp of the tokens (training and inference), `cp_allgather` (1) by the
        all-gather method, which also holds a layer's gathered keys and values (`cp_kv`); `ep`:
        each rank holds 1/ep of the experts and of the replica's sequences."""
        w, m = self.workload, self.model
        offloaded = self.stage == "training" and _uses(train_offload)
        if offloaded:  # training-time offload shards the optimizer state across dp
            zero1 = np.logical_or(self._zero1(zero1), np.asarray(train_offload) > 0)
        # ZeRO-1, full sharding and training-time offload shard over the dp x cp ranks of a position.
        terms = self.model_state_terms(self.params_per_gpu(tp, pp, ep), dp * cp, zero1, full_shard)
        if offloaded:  # the offloaded states leave the GPU (`host_terms`): their device terms are 0
            for name, level in OFFLOAD_LEVELS.items():
                terms[name] = np.where(np.asarray(train_offload) >= level, 0.0, terms[name])
            unit = self.gathered_unit_params(tp, ep) * self.dtype_bytes
            terms["offload_buffer"] = np.where(
                (np.asarray(train_offload) > 0) & ~np.asarray(full_shard, bool), unit, 0.0
            )
        if _uses(full_shard):  # a term only where full sharding is in play (plans without it keep their terms)
            terms["gathered"] = self.gathered_bytes(tp, full_shard, ep)
        max_len = w.prompt_len + w.response_len.max
        if self.stage == "training":
            tokens = self.micro_batch_tokens(dp, micro_batches, token_budget) / (cp * ep)
            in_flight = np.minimum(pp, micro_batches)
            sbh = tokens * m.hidden_dim * self.dtype_bytes / 2
            full = KORTHIKANTI_BYTES_PER_SBH * sbh / tp
            per_sbh = min(SELECTIVE_SAVED_BYTES_PER_SBF * m.ffn_dim / m.hidden_dim, SELECTIVE_SAVED_MAX_BYTES_PER_SBH)
            gate_output = per_sbh * sbh / tp
            kept = np.select(
                [np.equal(recompute, RECOMPUTE_FULL), np.equal(recompute, RECOMPUTE_SELECTIVE)],
                [RECOMPUTE_BYTES_PER_SBH * sbh, full - gate_output],
                full,
            )
            if _uses(np.greater(cp, 1)):  # Ulysses without recompute keeps the core's output twice
                ulysses = np.greater(cp, 1) & ~np.asarray(cp_allgather, bool) & np.equal(recompute, 0)
                kept = kept + np.where(ulysses, self.attention_output_bytes(tokens, tp), 0.0)
            rows = tokens / max_len
            # One layer's working set while its backward reruns it (full; the core's is
            # negligible). The layers rerun only after the head's backward has freed the logits
            # and the loss's working copy, so the rerun adds only what exceeds their room.
            logits = self.logits_bytes(rows * max_len, tp) if self.head == "lm" else 0.0
            rerun = np.where(np.equal(recompute, RECOMPUTE_FULL), np.maximum(full - logits, 0.0), 0.0)
            terms["activations"] = kept * (m.num_layers / pp) * in_flight + rerun
            # One micro-batch per rank (rows, not a token budget's packs) without full recompute:
            # its gradients do not exist while its activations do (`_one_pass_terms`). Not under
            # training-time offload, whose measured peaks exceed even the summed terms (the
            # host gradients' device staging, which no term prices: docs/memory.md, offload).
            one_pass = np.equal(micro_batches, 1) & np.equal(token_budget, 0) & ~np.equal(recompute, RECOMPUTE_FULL)
            one_pass = one_pass & np.equal(train_offload, 0)
        elif self.stage == "inference":
            rows = self.micro_batch_size(dp, micro_batches) / (cp * ep)  # a cp (ep) rank's share of the tokens
            terms["activations"] = KORTHIKANTI_BYTES_PER_SBH * max_len * rows * m.hidden_dim / tp * self.dtype_bytes / 2
        else:
            rows = self.samples_per_replica(dp * ep)  # an ep rank's share of the replica's samples
            terms["kv_cache"] = np.minimum(kv_budget, self.full_kv_bytes(tp, pp, dp, ep))
        if self.head == "lm":
            terms["logits"] = self.logits_bytes(rows * (max_len if self.stage != "generation" else 1), tp)
        if self.stage != "generation" and _uses(np.logical_and(np.greater(cp, 1), cp_allgather)):
            # The whole sequences' keys and values of one layer (the ranks' rows are the replica's),
            # and of every layer in flight where the backward finds them saved (no recompute).
            whole = rows * cp * max_len
            gathered = self.allgather_kv_bytes(whole, tp)
            if self.stage == "training":
                saved = np.equal(recompute, 0) * (m.num_layers / pp) * np.minimum(pp, micro_batches)
                gathered = gathered * np.maximum(saved, 1.0)
            terms["cp_kv"] = np.where(np.greater(cp, 1) & np.asarray(cp_allgather, bool), gathered, 0.0)
        if self.stage == "training":
            terms["tied_gradients"] = self.tied_gradient_bytes(tp, pp)
            if _uses(one_pass):
                # Full sharding's gathered units hold the head's gradient (`gathered_bytes`).
                head_gradient = np.where(np.asarray(full_shard, bool), 0.0, self.head_gradient_bytes(tp))
                self._one_pass_terms(terms, one_pass, head_gradient)
        return terms

    @staticmethod
    def _one_pass_terms(terms: dict[str, Array], one_pass: Array, head_gradient: Array) -> None:
        """Training's transient terms where a rank runs its rows as one micro-batch without full
        recompute (`one_pass`). The engine sets every gradient to None before the forward
        (`Engine.train_step`), so while the forward's activations are kept no gradient exists:
        the step peaks either at the start of the LM head's backward (the kept activations, the
        logits chunk and the head's weight gradient, the first one made) or at the backward's
        end (every gradient, and a tied embedding's two extra copies), whichever is larger; in
        between, each layer's gradients take the room its freed activations held. Summing the
        terms would price the gradients beside the activations (measured on CPU ranks:
        docs/memory.md). The `gradients` term stays whole, as the gradients stay resident after
        the update (beside the next model-stages of a colocated rank), so the transient terms
        carry what the peak holds above them: at the head, the logits and the activations beyond
        the gradients' room; at the end, the tied copies. With more micro-batches the earlier
        ones' gradients are held beside the later ones' activations, and full recompute peaks
        in the backward (a rerun layer beside nearly every gradient): there the terms add up."""
        gradients, logits, tied = terms["gradients"], terms.get("logits", 0.0), terms["tied_gradients"]
        head = terms["activations"] + logits + head_gradient
        end = gradients + tied
        above = np.maximum(head, end) - gradients  # at least the tied copies: never negative
        at_head = head >= end
        held_logits = np.where(at_head, np.minimum(logits, above), 0.0)
        held_tied = np.where(at_head, 0.0, tied)
        terms["activations"] = np.where(one_pass, above - held_logits - held_tied, terms["activations"])
        if "logits" in terms:
            terms["logits"] = np.where(one_pass, held_logits, logits)
        terms["tied_gradients"] = np.where(one_pass, held_tied, tied)

    def head_gradient_bytes(self, tp: Array) -> Array:
        """Bytes of the output head's weight gradient on one tp rank: its vocabulary rows (a
        tied embedding's, whose head use comes first in the backward), or the value head's
        hidden-wide row."""
        rows = self.model.vocab_size / tp if self.head == "lm" else 1.0
        return rows * self.model.hidden_dim * self.dtype_bytes

    def attention_output_bytes(self, tokens: Array, tp: Array) -> Array:
        """Bytes of one layer's attention output for a rank's `tokens` tokens (its tp rank's
        query heads). Unsplit, the output projection's input is a view of the attention
        kernel's output, which both keep for the backward; under Ulysses the kernel's output
        (every column, 1/cp of the heads) and the projection's input (the all-to-all's: 1/cp of
        the columns, every head) are two tensors, so a layer keeps one more output-sized tensor
        (unless the core is recomputed, which keeps only the projection's input)."""
        return tokens * self.model.num_heads / tp * self.model.head_dim * self.dtype_bytes

    def logits_bytes(self, tokens: Array, tp: Array) -> Array:
        """Bytes of the LM head's fp32 logits on one tp rank (its vocabulary columns) in a pass
        over `tokens` tokens: in training and inference one chunk of at most
        `LOGIT_CHUNK_TOKENS` tokens (the runtime's chunked head); in generation all `tokens`
        (each row's last position, which sampling reads whole)."""
        held = tokens if self.stage == "generation" else np.minimum(tokens, LOGIT_CHUNK_TOKENS)
        return 4.0 * held * self.model.vocab_size / tp

    def tied_gradient_bytes(self, tp: Array, pp: Array) -> Array:
        """Transient bytes of a tied embedding's backward on a GPU that holds both its uses
        (pp = 1): the LM head's gradient of the shared weight waits in autograd's buffer
        until the lookup's arrives at the end of the backward pass, and their sum is made
        beside both, so two gradient-sized copies exist above the one kept (measured on
        CPU ranks: docs/memory.md). With pp > 1 each stage's copy has one use, so none."""
        m = self.model
        if self.head != "lm" or not m.tied_embeddings:
            return np.zeros(np.shape(pp))
        embedding = m.vocab_size * m.hidden_dim / tp * self.dtype_bytes
        return np.where(pp == 1, 2.0 * embedding, 0.0)

    def host_terms(
        self, tp: Array, pp: Array, dp: Array, train_offload: Array, cp: Array = 1, ep: Array = 1
    ) -> dict[str, Array]:
        """Host-memory bytes per GPU of training-time offload, by term: the gradients and AdamW
        state (`train_offload` >= 1) and the parameters (2) of this GPU's shard across dp x cp."""
        if self.stage != "training" or not _uses(train_offload):
            return {}
        shard = self.model_state_terms(self.params_per_gpu(tp, pp, ep), dp * cp, True, 1)
        level = np.asarray(train_offload)
        return {name: np.where(level >= OFFLOAD_LEVELS[name], shard[name], 0.0) for name in OFFLOAD_LEVELS}

    def host_optimizer_time(self, tp: Array, pp: Array, shards: Array, ep: Array = 1) -> Array:
        """Seconds of one AdamW step on the host over this GPU's shard (of `shards`: dp x cp),
        when every GPU of its node steps at once on the node's CPUs."""
        shard = self.params_per_gpu(tp, pp, ep) / shards
        return shard * self.cluster.gpus_per_node / self.calibration.host_adam_params_per_s

    def host_transfer_time(
        self, tp: Array, pp: Array, shards: Array, micro_batches: Array, train_offload: Array, ep: Array = 1
    ) -> Array:
        """Seconds per optimizer step on the host link: each micro-batch's gradient shard out and
        the updated parameter shard in (1), or per micro-batch the two gathers' parameter shards
        in and the gradient shard out (2); one copy per layer each time."""
        link = self.cluster.host_link
        shard_bytes = self.params_per_gpu(tp, pp, ep) / shards * self.dtype_bytes
        level = np.asarray(train_offload)
        copies = np.where(level >= 2, 3.0 * micro_batches, micro_batches + 1.0)
        moved = copies * (shard_bytes / link.bytes_per_s + self.model.num_layers / pp * link.latency_s)
        return np.where(level > 0, moved, 0.0)

    def offload_time(self, resident_bytes: Array) -> Array:
        """Seconds to move resident states to the host after a run and back before the next."""
        link = self.cluster.host_link
        return 2 * (link.latency_s + resident_bytes / link.bytes_per_s)

    # ---- latency ---------------------------------------------------------------------
    def time_terms(
        self,
        tp: Array,
        pp: Array,
        dp: Array,
        micro_batches: Array,
        pp_inter: Array,
        dp_inter: Array,
        *,
        recompute: Array = 0,
        zero1: Array | None = None,
        kv_budget: Array = math.inf,
        full_shard: Array = 0,
        train_offload: Array = 0,
        cp: Array = 1,
        cp_inter: Array = False,
        ep: Array = 1,
        ep_inter: Array = False,
        cp_allgather: Array = 0,
    ) -> dict[str, Array]:
        """Seconds per RL step by term, for the slowest replica. `cp`, `cp_inter`: the context-
        parallel degree and whether a tp x cp group crosses nodes (training and inference),
        `cp_allgather` (1) where the cp method is the all-gather one (else Ulysses);
        `ep`, `ep_inter`: the expert-parallel degree and whether a tp x ep group crosses nodes."""
        if self.stage == "generation":
            return self._generation_terms(tp, pp, dp, pp_inter, kv_budget, ep, ep_inter)
        return self._pipeline_terms(
            tp,
            pp,
            dp,
            micro_batches,
            pp_inter,
            dp_inter,
            recompute,
            zero1,
            full_shard,
            train_offload,
            cp,
            cp_inter,
            ep,
            ep_inter,
            cp_allgather,
        )

    def _pipeline_terms(
        self,
        tp: Array,
        pp: Array,
        dp: Array,
        micro_batches: Array,
        pp_inter: Array,
        dp_inter: Array,
        recompute: Array = 0,
        zero1: Array | None = None,
        full_shard: Array = 0,
        train_offload: Array = 0,
        cp: Array = 1,
        cp_inter: Array = False,
        ep: Array = 1,
        ep_inter: Array = False,
        cp_allgather: Array = 0,
    ) -> dict[str, Array]:
        """Inference forwards or 1F1B training: (m + pp - 1) slots per mini-batch."""
        w, m = self.workload, self.model
        seq = w.prompt_len + w.response_len.mean()
        b = self.micro_batch_size(dp, micro_batches)
        passes: Array
        launches: Array
        attention_passes: Array
        if self.stage == "training":
            # backward = 2x forward; full recomputation reruns the forward inside the backward,
            # selective only the attention core
            full_rerun = np.equal(recompute, RECOMPUTE_FULL)
            passes, rounds = np.where(full_rerun, 4.0, 3.0), w.mini_batches * w.ppo_epochs
            attention_passes = np.where(np.greater(recompute, 0), 4.0, 3.0)
            launches = np.where(full_rerun, 3.0, 2.0)  # forward, (recompute), backward
        else:
            passes, rounds, launches = 1.0, 1, 1.0
            attention_passes = 1.0
        m_count = micro_batches
        dense = self.dense_flops_per_token(pp, ep) * b * seq * passes
        attention = self.attention_flops(b * seq, seq / 2) / pp * attention_passes  # causal: half the keys
        attention = attention * self.cp_attention_share(cp, cp_allgather)  # the slowest cp rank's share
        slot_compute = self.compute_time(dense, attention, tp * cp * ep)  # each cp (ep) rank computes 1/cp (1/ep)
        activation_bytes = b * seq * m.hidden_dim * self.dtype_bytes / (cp * ep)
        layers = m.num_layers / pp
        slot_tp = 2 * passes * layers * self.allreduce_time(activation_bytes, tp, False)
        slot_pp = np.where(pp > 1, np.minimum(launches, 2.0) * self.p2p_time(activation_bytes, pp_inter), 0.0)
        # Ulysses: 4 all-to-alls per layer and forward pass (q, k, v in; the output back).
        ulysses = passes * layers * self.all_to_all_time(self.ulysses_bytes(b * seq / cp, tp, cp), cp, cp_inter)
        # All-gather KV: a gather per forward (reruns too: full, or the core under selective),
        # a reduce-scatter of the gradients per backward; each moves (cp - 1) / cp of the bytes.
        gathers = 1.0 if self.stage != "training" else 1.0 + np.greater(recompute, 0) + 1.0
        kv = gathers * layers * self.all_to_all_time(self.allgather_kv_bytes(b * seq, tp), cp, cp_inter)
        slot_cp = np.where(np.asarray(cp_allgather, bool), kv, ulysses)
        # Expert parallelism: dispatch and combine per MoE layer and forward pass.
        splits = _splits_experts(m, ep)
        slot_ep: Array = 0.0
        if splits:
            moe_layers = m.sparse_layers() / pp
            slot_ep = 2 * passes * moe_layers * self.all_to_all_time(self.dispatch_bytes(b * seq / ep), ep, ep_inter)
        c = self.calibration
        slot_overhead = launches * layers * c.launch_overhead_s + np.minimum(launches, 2.0) * c.micro_batch_overhead_s
        slot = slot_compute + slot_tp + slot_pp + slot_cp + slot_ep + slot_overhead
        terms = {
            "compute": rounds * m_count * slot_compute,
            "tp_comm": rounds * m_count * slot_tp,
            "pp_comm": rounds * m_count * slot_pp,
            "overhead": rounds * m_count * slot_overhead + c.stage_overhead_s,
            "bubble": rounds * (pp - 1) * slot,
        }
        if _uses(np.greater(cp, 1)):  # a term only where context parallelism is in play
            terms["cp_comm"] = rounds * m_count * slot_cp
        if splits:  # a term only where expert parallelism is in play
            terms["ep_comm"] = rounds * m_count * slot_ep
        # A ring all-gather or reduce-scatter moves half an all-reduce's bytes in half its hops.
        replica_bytes = self.params_per_gpu(tp, pp, ep) * self.dtype_bytes
        if self.stage == "training":
            # ZeRO-1 reduce-scatters gradients and all-gathers parameters: a ring all-reduce's bytes,
            # once per mini-batch; full sharding gathers twice and reduce-scatters once per micro-batch.
            # The cp ranks of a replica hold the same weights: they join the gradients' reduction.
            halves = np.where(full_shard, 1.5 * m_count, 1.0)
            sync_inter = np.logical_or(dp_inter, np.logical_and(np.greater(cp, 1), cp_inter))
            sync = self.allreduce_time(replica_bytes, dp * cp, sync_inter)
            if splits:
                # The ep ranks are data-parallel for the non-expert weights (dp x ep ranks); each
                # expert's gradients are summed over the dp replicas only.
                expert_bytes = self.expert_params_per_gpu(tp, pp, ep) * self.dtype_bytes
                ep_sync_inter = np.logical_or(dp_inter, np.logical_and(np.greater(ep, 1), ep_inter))
                split_sync = self.allreduce_time(
                    replica_bytes - expert_bytes, dp * ep, ep_sync_inter
                ) + self.allreduce_time(expert_bytes, dp, dp_inter)
                sync = np.where(np.greater(ep, 1), split_sync, sync)
            terms["dp_sync"] = rounds * halves * sync
            # Each rank steps its shard of dp x cp (ZeRO-1, full sharding, offload).
            terms["optimizer"] = rounds * self._optimizer_time(tp, pp, dp * cp, zero1, full_shard, ep)
            if _uses(train_offload):  # the step runs on the host, its shard moved over the host link
                level = np.asarray(train_offload)
                host_step = self.host_optimizer_time(tp, pp, dp * cp, ep)
                terms["optimizer"] = np.where(level > 0, rounds * host_step, terms["optimizer"])
                terms["host_transfer"] = rounds * self.host_transfer_time(tp, pp, dp * cp, m_count, level, ep)
        elif _uses(full_shard):  # inference all-gathers the parameters once per micro-batch, over dp x cp
            sync_inter = np.logical_or(dp_inter, np.logical_and(np.greater(cp, 1), cp_inter))
            gather = 0.5 * m_count * self.allreduce_time(replica_bytes, dp * cp, sync_inter)
            terms["dp_sync"] = np.where(full_shard, gather, 0.0)
        return terms

    def _optimizer_time(
        self, tp: Array, pp: Array, shards: Array, zero1: Array | None = None, full_shard: Array = 0, ep: Array = 1
    ) -> Array:
        """AdamW is memory bound: read and write params, grads, master and moments (of this
        rank's shard of `shards`, dp x cp, where sharded)."""
        shard = np.where(self._zero1(zero1, full_shard), shards, 1)
        bytes_per_param = 2 * (2 * self.dtype_bytes + ADAM_BYTES_MIXED)
        moved = self.params_per_gpu(tp, pp, ep) / shard * bytes_per_param
        return moved / (self.cluster.gpu.hbm_bytes_per_s * self.calibration.decode_memory)

    def kv_budget_binds(self, tp: Array, pp: Array, dp: Array, kv_budget: Array, ep: Array = 1) -> Array:
        """Whether a KV budget in bytes per GPU holds less than a replica's peak demand (of an ep
        rank's share of its samples; one that does not bind prices as the unbounded cache)."""
        w = self.workload
        capacity = np.asarray(kv_budget, dtype=float) / self.kv_bytes_per_token(tp, pp)
        longest = w.response_len.expected_longest(w.samples_per_step)
        return binds(w.response_len, float(w.prompt_len), self.samples_per_replica(dp * ep), capacity, longest)

    def _generation_terms(
        self,
        tp: Array,
        pp: Array,
        dp: Array,
        pp_inter: Array,
        kv_budget: Array = math.inf,
        ep: Array = 1,
        ep_inter: Array = False,
    ) -> dict[str, Array]:
        """Prefill, then decode iterations until the longest response of the step finishes. Under
        expert parallelism each ep rank decodes its 1/ep of the replica's samples (attention
        data-parallel), their tokens dispatched to the experts and combined per MoE layer."""
        w, m, c = self.workload, self.model, self.calibration
        n = self.samples_per_replica(dp * ep)
        p = float(w.prompt_len)
        # The step waits for the slowest replica, the one holding the longest response.
        longest = w.response_len.expected_longest(w.samples_per_step)
        pipeline = (2 * pp - 1) / pp  # pp micro-batches in flight: pp + pp - 1 slots
        # pp micro-batches of n / pp samples each; a slot is one on the busiest stage.
        prefill_flops = self.dense_flops_per_token(pp, ep) * n * p / pp, self.attention_flops(n * p, p / 2) / pp / pp
        prefill = self.compute_time(*prefill_flops, tp) * (2 * pp - 1)
        # Prefill all-reduces are large: (2 pp - 1) slots of 2 L / pp all-reduces per micro-batch.
        prefill_bytes = n * p * m.hidden_dim * self.dtype_bytes / pp
        prefill_tp = (2 * pp - 1) * 2 * m.num_layers / pp * self.allreduce_time(prefill_bytes, tp, False)
        # Decode, sliced (a trailing axis): iterations, running sequences and their KV tokens.
        capacity = np.asarray(kv_budget, dtype=float) / self.kv_bytes_per_token(tp, pp)
        dt, running, tokens = decode_profile(w.response_len, p, n, capacity, longest)
        tp_, pp_, inter_, ep_ = (np.asarray(x, dtype=float)[..., None] for x in (tp, pp, pp_inter, ep))
        flops = running / pp_ * self.dense_flops_per_token(pp_, ep_), self.attention_flops(1.0, tokens) / pp_ / pp_
        compute = self.compute_time(*flops, tp_, decode=True)  # one of pp micro-batches on the busiest stage
        weights = self.params_per_gpu(tp_, pp_, ep_) * self.dtype_bytes
        kv = tokens * self.kv_bytes_per_token(tp_, pp_) / pp_
        memory = (weights + kv) / (self.cluster.gpu.hbm_bytes_per_s * c.decode_memory)
        token_bytes = running * m.hidden_dim * self.dtype_bytes / pp_
        tp_comm = 2 * m.num_layers * self.allreduce_time(token_bytes, tp_, False) * pp_
        pp_comm = np.where(pp_ > 1, (2 * pp_ - 2) * self.p2p_time(token_bytes, inter_ > 0), 0.0)
        iterations = dt.sum(axis=-1)
        terms = {
            "prefill": prefill,
            "decode": ((2 * pp_ - 1) * np.maximum(compute, memory) * dt).sum(axis=-1),
            "tp_comm": prefill_tp + (tp_comm * dt).sum(axis=-1),
            "pp_comm": (pp_comm * dt).sum(axis=-1),
            "overhead": (m.num_layers * c.launch_overhead_s * pipeline + c.decode_token_overhead_s) * iterations
            + c.stage_overhead_s,
        }
        if _splits_experts(m, ep):  # dispatch and combine per MoE layer, as the tp all-reduces are paced
            moe_layers = m.sparse_layers()
            prefill_ep = (
                (2 * pp - 1) * 2 * moe_layers / pp * self.all_to_all_time(self.dispatch_bytes(n * p / pp), ep, ep_inter)
            )
            ep_inter_ = np.asarray(ep_inter)[..., None]
            decode_ep = 2 * moe_layers * self.all_to_all_time(self.dispatch_bytes(running / pp_), ep_, ep_inter_) * pp_
            terms["ep_comm"] = prefill_ep + (decode_ep * dt).sum(axis=-1)
        return terms

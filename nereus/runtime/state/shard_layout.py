"""Which slice of every parameter each rank of an EMU holds: the runtime's sharding contract.

Pure Python (no torch): the engine builds its modules from these shapes, the resharder
and the checkpointer move state by intersecting these boxes. Ranks inside an EMU are
stage-major, as in the planner: position `s * tp + r` is pipeline stage `s`, tensor rank `r`
(with context parallelism, the cp ranks of a stage hold the same position's boxes: the EMU
entry `(s * cp + c) * tp + r` is stage `s`, cp rank `c`, tensor rank `r`).

Parameter names (L layers, i in 0..L-1; * marks a tensor-parallel split dim):
    embed.weight                      [vocab*, hidden]          stage 0 (and the last stage when tied)
    layers.i.attn_norm.weight         [hidden]
    layers.i.attn.q_proj.weight       [heads*head_dim*, hidden]   (.bias with qkv_bias)
    layers.i.attn.k_proj.weight       [kv_heads*head_dim*, hidden] (.bias with qkv_bias)
    layers.i.attn.v_proj.weight       [kv_heads*head_dim*, hidden] (.bias with qkv_bias)
    layers.i.attn.q_norm.weight       [head_dim]                 (qk_norm only)
    layers.i.attn.k_norm.weight       [head_dim]                 (qk_norm only)
    layers.i.attn.o_proj.weight       [hidden, heads*head_dim*]
    layers.i.mlp_norm.weight          [hidden]
    layers.i.mlp.gate_proj.weight     [ffn*, hidden]
    layers.i.mlp.up_proj.weight       [ffn*, hidden]
    layers.i.mlp.down_proj.weight     [hidden, ffn*]
  sparse (mixture-of-experts) layers instead of the three mlp.*_proj (E experts, F = expert_ffn_dim):
    layers.i.mlp.router.weight        [E, hidden]
    layers.i.mlp.experts.gate_proj    [E^, F*, hidden]
    layers.i.mlp.experts.up_proj      [E^, F*, hidden]
    layers.i.mlp.experts.down_proj    [E^, hidden, F*]
    final_norm.weight                 [hidden]                  last stage
    lm_head.weight                    [vocab*, hidden]          last stage, untied LM head only
    value_head.weight, .bias          [1, hidden], [1]          last stage, value head only

^ marks the expert dim, split over the ep ranks in contiguous blocks (ep rank e holds experts
[e E/ep, (e+1) E/ep)); every other parameter is the same on the ep ranks of a position.

When tp exceeds the KV heads, k/v are not split but replicated in whole heads: tensor
rank r holds KV head r // (tp // kv_heads) (the planner's `kv_heads_rule`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from nereus.spec.check import layout_problem
from nereus.spec.model import Head, Model
from nereus.spec.plan import StagePlan

#: Where a parameter lives along the pipeline.
Place = Literal["first", "layer", "last", "first_and_last"]

#: A box: (offset, length) along every dim of the global tensor.
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ParamInfo:
    """One logical parameter of a model with a given head."""

    name: str
    global_shape: tuple[int, ...]
    """Shape of the whole, unsharded tensor."""
    tp_dim: int | None
    """The dim split across tensor ranks; None when every tensor rank holds it whole."""
    place: Place
    """Which pipeline stages hold it."""
    layer: int | None = None
    """The transformer block it belongs to (place == "layer")."""
    kv: bool = False
    """A k/v projection: replicated in whole heads once tp exceeds the KV heads."""
    expert: bool = False
    """An expert stack: dim 0 (the expert index) is split over the ep ranks."""


def _layer_params(model: Model, layer: int) -> list[ParamInfo]:
    q_dim = model.num_heads * model.head_dim
    kv_dim = model.num_kv_heads * model.head_dim
    prefix = f"layers.{layer}."
    hidden = model.hidden_dim

    def info(name: str, shape: tuple[int, ...], split: int | None, kv: bool = False, expert: bool = False) -> ParamInfo:
        return ParamInfo(prefix + name, shape, split, "layer", layer, kv, expert)

    params = [info("attn_norm.weight", (hidden,), None)]
    for proj, dim, kv in (("q", q_dim, False), ("k", kv_dim, True), ("v", kv_dim, True)):
        params.append(info(f"attn.{proj}_proj.weight", (dim, hidden), 0, kv))
        if model.qkv_bias:
            params.append(info(f"attn.{proj}_proj.bias", (dim,), 0, kv))
    if model.qk_norm:
        params += [
            info("attn.q_norm.weight", (model.head_dim,), None),
            info("attn.k_norm.weight", (model.head_dim,), None),
        ]
    params += [info("attn.o_proj.weight", (hidden, q_dim), 1), info("mlp_norm.weight", (hidden,), None)]
    moe = model.moe
    if moe is not None and moe.is_sparse(layer):
        experts, ffn = moe.num_experts, moe.expert_ffn_dim
        return [
            *params,
            info("mlp.router.weight", (experts, hidden), None),
            info("mlp.experts.gate_proj", (experts, ffn, hidden), 1, expert=True),
            info("mlp.experts.up_proj", (experts, ffn, hidden), 1, expert=True),
            info("mlp.experts.down_proj", (experts, hidden, ffn), 2, expert=True),
        ]
    params += [
        info("mlp.gate_proj.weight", (model.ffn_dim, hidden), 0),
        info("mlp.up_proj.weight", (model.ffn_dim, hidden), 0),
        info("mlp.down_proj.weight", (hidden, model.ffn_dim), 1),
    ]
    return params


def param_infos(model: Model, head: Head = "lm") -> list[ParamInfo]:
    """Every logical parameter, in forward order (embedding, blocks, final norm, head)."""
    tied = head == "lm" and model.tied_embeddings
    embed_place: Place = "first_and_last" if tied else "first"
    params = [ParamInfo("embed.weight", (model.vocab_size, model.hidden_dim), 0, embed_place)]
    for layer in range(model.num_layers):
        params += _layer_params(model, layer)
    params.append(ParamInfo("final_norm.weight", (model.hidden_dim,), None, "last"))
    if head == "value":
        params += [
            ParamInfo("value_head.weight", (1, model.hidden_dim), None, "last"),
            ParamInfo("value_head.bias", (1,), None, "last"),
        ]
    elif not tied:
        params.append(ParamInfo("lm_head.weight", (model.vocab_size, model.hidden_dim), 0, "last"))
    return params


def stage_layers(model: Model, pp: int, stage: int) -> range:
    """The transformer blocks pipeline stage `stage` of `pp` runs (equal contiguous runs)."""
    per_stage = model.num_layers // pp
    return range(stage * per_stage, (stage + 1) * per_stage)


def holds(info: ParamInfo, model: Model, pp: int, stage: int) -> bool:
    """Whether pipeline stage `stage` of `pp` holds `info`."""
    last = stage == pp - 1
    if info.place == "first":
        return stage == 0
    if info.place == "last":
        return last
    if info.place == "first_and_last":
        return stage == 0 or last
    assert info.layer is not None
    return info.layer in stage_layers(model, pp, stage)


def local_box(info: ParamInfo, model: Model, tp: int, tp_rank: int, ep: int = 1, ep_rank: int = 0) -> Box:
    """The box of `info` a (tensor rank, ep rank) holds (on a stage that holds it)."""
    box = [(0, size) for size in info.global_shape]
    if info.tp_dim is not None and info.kv and tp > model.num_kv_heads:
        head = tp_rank // (tp // model.num_kv_heads)
        box[info.tp_dim] = (head * model.head_dim, model.head_dim)
    elif info.tp_dim is not None:
        length = info.global_shape[info.tp_dim] // tp
        box[info.tp_dim] = (tp_rank * length, length)
    if info.expert and ep > 1:
        per_rank = info.global_shape[0] // ep
        box[0] = (ep_rank * per_rank, per_rank)
    return tuple(box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(length for _, length in box)


def box_numel(box: Box) -> int:
    return math.prod(length for _, length in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of the same tensor, or None when they are disjoint."""
    out = []
    for (a_start, a_len), (b_start, b_len) in zip(a, b, strict=True):
        start = max(a_start, b_start)
        end = min(a_start + a_len, b_start + b_len)
        if end <= start:
            return None
        out.append((start, end - start))
    return tuple(out)


@dataclass(frozen=True)
class RankLayout:
    """Where one model's replicas live: (tp, cp, ep, pp) per replica, dp replicas, on these ranks.

    `ranks` lists tp * cp * ep * pp * dp global ranks, replica-major, then stage-major, then ep
    rank, then cp rank, tensor rank innermost: replica d, stage s, ep rank e, cp rank c, tensor
    rank r is `ranks[(((d * pp + s) * ep + e) * cp + c) * tp + r]` (cp = ep = 1:
    `ranks[(d * pp + s) * tp + r]`). Every replica holds the same logical state; the cp ranks of
    a (replica, stage, ep rank, tensor rank) hold the same shard of it; the ep ranks of a
    (replica, stage, tensor rank) hold the same shard of every parameter but the expert stacks,
    whose experts they split (`local_box`).

    torch's process groups order their ranks ascending, and DTensor's meshes, FSDP2's shards and
    every gather put group rank i's part at coordinate i, so a rank's tensor, cp and replica
    coordinates must be its places among its groups' ranks. The layout puts them so, whatever
    order it is given (an EMU's GPU list, a transition's result): each (replica, stage)'s tp x cp
    ranks ascending, the replicas by their first rank; the stages keep their ranks (a pipeline
    may run in either direction, as the fused actor-critic schedule's critic does). Which rank
    holds which box moves with it, consistently: checkpoints, resharding and transitions read the
    boxes from the layout. Replicas whose ranks interleave (replica 0 below replica 1 at one
    position, above it at another) have no replica order every data-parallel group follows
    (`shards_in_group_order`, which with cp > 1 orders a position's dp x cp ranks): the state
    code does not need one, an engine that splits rows across its replicas and cp ranks does
    (`Engine.create` refuses such a layout for it).
    """

    tp: int
    pp: int
    dp: int
    ranks: tuple[int, ...]
    cp: int = 1
    """Context-parallel degree: ranks of a replica splitting each sequence (`StagePlan.cp`)."""
    ep: int = 1
    """Expert-parallel degree: ranks of a replica stage splitting the experts and the replica's
    sequences (`StagePlan.ep`; docs/moe.md)."""

    def __post_init__(self) -> None:
        cp = f" cp={self.cp}" if self.cp != 1 else ""
        ep = f" ep={self.ep}" if self.ep != 1 else ""
        if self.cp < 1:
            raise ValueError(f"layout cp={self.cp}: the context-parallel degree must be at least 1")
        if self.ep < 1:
            raise ValueError(f"layout ep={self.ep}: the expert-parallel degree must be at least 1")
        if len(self.ranks) != self.replica_size * self.dp:
            raise ValueError(
                f"layout tp={self.tp}{cp}{ep} pp={self.pp} dp={self.dp} needs {self.replica_size * self.dp} ranks, "
                f"got {len(self.ranks)}"
            )
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"layout ranks {self.ranks} repeat a rank")
        object.__setattr__(self, "ranks", self._in_group_order())

    def _in_group_order(self) -> tuple[int, ...]:
        block = self.tp * self.cp * self.ep
        replicas = sorted(
            [sorted(self.ranks[(d * self.pp + s) * block : (d * self.pp + s + 1) * block]) for s in range(self.pp)]
            for d in range(self.dp)
        )
        return tuple(rank for replica in replicas for stage in replica for rank in stage)

    @property
    def replica_size(self) -> int:
        """Ranks of one replica: tp x cp x ep x pp."""
        return self.tp * self.cp * self.ep * self.pp

    @property
    def shards(self) -> int:
        """Ranks of a (stage, tensor rank) position holding the same weights: dp x cp. ZeRO-1 and
        full sharding split rows over them (`sharded_state.dp_rows`), shard `shard_index`."""
        return self.dp * self.cp

    def shard_index(self, rank: int) -> int:
        """Where a rank of the layout sits among its position's dp x cp ranks: replica-major,
        `replica * cp + cp rank` (its rows of a split family are `dp_rows(rows, shards, this)`)."""
        replica, _, cp_rank, _ = self.place(self.ranks.index(rank))
        return replica * self.cp + cp_rank

    @property
    def shards_in_group_order(self) -> bool:
        """Whether every position's dp x cp ranks ascend with `shard_index` (so a group rank of
        the data-parallel and sharding groups is the replica, or the shard index, as splitting
        rows across them needs). Within a replica the cp ranks ascend already."""
        size = self.replica_size
        replicas = [self.ranks[d * size : (d + 1) * size] for d in range(self.dp)]
        block = self.tp * self.cp
        for stage in range(self.pp):
            for tp_rank in range(self.tp):
                column = [
                    replica[stage * block + c * self.tp + tp_rank] for replica in replicas for c in range(self.cp)
                ]
                if column != sorted(column):
                    return False
        return True

    def place(self, index: int) -> tuple[int, int, int, int]:
        """(replica, stage, cp rank, tensor rank) of entry `index` of `ranks` (`ep_place`: its ep rank)."""
        replica_stage_ep_cp, tp_rank = divmod(index, self.tp)
        replica_stage_ep, cp_rank = divmod(replica_stage_ep_cp, self.cp)
        replica, stage = divmod(replica_stage_ep // self.ep, self.pp)
        return replica, stage, cp_rank, tp_rank

    def ep_place(self, index: int) -> int:
        """The ep rank of entry `index` of `ranks`."""
        return (index // (self.tp * self.cp)) % self.ep

    def coords(self, rank: int) -> tuple[int, int, int] | None:
        """(replica, stage, tensor rank) of a global rank, or None if it is not in the layout."""
        if rank not in self.ranks:
            return None
        replica, stage, _, tp_rank = self.place(self.ranks.index(rank))
        return replica, stage, tp_rank

    def cp_rank(self, rank: int) -> int:
        """The cp rank of a global rank of the layout (0 without context parallelism)."""
        return self.place(self.ranks.index(rank))[2]

    def ep_rank(self, rank: int) -> int:
        """The ep rank of a global rank of the layout (0 without expert parallelism)."""
        return self.ep_place(self.ranks.index(rank))

    def rank_at(self, replica: int, stage: int, tp_rank: int, cp_rank: int = 0, ep_rank: int = 0) -> int:
        return self.ranks[(((replica * self.pp + stage) * self.ep + ep_rank) * self.cp + cp_rank) * self.tp + tp_rank]


#: Families of per-parameter state; every family of a parameter shares the parameter's box.
STATE_FAMILIES = ("param", "grad", "exp_avg", "exp_avg_sq")


def state_key(family: str, name: str) -> str:
    """The key of one family's tensor for parameter `name` in a rank's flat state dict."""
    assert family in STATE_FAMILIES, family
    return f"{family}/{name}"


def position_boxes(model: Model, head: Head, tp: int, pp: int, ep: int = 1) -> list[dict[str, Box]]:
    """For each EMU position `(s * ep + e) * tp + r` (stage, ep rank, tensor rank), the box of
    every parameter it holds."""
    problem = layout_problem(model, tp, pp) or ep_problem(model, ep)
    if problem:
        raise ValueError(problem)
    infos = param_infos(model, head)
    return [
        {info.name: local_box(info, model, tp, tp_rank, ep, ep_rank) for info in infos if holds(info, model, pp, stage)}
        for stage in range(pp)
        for ep_rank in range(ep)
        for tp_rank in range(tp)
    ]


def ep_problem(model: Model, ep: int) -> str | None:
    """Why the runtime cannot split `model`'s experts over `ep` ranks (None when it can)."""
    if ep == 1:
        return None
    if model.moe is None:
        return f"ep={ep} splits experts, and {model.name} has none (a dense model runs with ep 1)"
    if model.moe.num_experts % ep:
        return f"ep={ep} does not divide the {model.moe.num_experts} experts of {model.name}"
    return None


def stage_layout(entry: StagePlan) -> RankLayout:
    """The runtime layout of a plan entry: GPU ids are world ranks, EMU by EMU."""
    return RankLayout(entry.tp, entry.pp, entry.dp, tuple(entry.gpus), entry.cp, entry.ep)

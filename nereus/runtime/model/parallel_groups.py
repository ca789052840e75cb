"""A rank's place in a RankLayout and its process groups: tensor-, context-, expert-, pipeline-
and data-parallel groups, the dp x cp sharding group (and the tied-embedding pair), built
collectively by every world rank."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from nereus.runtime.comm import collectives
from nereus.runtime.model.context_parallel import ContextParallel
from nereus.runtime.model.moe import ExpertParallel
from nereus.runtime.model.pipeline import PipelineLink
from nereus.runtime.model.tensor_parallel import TensorParallel
from nereus.runtime.state.shard_layout import RankLayout
from nereus.spec.check import layout_problem
from nereus.spec.model import Head, Model
from nereus.spec.plan import CpMethod


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's coordinates in a RankLayout and its process groups."""

    layout: RankLayout
    replica: int
    pp_rank: int
    """This rank's pipeline stage in its replica."""
    tp: TensorParallel
    link: PipelineLink
    dp_group: Any
    """The ranks holding the same shards in the other replicas, at this rank's cp and ep rank
    (None when dp is 1)."""
    embed_group: Any
    """First and last stage of this replica and tensor rank, tied embeddings with pp > 1 only."""
    cp: ContextParallel = field(default_factory=ContextParallel.single)
    """This rank's place among the cp ranks splitting its replica's sequences (same shards)."""
    shard_group: Any = None
    """The dp x cp ranks holding this rank's (stage, tensor rank) weights, in `shard_index` order:
    gradients are summed over them, and ZeRO-1 and full sharding split rows across them (the dp
    group when cp is 1, the cp group when dp is 1; None when both are 1)."""
    shard_index: int = 0
    """This rank's place in `shard_group` (`RankLayout.shard_index`)."""

    @property
    def shards(self) -> int:
        """Ranks of `shard_group`: dp x cp."""
        return self.layout.shards

    ep: ExpertParallel = field(default_factory=ExpertParallel.single)
    """This rank's place among the ep ranks of its (replica, stage, tensor rank) position, which
    split the experts and the replica's sequences (`moe`)."""


def build_groups(
    model: Model, head: Head, layout: RankLayout, cp_method: CpMethod = "ulysses"
) -> ParallelGroups | None:
    """Create the layout's groups (collective: every world rank calls it, in the same order);
    `cp_method`: how the cp ranks' attention sees the whole sequence (`ContextParallel.method`)."""
    tp, pp, dp, cp, ep = layout.tp, layout.pp, layout.dp, layout.cp, layout.ep
    rank = dist.get_rank()
    coords = layout.coords(rank)
    mine: dict[str, Any] = {}

    def make(kind: str, lines: list[list[int]]) -> None:
        for ranks in lines:
            group = collectives.subgroup(ranks)
            if rank in ranks:
                mine[kind] = group

    for tp_ranks in _along(layout, "tp"):
        make("tp", [tp_ranks])
        if tp > model.num_kv_heads:
            copies = tp // model.num_kv_heads
            make("kv", [tp_ranks[kv_head * copies : (kv_head + 1) * copies] for kv_head in range(model.num_kv_heads)])
    for stage_ranks in _along(layout, "pp"):
        make("pp", [stage_ranks])
        if head == "lm" and model.tied_embeddings and pp > 1:
            make("embed", [[stage_ranks[0], stage_ranks[-1]]])
    make("dp", _along(layout, "dp"))
    if cp > 1:
        make("cp", _along(layout, "cp"))
        if dp > 1:
            make("shard", _along(layout, "dp", "cp"))
    if ep > 1:
        make("ep", _along(layout, "ep"))
    if coords is None:
        return None
    replica, stage, tp_rank = coords
    cp_rank, ep_rank = layout.cp_rank(rank), layout.ep_rank(rank)
    link = PipelineLink(
        stage,
        pp,
        layout.rank_at(replica, stage - 1, tp_rank, cp_rank, ep_rank) if stage > 0 else None,
        layout.rank_at(replica, stage + 1, tp_rank, cp_rank, ep_rank) if stage < pp - 1 else None,
        mine.get("pp"),
    )
    tensor = TensorParallel(tp, tp_rank, mine.get("tp"), mine.get("kv"))
    context = ContextParallel(cp, cp_rank, mine.get("cp"), cp_method)
    experts = ExpertParallel(ep, ep_rank, mine.get("ep"))
    shard_group = mine.get("shard") if dp > 1 and cp > 1 else mine.get("dp") if cp == 1 else mine.get("cp")
    return ParallelGroups(
        layout, replica, stage, tensor, link, mine.get("dp"), mine.get("embed"), context, shard_group,
        layout.shard_index(rank), experts,
    )  # fmt: skip


#: The coordinates of a layout's rank, outermost first (`RankLayout.rank_at`'s order).
_AXES = ("dp", "pp", "ep", "cp", "tp")


def _along(layout: RankLayout, *axes: str) -> list[list[int]]:
    """The ranks along `axes` (`_AXES` order) at every position of the other coordinates, outermost first."""
    grid = torch.tensor(layout.ranks).view(*(getattr(layout, name) for name in _AXES))
    inner = [_AXES.index(name) for name in axes]
    outer = [dim for dim in range(len(_AXES)) if dim not in inner]
    return grid.permute(*outer, *inner).reshape(-1, math.prod(grid.shape[dim] for dim in inner)).tolist()


def admissible_layouts(model: Model, max_ranks: int) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) with tp * pp * dp <= max_ranks that the runtime can shard `model` as."""
    return [
        (tp, pp, dp)
        for tp in range(1, max_ranks + 1)
        for pp in range(1, max_ranks // tp + 1)
        if layout_problem(model, tp, pp) is None
        for dp in range(1, max_ranks // (tp * pp) + 1)
    ]

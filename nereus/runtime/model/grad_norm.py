"""The global gradient norm of a model trained in any TP x PP x DP layout, and clipping by it.

After `Engine.forward_backward` every replica holds the same reduced gradients, so the norm of
the whole model is that of one replica: the sum, over its tensor and pipeline ranks, of the
squared norms of the gradient pieces each holds. A piece held by several ranks of the replica
counts once: a parameter every tensor rank holds whole (norms, the value head), a KV head
copied onto several tensor ranks, a tied embedding held by the first and the last stage, and
every weight but the experts under expert parallelism (the ep ranks hold the same copy; each
holds its own experts).
The sum runs in float64, so layouts agree with a single rank to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from nereus.runtime.comm import collectives
from nereus.runtime.state.shard_layout import local_box, param_infos
from nereus.spec.model import Head, Model

if TYPE_CHECKING:
    from nereus.runtime.model.engine import Engine
    from nereus.runtime.model.parallel_groups import ParallelGroups

#: Added to the norm before dividing by it (torch.nn.utils.clip_grad_norm_'s guard).
CLIP_EPS = 1e-6
#: Gradient elements normed in float64 at a time. `torch.linalg.vector_norm(..., dtype=float64)`
#: (and `_foreach_norm`, one slice after another on CPU) first copies its input to float64, so a
#: slice's copy is this many x 8 bytes (2 MiB), freed before the next slice's; 2^22 elements
#: (a 32 MiB copy) was the peak of bf16 training under offload.
NORM_SLICE_ELEMENTS = 1 << 18


def counted_params(model: Model, head: Head, groups: ParallelGroups, held: Collection[str]) -> list[str]:
    """The parameters of this rank (of `held`) whose gradient piece it counts in the replica's
    norm: of the ranks holding the same piece, only the lowest tensor rank on the first stage
    holding it, on ep rank 0 unless it is an expert stack (split over the ep ranks). An engine
    works them out once (`Engine.counted_params`): its layout never changes."""
    tp = groups.layout.tp
    names = []
    for info in param_infos(model, head):
        if info.name not in held:
            continue
        box = local_box(info, model, tp, groups.tp.rank)
        first_holder = min(rank for rank in range(tp) if local_box(info, model, tp, rank) == box)
        tied_copy = info.place == "first_and_last" and groups.pp_rank > 0
        ep_copy = not info.expert and groups.ep.rank > 0
        if first_holder == groups.tp.rank and not tied_copy and not ep_copy:
            names.append(info.name)
    return names


def global_grad_norm(engine: Engine) -> float:
    """The L2 norm of the whole model's gradient, the same on every rank of the layout
    (collective over each replica's tensor and pipeline groups)."""
    groups = engine.groups
    parts: list[torch.Tensor] = []
    for name in engine.counted_params:
        # Under ZeRO-1 and full sharding a rank's gradient is reduced in its own rows only
        # (of its position's dp x cp ranks): each counts those (`Engine.counted_grad`).
        piece = engine.counted_grad(name)
        if piece is None:
            continue
        # Slice by slice: the float64 copies stay bounded however large the tensor (an
        # embedding's whole-tensor copies would outgrow the model's own gradients).
        parts += piece.detach().reshape(-1).split(NORM_SLICE_ELEMENTS)
    total = torch.zeros((), dtype=torch.float64, device=engine.device)
    if parts:  # every slice's norm in float64 by one foreach call, then their squares summed
        total += torch.stack(torch._foreach_norm(parts, 2, dtype=torch.float64)).square().sum()
    if engine.dp_split_grads:  # the rows are split over the dp x cp ranks of each position
        collectives.all_reduce(total, groups.shard_group)
    # Tensor ranks first (each stage's total on each of its ranks), then across the stages.
    for group in (groups.tp.group, groups.link.group, groups.ep.group):
        if group is not None:
            collectives.all_reduce(total, group)
    return math.sqrt(float(total))


def clip_grad_norm(engine: Engine, max_norm: float | None) -> float:
    """Scale the gradients down so that their global norm is at most `max_norm` (None: leave
    them); returns the norm before clipping (collective, see `global_grad_norm`)."""
    norm = global_grad_norm(engine)
    if max_norm is not None and norm > max_norm:
        scale = max_norm / (norm + CLIP_EPS)
        with torch.no_grad():
            torch._foreach_mul_(engine.grads(), scale)
    return norm

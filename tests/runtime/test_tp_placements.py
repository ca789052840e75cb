"""The sharding contract's tensor-parallel boxes are DTensor's placements (pure computation).

`shard_layout.local_box` says which slice of every parameter a tensor rank holds; checkpoints,
resharded resume and live transitions move state by those boxes. Here every box of every preset
model, head and admissible tp is held to the box DTensor computes for the placement torchtitan's
parallelize plan gives that parameter (`compute_local_shape_and_global_offset`'s math, the
function DCP reads shards by): ColwiseParallel linears (q/k/v, gate/up, the untied LM head) and
the vocabulary-split embedding (RowwiseParallel on `nn.Embedding`) `Shard(0)`, RowwiseParallel
linears (o, down) `Shard(1)`, norms, routers and the value head `Replicate()`; a stack of
experts (expert index first) splits each expert as its linear would, `Shard(1)` for gate/up
[experts, ffn, hidden] and `Shard(2)` for down [experts, hidden, ffn]. K/V projections whose heads
are fewer than the tensor ranks are replicated in whole heads: on a (kv heads, copies) view of
the tp mesh, `(Shard(0), Replicate())`. So a DTensor engine and the existing shards agree, and
state moved by boxes lands where DTensor expects it.
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from nereus.runtime.state.shard_layout import Box, ParamInfo, local_box, param_infos
from nereus.spec.check import layout_problem
from nereus.spec.model import Head, Model
from nereus.spec.presets import MODELS

pytestmark = pytest.mark.one_rank

#: The parallel style torchtitan's plan gives each module kind, by the parameter's name ending.
COLWISE = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
COLWISE += ("gate_proj.weight", "up_proj.weight", "lm_head.weight", "embed.weight")
ROWWISE = ("o_proj.weight", "down_proj.weight")
#: Expert stacks: each expert's slice as its column- or row-wise linear's, one dim further in.
EXPERT_COLWISE = ("experts.gate_proj", "experts.up_proj")
EXPERT_ROWWISE = ("experts.down_proj",)


def placement_box(info: ParamInfo, model: Model, tp: int, tp_rank: int) -> Box:
    """The box of `info` on tensor rank `tp_rank` as DTensor places it under the plan above."""
    if info.name.endswith(EXPERT_COLWISE):
        placement = Shard(1)
    elif info.name.endswith(EXPERT_ROWWISE):
        placement = Shard(2)
    elif info.name.endswith(COLWISE):
        placement = Shard(0)
    elif info.name.endswith(ROWWISE):
        placement = Shard(1)
    else:
        placement = Replicate()
    if info.kv and tp > model.num_kv_heads:
        copies = tp // model.num_kv_heads
        mesh_shape: tuple[int, ...] = (model.num_kv_heads, copies)
        coordinate = [tp_rank // copies, tp_rank % copies]
        placements: tuple[Shard | Replicate, ...] = (placement, Replicate())
    else:
        mesh_shape, coordinate, placements = (tp,), [tp_rank], (placement,)
    shape, offset = _compute_local_shape_and_global_offset(info.global_shape, mesh_shape, coordinate, placements)
    return tuple(zip(offset, shape, strict=True))


def cases() -> list[tuple[str, Head, int]]:
    return [
        (name, head, tp)
        for name, model in MODELS.items()
        for head in ("lm", "value")
        for tp in (1, 2, 4, 8, 16)
        if layout_problem(model, tp, 1) is None
    ]


@pytest.mark.parametrize(("name", "head", "tp"), cases())
def test_local_boxes_are_dtensor_placements(name: str, head: Head, tp: int) -> None:
    model = MODELS[name]
    # Every block's parameters have the same boxes as block 0's: the others add only time.
    for info in (info for info in param_infos(model, head) if info.layer in (None, 0)):
        split = COLWISE + ROWWISE + EXPERT_COLWISE + EXPERT_ROWWISE
        assert info.tp_dim is None or info.name.endswith(split), info.name
        for tp_rank in range(tp):
            assert local_box(info, model, tp, tp_rank) == placement_box(info, model, tp, tp_rank), (info.name, tp_rank)


def test_replicated_kv_heads_are_covered() -> None:
    """The cases include k/v heads replicated over tensor ranks (tp above the KV heads)."""
    assert any(tp > MODELS[name].num_kv_heads for name, _, tp in cases())

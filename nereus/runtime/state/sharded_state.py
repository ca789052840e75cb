"""Shard metadata of a model's state on a RankLayout, and helpers to cut and gather it.

A rank's state is a flat dict keyed by `state_key(family, name)`; every tensor has the
shape of its box. `StateMeta` says, for one (model, head, layout, families), every key's
global shape and dtype and the box each rank holds. The resharder and the checkpointer
work on these boxes only; `cut` and `gather` turn a logical (unsharded) state into
per-rank dicts and back, for tests, benchmarks and single-process tools.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nereus.runtime.state.shard_layout import (
    STATE_FAMILIES,
    Box,
    RankLayout,
    box_numel,
    box_shape,
    param_infos,
    position_boxes,
    state_key,
)
from nereus.spec.capabilities import RUNTIME_DTYPES
from nereus.spec.model import Head, Model
from nereus.spec.plan import StagePlan
from nereus.spec.stages import Stage
from nereus.spec.workload import Workload

if TYPE_CHECKING:
    import torch

#: The dtype of every state tensor unless a caller says otherwise (AdamW keeps fp32 state).
DEFAULT_DTYPE = "float32"

#: Bytes per element of the dtypes state tensors may have, by torch name (the spec
#: layer's DTYPE_BYTES is keyed by workload names such as bf16).
TORCH_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def keeps_masters(workload: Workload, stage: Stage) -> bool:
    """Whether a model-stage's engine keeps fp32 master weights: a training stage of a 16-bit
    workload whose optimizer asks for them (the other stages are never stepped by the run)."""
    return stage == "training" and workload.dtype != "fp32" and workload.optimizer.master_weights


def state_dtypes(workload: Workload, stage: Stage) -> dict[str, str]:
    """The dtype of every state family of a model-stage's engine: `param` is the fp32 master
    where there is one, gradients are in the compute dtype, AdamW moments always fp32."""
    compute = RUNTIME_DTYPES.get(workload.dtype, DEFAULT_DTYPE)
    param = DEFAULT_DTYPE if keeps_masters(workload, stage) else compute
    return {"param": param, "grad": compute, "exp_avg": DEFAULT_DTYPE, "exp_avg_sq": DEFAULT_DTYPE}


def dp_sharded_families(
    workload: Workload, stage: Stage, zero1: bool, full_shard: bool = False, train_offload: bool = False
) -> frozenset[str]:
    """The families a model-stage's engine splits across its dp replicas (and their cp ranks,
    which hold the same weights: the rows go over dp x cp, `state_meta`). Full sharding
    (FSDP2) splits every family; ZeRO-1 the AdamW moments and the fp32 masters (the `param`
    family where there are masters; the working weights stay whole on every replica) of a
    training stage, and training-time offload (ZeRO-1 implied) its gradients too: the host
    holds this replica's reduced rows only. Empty otherwise."""
    if full_shard:
        return frozenset(STATE_FAMILIES)
    if not (zero1 or train_offload) or stage != "training":
        return frozenset()
    offloaded = {"grad"} if train_offload else set()
    return frozenset({"exp_avg", "exp_avg_sq"} | ({"param"} if keeps_masters(workload, stage) else set()) | offloaded)


def shards_across_dp(workload: Workload, entry: StagePlan) -> bool:
    """Whether a plan entry runs ZeRO-1: its own `zero1`, else the workload's optimizer says;
    training-time offload always does (its host state is this replica's rows)."""
    zero1 = workload.optimizer.shard_across_dp if entry.zero1 is None else entry.zero1
    return entry.stage == "training" and (bool(zero1) or entry.train_offload != "none")


def stage_dp_sharded(workload: Workload, entry: StagePlan) -> frozenset[str]:
    """The families a plan entry's engine shards across its replicas (`dp_sharded_families`)."""
    offloaded = entry.stage == "training" and entry.train_offload != "none"
    return dp_sharded_families(workload, entry.stage, shards_across_dp(workload, entry), entry.full_shard, offloaded)


def even_split(num_rows: int, parts: int) -> list[tuple[int, int]]:
    """(start, stop) of `parts` contiguous runs covering `num_rows`, sizes differing by at most one."""
    base, extra = divmod(num_rows, parts)
    bounds, start = [], 0
    for part in range(parts):
        stop = start + base + (part < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def dp_rows(rows: int, dp: int, replica: int) -> tuple[int, int]:
    """(offset, count) of the first-dimension rows of a `rows`-row box that `replica` holds
    of a family split across dp (ZeRO-1 or full sharding): `torch.chunk`'s split, which is
    FSDP2's `Shard(0)` placement, ceil(rows / dp) rows each and the last replicas fewer (a
    box with fewer rows than dp leaves the last ones none: count 0)."""
    chunk = -(-rows // dp)
    offset = min(rows, replica * chunk)
    return offset, min(chunk, rows - offset)


def dp_box(box: Box, dp: int, replica: int) -> Box:
    """Shard `replica`'s part (of `dp` shards: dp x cp with cp) of a tp/pp box in a family split
    across them: its rows of the first dimension."""
    if not box:
        return box
    offset, count = dp_rows(box[0][1], dp, replica)
    return ((box[0][0] + offset, count), *box[1:])


@dataclass(frozen=True)
class TensorMeta:
    """One logical state tensor: a family of one parameter."""

    key: str
    """`family/name`, the key in every rank's state dict."""
    family: str
    name: str
    global_shape: tuple[int, ...]
    dtype: str
    """torch dtype name without the `torch.` prefix, e.g. `float32`."""

    @property
    def itemsize(self) -> int:
        return TORCH_DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class StateMeta:
    """Shard metadata of one model's state laid out as `layout`."""

    model: Model
    head: Head
    layout: RankLayout
    families: tuple[str, ...]
    tensors: dict[str, TensorMeta]
    """Every logical tensor, by key, in forward order, families interleaved per parameter."""
    boxes: dict[int, dict[str, Box]] = field(repr=False)
    """For every rank of the layout, the box of each key it holds."""
    dp_sharded: frozenset[str] = frozenset()
    """The families split across the dp x cp ranks of a position (their rows, `dp_box`); the others
    are whole on each."""

    def rank_boxes(self, rank: int) -> dict[str, Box]:
        """The boxes `rank` holds; empty for a rank outside the layout."""
        return self.boxes.get(rank, {})

    def holders(self, key: str) -> dict[int, Box]:
        """Every rank that holds `key`, with its box (replicas repeat the same box)."""
        return {rank: boxes[key] for rank, boxes in self.boxes.items() if key in boxes}

    def rank_bytes(self, rank: int) -> int:
        """Bytes of state `rank` holds."""
        return sum(box_numel(box) * self.tensors[key].itemsize for key, box in self.rank_boxes(rank).items())


def state_meta(
    model: Model,
    head: Head,
    layout: RankLayout,
    families: Iterable[str] = STATE_FAMILIES,
    dtypes: dict[str, str] | None = None,
    dp_sharded: Iterable[str] = (),
) -> StateMeta:
    """The shard metadata of `model` with `head` laid out as `layout`.

    `dtypes` maps a family to its dtype name; families it leaves out are DEFAULT_DTYPE.
    Families in `dp_sharded` are split across the dp x cp ranks of each position (ZeRO-1 or full
    sharding, `dp_box`: the cp ranks of a replica hold the same weights, so they share the split);
    the others are whole on every replica. Raises ValueError when the layout cannot shard the model or
    a family is unknown.
    """
    sharded = frozenset(dp_sharded)
    families = tuple(families)
    dtypes = dtypes or {}
    unknown = [family for family in (*families, *dtypes) if family not in STATE_FAMILIES]
    if unknown:
        raise ValueError(f"unknown state families {unknown}; choose from {', '.join(STATE_FAMILIES)}")
    for family, dtype in dtypes.items():
        if dtype not in TORCH_DTYPE_BYTES:
            raise ValueError(f"family {family}: dtype {dtype!r} is not one of {', '.join(TORCH_DTYPE_BYTES)}")
    tensors = {}
    for info in param_infos(model, head):
        for family in families:
            key = state_key(family, info.name)
            tensors[key] = TensorMeta(key, family, info.name, info.global_shape, dtypes.get(family, DEFAULT_DTYPE))
    positions = position_boxes(model, head, layout.tp, layout.pp, layout.ep)
    boxes: dict[int, dict[str, Box]] = {}
    for index, rank in enumerate(layout.ranks):
        replica, stage, cp_rank, tp_rank = layout.place(index)  # cp ranks hold their position's boxes
        position = (stage * layout.ep + layout.ep_place(index)) * layout.tp + tp_rank
        shard = replica * layout.cp + cp_rank  # a split family's rows: over dp x cp (`RankLayout.shard_index`)
        boxes[rank] = {
            state_key(family, name): dp_box(box, layout.shards, shard) if family in sharded else box
            for name, box in positions[position].items()
            for family in families
        }
    return StateMeta(model, head, layout, families, tensors, boxes, sharded & frozenset(families))


def box_slices(box: Box, within: Box | None = None) -> tuple[slice, ...]:
    """Index of `box` inside a tensor that holds `within` (the global tensor when None)."""
    if within is None:
        return tuple(slice(start, start + length) for start, length in box)
    return tuple(
        slice(start - outer, start - outer + length) for (start, length), (outer, _) in zip(box, within, strict=True)
    )


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype), name
    return dtype


def random_tensor(meta: TensorMeta, seed: int) -> torch.Tensor:
    """A reproducible random global tensor for `meta`: the same on every rank for one seed."""
    import torch

    generator = torch.Generator().manual_seed(seed ^ zlib.crc32(meta.key.encode()))
    tensor = torch.randn(meta.global_shape, generator=generator, dtype=torch.float32)
    return tensor.to(torch_dtype(meta.dtype))


def random_logical_state(meta: StateMeta, seed: int) -> dict[str, torch.Tensor]:
    """A random unsharded state: one global tensor per key (tests and benchmarks)."""
    return {key: random_tensor(tensor, seed) for key, tensor in meta.tensors.items()}


def random_rank_state(meta: StateMeta, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """`rank`'s shards of `random_logical_state(meta, seed)`, built one key at a time."""
    return {
        key: random_tensor(meta.tensors[key], seed)[box_slices(box)].clone()
        for key, box in meta.rank_boxes(rank).items()
    }


def cut(meta: StateMeta, logical: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """`rank`'s state dict: a contiguous copy of its box of every logical tensor it holds."""
    return {key: logical[key][box_slices(box)].clone() for key, box in meta.rank_boxes(rank).items()}


def gather(meta: StateMeta, states: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The logical state assembled from every rank's dict, checking the dicts against `meta`.

    Raises ValueError when a rank misses a key, holds a tensor of the wrong shape or dtype,
    replicas of a box disagree bitwise, or part of a tensor is held by no rank.
    """
    import torch

    for rank, boxes in meta.boxes.items():
        extra = sorted(set(states.get(rank, {})) - set(boxes))
        if extra:
            raise ValueError(f"rank {rank} holds keys outside its layout: {extra[:3]}")
    logical: dict[str, torch.Tensor] = {}
    for key, tensor_meta in meta.tensors.items():
        logical[key] = torch.empty(tensor_meta.global_shape, dtype=torch_dtype(tensor_meta.dtype))
        first_holder: dict[Box, int] = {}
        for rank, box in meta.holders(key).items():
            shard = states.get(rank, {}).get(key)
            check_shard(rank, key, shard, box, tensor_meta)
            assert shard is not None
            if box in first_holder:
                if not torch.equal(states[first_holder[box]][key], shard):
                    raise ValueError(f"rank {rank}: {key} differs from rank {first_holder[box]}, a replica of its box")
                continue
            first_holder[box] = rank
            logical[key][box_slices(box)] = shard
        # The distinct boxes of one layout are disjoint, so they cover the tensor iff their sizes add up.
        if sum(box_numel(box) for box in first_holder) != math.prod(tensor_meta.global_shape):
            raise ValueError(f"{key}: no rank holds part of the tensor")
    return logical


def check_shard(rank: int, key: str, tensor: torch.Tensor | None, box: Box, meta: TensorMeta) -> None:
    """Raise ValueError unless `tensor` is `rank`'s shard of `key`: present, box-shaped, of the right dtype."""
    if tensor is None:
        raise ValueError(f"rank {rank} is missing {key}")
    if tuple(tensor.shape) != box_shape(box):
        raise ValueError(f"rank {rank}: {key} has shape {tuple(tensor.shape)}, its box needs {box_shape(box)}")
    if tensor.dtype != torch_dtype(meta.dtype):
        raise ValueError(f"rank {rank}: {key} is {tensor.dtype}, expected {meta.dtype}")


def check_rank_state(meta: StateMeta, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless `tensors` is exactly `rank`'s state in `meta`'s layout."""
    boxes = meta.rank_boxes(rank)
    extra = sorted(set(tensors) - set(boxes))
    if extra:
        raise ValueError(f"rank {rank}: state holds keys outside the layout: {extra[:3]}")
    for key, box in boxes.items():
        check_shard(rank, key, tensors.get(key), box, meta.tensors[key])

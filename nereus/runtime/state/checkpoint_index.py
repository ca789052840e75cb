"""A checkpoint's JSON index (index.json): its schema (`CheckpointIndex`), its self-checksum (an
edited index is refused), and the reader that refuses an index that is malformed, edited, or
inconsistent with the layout it names. The shards themselves are written and read by
`nereus.runtime.state.checkpoint`.
"""

from __future__ import annotations

import json
import math
import zlib
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError

from nereus.errors import NereusError
from nereus.runtime.state.shard_layout import Box, RankLayout, box_numel, ep_problem, layout_problem
from nereus.runtime.state.sharded_state import TORCH_DTYPE_BYTES, StateMeta, state_meta
from nereus.spec.base import StrictModel
from nereus.spec.io import read_utf8
from nereus.spec.model import Head, Model

INDEX_NAME = "index.json"
FORMAT_NAME: Literal["nereus-checkpoint"] = "nereus-checkpoint"


class ShardEntry(StrictModel):
    """One stored tensor of a shard: a box of one key."""

    key: str
    """`family/name`, also the tensor's name inside the safetensors file."""
    box: list[tuple[int, int]]
    """(offset, length) along every dim of the global tensor."""
    crc32: int
    """CRC-32 of the tensor's raw bytes (row-major)."""


class ShardRecord(StrictModel):
    """One safetensors file of the checkpoint."""

    file: str
    """File name inside the checkpoint folder."""
    rank: int
    """The rank that wrote it (its position in the saved layout)."""
    nbytes: int
    """Size of the whole file."""
    crc32: int
    """CRC-32 of the whole file."""
    entries: list[ShardEntry]


class TensorRecord(StrictModel):
    """One logical tensor of the saved state."""

    key: str
    global_shape: list[int]
    dtype: str
    """torch dtype name, e.g. `float32`."""


class CheckpointIndex(StrictModel):
    """The JSON index of a checkpoint folder."""

    format: Literal["nereus-checkpoint"] = FORMAT_NAME
    version: Literal[1] = 1
    model: Model
    head: Head
    tp: int
    pp: int
    dp: int
    cp: int = Field(default=1, gt=0)
    """Context-parallel degree of the saved layout; written only when above 1."""
    ep: int = Field(default=1, gt=0)
    """Expert-parallel degree of the saved layout; written only when above 1."""
    ranks: list[int]
    """Global ranks of the saved layout (replica-major, stage-major, cp rank, tensor rank innermost)."""
    step: int
    """Optimizer steps taken when the checkpoint was saved."""
    families: list[str]
    dp_sharded: list[str] = Field(default_factory=list)
    """The families whose boxes are split across the saved replicas (ZeRO-1 rows); written only when any is."""
    tensors: list[TensorRecord]
    shards: list[ShardRecord]
    index_crc32: int = 0
    """CRC-32 of the index written with this field at 0: any edit changes it."""

    def layout(self) -> RankLayout:
        return RankLayout(self.tp, self.pp, self.dp, tuple(self.ranks), self.cp, self.ep)


def index_text(index: CheckpointIndex) -> str:
    # Without ZeRO-1 rows or context parallelism the index is written as before those fields
    # existed (same bytes, same CRC).
    exclude = ({"dp_sharded"} if not index.dp_sharded else set()) | ({"cp"} if index.cp == 1 else set())
    exclude |= {"ep"} if index.ep == 1 else set()
    return index.model_dump_json(indent=1, exclude=exclude or None)


def sealed_index(index: CheckpointIndex) -> CheckpointIndex:
    unsealed = index.model_copy(update={"index_crc32": 0})
    return index.model_copy(update={"index_crc32": zlib.crc32(index_text(unsealed).encode())})


def read_index(path: str | Path) -> CheckpointIndex:
    """The checked index of the checkpoint folder at `path`."""
    index_path = Path(path) / INDEX_NAME
    if not index_path.is_file():
        raise NereusError(f"{index_path}: missing; {path} is not a finished nereus checkpoint")
    text = read_utf8(index_path)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise NereusError(
            f"{index_path}: not valid JSON ({error.msg} at line {error.lineno}); the index is corrupted"
        ) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise NereusError(f"{index_path}: not a nereus checkpoint index (format must be {FORMAT_NAME!r})")
    try:
        index = CheckpointIndex.model_validate_json(text)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise NereusError(f"{index_path}: {where}: {first['msg']}; the index is corrupted or was edited") from None
    if sealed_index(index).index_crc32 != index.index_crc32:
        raise NereusError(f"{index_path}: checksum mismatch; the index was edited or corrupted")
    problem = _index_problem(index)
    if problem:
        raise NereusError(f"{index_path}: {problem}")
    return index


def _index_problem(index: CheckpointIndex) -> str | None:
    """Why a checksum-valid index still cannot be right, or None."""
    problem = layout_problem(index.model, index.tp, index.pp) or ep_problem(index.model, index.ep)
    size = index.tp * index.cp * index.ep * index.pp * index.dp
    if problem or len(index.ranks) != size or len(set(index.ranks)) != len(index.ranks):
        cp = f" cp={index.cp}" if index.cp != 1 else ""
        ep = f" ep={index.ep}" if index.ep != 1 else ""
        return f"saved layout tp={index.tp}{cp}{ep} pp={index.pp} dp={index.dp} on ranks {index.ranks} is invalid"
    if not set(index.dp_sharded) <= set(index.families):
        return f"dp-sharded families {index.dp_sharded} are not among the saved families {index.families}"
    try:
        expected = saved_meta(index)
    except ValueError as error:
        return str(error)
    records = {record.key: record for record in index.tensors}
    for key, tensor in expected.tensors.items():
        record = records.get(key)
        if record is None or tuple(record.global_shape) != tensor.global_shape or record.dtype not in TORCH_DTYPE_BYTES:
            return f"tensor {key} is missing or does not match model {index.model.name}"
    stored: dict[str, set[Box]] = defaultdict(set)
    for shard in index.shards:
        for entry in shard.entries:
            box = tuple(entry.box)
            if entry.key not in records or box not in set(expected.holders(entry.key).values()):
                return f"{shard.file}: {entry.key} box {entry.box} is not a box of the saved layout"
            if box in stored[entry.key]:
                return f"{shard.file}: {entry.key} box {entry.box} is stored twice"
            stored[entry.key].add(box)
    for key, tensor in expected.tensors.items():
        # Distinct boxes of one layout are disjoint: they cover the tensor iff their sizes add up.
        if sum(box_numel(box) for box in stored[key]) != math.prod(tensor.global_shape):
            return f"the shards do not hold all of {key}"
    return None


def saved_meta(index: CheckpointIndex) -> StateMeta:
    dtypes = {record.key: record.dtype for record in index.tensors}
    meta = state_meta(index.model, index.head, index.layout(), index.families, dp_sharded=index.dp_sharded)
    tensors = {key: replace(tensor, dtype=dtypes.get(key, tensor.dtype)) for key, tensor in meta.tensors.items()}
    return replace(meta, tensors=tensors)

"""Checkpoints: one safetensors shard per writing rank plus a JSON index, loadable into any layout.

Layout of a checkpoint folder:
    index.json                 model, head, saved layout, optimizer step, every tensor's global
                               shape and dtype, and per shard its file, byte size, CRC-32 and the
                               (key, box, CRC-32) of every tensor it holds; the index carries a
                               CRC-32 of itself, so an edited index is refused (its schema and
                               reader: `checkpoint_index`)
    shard-00003.safetensors    rank 3's boxes, keyed by `family/name`

Replicas hold identical boxes, so each distinct box is written once, by its least-loaded
holder; the families a ZeRO-1 engine splits across its replicas (the index's `dp_sharded`)
are stored as each replica's rows. Saving is atomic: shards and index go into a temporary
folder beside the target, every file and the folder are fsynced, then the folder is renamed
into place; a target that exists is refused. Loading into any RankLayout reads, for each box the rank needs, only the
stored tensors that overlap it, checks each one's CRC-32, and copies the overlap.
Anything missing, truncated, corrupted or inconsistent is refused with a one-line
NereusError naming the file and the problem.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import zlib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nereus.errors import NereusError
from nereus.runtime.state.checkpoint_index import (
    INDEX_NAME,
    CheckpointIndex,
    ShardEntry,
    ShardRecord,
    TensorRecord,
    index_text,
    read_index,
    saved_meta,
    sealed_index,
)
from nereus.runtime.state.shard_layout import Box, RankLayout, box_numel, box_shape, intersect
from nereus.runtime.state.sharded_state import (
    StateMeta,
    box_slices,
    check_rank_state,
    state_meta,
    torch_dtype,
)
from nereus.spec.check import layout_problem
from nereus.spec.io import one_line
from nereus.spec.model import Head, Model

if TYPE_CHECKING:
    import torch

#: Bytes read at a time when checksumming a whole shard file.
_CHUNK_BYTES = 1 << 24


@dataclass(frozen=True)
class LoadedState:
    """One rank's state read from a checkpoint."""

    tensors: dict[str, torch.Tensor]
    step: int
    meta: StateMeta
    """The shard metadata of the layout it was loaded into."""
    bytes_read: int
    """Bytes of stored tensors read: each stored tensor that overlaps a needed box, whole (to check its CRC)."""


def _crc(tensor: torch.Tensor) -> int:
    import torch

    raw = tensor.detach().contiguous().view(torch.uint8).numpy()
    return zlib.crc32(raw.data)


def _file_crc(path: Path) -> int:
    crc = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def _check_size(path: Path, record: ShardRecord) -> None:
    """Raise unless the shard file `path` exists at the size the index records."""
    if not path.is_file():
        raise NereusError(f"{path}: missing shard; the checkpoint is incomplete")
    size = path.stat().st_size
    if size != record.nbytes:
        raise NereusError(f"{path}: {size} bytes, the index says {record.nbytes}; the shard is truncated or corrupted")


def _check_file_crc(path: Path, record: ShardRecord) -> None:
    """Raise unless the whole shard file `path` has the CRC-32 the index records."""
    if _file_crc(path) != record.crc32:
        raise NereusError(f"{path}: fails its CRC-32 check; the shard is corrupted")


def fsync_path(path: Path) -> None:
    """Flush a file or folder to disk (a folder: so a rename into it survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def writers(meta: StateMeta) -> dict[int, list[str]]:
    """The keys each rank writes: every distinct box once, by its least-loaded holder."""
    load: dict[int, int] = defaultdict(int)
    assigned: dict[int, list[str]] = {rank: [] for rank in meta.layout.ranks}
    for key, tensor in meta.tensors.items():
        by_box: dict[Box, list[int]] = defaultdict(list)
        for rank, box in meta.holders(key).items():
            by_box[box].append(rank)
        for box, holders in by_box.items():
            writer = min(holders, key=lambda rank: (load[rank], rank))
            load[writer] += box_numel(box) * tensor.itemsize
            assigned[writer].append(key)
    return assigned


def _write_shard(folder: Path, meta: StateMeta, rank: int, tensors: dict[str, torch.Tensor]) -> ShardRecord | None:
    """Write `rank`'s assigned boxes into one fsynced safetensors file; None if it writes nothing."""
    from safetensors.torch import save_file

    check_rank_state(meta, rank, tensors)
    boxes = meta.rank_boxes(rank)
    keys = writers(meta)[rank]
    if not keys:
        return None
    payload = {key: tensors[key].detach().cpu().contiguous() for key in keys}
    path = folder / f"shard-{rank:05d}.safetensors"
    save_file(payload, str(path))
    fsync_path(path)
    entries = [ShardEntry(key=key, box=list(boxes[key]), crc32=_crc(payload[key])) for key in keys]
    return ShardRecord(file=path.name, rank=rank, nbytes=path.stat().st_size, crc32=_file_crc(path), entries=entries)


def _start(target: Path) -> Path:
    if target.exists():
        raise NereusError(f"{target}: already exists; save each checkpoint into a new folder")
    if not target.parent.is_dir():
        raise NereusError(f"{target.parent}: no such folder; create it before saving a checkpoint into it")
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))


def _finish(folder: Path, target: Path, meta: StateMeta, step: int, shards: Iterable[ShardRecord]) -> CheckpointIndex:
    """Write the index of `shards`, fsync it and the folder, and rename the folder into place."""
    layout = meta.layout
    tensors = [TensorRecord(key=t.key, global_shape=list(t.global_shape), dtype=t.dtype) for t in meta.tensors.values()]
    index = CheckpointIndex(
        model=meta.model,
        head=meta.head,
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        cp=layout.cp,
        ep=layout.ep,
        ranks=list(layout.ranks),
        step=step,
        families=list(meta.families),
        dp_sharded=sorted(meta.dp_sharded),
        tensors=tensors,
        shards=sorted(shards, key=lambda shard: shard.rank),
    )
    index = sealed_index(index)
    index_path = folder / INDEX_NAME
    index_path.write_text(index_text(index))
    fsync_path(index_path)
    fsync_path(folder)
    os.rename(folder, target)
    fsync_path(target.parent)
    return index


def save_checkpoint(
    path: str | Path, meta: StateMeta, states: dict[int, dict[str, torch.Tensor]], step: int
) -> CheckpointIndex:
    """Save every rank's state (all held by this process) as a checkpoint at `path`, atomically."""
    target = Path(path)
    missing = [rank for rank in meta.layout.ranks if rank not in states]
    if missing:
        raise ValueError(f"save_checkpoint needs the state of every rank of the layout; missing ranks {missing}")
    folder = _start(target)
    try:
        records = [_write_shard(folder, meta, rank, states[rank]) for rank in meta.layout.ranks]
        index = _finish(folder, target, meta, step, [record for record in records if record is not None])
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return index


def save_checkpoint_distributed(
    path: str | Path, meta: StateMeta, rank: int, tensors: dict[str, torch.Tensor], step: int
) -> CheckpointIndex:
    """Save a checkpoint from a torch.distributed job; every rank of the job calls it.

    Each rank of the layout writes its own shard into a shared temporary folder (the path must
    be visible to every rank), global rank 0 writes the index and renames the folder. A failure
    on any rank removes the temporary folder and raises on every rank.
    """
    import torch.distributed as dist

    from nereus.runtime.comm import collectives

    target = Path(path)
    started: str | NereusError | None = None
    if dist.get_rank() == 0:
        try:
            started = str(_start(target))
        except NereusError as error:
            started = error
    started = collectives.broadcast_object(started, 0)
    if isinstance(started, NereusError):
        raise started
    folder = Path(started)
    try:
        outcome: ShardRecord | str | None = _write_shard(folder, meta, rank, tensors) if rank in meta.boxes else None
    except (NereusError, ValueError, OSError) as error:
        outcome = f"rank {rank}: {error}"
    except Exception as error:  # safetensors reports a failed write (a full disk) in its own error type
        outcome = f"rank {rank}: writing {folder / f'shard-{rank:05d}.safetensors'} failed: {one_line(str(error))}"
    outcomes = collectives.all_gathered_objects(outcome)
    result = _seal_or_discard(folder, target, meta, step, outcomes) if dist.get_rank() == 0 else None
    result = collectives.broadcast_object(result, 0)
    if isinstance(result, str):
        raise NereusError(result)
    assert isinstance(result, CheckpointIndex)
    return result


def _seal_or_discard(
    folder: Path, target: Path, meta: StateMeta, step: int, outcomes: list[Any]
) -> CheckpointIndex | str:
    """On rank 0: finish the save, or remove the folder and return the first failure."""
    failures = [outcome for outcome in outcomes if isinstance(outcome, str)]
    try:
        if failures:
            raise NereusError(f"{target}: saving failed on {failures[0]}")
        shards = [outcome for outcome in outcomes if isinstance(outcome, ShardRecord)]
        _check_visible(folder, shards)
        return _finish(folder, target, meta, step, shards)
    except (NereusError, OSError) as error:
        shutil.rmtree(folder, ignore_errors=True)
        return str(error)


#: How long rank 0 waits for another node's shard to appear complete in a shared folder
#: (a network filesystem may show a file written elsewhere a moment late), in seconds.
SHARD_VISIBLE_S = 10.0


def _check_visible(folder: Path, shards: list[ShardRecord]) -> None:
    """Commit only a checkpoint whose every part rank 0 sees whole: each rank reported its
    shard written and fsynced, and rank 0 must find it at full size in the shared folder (a
    rank on another node whose folder is not shared wrote somewhere else)."""
    deadline = time.monotonic() + SHARD_VISIBLE_S
    for shard in shards:
        path = folder / shard.file
        while not (path.is_file() and path.stat().st_size == shard.nbytes):
            if time.monotonic() > deadline:
                raise NereusError(
                    f"{path}: rank {shard.rank} wrote it, but the committing rank does not see it whole; "
                    "put the checkpoint folder on storage every node shares"
                )
            time.sleep(0.1)


# --- reading --------------------------------------------------------------------------------


class _ShardReader:
    """Opens shard files on first use, checks their size and header, and CRC-checks each tensor read."""

    def __init__(self, folder: Path, index: CheckpointIndex) -> None:
        self.folder = folder
        self.records = {shard.file: shard for shard in index.shards}
        self.dtypes = {record.key: record.dtype for record in index.tensors}
        self.handles: dict[str, Any] = {}
        self.bytes_read = 0

    def open(self, file: str) -> Any:
        """The safe_open handle of `file`, after checking it exists and has the indexed size."""
        from safetensors import safe_open

        if file in self.handles:
            return self.handles[file]
        path = self.folder / file
        _check_size(path, self.records[file])
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as error:  # safetensors raises its own error types for a bad header
            raise NereusError(f"{path}: unreadable safetensors header ({error}); the shard is corrupted") from None
        self.handles[file] = handle
        return handle

    def tensor(self, file: str, entry: ShardEntry) -> torch.Tensor:
        """The stored tensor of `entry`, checked against its box, dtype and CRC-32."""
        path = self.folder / file
        try:
            stored = self.open(file).get_tensor(entry.key)
        except NereusError:
            raise
        except Exception as error:
            raise NereusError(f"{path}: cannot read {entry.key} ({error}); the shard is corrupted") from None
        shape, dtype = box_shape(tuple(entry.box)), torch_dtype(self.dtypes[entry.key])
        if tuple(stored.shape) != shape or stored.dtype != dtype:
            raise NereusError(
                f"{path}: {entry.key} is {stored.dtype} {tuple(stored.shape)}, the index says {dtype} {shape}; "
                "the shard is corrupted"
            )
        if _crc(stored) != entry.crc32:
            raise NereusError(f"{path}: {entry.key} fails its CRC-32 check; the shard is corrupted")
        self.bytes_read += stored.numel() * stored.element_size()
        return stored


def load_checkpoint(
    path: str | Path,
    layout: RankLayout,
    rank: int,
    model: Model | None = None,
    head: Head | None = None,
    families: Iterable[str] | None = None,
) -> LoadedState:
    """Read `rank`'s state for `layout` from the checkpoint at `path` (any saved layout).

    `model` and `head`, when given, must match the checkpoint's; `families` defaults to
    every family saved. A rank outside `layout` gets an empty state.
    """
    import torch

    folder = Path(path)
    index = read_index(folder)
    if model is not None and model != index.model:
        raise NereusError(f"{folder}: holds model {index.model.name}, not {model.name}; load the matching checkpoint")
    if head is not None and head != index.head:
        raise NereusError(f"{folder}: holds a model with a {index.head} head, not a {head} head")
    wanted = tuple(index.families if families is None else families)
    absent = [family for family in wanted if family not in index.families]
    if absent:
        raise NereusError(f"{folder}: has no {', '.join(absent)} state (saved families: {', '.join(index.families)})")
    problem = layout_problem(index.model, layout.tp, layout.pp)
    if problem:
        raise NereusError(f"cannot load {folder} into tp={layout.tp} pp={layout.pp}: {problem}")
    saved = saved_meta(index)
    meta = state_meta(index.model, index.head, layout, wanted)
    meta = replace(meta, tensors={key: saved.tensors[key] for key in meta.tensors})
    reader = _ShardReader(folder, index)
    stored_boxes: dict[str, list[tuple[str, ShardEntry]]] = defaultdict(list)
    for shard in index.shards:
        for entry in shard.entries:
            stored_boxes[entry.key].append((shard.file, entry))
    tensors = {}
    for key, box in meta.rank_boxes(rank).items():
        out = torch.empty(box_shape(box), dtype=torch_dtype(meta.tensors[key].dtype))
        for file, entry in stored_boxes[key]:
            stored_box = tuple(entry.box)
            piece = intersect(box, stored_box)
            if piece is not None:
                out[box_slices(piece, box)] = reader.tensor(file, entry)[box_slices(piece, stored_box)]
        tensors[key] = out
    return LoadedState(tensors, index.step, meta, reader.bytes_read)


def check_files(path: str | Path) -> CheckpointIndex:
    """Check the index and every shard file's presence, size and whole-file CRC-32 (no tensor is
    decoded: cheap enough to vet a checkpoint before a resume spawns any rank)."""
    folder = Path(path)
    index = read_index(folder)
    for shard in index.shards:
        _check_size(folder / shard.file, shard)
        _check_file_crc(folder / shard.file, shard)
    return index


def verify_checkpoint(path: str | Path) -> CheckpointIndex:
    """Check the index and every shard's size, whole-file CRC-32, header and tensors."""
    folder = Path(path)
    index = read_index(folder)
    reader = _ShardReader(folder, index)
    for shard in index.shards:
        reader.open(shard.file)
        _check_file_crc(folder / shard.file, shard)
        for entry in shard.entries:
            reader.tensor(shard.file, entry)
    return index

"""Which safetensors file holds each tensor of a Hugging Face folder, with its shape and dtype.

Pure Python, no torch: the headers are read directly (8-byte little-endian length, then a
JSON object), so `nereus run` checks a folder's weights against its config before any rank
exists. A folder holds `model.safetensors` or a sharded `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nereus.errors import NereusError
from nereus.runtime.hf.names import OPTIONAL, Source, expert_layout, sources
from nereus.runtime.state.shard_layout import param_infos
from nereus.spec.model import Head, Model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: safetensors dtypes the runtime reads (it computes in float32).
FLOAT_DTYPES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: its file, shape and safetensors dtype."""

    file: Path
    shape: tuple[int, ...]
    dtype: str


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file (NereusError for a missing, truncated or bad file)."""
    try:
        with path.open("rb") as handle:
            prefix = handle.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            header = handle.read(length) if 0 <= length < path.stat().st_size else b""
    except OSError as exc:
        raise NereusError(
            f"{path}: cannot be read ({exc.strerror}); the folder's safetensors files must all be there"
        ) from None
    if length < 0 or len(header) != length:
        raise NereusError(f"{path}: truncated or not a safetensors file (its header is incomplete)")
    try:
        data = json.loads(header)
    except ValueError:
        raise NereusError(f"{path}: not a safetensors file (its header is not JSON)") from None
    payload = path.stat().st_size - 8 - length
    entries = {}
    for name, info in data.items():
        if name == "__metadata__":
            continue
        if info["data_offsets"][1] > payload:
            raise NereusError(f"{path}: truncated: tensor {name} ends past the end of the file")
        entries[name] = TensorEntry(path, tuple(info["shape"]), info["dtype"])
    return entries


def checkpoint_tensors(folder: Path) -> dict[str, TensorEntry]:
    """Every tensor of a Hugging Face folder by its Hugging Face name."""
    index = folder / INDEX_FILE
    if not index.is_file():
        if not (folder / SINGLE_FILE).is_file():
            raise NereusError(
                f"{folder}: holds neither {SINGLE_FILE} nor {INDEX_FILE}; save its weights as safetensors"
            )
        return read_header(folder / SINGLE_FILE)
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        raise NereusError(f"{index}: weight_map: missing or not JSON; it maps each tensor to its file") from None
    tensors: dict[str, TensorEntry] = {}
    for file in sorted(set(weight_map.values())):
        tensors.update(read_header(folder / file))
    for name, file in weight_map.items():
        if name not in tensors or tensors[name].file.name != file:
            raise NereusError(f"{folder / file}: lacks tensor {name} that {INDEX_FILE} places there")
    return tensors


#: Where a runtime parameter is in a folder: its checkpoint tensors, each with the part it holds.
Stored = tuple[tuple[Source, TensorEntry], ...]


def check_weights(folder: Path, model: Model, head: Head) -> dict[str, Stored]:
    """The checkpoint tensors of every runtime parameter of `model` with `head` (the optional
    ones it lacks left out); NereusError naming the file and tensor for a missing tensor, a
    wrong shape or a non-float dtype."""
    tensors = checkpoint_tensors(folder)
    layout = expert_layout(frozenset(tensors))
    found = {}
    for info in param_infos(model, head):
        parts = []
        for source in sources(info, layout):
            name = source.hf
            entry = tensors.get(name)
            if entry is None:
                if info.name in OPTIONAL:
                    break
                raise NereusError(f"{folder}: tensor {name} is missing (config.json describes a model that has it)")
            if entry.shape != source.hf_shape:
                raise NereusError(
                    f"{entry.file}: tensor {name} has shape {list(entry.shape)}, config.json implies "
                    f"{list(source.hf_shape)}; the weights and config.json disagree"
                )
            if entry.dtype not in FLOAT_DTYPES:
                raise NereusError(f"{entry.file}: tensor {name} has dtype {entry.dtype}; expected a float type")
            parts.append((source, entry))
        else:
            found[info.name] = tuple(parts)
    return found

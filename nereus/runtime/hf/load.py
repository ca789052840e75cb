"""Hugging Face weights straight into a rank's TP/PP shards, by box overlap.

Each rank opens only the files holding tensors its shard needs and reads, through
safetensors' `get_slice`, only the box of each tensor it holds: no rank builds a whole
tensor it does not hold whole. A file is opened once per tensor, so at most one tensor's
mapped pages are resident at a time. Values are converted to the engine's float32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nereus.runtime.hf.files import Stored, TensorEntry, check_weights
from nereus.runtime.model.engine import Engine
from nereus.runtime.state.shard_layout import Box, box_shape, intersect, local_box, param_infos


def read_box(entry: TensorEntry, name: str, box: Box) -> torch.Tensor:
    """The part of checkpoint tensor `name` inside `box`, read from its file alone."""
    from safetensors import safe_open

    with safe_open(str(entry.file), framework="pt") as handle:
        piece: torch.Tensor = handle.get_slice(name)[tuple(slice(start, start + length) for start, length in box)]
    return piece


def read_stored(stored: Stored, box: Box) -> torch.Tensor:
    """The part of a runtime parameter inside `box`, as float32, from its checkpoint tensors
    (each read only where it overlaps the box)."""
    if len(stored) == 1 and not stored[0][0].per_expert and stored[0][0].hf_shape == box_shape(stored[0][0].box):
        return read_box(stored[0][1], stored[0][0].hf, box).float()
    out = torch.empty(box_shape(box), dtype=torch.float32)
    for source, entry in stored:
        part = intersect(box, source.box)
        if part is None:
            continue
        hf_box = tuple(
            (start - origin + hf_start, length)
            for (start, length), (origin, _), hf_start in zip(part, source.box, source.hf_start, strict=True)
        )
        piece = read_box(entry, source.hf, hf_box[1:] if source.per_expert else hf_box)
        target = tuple(slice(start - b, start - b + length) for (start, length), (b, _) in zip(part, box, strict=True))
        out[target] = piece.unsqueeze(0) if source.per_expert else piece
    return out


def load_engine(engine: Engine, folder: Path) -> list[str]:
    """Set this rank's parameters from a Hugging Face folder; the names the folder lacks (a
    new value head) keep the engine's initialisation and are returned."""
    model, layout, g = engine.model, engine.groups.layout, engine.groups
    entries = check_weights(folder, model, engine.head)
    kept = []
    with torch.no_grad():
        for info in param_infos(model, engine.head):
            if info.name not in engine.params:
                continue
            if info.name not in entries:
                kept.append(info.name)
                continue
            box = local_box(info, model, layout.tp, g.tp.rank, g.ep.size, g.ep.rank)
            engine.set_param(info.name, read_stored(entries[info.name], box))
    return kept

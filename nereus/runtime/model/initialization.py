"""Initial weights and their shards: every parameter's whole initial value is a function of
(seed, name) only, so any layout's shard of it is the same numbers; `shard_params` cuts a
rank's boxes out of whole tensors."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from nereus.runtime.state.shard_layout import ParamInfo, box_shape, holds, local_box, param_infos
from nereus.spec.model import Head, Model

#: Standard deviation of the normal initialisation of weight matrices.
INIT_STD = 0.02


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_logical_param(info: ParamInfo, seed: int, randomize_all: bool = False) -> torch.Tensor:
    """The whole (unsharded) initial value of one parameter, a function of (seed, name) only.

    Weight matrices are N(0, INIT_STD); norms start at one and biases at zero, unless
    `randomize_all` (tests: every parameter then carries a distinct random value).
    """
    generator = torch.Generator().manual_seed(_name_seed(seed, info.name))
    values = torch.randn(info.global_shape, generator=generator, dtype=torch.float32)
    is_norm = info.name.endswith("norm.weight")
    is_bias = info.name.endswith(".bias")
    if randomize_all:
        return 1.0 + 0.1 * values if is_norm else 0.1 * values if is_bias else INIT_STD * values
    if is_norm:
        return torch.ones(info.global_shape)
    if is_bias:
        return torch.zeros(info.global_shape)
    return INIT_STD * values


def init_logical_params(model: Model, head: Head, seed: int, randomize_all: bool = False) -> dict[str, torch.Tensor]:
    return {info.name: init_logical_param(info, seed, randomize_all) for info in param_infos(model, head)}


def box_slice(tensor: torch.Tensor, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The part of a whole tensor inside `box`."""
    return tensor[tuple(slice(start, start + length) for start, length in box)]


def shard_params(
    logical: Mapping[str, torch.Tensor],
    model: Model,
    head: Head,
    tp: int,
    pp: int,
    stage: int,
    tp_rank: int,
    ep: int = 1,
    ep_rank: int = 0,
) -> dict[str, torch.Tensor]:
    """This rank's slices of whole parameters: exactly the names and boxes of the contract."""
    out = {}
    for info in param_infos(model, head):
        if holds(info, model, pp, stage):
            box = local_box(info, model, tp, tp_rank, ep, ep_rank)
            piece = box_slice(logical[info.name], box)
            assert tuple(piece.shape) == box_shape(box), (info.name, piece.shape, box)
            out[info.name] = piece.clone()
    return out

"""Packing of left-padded rows (`nereus.runtime.model.attention.Packing`): packing and unpacking
are inverse permutations of each row's columns, their gradients are those of torch's `gather`
exactly, and their backward keeps no copy of the permuted tensor (torch's `gather` saves its
input; under context parallelism every layer packs its queries, keys and values and unpacks its
output). What autograd keeps is read with saved-tensor hooks, which see every tensor a graph saves."""

from __future__ import annotations

import pytest
import torch

from nereus.runtime.model.attention import Packing, _gather_columns

pytestmark = pytest.mark.one_rank


def left_padded(rows: int = 4, cols: int = 9) -> torch.Tensor:
    pads = torch.tensor([0, 3, 1, 5])[:rows]
    return torch.arange(cols).unsqueeze(0) >= pads.unsqueeze(1)


def saved_bytes(fn: object, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """fn(x) and the bytes of the distinct storages its graph saves (x's own included)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)  # type: ignore[operator]
    return out, sum(storages.values())


@pytest.mark.parametrize("dim", [1, 2])
def test_pack_and_unpack_are_gather_and_inverse(dim: int) -> None:
    packing = Packing.of(left_padded())
    assert packing is not None
    generator = torch.Generator().manual_seed(0)
    shape = (4, 9, 3, 5) if dim == 1 else (4, 2, 9, 5)
    x = torch.randn(shape, generator=generator, requires_grad=True)
    weight = torch.randn(shape, generator=generator)
    reference = x.detach().clone().requires_grad_(True)
    packed = packing.pack(x, dim)
    assert torch.equal(packed, _gather_columns(reference, packing.order, dim))
    assert torch.equal(packing.unpack(packed, dim), x)
    (packed * weight).sum().backward()
    (_gather_columns(reference, packing.order, dim) * weight).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, reference.grad)
    # Real tokens first in every packed row, in their order.
    mask = left_padded()
    real_first = torch.sort(mask.int(), dim=1, descending=True).values.bool()
    assert torch.equal(_gather_columns(mask, packing.order, 1), real_first)


def test_backward_keeps_no_copy_of_the_permuted_tensor() -> None:
    packing = Packing.of(left_padded())
    assert packing is not None
    x = torch.randn(4, 9, 64, requires_grad=True) * 1.0  # a non-leaf, as a layer's q, k or v is
    _, ours = saved_bytes(packing.pack, x)
    _, gathers = saved_bytes(lambda t: _gather_columns(t, packing.order, 1), x)
    index_bytes = packing.restore.numel() * packing.restore.element_size()
    assert ours == index_bytes  # the inverse permutation only
    assert gathers >= x.numel() * x.element_size()  # torch's gather keeps its input
    with torch.no_grad():  # no graph: the plain gather
        assert not packing.pack(x).requires_grad

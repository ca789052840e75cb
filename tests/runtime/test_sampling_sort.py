"""The sampler's sort: the key sort gives torch's stable descending sort exactly (values, order, ties)."""

from __future__ import annotations

import pytest
import torch

from nereus.runtime.generation.sampling import KEY_SORT_MIN_VOCAB, _sort_by_keys, sort_descending

pytestmark = pytest.mark.logic


@pytest.mark.parametrize("vocab", [3, 40, KEY_SORT_MIN_VOCAB, 1000])
def test_key_sort_is_the_stable_descending_sort(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=generator) * 4
    logits[0] = 1.5  # a row of ties only
    logits[1, ::2] = logits[1, 1::2][: logits[1, ::2].numel()]  # pairs of equal values
    logits[2, 0], logits[2, -1] = 0.0, -0.0  # equal as floats, different bits
    logits[3, 1] = float("-inf")  # top-k filters
    logits[4] = torch.round(logits[4])  # many ties among few values
    expected = logits.sort(dim=-1, descending=True, stable=True)
    for values, order in (_sort_by_keys(logits), sort_descending(logits)):
        assert torch.equal(order, expected.indices)
        assert torch.equal(values, expected.values)

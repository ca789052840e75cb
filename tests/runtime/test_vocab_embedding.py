"""The vocabulary-split embedding (`tensor_parallel.VocabParallelEmbedding`) on two tensor ranks:
its output and each rank's weight gradient are the whole embedding's to the bit, and no op of
its forward or backward makes a tensor of the whole vocabulary's rows (`F.embedding` on a
`Shard(0)` DTensor did: its backward left a `Replicate()` gradient of every row on every rank)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.parallel_groups import build_groups
from nereus.runtime.model.tensor_parallel import VocabParallelEmbedding
from nereus.runtime.state.shard_layout import RankLayout
from nereus.spec.presets import MODELS

pytestmark = pytest.mark.multiprocess

VOCAB, HIDDEN = 40, 12


class LargestRows(TorchDispatchMode):
    """The most rows (first dim) of any tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2:
                self.rows = max(self.rows, int(leaf.shape[0]))
        return out


def worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = MODELS["tiny"]
    groups = build_groups(model, "lm", RankLayout(2, 1, 1, (0, 1)))
    assert groups is not None
    generator = torch.Generator().manual_seed(0)
    whole = torch.randn(VOCAB, HIDDEN, generator=generator)
    tokens = torch.randint(0, VOCAB, (3, 7), generator=generator)  # rows of both ranks
    grad_out = torch.randn(3, 7, HIDDEN, generator=generator)
    rows = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)

    embedding = VocabParallelEmbedding(VOCAB, HIDDEN, groups.tp)
    with torch.no_grad():
        embedding.weight.copy_(whole[rows])
    seen = LargestRows()
    with seen:
        out = embedding(tokens)
        out.backward(grad_out)
    reference = whole.clone().requires_grad_(True)
    expected = F.embedding(tokens, reference)
    expected.backward(grad_out)
    assert embedding.weight.grad is not None and reference.grad is not None
    return {
        "output_equal": torch.equal(out, expected),
        "grad_equal": torch.equal(embedding.weight.grad, reference.grad[rows]),
        "largest_rows": seen.rows,
    }


def test_vocab_split_embedding_is_the_whole_one_on_local_rows() -> None:
    for result in spawn(worker, 2):
        assert result["output_equal"] and result["grad_equal"], result
        # The largest tensor any op made holds a rank's rows (20 of 40) or fewer.
        assert result["largest_rows"] <= VOCAB // 2, result

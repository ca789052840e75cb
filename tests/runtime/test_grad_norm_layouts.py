"""The global gradient norm and clipping under TP, PP and DP equal a single rank's.

One 4-rank gloo world runs the same batch through every layout below; each rank of a
layout computes `global_grad_norm`, clips to half of it and measures again. Every rank of
every layout must report the single-rank norm (which must equal torch's own norm of the
single rank's gradients), the clipped norm must be the limit, and the clipped gradients,
assembled whole, must be the single rank's clipped gradients (every piece scaled once).
"""

from __future__ import annotations

import pytest
import torch

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.engine import Engine
from nereus.runtime.model.grad_norm import clip_grad_norm, global_grad_norm
from nereus.runtime.model.initialization import init_logical_params
from nereus.runtime.model.losses import NextTokenLoss, ValueLoss
from nereus.runtime.model.transformer import Batch
from nereus.runtime.state.shard_layout import RankLayout
from nereus.runtime.state.sharded_state import gather, state_meta
from nereus.spec.presets import MODELS

pytestmark = pytest.mark.multiprocess

WORLD = 4
TINY = MODELS["tiny"]  # 4 heads, 2 KV heads: tp=4 copies each KV head onto two ranks
#: (head, tp, pp, dp): tensor, pipeline (tied embedding on both ends) and data parallel, mixed.
CASES = [
    ("lm", 1, 1, 1),
    ("lm", 2, 1, 1),
    ("lm", 4, 1, 1),
    ("lm", 1, 2, 1),
    ("lm", 1, 1, 2),
    ("lm", 2, 2, 1),
    ("lm", 1, 2, 2),
    ("value", 1, 1, 1),
    ("value", 2, 1, 1),
    ("value", 1, 2, 2),
    # The layouts `nereus run` moves the tiny PPO plan through on 4 ranks (tests/cli's pool
    # trace): dp=4, and four pipeline stages (the tied embedding on the first and the last).
    ("lm", 1, 1, 4),
    ("lm", 1, 4, 1),
    ("value", 1, 1, 4),
    ("value", 1, 4, 1),
]


def batch_for(head: str) -> Batch:
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, TINY.vocab_size, (8, 9), generator=generator)
    mask = torch.ones(8, 9, dtype=torch.bool)
    fields = {"loss_mask": torch.rand(8, 9, generator=generator) > 0.3}
    if head == "value":
        fields["value_targets"] = torch.randn(8, 9, generator=generator)
    return Batch(tokens, mask, fields)


#: One rank's findings: per case, the norms it measured and its clipped gradient pieces.
RankResult = tuple[dict[str, list[float]], dict[str, dict[str, torch.Tensor]]]


def norms_worker(rank: int, world: int) -> RankResult:
    torch.set_num_threads(1)
    found: dict[str, list[float]] = {}
    clipped_grads: dict[str, dict[str, torch.Tensor]] = {}
    for head, tp, pp, dp in CASES:
        layout = RankLayout(tp, pp, dp, tuple(range(tp * pp * dp)))
        engine = Engine.create(TINY, head, layout)  # type: ignore[arg-type]
        if engine is None:
            continue
        engine.load_logical_params(init_logical_params(TINY, head, 3, randomize_all=True))  # type: ignore[arg-type]
        objective = ValueLoss() if head == "value" else NextTokenLoss()
        engine.forward_backward(batch_for(head), objective, 2 if pp > 1 else 1)
        norm = global_grad_norm(engine)
        values = [norm]
        if (tp, pp, dp) == (1, 1, 1):
            grads = [param.grad for param in engine.params.values() if param.grad is not None]
            values.append(float(torch.nn.utils.get_total_norm(grads)))
        before = clip_grad_norm(engine, norm / 2)
        values += [before, global_grad_norm(engine)]
        found[f"{head}-{tp}-{pp}-{dp}"] = values
        state = engine.local_state()
        clipped_grads[f"{head}-{tp}-{pp}-{dp}"] = {k: t.clone() for k, t in state.items() if k.startswith("grad/")}
    return found, clipped_grads


def whole_grads(per_rank: list[RankResult], head: str, tp: int, pp: int, dp: int) -> torch.Tensor:
    """One case's clipped gradients assembled whole (replicas checked bitwise equal), flat."""
    layout = RankLayout(tp, pp, dp, tuple(range(tp * pp * dp)))
    case = f"{head}-{tp}-{pp}-{dp}"
    logical = gather(state_meta(TINY, head, layout, ("grad",)), {r: per_rank[r][1][case] for r in layout.ranks})  # type: ignore[arg-type]
    return torch.cat([logical[key].reshape(-1).double() for key in sorted(logical)])


@pytest.mark.slow
def test_grad_norm_is_global_and_equal_across_layouts():
    per_rank = spawn(norms_worker, WORLD)
    norms = [found for found, _ in per_rank]
    for head in ("lm", "value"):
        norm, torch_norm, *_ = norms[0][f"{head}-1-1-1"]
        assert norm == pytest.approx(torch_norm, rel=1e-6), head  # torch's norm of the same gradients
    for head, tp, pp, dp in CASES:
        case, reference = f"{head}-{tp}-{pp}-{dp}", norms[0][f"{head}-1-1-1"][0]
        for rank in range(tp * pp * dp):
            norm, *_, before, clipped = norms[rank][case]
            assert norm == pytest.approx(reference, rel=1e-5), (case, rank)
            assert before == norm, (case, rank)
            assert clipped == pytest.approx(norm / 2, rel=1e-5), (case, rank)
        # The clipped gradients themselves: the norm counts a tied or replicated piece once, so
        # a copy left unscaled would escape it; assembled (copies equal bitwise), they are the
        # single rank's.
        mine, single = whole_grads(per_rank, head, tp, pp, dp), whole_grads(per_rank, head, 1, 1, 1)
        assert float((mine - single).norm() / single.norm()) < 1e-5, case

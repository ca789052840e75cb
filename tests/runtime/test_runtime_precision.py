"""Mixed precision in the engine: bf16 weights, activations and gradients with fp32 master
weights and AdamW moments; the state bytes a rank holds are the cost model's formula; the
contract state (the masters) round-trips bitwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nereus.cost.calibration import Calibration
from nereus.cost.stage import StageCostModel
from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.adamw import Precision, stage_precision
from nereus.runtime.model.engine import Engine, EngineConfig
from nereus.runtime.model.losses import NextTokenLoss
from nereus.runtime.model.transformer import Batch
from nereus.runtime.state.shard_layout import RankLayout
from nereus.spec.presets import MODELS, cluster_preset, workload_preset

pytestmark = pytest.mark.multiprocess

TINY = MODELS["tiny"]
BF16 = workload_preset("tiny-ppo").model_copy(update={"dtype": "bf16"})


def batch(rows: int = 4, seq: int = 9) -> Batch:
    tokens = torch.randint(0, TINY.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(rows, seq, dtype=torch.bool)
    mask[1, :3] = False
    return Batch(tokens, mask)


def precision_worker(rank: int, world: int, precision: Precision) -> dict[str, Any]:
    torch.set_num_threads(1)
    layout = RankLayout(1, 1, world, tuple(range(world)))
    engine = Engine.create(TINY, "lm", layout, EngineConfig(precision=precision))
    assert engine is not None
    losses = [engine.train_step(batch(), NextTokenLoss()) for _ in range(3)]
    state = {key: tensor.clone() for key, tensor in engine.local_state().items()}
    masters = engine.optimizer.masters
    rounded = all(torch.equal(p, masters[n].to(p.dtype)) for n, p in engine.params.items()) if masters else None
    other = Engine.create(TINY, "lm", layout, EngineConfig(precision=precision))
    assert other is not None
    other.load_local_state({k: v for k, v in state.items() if not k.startswith("grad/")}, engine.optimizer_step)
    for e in (engine, other):
        e.train_step(batch(), NextTokenLoss())
    same = all(torch.equal(engine.local_state()[k], other.local_state()[k]) for k in state if "grad/" not in k)
    return {
        "bytes": engine.state_bytes(),
        "numel": sum(p.numel() for p in engine.params.values()),
        "dtypes": {str(p.dtype) for p in engine.params.values()},
        "param_family": {str(v.dtype) for k, v in state.items() if k.startswith("param/")},
        "losses": losses,
        "rounded": rounded,
        "resumed_bitwise": same,
    }


def cost_terms(numel: int, workload: Any) -> dict[str, float]:
    cost = StageCostModel(TINY, "lm", "training", workload, cluster_preset("h100-sxm"), Calibration())
    return {k: float(v) for k, v in cost.model_state_terms(numel, 1).items()}


def test_bf16_state_bytes_are_the_formula_and_resume_is_bitwise() -> None:
    (result,) = spawn(precision_worker, 1, stage_precision(BF16, "training"))
    n = result["numel"]
    assert result["dtypes"] == {"torch.bfloat16"} and result["param_family"] == {"torch.float32"}
    # 2 bytes/param bf16 weights, a bf16 gradient buffer, 12 bytes/param fp32 master + moments
    assert result["bytes"] == {"parameters": 2 * n, "gradients": 2 * n, "optimizer": 12 * n}
    assert result["bytes"] == cost_terms(n, BF16)
    assert result["rounded"] and result["resumed_bitwise"]
    assert result["losses"][-1] < result["losses"][0]


def test_fp32_state_bytes_are_the_formula() -> None:
    fp32 = BF16.model_copy(update={"dtype": "fp32"})
    (result,) = spawn(precision_worker, 1, stage_precision(fp32, "training"))
    n = result["numel"]
    assert result["dtypes"] == {"torch.float32"} and result["rounded"] is None
    assert result["bytes"] == {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n} == cost_terms(n, fp32)
    assert result["resumed_bitwise"]

"""ZeRO-1 (`shard_across_dp`): the same updates as without sharding, each replica holding
only its rows of the masters and moments (the cost model's bytes), and the sharded state
reshards to and from unsharded layouts bitwise (the boxes `state_meta` gives)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.adamw import AdamWConfig, stage_precision
from nereus.runtime.model.engine import Engine, EngineConfig
from nereus.runtime.model.grad_norm import global_grad_norm
from nereus.runtime.model.losses import NextTokenLoss
from nereus.runtime.model.transformer import Batch
from nereus.runtime.state.reshard import execute
from nereus.runtime.state.reshard_plan import plan_reshard
from nereus.runtime.state.shard_layout import RankLayout
from nereus.runtime.state.sharded_state import dp_sharded_families, gather, state_dtypes, state_meta
from nereus.spec.presets import MODELS, workload_preset

pytestmark = pytest.mark.multiprocess

TINY = MODELS["tiny"]
FP32 = workload_preset("tiny-ppo")
BF16 = FP32.model_copy(update={"dtype": "bf16"})
FAMILIES = ("param", "exp_avg", "exp_avg_sq")


def batch() -> Batch:
    tokens = torch.randint(0, TINY.vocab_size, (4, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[1, :3] = False
    return Batch(tokens, mask)


def meta(workload: Any, layout: RankLayout, zero1: bool) -> Any:
    sharded = dp_sharded_families(workload, "training", zero1)
    return state_meta(TINY, "lm", layout, FAMILIES, state_dtypes(workload, "training"), sharded)


def engine(workload: Any, layout: RankLayout, zero1: bool) -> Engine:
    config = EngineConfig(AdamWConfig(lr=1e-2), precision=stage_precision(workload, "training"), shard_across_dp=zero1)
    made = Engine.create(TINY, "lm", layout, config)
    assert made is not None
    return made


def contract(e: Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in e.local_state().items() if k.split("/")[0] in FAMILIES}


def logical(workload: Any, layout: RankLayout, zero1: bool, state: dict[str, torch.Tensor]) -> Any:
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return gather(meta(workload, layout, zero1), dict(enumerate(states)))


def zero1_worker(rank: int, world: int, workload: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    dp2, dp1 = RankLayout(1, 1, 2, (0, 1)), RankLayout(1, 1, 1, (0,))
    plain, sharded = engine(workload, dp2, False), engine(workload, dp2, True)
    for e in (plain, sharded):
        for _ in range(3):
            e.train_step(batch(), NextTokenLoss())
    norm_error = abs(global_grad_norm(plain) - global_grad_norm(sharded))
    param_error = max(float((plain.params[n].float() - p.float()).abs().max()) for n, p in sharded.params.items())
    whole = logical(workload, dp2, False, contract(plain))
    split = logical(workload, dp2, True, contract(sharded))
    state_error = max(float((whole[k] - split[k]).abs().max()) for k in whole)
    # dp=2 sharded -> dp=1 whole -> dp=2 sharded, both moves by the resharder
    split_meta, one_meta = meta(workload, dp2, True), meta(workload, dp1, False)
    to_one = execute(plan_reshard(split_meta, one_meta), rank, contract(sharded), 3)
    back = execute(plan_reshard(one_meta, split_meta), rank, to_one.tensors, to_one.step)
    moved = engine(workload, dp2, True)
    moved.load_local_state(back.tensors, 3)
    round_trip = all(torch.equal(back.tensors[k], v) for k, v in contract(sharded).items())
    for e in (sharded, moved):
        e.train_step(batch(), NextTokenLoss())
    continued = all(torch.equal(moved.params[n], p) for n, p in sharded.params.items())
    continued &= all(torch.equal(moved.local_state()[k], v) for k, v in contract(sharded).items())
    one = None
    if rank == 0:
        one = all(torch.equal(to_one.tensors[k], split[k]) for k in split)
    return {
        "param_error": param_error,
        "norm_error": norm_error,
        "state_error": state_error,
        "bytes": sharded.state_bytes(),
        "plain_bytes": plain.state_bytes(),
        "numel": sum(p.numel() for p in sharded.params.values()),
        "round_trip": round_trip,
        "continued": continued,
        "gathered_on_one": one,
    }


@pytest.mark.parametrize("workload", [FP32, BF16], ids=["fp32", "bf16"])
def test_zero1_steps_match_unsharded_and_reshard_bitwise(workload: Any) -> None:
    results = spawn(zero1_worker, 2, workload)
    tolerance = 1e-6 if workload.dtype == "fp32" else 0.0
    for result in results:
        assert result["param_error"] <= tolerance and result["state_error"] <= 1e-6
        assert result["round_trip"] and result["continued"] and result["norm_error"] <= 1e-9
        n = result["numel"]
        weights = 4 if workload.dtype == "fp32" else 2
        optimizer = (8 if workload.dtype == "fp32" else 12) * n
        # every TINY tensor has an even first dimension: each replica holds exactly half
        assert result["bytes"] == {"parameters": weights * n, "gradients": weights * n, "optimizer": optimizer // 2}
        assert result["plain_bytes"]["optimizer"] == optimizer
    assert results[0]["gathered_on_one"]


def small_bucket_worker(rank: int, world: int, workload: Any) -> bool:
    """The same steps with buckets far smaller than a tensor (every gradient and every
    all-gathered weight staged in row blocks) as with the default buckets: bitwise."""
    from nereus.runtime.model import data_parallel

    torch.set_num_threads(1)
    dp2 = RankLayout(1, 1, 2, (0, 1))
    same = True
    for zero1 in (False, True):
        engines = []
        for bucket_elements in (data_parallel.GRAD_BUCKET_ELEMENTS, 97):
            data_parallel.GRAD_BUCKET_ELEMENTS = bucket_elements
            made = engine(workload, dp2, zero1)
            for _ in range(2):
                made.train_step(batch(), NextTokenLoss())
            engines.append(contract(made))
        data_parallel.GRAD_BUCKET_ELEMENTS = 1 << 22
        same &= all(torch.equal(engines[0][k], v) for k, v in engines[1].items())
    return same


def test_row_block_buckets_change_no_bit() -> None:
    assert all(spawn(small_bucket_worker, 2, BF16))

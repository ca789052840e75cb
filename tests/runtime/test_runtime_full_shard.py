"""Full sharding (`EngineConfig.full_shard`) on FSDP2: the same updates as the replicated
engine, every family held in the rows `state_meta` gives (read off the DTensor placements),
and the state moves bitwise into and out of full sharding through checkpoints (any layout)
and live transitions (a replica's whole state, as `Engine.whole_state` assembles it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.adamw import AdamWConfig, stage_precision
from nereus.runtime.model.engine import Engine, EngineConfig
from nereus.runtime.model.grad_norm import global_grad_norm
from nereus.runtime.model.losses import NextTokenLoss, ValueLoss
from nereus.runtime.model.transformer import Batch
from nereus.runtime.state.checkpoint import load_checkpoint, save_checkpoint_distributed
from nereus.runtime.state.shard_layout import RankLayout
from nereus.runtime.state.sharded_state import (
    check_rank_state,
    dp_rows,
    dp_sharded_families,
    state_dtypes,
    state_meta,
)
from nereus.spec.presets import MODELS, workload_preset

pytestmark = pytest.mark.multiprocess

TINY = MODELS["tiny"]
FP32 = workload_preset("tiny-ppo")
BF16 = FP32.model_copy(update={"dtype": "bf16"})
FAMILIES = ("param", "exp_avg", "exp_avg_sq")
DP2, DP1 = RankLayout(1, 1, 2, (0, 1)), RankLayout(1, 1, 1, (0,))


def batch(seed: int = 5) -> Batch:
    tokens = torch.randint(0, TINY.vocab_size, (4, 9), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[1, :3] = False
    return Batch(tokens, mask)


def engine(workload: Any, layout: RankLayout, full: bool = False, zero1: bool = False) -> Engine:
    precision = stage_precision(workload, "training")
    made = Engine.create(TINY, "lm", layout, EngineConfig(AdamWConfig(lr=1e-2), 0, None, precision, zero1, full))
    assert made is not None
    return made


def contract(e: Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in e.local_state().items() if k.split("/")[0] in FAMILIES}


def meta(workload: Any, layout: RankLayout, full: bool) -> Any:
    sharded = dp_sharded_families(workload, "training", False, full)
    return state_meta(TINY, "lm", layout, FAMILIES, state_dtypes(workload, "training"), sharded)


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    shapes = a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    return shapes and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


def steps_worker(rank: int, world: int, workload: Any, micro_batches: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    plain, full = engine(workload, DP2), engine(workload, DP2, full=True)
    losses: list[list[float]] = [[], []]
    for losses_of, e in zip(losses, (plain, full), strict=True):
        for step in range(3):
            losses_of.append(e.train_step(batch(step), NextTokenLoss(), micro_batches))
    whole, split = plain.whole_state(FAMILIES), full.whole_state(FAMILIES)
    check_rank_state(meta(workload, DP2, True), rank, contract(full))
    return {
        "loss_error": max(abs(a - b) for a, b in zip(*losses, strict=True)),
        "state_error": max(float((whole[k].float() - split[k].float()).abs().max()) for k in whole),
        "norm_error": abs(global_grad_norm(plain) - global_grad_norm(full)),
        "bytes": full.state_bytes(),
        "plain_bytes": plain.state_bytes(),
    }


@pytest.mark.parametrize(
    ("workload", "micro_batches"), [(FP32, 2), (BF16, 1), (BF16, 2)], ids=["fp32", "bf16", "bf16-2mb"]
)
def test_full_sharding_steps_as_the_replicated_engine(workload: Any, micro_batches: int) -> None:
    """bf16 with one micro-batch: bitwise (FSDP2 reduces the 16-bit gradients in fp32 and rounds
    them back, as the replicated engine does; AdamW steps the same fp32 masters). Over several
    micro-batches FSDP2 reduces each micro-batch's gradient and sums the reduced ones (the
    replicated engine sums the local ones first): equal to bf16 rounding over 3 steps of lr
    1e-2; fp32 to its summation order."""
    tolerance = {(FP32.dtype, 2): 1e-4, (BF16.dtype, 1): 0.0, (BF16.dtype, 2): 5e-2}[(workload.dtype, micro_batches)]
    for result in spawn(steps_worker, 2, workload, micro_batches):
        assert result["state_error"] <= tolerance and result["loss_error"] <= max(tolerance, 1e-6)
        assert result["norm_error"] <= max(tolerance, 1e-12)
        plain, full = result["plain_bytes"], result["bytes"]
        # every TINY tensor has an even first dimension: each replica holds half of every family
        assert full["gradients"] * 2 == plain["gradients"]
        assert sum(full.values()) * 2 == sum(plain.values())


def moves_worker(rank: int, world: int, workload: Any, folder: str) -> dict[str, bool]:
    torch.set_num_threads(1)
    full = engine(workload, DP2, full=True)
    for step in range(2):
        full.train_step(batch(step), NextTokenLoss())
    whole = full.whole_state(FAMILIES)
    # a checkpoint of the FSDP2 rows, loaded at dp=1 (whole), replicated, ZeRO-1 and fully sharded
    path = Path(folder) / "ckpt"
    save_checkpoint_distributed(path, meta(workload, DP2, True), rank, contract(full), 2)
    one = load_checkpoint(path, DP1, rank).tensors
    results = {"whole at dp=1": rank != 0 or equal(one, {k: v for k, v in whole.items()})}
    targets = {
        "replicated": engine(workload, DP2),
        "zero1": engine(workload, DP2, zero1=True),
        "full": engine(workload, DP2, full=True),
    }
    for name, target in targets.items():
        target.load_local_state(load_checkpoint(path, DP2, rank).tensors, 2)
        results[f"checkpoint into {name}"] = equal(target.whole_state(FAMILIES), whole)
    # a live transition: a replica's whole state into a fully sharded engine, and out of one
    moved = engine(workload, DP2, full=True)
    moved.load_local_state(targets["replicated"].whole_state(FAMILIES), 2)
    results["live into full"] = equal(contract(moved), contract(full))
    out = engine(workload, DP2)
    out.load_local_state(moved.whole_state(FAMILIES), 2)
    results["live out of full"] = equal(out.whole_state(FAMILIES), whole)
    # resumed engines continue as the original does, bit for bit
    for e in (full, moved, targets["full"]):
        e.train_step(batch(7), NextTokenLoss())
    results["continues"] = equal(contract(moved), contract(full)) and equal(contract(targets["full"]), contract(full))
    dist.barrier()
    return results


@pytest.mark.parametrize("workload", [FP32, BF16], ids=["fp32", "bf16"])
def test_full_sharding_state_moves_bitwise_through_checkpoints_and_transitions(workload: Any, tmp_path: Path) -> None:
    for result in spawn(moves_worker, 2, workload, str(tmp_path)):
        assert all(result.values()), result


def odd_rows_worker(rank: int, world: int) -> dict[str, Any]:
    """A value head (1 row, 1-element bias) and odd shapes: FSDP2's rows are `dp_rows`'s, the
    last replica holding none of a one-row tensor."""
    torch.set_num_threads(1)
    precision = stage_precision(FP32, "training")
    made = Engine.create(TINY, "value", DP2, EngineConfig(AdamWConfig(lr=1e-2), 0, None, precision, False, True))
    assert made is not None
    shapes = {k: tuple(v.shape) for k, v in made.local_state().items()}
    expected = {f"param/{n}": (dp_rows(p.shape[0], 2, rank)[1], *p.shape[1:]) for n, p in made.params.items()}
    return {"shapes": shapes == expected, "bias_rows": shapes["param/value_head.bias"][0]}


def test_a_tensor_with_fewer_rows_than_dp_lies_on_the_first_replicas() -> None:
    results = spawn(odd_rows_worker, 2)
    assert all(r["shapes"] for r in results)
    assert [r["bias_rows"] for r in results] == [1, 0]


def value_head_worker(rank: int, world: int) -> dict[str, bool]:
    """A value head's one-row tensors after a step: the replica holding all their rows and the one
    holding none take part in the same gathers, and the whole state is the replicated engine's (to
    the gradient reduction's rounding)."""
    torch.set_num_threads(1)
    precision = stage_precision(FP32, "training")
    engines = {}
    for name, zero1, full in (("replicated", False, False), ("zero1", True, False), ("full", False, True)):
        config = EngineConfig(AdamWConfig(lr=1e-2), 0, None, precision, zero1, full)
        made = Engine.create(TINY, "value", DP2, config)
        assert made is not None
        rows = batch()
        targets = torch.randn(rows.tokens.shape, generator=torch.Generator().manual_seed(1))
        made.train_step(Batch(rows.tokens, rows.attention_mask, {"value_targets": targets}), ValueLoss())
        engines[name] = made.whole_state(FAMILIES)
    return {name: close(state, engines["replicated"]) for name, state in engines.items()}


def test_a_value_head_s_whole_state_is_assembled_by_every_replica_alike() -> None:
    assert all(all(result.values()) for result in spawn(value_head_worker, 2))


def inference_worker(rank: int, world: int) -> bool:
    """An inference engine (16-bit, no masters) fully sharded computes what the replicated one does."""
    torch.set_num_threads(1)
    precision = stage_precision(BF16, "inference")
    outputs = []
    for full in (False, True):
        made = Engine.create(TINY, "lm", DP2, EngineConfig(precision=precision, full_shard=full))
        assert made is not None
        outputs.append(made.log_probs(batch(), num_microbatches=2))
    return torch.equal(*outputs)


def test_fully_sharded_inference_is_bitwise_the_replicated() -> None:
    assert all(spawn(inference_worker, 2))


def test_full_sharding_refuses_interleaved_replicas() -> None:
    """Replicas listed downwards are put in group order by the layout; interleaved ones (replica
    0 below replica 1 at one tensor rank, above it at the other) have no such order."""
    assert RankLayout(1, 1, 2, (1, 0)).shards_in_group_order
    for config in (EngineConfig(full_shard=True), EngineConfig(shard_across_dp=True)):
        with pytest.raises(ValueError, match="the replicas interleave"):
            Engine.create(TINY, "lm", RankLayout(2, 1, 2, (0, 3, 1, 2)), config)

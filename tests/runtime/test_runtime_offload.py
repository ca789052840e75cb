"""Offload in the engine (`nereus.runtime.model.offload`): training-time offload
(`EngineConfig.train_offload`) steps as the engine without it, its host state apart from the
device's; a sleeping engine (`EngineConfig.offload`) keeps its state bitwise in host memory
and computes the same awake; the state moves bitwise into and out of offload through
checkpoints (safetensors, any layout) and live transitions; the updated rows' all-gather under
training-time offload stages one parameter at a time."""

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
from nereus.runtime.model.losses import NextTokenLoss
from nereus.runtime.model.transformer import Batch
from nereus.runtime.state.checkpoint import load_checkpoint, save_checkpoint_distributed
from nereus.runtime.state.shard_layout import RankLayout
from nereus.runtime.state.sharded_state import check_rank_state, dp_sharded_families, state_dtypes, state_meta
from nereus.spec.presets import MODELS, workload_preset

pytestmark = pytest.mark.multiprocess

TINY = MODELS["tiny"]
FP32 = workload_preset("tiny-ppo")
BF16 = FP32.model_copy(update={"dtype": "bf16"})
FAMILIES = ("param", "exp_avg", "exp_avg_sq")
DP2, DP1, PP2 = RankLayout(1, 1, 2, (0, 1)), RankLayout(1, 1, 1, (0,)), RankLayout(1, 2, 1, (0, 1))


def batch(seed: int = 5) -> Batch:
    tokens = torch.randint(0, TINY.vocab_size, (4, 9), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[1, :3] = False
    return Batch(tokens, mask)


def engine(workload: Any, layout: RankLayout, **choices: Any) -> Engine:
    precision = stage_precision(workload, "training")
    made = Engine.create(TINY, "lm", layout, EngineConfig(AdamWConfig(lr=1e-2), 0, None, precision, **choices))
    assert made is not None
    return made


def contract(e: Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in e.local_state().items() if k.split("/")[0] in FAMILIES}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def steps_worker(rank: int, world: int, workload: Any, micro_batches: int, choices: dict[str, Any]) -> dict[str, Any]:
    """The same 3 steps without and with training-time offload (ZeRO-1, or FSDP2 under full
    sharding: the sharding the offloaded engine implies)."""
    torch.set_num_threads(1)
    full = choices.get("full_shard", False)
    plain, offloaded = engine(workload, DP2, shard_across_dp=True, full_shard=full), engine(workload, DP2, **choices)
    losses: list[list[float]] = [[], []]
    for losses_of, e in zip(losses, (plain, offloaded), strict=True):
        for step in range(3):
            losses_of.append(e.train_step(batch(step), NextTokenLoss(), micro_batches))
    whole, moved = plain.whole_state(FAMILIES), offloaded.whole_state(FAMILIES)
    sharded = dp_sharded_families(workload, "training", True, full, train_offload=True)
    meta = state_meta(TINY, "lm", DP2, (*FAMILIES, "grad"), state_dtypes(workload, "training"), sharded)
    check_rank_state(meta, rank, {k: v for k, v in offloaded.local_state().items()})
    return {
        "loss_error": max(abs(a - b) for a, b in zip(*losses, strict=True)),
        "state_error": max(float((whole[k].float() - moved[k].float()).abs().max()) for k in whole),
        "norm_error": abs(global_grad_norm(plain) - global_grad_norm(offloaded)),
        "device": offloaded.state_bytes(),
        "host": offloaded.host_bytes(),
        "plain": plain.state_bytes(),
    }


@pytest.mark.parametrize(
    ("workload", "micro_batches", "choices"),
    [
        (FP32, 1, {"train_offload": "optimizer"}),
        (BF16, 1, {"train_offload": "optimizer"}),
        (BF16, 2, {"train_offload": "optimizer"}),
        (FP32, 2, {"train_offload": "optimizer", "full_shard": True}),
        (BF16, 1, {"train_offload": "params", "full_shard": True}),
    ],
    ids=["fp32", "bf16", "bf16-2mb", "fp32-2mb-fullshard", "bf16-params"],
)
def test_training_time_offload_steps_as_the_engine_without_it(
    workload: Any, micro_batches: int, choices: dict[str, Any]
) -> None:
    """One micro-batch: bitwise (each gradient is reduce-scattered in fp32 as ZeRO-1's buckets
    are, and AdamW's host arithmetic is the device's). Over two micro-batches each one's
    gradient is reduced before they are summed (ZeRO-1 sums them first): bf16 to its rounding
    over 3 steps of lr 1e-2 (as FSDP2's per-micro-batch reduction, test_runtime_full_shard),
    fp32 to its summation order; FSDP2 reduces per micro-batch itself, so bitwise again."""
    tolerance = (
        0.0
        if micro_batches == 1 or choices.get("full_shard")
        else {"float32": 1e-4, "bfloat16": 5e-2}[stage_precision(workload, "training").dtype]
    )
    for result in spawn(steps_worker, 2, workload, micro_batches, choices):
        assert result["state_error"] <= tolerance and result["loss_error"] <= max(tolerance, 1e-6), result
        assert result["norm_error"] <= max(tolerance, 1e-12), result
        device, host, plain = result["device"], result["host"], result["plain"]
        # the optimizer state and the gradients left the device for the host (this replica's rows)
        assert device["optimizer"] == 0 and device["gradients"] == 0 and host["optimizer"] == plain["optimizer"]
        if choices["train_offload"] == "params":  # and the parameters' shards with them
            assert device["parameters"] == 0 and host["parameters"] == plain["parameters"]
        else:
            assert device["parameters"] == plain["parameters"] and host["gradients"] > 0


def sleep_worker(rank: int, world: int, workload: Any, choices: dict[str, Any]) -> dict[str, Any]:
    """Steps with the engine put to sleep after each (its state in host memory), against the
    same steps awake."""
    torch.set_num_threads(1)
    awake = engine(workload, DP2, **choices)
    sleepy = engine(workload, DP2, offload=True, **choices)
    out: dict[str, Any] = {"asleep_device": [], "asleep_host": [], "awake_device": []}
    for step in range(3):
        for e in (awake, sleepy):
            e.train_step(batch(step), NextTokenLoss())
        before = sum(sleepy.state_bytes().values())
        sleepy.sleep()
        out["asleep_device"].append(sum(sleepy.state_bytes().values()))
        out["asleep_host"].append(sleepy.host_bytes().get("asleep", 0) - before)
        out["awake_device"].append(before)
    out["state"] = equal(contract(sleepy), contract(awake))  # readable asleep (woken under full sharding)
    sleepy.sleep()
    sleepy.wake()  # every tensor back in memory of its own, none left pointing at a host buffer
    parked = {buffer.data_ptr() for buffer in sleepy.parking.buffers.values()}
    held = [t for t in sleepy.local_state().values()] + [p.data for p in sleepy.params.values()]
    out["woke"] = not parked & {t.data_ptr() for t in held} and sum(sleepy.state_bytes().values()) > 0
    sleepy.sleep()
    out["log_probs"] = torch.equal(sleepy.log_probs(batch(9)), awake.log_probs(batch(9)))
    return out


@pytest.mark.parametrize(
    "choices",
    [{}, {"shard_across_dp": True}, {"full_shard": True}, {"train_offload": "optimizer"}],
    ids=["replicated", "zero1", "fullshard", "train-offload"],
)
def test_a_sleeping_engine_keeps_its_state_in_host_memory(choices: dict[str, Any]) -> None:
    for result in spawn(sleep_worker, 2, BF16, choices):
        assert result["state"] and result["log_probs"] and result["woke"], result
        assert result["asleep_device"] == [0, 0, 0] and min(result["awake_device"]) > 0
        if "train_offload" not in choices:  # every device byte went to host buffers of its size
            assert result["asleep_host"] == [0, 0, 0], result


def moves_worker(rank: int, world: int, workload: Any, folder: str) -> dict[str, bool]:
    """A checkpoint of a training-time offloaded (and asleep) engine loaded into every other
    choice and back; live transitions (a replica's whole state) into and out of offload."""
    torch.set_num_threads(1)
    source = engine(workload, DP2, train_offload="optimizer", offload=True)
    for step in range(2):
        source.train_step(batch(step), NextTokenLoss())
    source.sleep()
    whole = source.whole_state(FAMILIES)
    sharded = dp_sharded_families(workload, "training", True, False, train_offload=True)
    meta = state_meta(TINY, "lm", DP2, FAMILIES, state_dtypes(workload, "training"), sharded)
    path = Path(folder) / "ckpt"
    save_checkpoint_distributed(path, meta, rank, contract(source), 2)
    results = {"whole at dp=1": rank != 0 or equal(load_checkpoint(path, DP1, rank).tensors, whole)}
    targets = {
        "replicated": engine(workload, DP2),
        "zero1": engine(workload, DP2, shard_across_dp=True),
        "full": engine(workload, DP2, full_shard=True),
        "offloaded": engine(workload, DP2, train_offload="optimizer"),
        "params": engine(workload, DP2, train_offload="params", full_shard=True),
        "asleep": engine(workload, DP2, offload=True),
    }
    targets["asleep"].sleep()
    for name, target in targets.items():
        target.load_local_state(load_checkpoint(path, DP2, rank).tensors, 2)
        results[f"checkpoint into {name}"] = equal(target.whole_state(FAMILIES), whole)
    # live: a replicated replica's whole state into an offloaded engine, and out of it
    moved = engine(workload, DP2, train_offload="optimizer")
    moved.load_local_state(targets["replicated"].whole_state(FAMILIES), 2)
    results["live into offload"] = equal(contract(moved), contract(source))
    out = engine(workload, DP2)
    out.load_local_state(moved.whole_state(FAMILIES), 2)
    results["live out of offload"] = equal(out.whole_state(FAMILIES), whole)
    # every resumed engine continues as the source does, bit for bit (the plain ones as ZeRO-1)
    for e in (source, moved, targets["offloaded"], targets["zero1"]):
        e.train_step(batch(7), NextTokenLoss())
    reference = source.whole_state(FAMILIES)
    results["continues"] = all(
        equal(e.whole_state(FAMILIES), reference) for e in (moved, targets["offloaded"], targets["zero1"])
    )
    dist.barrier()
    return results


@pytest.mark.parametrize("workload", [FP32, BF16], ids=["fp32", "bf16"])
def test_offloaded_state_moves_bitwise_through_checkpoints_and_transitions(workload: Any, tmp_path: Path) -> None:
    for result in spawn(moves_worker, 2, workload, str(tmp_path)):
        assert all(result.values()), result


def pipeline_worker(rank: int, world: int) -> float:
    """pp=2 with a tied embedding: its host gradient rows are summed between the two stages."""
    torch.set_num_threads(1)
    errors = []
    plain, offloaded = engine(BF16, PP2), engine(BF16, PP2, train_offload="optimizer")
    for step in range(2):
        errors.append(
            abs(
                plain.train_step(batch(step), NextTokenLoss(), 2)
                - offloaded.train_step(batch(step), NextTokenLoss(), 2)
            )
        )
    a, b = plain.whole_state(FAMILIES), offloaded.whole_state(FAMILIES)
    return max(max(errors), *(float((a[k].float() - b[k].float()).abs().max()) for k in a))


def test_training_time_offload_in_a_pipeline_with_tied_embeddings() -> None:
    """dp=1: nothing reduced across replicas; the tied embedding's two stages sum their host
    rows. bf16 with two micro-batches accumulated on the host as autograd accumulates them."""
    assert TINY.tied_embeddings
    assert max(spawn(pipeline_worker, 2)) == 0.0


def test_parameter_offload_needs_full_sharding_over_replicas() -> None:
    with pytest.raises(ValueError, match="needs full_shard over dp x cp > 1"):
        Engine.create(TINY, "lm", DP1, EngineConfig(train_offload="params", full_shard=True))


def gather_worker(rank: int, world: int) -> dict[str, int]:
    """The all-gathers of the updated rows after a step under training-time offload: the bytes of
    this rank's rows each call stages (its send buffer; the received rows are dp times as many)."""
    from nereus.runtime.model import engine as engine_module

    torch.set_num_threads(1)
    e = engine(FP32, DP2, train_offload="optimizer")
    e.train_step(batch(), NextTokenLoss(), 1)
    staged: list[int] = []
    gather = engine_module.all_gather_rows

    def recorded(bucket: Any, *args: Any) -> Any:  # the send buffer: the most rows a replica has
        rows = max(sum(piece[d].numel() for piece in bucket) for d in range(len(bucket[0])))
        staged.append(rows * bucket[0][0].element_size())
        return gather(bucket, *args)

    engine_module.all_gather_rows = recorded  # type: ignore[assignment]
    try:
        e._all_gather_rows({n: p.data for n, p in e.params.items()})
    finally:
        engine_module.all_gather_rows = gather  # type: ignore[assignment]
    shards = range(e.groups.shards)
    largest = max(max(e.rows(p.data, i).numel() for i in shards) * p.element_size() for p in e.params.values())
    mine = sum(e.mine(p.data).numel() * p.element_size() for p in e.params.values())
    return {"calls": len(staged), "params": len(e.params), "most": max(staged), "largest": largest, "mine": mine}


def test_training_time_offload_gathers_the_updated_rows_one_parameter_at_a_time() -> None:
    # One call per parameter, none staging more than the largest parameter's rows (ZeRO-1's
    # buckets would stage up to GRAD_BUCKET_ELEMENTS: here every row of the model in one call).
    for result in spawn(gather_worker, 2):
        assert result["calls"] == result["params"] > 1
        assert result["most"] <= result["largest"] < result["mine"]

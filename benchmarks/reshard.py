"""Benchmark: resharding a ~100M-parameter model with its AdamW state between layouts on 2 ranks.

The model is a Llama-style decoder of 100.1M parameters (12 layers, hidden 768, 12 heads,
4 KV heads, SwiGLU 2048, vocabulary 32000, tied embeddings); its state is param, exp_avg
and exp_avg_sq in fp32 (1.2 GB). For each pair of layouts on the same 2 ranks (gloo, one
thread per rank) it times:
  in-memory   nereus.runtime.reshard.execute (point-to-point over gloo);
  DCP         a round trip through torch.distributed.checkpoint: save the source layout
              (tensor-parallel tensors as DTensors, the rest as plain tensors), then load
              into the target layout (DCP reshards by its own chunk metadata);
  nereus ckpt the same round trip through nereus.runtime.checkpoint.
Every result is checked bitwise against the expected target shards. Both checkpoint
round trips write to a temporary folder on the local disk with fsync; their reads come
from the page cache. Reports medians of --runs, the in-memory speed-up over DCP, and bytes
moved against the lower bound.
Prints a table and writes benchmarks/results/reshard.json.

    .venv/bin/python benchmarks/reshard.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nereus.runtime.checkpoint import load_checkpoint, save_checkpoint_distributed
from nereus.runtime.dist import spawn
from nereus.runtime.reshard import execute, plan_reshard
from nereus.runtime.shard_layout import RankLayout, box_shape
from nereus.runtime.sharded_state import StateMeta, random_rank_state, state_meta
from nereus.spec.model import Model

RESULTS = Path(__file__).resolve().parent / "results" / "reshard.json"
FAMILIES = ("param", "exp_avg", "exp_avg_sq")
SEED = 2026
MODEL = Model(
    name="bench-100m",
    num_layers=12,
    hidden_dim=768,
    num_heads=12,
    num_kv_heads=4,
    head_dim=64,
    ffn_dim=2048,
    vocab_size=32000,
    tied_embeddings=True,
)
#: (name, source (tp, pp, dp), target (tp, pp, dp)), all on ranks (0, 1).
PAIRS = (
    ("tp2 -> pp2", (2, 1, 1), (1, 2, 1)),
    ("pp2 -> tp2", (1, 2, 1), (2, 1, 1)),
    ("tp2 -> dp2", (2, 1, 1), (1, 1, 2)),
)


def layout_meta(shape: tuple[int, int, int]) -> StateMeta:
    return state_meta(MODEL, "lm", RankLayout(*shape, (0, 1)), FAMILIES)


def timed(action: Any) -> tuple[float, Any]:
    """Wall time of `action` across both ranks (barriers on both sides)."""
    dist.barrier()
    started = time.perf_counter()
    result = action()
    dist.barrier()
    return time.perf_counter() - started, result


def dcp_state(meta: StateMeta, rank: int, tensors: dict[str, torch.Tensor], mesh: Any) -> dict[str, Any]:
    """A state dict DCP can reshard: tensor-split shards as DTensors over both ranks, whole ones plain."""
    from torch.distributed.tensor import DTensor, Shard

    state: dict[str, Any] = {}
    for key, box in meta.rank_boxes(rank).items():
        shape = meta.tensors[key].global_shape
        split = [dim for dim, (_, length) in enumerate(box) if length != shape[dim]]
        if not split:
            state[key] = tensors[key]
            continue
        assert meta.layout.tp == 2 and len(split) == 1, (key, box)
        stride = torch.empty(shape, device="meta").stride()
        state[key] = DTensor.from_local(
            tensors[key], mesh, [Shard(split[0])], run_check=False, shape=torch.Size(shape), stride=stride
        )
    return state


def local_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {key: value.to_local() if isinstance(value, DTensor) else value for key, value in state.items()}


def dcp_round_trip(
    source: StateMeta, target: StateMeta, rank: int, tensors: dict[str, torch.Tensor], folder: str, mesh: Any
) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    dcp.save(dcp_state(source, rank, tensors, mesh), storage_writer=dcp.FileSystemWriter(folder))
    empty = {key: torch.empty(box_shape(box)) for key, box in target.rank_boxes(rank).items()}
    loading = dcp_state(target, rank, empty, mesh)
    dcp.load(loading, storage_reader=dcp.FileSystemReader(folder))
    return local_tensors(loading)


def nereus_round_trip(
    source: StateMeta, target: StateMeta, rank: int, tensors: dict[str, torch.Tensor], folder: str, mesh: Any
) -> dict[str, torch.Tensor]:
    path = Path(folder) / "ckpt"
    save_checkpoint_distributed(path, source, rank, tensors, 1)
    return load_checkpoint(path, target.layout, rank).tensors


def fresh_folder(rank: int, scratch: str, name: str) -> str:
    """A new empty folder that both ranks use (rank 0 clears it)."""
    folder = Path(scratch) / name
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
    dist.barrier()
    return str(folder)


def measure_pair(
    rank: int, shapes: tuple[tuple[int, int, int], tuple[int, int, int]], runs: int, scratch: str, mesh: Any
) -> dict[str, Any]:
    source, target = layout_meta(shapes[0]), layout_meta(shapes[1])
    plan = plan_reshard(source, target)
    tensors = random_rank_state(source, rank, SEED)
    expected = random_rank_state(target, rank, SEED)
    times: dict[str, list[float]] = {"memory": [], "dcp": [], "nereus_ckpt": []}
    correct = True
    for run in range(runs):
        elapsed, result = timed(partial(execute, plan, rank, tensors, 1))
        times["memory"].append(elapsed)
        correct &= all(torch.equal(result.tensors[key], expected[key]) for key in expected)
        del result
        for method, trip in (("dcp", dcp_round_trip), ("nereus_ckpt", nereus_round_trip)):
            folder = fresh_folder(rank, scratch, f"{method}-{run}")
            elapsed, loaded = timed(partial(trip, source, target, rank, tensors, folder, mesh))
            times[method].append(elapsed)
            correct &= all(torch.equal(loaded[key], expected[key]) for key in expected)
            del loaded  # keep one target state alive at a time, so runs do not pay for each other's memory
    flags: list[Any] = [None, None]
    dist.all_gather_object(flags, correct)
    medians = {method: statistics.median(values) for method, values in times.items()}
    return {
        "source": shapes[0],
        "target": shapes[1],
        "memory_s": medians["memory"],
        "dcp_s": medians["dcp"],
        "nereus_checkpoint_s": medians["nereus_ckpt"],
        "speedup_vs_dcp": medians["dcp"] / medians["memory"],
        "bytes_moved": plan.bytes_moved,
        "lower_bound_bytes": plan.lower_bound,
        "state_bytes": sum(source.rank_bytes(r) for r in (0, 1)),
        "bitwise_equal": all(flags),
        "all_times_s": times,
    }


def _worker(rank: int, world_size: int, runs: int, scratch: str) -> list[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))  # made once: not part of any timed round trip
    return [
        {"pair": name, **measure_pair(rank, (source, target), runs, scratch, mesh)} for name, source, target in PAIRS
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="timed repetitions per pair (median reported)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nereus-reshard-bench-") as scratch:
        rows = spawn(_worker, 2, args.runs, scratch)[0]
    gb = 1e9
    print(f"{MODEL.name}: {MODEL.num_params() / 1e6:.1f}M params, state {rows[0]['state_bytes'] / gb:.2f} GB (fp32 x3)")
    print(
        f"{'pair':<12} {'in-memory':>10} {'DCP':>8} {'nereus ckpt':>12} {'speed-up':>9} {'moved GB':>9} {'bound GB':>9}"
    )
    for row in rows:
        print(
            f"{row['pair']:<12} {row['memory_s']:>9.2f}s {row['dcp_s']:>7.2f}s {row['nereus_checkpoint_s']:>11.2f}s "
            f"{row['speedup_vs_dcp']:>8.1f}x {row['bytes_moved'] / gb:>9.3f} {row['lower_bound_bytes'] / gb:>9.3f}"
            + ("" if row["bitwise_equal"] else "  MISMATCH")
        )
    RESULTS.parent.mkdir(exist_ok=True)
    payload = {
        "benchmark": "reshard",
        "model": MODEL.name,
        "params": MODEL.num_params(),
        "ranks": 2,
        "threads_per_rank": 1,
        "runs": args.runs,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "results": rows,
    }
    RESULTS.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Benchmark: a training step of the fully sharded engine (FSDP2) against the replicated one.

One gloo world of 2 CPU ranks (one thread each), dp=2 (tp=1, pp=1), bf16 with fp32 masters
(the run's training precision) unless --dtype says otherwise. For each model (the `tiny`
preset and a ~100M-parameter decoder, memory_parity.py's), both engines are built on the
same seed and their `train_step` (zero_grad, forward and backward, gradient reduction, AdamW)
timed alternately, step by step, so load on the shared machine falls on all alike. Reports
each engine's median step, the ratio new / old (target: at most 1.1) and each engine's state
bytes per rank; a third engine, FSDP2 with reshard_after_forward=False, is timed beside them.
Writes benchmarks/results/full_shard_step.json.

    .venv/bin/python benchmarks/full_shard_step.py [--models tiny,decoder-100m] [--engines ...] [--iters 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _record import begin, rank_times, write_result
from memory_parity import MODEL

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.adamw import AdamWConfig, Precision
from nereus.runtime.model.engine import Engine, EngineConfig
from nereus.runtime.model.losses import NextTokenLoss
from nereus.runtime.model.transformer import Batch
from nereus.runtime.state.shard_layout import RankLayout
from nereus.spec.model import Model
from nereus.spec.presets import MODELS

RESULTS = Path(__file__).resolve().parent / "results" / "full_shard_step.json"
TARGET = 1.1
#: The replicated engine (hand-written bucketed all-reduce), full sharding (FSDP2,
#: reshard_after_forward=True) and FSDP2 keeping each Block gathered from its forward to its
#: backward (reshard_after_forward=False, ZeRO-2-like in flight): the measurement behind
#: keeping the replicated engine for `full_shard: false`.
ENGINES = ("replicated", "full_shard", "fsdp_keep_gathered")


def models() -> dict[str, Model]:
    return {"tiny": MODELS["tiny"], MODEL["name"]: Model.model_validate(MODEL)}


def time_steps(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    layout = RankLayout(1, 1, 2, (0, 1))
    precision = Precision(args.dtype, master_weights=args.dtype != "float32")
    rows = []
    for name in args.models.split(","):
        model = models()[name]
        engines = {}
        for engine_name in args.engines.split(","):
            config = EngineConfig(AdamWConfig(), precision=precision, full_shard=engine_name != "replicated")
            made = Engine.create(model, "lm", layout, config)
            assert made is not None
            if engine_name == "fsdp_keep_gathered":
                for unit in (*made.pipeline_stage.layers.values(), made.pipeline_stage):
                    unit.set_reshard_after_forward(False)  # type: ignore[operator]
            engines[engine_name] = made
        generator = torch.Generator().manual_seed(0)
        batch = Batch(torch.randint(0, model.vocab_size, (args.rows, args.seq), generator=generator))
        times: dict[str, list[float]] = {engine_name: [] for engine_name in engines}
        for step in range(args.warmup + args.iters):
            for engine_name, engine in engines.items():  # alternated, step by step
                torch.distributed.barrier()
                started = time.perf_counter()
                engine.train_step(batch, NextTokenLoss())
                elapsed = time.perf_counter() - started
                if step >= args.warmup:
                    times[engine_name].append(elapsed)
        medians = {engine_name: statistics.median(t) for engine_name, t in times.items()}
        rows.append(
            {
                "model": name,
                "rank": rank,
                "median_step_s": medians,
                "ratios": {e: medians[e] / medians["replicated"] for e in medians if e != "replicated"},
                "state_bytes": {engine_name: e.state_bytes() for engine_name, e in engines.items()},
                "times_s": times,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(models()), help="Comma-separated: tiny, decoder-100m.")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rows", type=int, default=4, help="Sequences in the global batch.")
    parser.add_argument("--seq", type=int, default=64, help="Tokens per sequence.")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument(
        "--engines", default=",".join(ENGINES), help=f"Comma-separated, replicated first: {', '.join(ENGINES)}."
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    unknown = sorted(set(args.engines.split(",")) - set(ENGINES)) + sorted(set(args.models.split(",")) - set(models()))
    if unknown or "replicated" not in args.engines.split(","):
        parser.error(f"unknown engines or models {unknown}, or no replicated engine to compare with")
    started = begin()
    rows = [row for per_rank in spawn(time_steps, 2, args) for row in per_rank]
    for row in rows:
        steps = ", ".join(f"{e} {s:.4f} s" for e, s in row["median_step_s"].items())
        ratios = ", ".join(f"{e} {r:.2f}x" for e, r in row["ratios"].items())
        print(f"{row['model']:14} rank {row['rank']}: {steps}; against replicated: {ratios}")
    kept, repetitions = rank_times(rows)
    payload = {
        "target_ratio": TARGET,
        "ranks": 2,
        "threads_per_rank": 1,
        "layout": {"tp": 1, "pp": 1, "dp": 2},
        "engines": args.engines.split(","),
        "dtype": args.dtype,
        "rows_per_batch": args.rows,
        "seq": args.seq,
        "rows": kept,
    }
    write_result(args.output, payload, started, repetitions=repetitions)


if __name__ == "__main__":
    main()

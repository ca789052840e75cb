"""Benchmark: forward+backward tokens/s of the engine per (tp, pp, dp) layout.

Spawns one gloo world of --ranks CPU processes (one thread each) and, for every layout
with tp * pp * dp <= --ranks that the model admits, times `Engine.forward_backward` on a
global batch of --rows sequences of --seq tokens (1F1B, --microbatches per replica when
pp > 1), after --warmup untimed steps. Reports the median step time over --iters steps and
the global tokens/s (every token of the batch, forward and backward). On this 2-core
machine at most 2 ranks are timed; larger layouts are checked by the tests, not timed.
Prints a table and writes benchmarks/results/engine_throughput.json.

    .venv/bin/python benchmarks/engine_throughput.py
    .venv/bin/python benchmarks/engine_throughput.py --model tiny-wide --seq 256
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from _record import begin, write_result

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.engine import Engine
from nereus.runtime.model.losses import NextTokenLoss
from nereus.runtime.model.parallel_groups import admissible_layouts
from nereus.runtime.model.transformer import Batch
from nereus.runtime.state.shard_layout import RankLayout
from nereus.spec.presets import MODELS

RESULTS = Path(__file__).resolve().parent / "results" / "engine_throughput.json"


def time_layouts(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, object]]:
    model = MODELS[args.model]
    generator = torch.Generator().manual_seed(0)
    batch = Batch(torch.randint(0, model.vocab_size, (args.rows, args.seq), generator=generator))
    objective = NextTokenLoss()
    rows = []
    for tp, pp, dp in admissible_layouts(model, world):
        layout = RankLayout(tp, pp, dp, tuple(range(tp * pp * dp)))
        engine = Engine.create(model, "lm", layout)
        torch.distributed.barrier()  # idle ranks wait here, not in the next layout's timing
        if engine is None:
            continue
        num_microbatches = args.microbatches if pp > 1 else 1
        times = []
        for step in range(args.warmup + args.iters):
            engine.zero_grad()
            started = time.perf_counter()
            engine.forward_backward(batch, objective, num_microbatches)
            if step >= args.warmup:
                times.append(time.perf_counter() - started)
        if rank == layout.ranks[0]:
            median = statistics.median(times)
            rows.append(
                {
                    "tp": tp,
                    "pp": pp,
                    "dp": dp,
                    "ranks": tp * pp * dp,
                    "microbatches": num_microbatches,
                    "step_s": median,
                    "tokens_per_s": args.rows * args.seq / median,
                    "tokens_per_s_per_rank": args.rows * args.seq / median / (tp * pp * dp),
                    "step_s_runs": times,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS), help="model preset")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks (at most 2 on this machine)")
    parser.add_argument("--rows", type=int, default=8, help="sequences in the global batch")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per replica when pp > 1")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per layout")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per layout")
    args = parser.parse_args()
    recording = begin()
    load_before = os.getloadavg()[0]
    rows = sorted((row for ranks in spawn(time_layouts, args.ranks, args) for row in ranks), key=lambda r: r["ranks"])
    print(
        f"{args.model}: forward+backward of {args.rows} x {args.seq} tokens, gloo, 1 thread per rank "
        f"(machine load {load_before:.1f} before the run)"
    )
    print(f"{'tp':>3} {'pp':>3} {'dp':>3} {'mb':>3} {'step ms':>9} {'tokens/s':>10} {'tok/s/rank':>11}")
    for row in rows:
        print(
            f"{row['tp']:>3} {row['pp']:>3} {row['dp']:>3} {row['microbatches']:>3} {row['step_s'] * 1e3:>9.1f} "
            f"{row['tokens_per_s']:>10.0f} {row['tokens_per_s_per_rank']:>11.0f}"
        )
    step_s = {f"tp{r['tp']} pp{r['pp']} dp{r['dp']}": r.pop("step_s_runs") for r in rows}
    result = {
        "benchmark": "engine_throughput",
        "model": args.model,
        "rows": args.rows,
        "seq": args.seq,
        "ranks": args.ranks,
        "threads_per_rank": 1,
        "backend": "gloo",
        "warmup": args.warmup,
        "iters": args.iters,
        "load_average_1m_before": load_before,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "layouts": rows,
    }
    write_result(RESULTS, result, recording, {"step_s": step_s})
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

"""Benchmark: inter-stage fusion (long-tail migration) at maximum response lengths 512/1024/2048.

For each maximum length, the PPO workload preset (Llama-3.1-8B in every role, 512 prompts of
1024 tokens) gets log-normal response lengths with median max/16 and p99 max/2, so p99.9 is
above 10x the median (the shape RLHFuse reports for LMSYS-Chat-1M); `nereus plan` lays it out
on 16 and on 64 H100 GPUs; the generation simulator then sweeps the migration threshold 5%..95% over
--batches sampled batches and reports generation + inference time without and with fusion.
The paper reports 1.2-1.6x for generation + inference.

Prints a table and writes benchmarks/results/schedule_migrate.json.

    .venv/bin/python benchmarks/schedule_migrate.py
    .venv/bin/python benchmarks/schedule_migrate.py --gpus 32 --batches 8

With few generation replicas (dp 4 on 16 GPUs) migration frees little: most of the gain
needs enough replicas that a few destinations can take the tail.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

from _record import begin, write_result

from nereus.solver.migration import generation_profile, sweep_thresholds
from nereus.solver.plan_search import PlanRequest
from nereus.solver.planner import make_plan
from nereus.spec.presets import cluster_preset, model_preset, workload_preset
from nereus.spec.stages import ACTOR_GENERATION
from nereus.spec.workload import ResponseLengths

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "schedule_migrate.json"
MAX_LENGTHS = (512, 1024, 2048)
PAPER_RANGE = (1.2, 1.6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=[16, 64], help="cluster sizes (default 16 64 H100)")
    parser.add_argument("--model", default="llama-3.1-8b", help="model preset for every role")
    parser.add_argument("--batches", type=int, default=4, help="sampled batches per threshold (default 4)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    recording = begin()
    model = model_preset(args.model)
    rows = []
    columns = ("gpus", "max len", "layout", "no fusion", "fused", "speedup", "threshold", "dests", "mechanism")
    widths = (4, 7, 16, 10, 9, 8, 9, 6, 11)
    print(" ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    for num_gpus, max_len in [(g, n) for g in args.gpus for n in MAX_LENGTHS]:
        cluster = cluster_preset("h100", num_gpus)
        base = workload_preset("ppo", model.name)
        lengths = ResponseLengths(median=max_len // 16, p99=max_len // 2, max=max_len)
        workload = base.model_copy(update={"response_len": lengths})
        started = time.perf_counter()
        plan = make_plan(PlanRequest(cluster, (model,), workload, num_gpus)).best
        profile = generation_profile(plan)
        result = sweep_thresholds(profile, num_batches=args.batches, seed=0)
        entry = plan.stage_plan(ACTOR_GENERATION)
        row = {
            "gpus": num_gpus,
            "max_length": max_len,
            "generation_layout": {"tp": entry.tp, "pp": entry.pp, "dp": entry.dp},
            **result.to_json(),
            "wall_s": time.perf_counter() - started,
        }
        rows.append(row)
        layout = f"tp{entry.tp} pp{entry.pp} dp{entry.dp}"
        print(
            f"{num_gpus:>4} {max_len:>7} {layout:>16} {result.baseline_s:>9.3f}s {result.best.total_s:>8.3f}s "
            f"{result.speedup:>7.3f}x {100 * result.best.threshold:>8.0f}% {result.best.destinations:>6.1f} "
            f"{result.best.mechanism:>11}",
            flush=True,
        )
    payload = {
        "benchmark": "schedule_migrate",
        "config": {"gpus": args.gpus, "model": args.model, "batches": args.batches, "gpu": "h100"},
        "paper_speedup_range": PAPER_RANGE,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "cases": rows,
    }
    # A seeded simulation per case (deterministic); its wall time is the raw number.
    write_result(args.out, payload, recording, {"wall_s": [r["wall_s"] for r in rows]})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

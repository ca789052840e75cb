"""Benchmark: wall time of the exact plan search on PPO presets, 32 to 1024 H100s.

For each (model, GPU count) it times `search()` (median of --runs) and `search(top_k=3)`
(exact top-k: dominance pruning is off, so it scores more leaves), checks both agree on
the best step time, and where the exhaustive `reference_search()` is affordable (its
option-count product, summed over placements, is at most --max-product) also reports the
optimality gap of search against it.
Prints a table and writes benchmarks/results/plan_search.json.

    .venv/bin/python benchmarks/plan_search.py            # full: 5 runs, 32..1024 GPUs
    .venv/bin/python benchmarks/plan_search.py --quick    # 3 runs, 32..128 GPUs, 8B only
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from pathlib import Path

from _record import begin, write_result

from nereus.cli.inputs import models_for
from nereus.solver.plan_search import PlanRequest, compile_problem, placements, price_all, reference_search, search
from nereus.spec.presets import cluster_preset, workload_preset

MODELS = ("llama-3.1-8b", "llama-3.3-70b")
GPU_COUNTS = (32, 64, 128, 256, 512, 1024)
RESULTS = Path(__file__).resolve().parent / "results" / "plan_search.json"


def exhaustive_size(request: PlanRequest) -> int:
    """Full assignments reference_search would score: the option-count product per placement, summed."""
    layouts = placements(request)
    tables = price_all(request, layouts)
    return sum(math.prod(len(o) for o in compile_problem(request, p, tables, prune=False).options) for p in layouts)


def measure(model: str, gpus: int, runs: int, max_product: float) -> dict[str, object]:
    workload = workload_preset("ppo", actor=model)
    request = PlanRequest(cluster_preset("h100", gpus), models_for(workload, None), workload, gpus)
    times, top3_times = [], []
    outcome = top3 = None
    for _ in range(runs):
        started = time.perf_counter()
        outcome = search(request)
        times.append(time.perf_counter() - started)
        started = time.perf_counter()
        top3 = search(request, top_k=3)
        top3_times.append(time.perf_counter() - started)
    assert outcome is not None and top3 is not None
    assert bool(outcome.candidates) == bool(top3.candidates), (model, gpus)
    if outcome.candidates:  # equal up to float summation order
        assert math.isclose(top3.candidates[0].step_time_s, outcome.candidates[0].step_time_s, rel_tol=1e-9)
    product = exhaustive_size(request)
    gap: float | None = None
    reference = "skipped"
    best = outcome.candidates[0].step_time_s if outcome.candidates else None
    if product <= max_product:
        exact = reference_search(request)
        truth = exact.candidates[0].step_time_s if exact.candidates else None
        if best is not None and truth is not None:
            gap = best / truth - 1.0
            reference = f"{gap:.2e}"
        else:
            reference = "both infeasible" if best is None and truth is None else "MISMATCH"
    return {
        "model": model,
        "gpus": gpus,
        "median_ms": statistics.median(times) * 1000,
        "search_ms_runs": [t * 1000 for t in times],
        "top3_ms_runs": [t * 1000 for t in top3_times],
        "top3_median_ms": statistics.median(top3_times) * 1000,
        "runs": runs,
        "gap": gap,
        "reference": reference,
        "exhaustive_assignments": product,
        "placements": outcome.num_placements,
        "leaves": outcome.num_leaves,
        "top3_leaves": top3.num_leaves,
        "step_time_s": best,
        "placement": outcome.candidates[0].placement.name if outcome.candidates else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="timed search() calls per case (median reported)")
    parser.add_argument("--quick", action="store_true", help="3 runs, 32..128 GPUs, llama-3.1-8b only")
    parser.add_argument(
        "--max-product",
        type=float,
        default=2e5,
        help="run reference_search only when its assignment count is at most this",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="JSON results file (default: results/plan_search.json, or plan_search_quick.json)",
    )
    args = parser.parse_args()
    recording = begin()
    if args.output is None:  # a quick run never overwrites the full results the README quotes
        args.output = RESULTS.with_name("plan_search_quick.json") if args.quick else RESULTS
    runs = min(args.runs, 3) if args.quick else args.runs
    models = MODELS[:1] if args.quick else MODELS
    gpu_counts = GPU_COUNTS[:3] if args.quick else GPU_COUNTS

    rows = [measure(model, gpus, runs, args.max_product) for model in models for gpus in gpu_counts]
    header = (
        f"{'model':<14} {'GPUs':>5} {'median ms':>10} {'top-3 ms':>9} {'runs':>4} {'placements':>10} {'leaves':>6} "
        f"{'top-3 leaves':>12} "
        f"{'exhaustive':>10} {'gap vs reference':>16} {'step s':>8}  placement"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        step = f"{r['step_time_s']:.2f}" if r["step_time_s"] is not None else "none"
        print(
            f"{r['model']:<14} {r['gpus']:>5} {r['median_ms']:>10.1f} {r['top3_median_ms']:>9.1f} {r['runs']:>4} "
            f"{r['placements']:>10} {r['leaves']:>6} {r['top3_leaves']:>12} "
            f"{r['exhaustive_assignments']:>10.2e} {r['reference']:>16} {step:>8}  "
            f"{r['placement'] or '-'}"
        )
    repetitions = {
        f"{r['model']}/{r['gpus']}": {"search_ms": r.pop("search_ms_runs"), "top3_ms": r.pop("top3_ms_runs")}
        for r in rows
    }
    payload = {
        "benchmark": "plan_search",
        "workload": "ppo",
        "cluster": "h100",
        "quick": args.quick,
        "max_product": args.max_product,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "results": rows,
    }
    write_result(args.output, payload, recording, repetitions)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

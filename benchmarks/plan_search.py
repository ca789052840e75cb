"""Benchmark: wall time of the exact plan search on PPO presets, 32 to 1024 H100s.

For each (model, GPU count) it times `search()` (median of --runs) and `search(top_k=3)`
(exact top-k: dominance pruning is off, so it scores more leaves), checks both agree on
the best step time, and where the exhaustive `reference_search()` is affordable (its
option-count product, summed over placements, is at most --max-product) also reports the
optimality gap of search against it.
Prints a table and writes benchmarks/results/plan_search.json.

    .venv/bin/python benchmarks/plan_search.py            # full: 5 runs, 32..1024 GPUs
    .venv/bin/python benchmarks/plan_search.py --quick    # 3 runs, 32..128 GPUs, 8B only
    .venv/bin/python benchmarks/plan_search.py --baseline /tmp/old   # also time another checkout

With --baseline DIR (a checkout of older code, e.g. `git archive c853336 | tar -x -C DIR`),
each case is also timed there, in a worker process importing nereus from DIR, alternating
with a worker on this checkout run by run, so both see the same machine load; the table
adds both medians and the median of the paired ratios.

With --slow-cases --baseline DIR, the host-memory-bound requests where no placement holds a plan
(`SLOW_CASES`: LLaMA-65B PPO on 8 H100s, Qwen3-235B-A22B GRPO on 16, which the search once
explored placement by placement for minutes) are timed instead, one fresh process per search
(baseline and this checkout alternating), each cut off after --cap seconds (then recorded as
None: it took longer); writes results/plan_search_slow_cases.json.

    git archive 87d7b24 | tar -x -C /tmp/before-skip    # before the search skipped such placements
    .venv/bin/python benchmarks/plan_search.py --slow-cases --baseline /tmp/before-skip --runs 3 --cap 60
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _record import Started, begin, write_result

from nereus.solver.plan_search import PlanRequest, compile_problem, placements, price_all, reference_search, search
from nereus.spec.presets import cluster_preset, models_for, workload_preset

MODELS = ("llama-3.1-8b", "llama-3.3-70b")
GPU_COUNTS = (32, 64, 128, 256, 512, 1024)
RESULTS = Path(__file__).resolve().parent / "results" / "plan_search.json"


#: A worker: reads "model gpus" lines, answers each with the seconds of one search() (after a warm-up).
WORKER = """
import sys, time
from nereus.solver.plan_search import PlanRequest, search
from nereus.spec.presets import cluster_preset, models_for, workload_preset
import nereus
print(nereus.__file__, flush=True)
requests = {}
for line in sys.stdin:
    model, gpus = line.split()
    if line not in requests:
        workload = workload_preset("ppo", actor=model)
        requests[line] = PlanRequest(cluster_preset("h100", int(gpus)), models_for(workload, None), workload, int(gpus))
        search(requests[line])
    started = time.perf_counter()
    search(requests[line])
    print(time.perf_counter() - started, flush=True)
"""


#: (model, workload preset, GPUs, maximum response or None: the preset's) where no placement
#: holds a plan and host memory binds: `--slow-cases`. LLaMA-65B's 2,048 positions need the cap.
SLOW_CASES = (("llama-65b", "ppo", 8, 1024), ("qwen3-235b-a22b", "grpo", 16, None))

#: One timed search of a slow case in a fresh process: argv model workload gpus max-response.
SLOW_WORKER = """
import sys, time
from nereus.solver.plan_search import PlanRequest, search
from nereus.spec.presets import cluster_preset, models_for, workload_preset
from nereus.spec.workload import with_max_response
import nereus
model, name, gpus, longest = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
workload = workload_preset(name, actor=model)
workload = with_max_response(workload, longest) if longest else workload
request = PlanRequest(cluster_preset("h100", gpus), models_for(workload, None), workload, gpus)
started = time.perf_counter()
outcome = search(request)
print(nereus.__file__, time.perf_counter() - started, len(outcome.candidates), flush=True)
"""


def slow_search_s(root: Path, case: tuple[str, str, int, int | None], cap: float) -> float | None:
    """Seconds of one `search` of `case` with nereus from `root` (None: cut off after `cap`)."""
    model, name, gpus, longest = case
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    argv = [sys.executable, "-c", SLOW_WORKER, model, name, str(gpus), str(longest or 0)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=root, timeout=cap, check=True)
    except subprocess.TimeoutExpired:
        return None
    imported, seconds, found = done.stdout.split()
    if root not in Path(imported).parents:
        raise RuntimeError(f"the search for {root} imported nereus from {imported}")
    assert found == "0", f"{case}: the slow cases hold no plan, {found} found"
    return float(seconds)


def slow_cases(baseline: Path, runs: int, cap: float, recording: Started) -> None:
    """Time `SLOW_CASES` on the baseline and this checkout, alternating run by run."""
    roots = (baseline.resolve(), Path(__file__).resolve().parent.parent)
    rows = []
    print(f"{'case':<34} {'baseline s (median)':>20} {'now s (median)':>15}")
    for case in SLOW_CASES:
        times: tuple[list[float | None], list[float | None]] = ([], [])
        for run in range(runs):
            for side in (0, 1)[:: 1 if run % 2 == 0 else -1]:
                times[side].append(slow_search_s(roots[side], case, cap))
        model, name, gpus, longest = case
        row = {"model": model, "workload": name, "gpus": gpus, "max_response": longest}
        for label, runs_s in zip(("baseline", "current"), times, strict=True):
            finished = [t for t in runs_s if t is not None]
            row[f"{label}_s_runs"] = runs_s
            # Cut-off runs took longer than every finished one: the median counts them as the largest.
            ordered = sorted(finished) + [math.inf] * (len(runs_s) - len(finished))
            median = statistics.median(ordered)
            row[f"{label}_median_s"] = median if math.isfinite(median) else None
            row[f"{label}_cut_off"] = len(runs_s) - len(finished)
        rows.append(row)
        said = [
            f"> {cap:g}" if row[f"{k}_median_s"] is None else f"{row[f'{k}_median_s']:.3f}"
            for k in ("baseline", "current")
        ]
        print(f"{model} {name} {gpus} GPUs{'':<10} {said[0]:>20} {said[1]:>15}")
    repetitions = {
        f"{r['model']}/{r['workload']}/{r['gpus']}": {
            "baseline_s": r.pop("baseline_s_runs"),
            "current_s": r.pop("current_s_runs"),
        }
        for r in rows
    }
    payload = {
        "benchmark": "plan_search_slow_cases",
        "what": "search() on requests where no placement holds a plan (host memory binds), one fresh process per run",
        "baseline": str(baseline),
        "runs": runs,
        "cap_s": cap,
        "cut_off_means": "killed after cap_s seconds (None in repetitions); a median of None: above cap_s",
        "results": rows,
    }
    output = RESULTS.with_name("plan_search_slow_cases.json")
    write_result(output, payload, recording, repetitions)
    print(f"wrote {output}")


class Worker:
    """A search() timer in its own process, importing nereus from `root`."""

    def __init__(self, root: Path) -> None:
        env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
        # cwd too: `python -c` puts the working directory first on sys.path.
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=root
        )
        assert self.process.stdout is not None
        imported = Path(self.process.stdout.readline().strip())
        if root not in imported.parents:
            raise RuntimeError(f"the worker for {root} imported nereus from {imported}")

    def time_ms(self, model: str, gpus: int) -> float:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{model} {gpus}\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline()) * 1000


def paired(model: str, gpus: int, runs: int, workers: tuple[Worker, Worker]) -> dict[str, object]:
    """Alternate the baseline and this checkout run by run (who goes first alternates too)."""
    baseline, current = [], []
    for run in range(runs):
        for worker in workers[:: 1 if run % 2 == 0 else -1]:
            (baseline if worker is workers[0] else current).append(worker.time_ms(model, gpus))
    return {
        "baseline_ms_runs": baseline,
        "current_ms_runs": current,
        "baseline_median_ms": statistics.median(baseline),
        "current_median_ms": statistics.median(current),
        "paired_ratio_median": statistics.median(c / b for b, c in zip(baseline, current, strict=True)),
    }


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
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a checkout of older code to time side by side (results/plan_search_vs_baseline.json)",
    )
    parser.add_argument("--slow-cases", action="store_true", help="time SLOW_CASES against --baseline")
    parser.add_argument("--cap", type=float, default=60.0, help="--slow-cases: seconds before a search is cut off")
    args = parser.parse_args()
    recording = begin()
    if args.slow_cases:
        if args.baseline is None:
            parser.error("--slow-cases needs --baseline DIR")
        slow_cases(args.baseline, args.runs, args.cap, recording)
        return
    if args.baseline is not None:
        compare(args.baseline, MODELS, GPU_COUNTS, max(args.runs, 5), recording)
        return
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


def compare(
    baseline: Path, models: tuple[str, ...], gpu_counts: tuple[int, ...], runs: int, recording: Started
) -> None:
    workers = (Worker(baseline.resolve()), Worker(Path(__file__).resolve().parent.parent))
    rows = []
    print(f"{'model':<14} {'GPUs':>5} {'baseline ms':>11} {'now ms':>8} {'paired ratio':>12}")
    for model in models:
        for gpus in gpu_counts:
            row = {"model": model, "gpus": gpus, **paired(model, gpus, runs, workers)}
            rows.append(row)
            print(
                f"{model:<14} {gpus:>5} {row['baseline_median_ms']:>11.1f} {row['current_median_ms']:>8.1f} "
                f"{row['paired_ratio_median']:>11.2f}x"
            )
    repetitions = {
        f"{r['model']}/{r['gpus']}": {"baseline_ms": r.pop("baseline_ms_runs"), "current_ms": r.pop("current_ms_runs")}
        for r in rows
    }
    payload = {"benchmark": "plan_search_vs_baseline", "baseline": str(baseline), "runs": runs, "results": rows}
    output = RESULTS.with_name("plan_search_vs_baseline.json")
    write_result(output, payload, recording, repetitions)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()

"""Benchmark: wall time of building the global transition DAG, 32 to 1024 H100s.

Two drifts per GPU count, each a pair of plans from `nereus plan` for Llama-3.1-8B PPO:
  seq-growth  responses capped at 1000 -> 8000 tokens on the same GPUs;
  pool-shrink the job loses a quarter of its nodes (plans for N and 3N/4 GPUs on an
              N-GPU cluster).
Times `build_transition` (local DAGs, scheduling, bytes and lower bound; freeing each
result is not timed), median of --runs after one untimed run,
as wall time and as the process's CPU time (the one to quote when the machine is shared:
other jobs stretch wall time, and less so the CPU time the build itself needs), and the
fastest run's CPU time; the 1-minute load average before and after is recorded, and so is the
machine's pure-Python speed then (`reference_loop_ms`: CPU ms of sum(range(10**6)), best of 5):
this VM's speed drifts by up to 1.5x from minute to minute, so compare runs through it. `copies`
counts the replicas Extends create (large rounds of alike copies share one Extend, so
it can exceed the number of Extends). The list scheduler is safe by construction, so the replay checker
(`check_result`) runs outside the timed path, once per case: its violations are recorded.
Prints a table and writes benchmarks/results/transition_time.json.

    .venv/bin/python benchmarks/transition_time.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import Counter
from pathlib import Path

from _record import begin, write_result

from nereus.solver.plan_search import PlanRequest
from nereus.solver.planner import make_plan
from nereus.solver.transition import build_transition
from nereus.solver.transition.check import check_result
from nereus.spec.plan import Plan
from nereus.spec.presets import cluster_preset, models_for, workload_preset
from nereus.spec.workload import with_max_response

GPU_COUNTS = (32, 64, 128, 256, 512, 1024)
RESULTS = Path(__file__).resolve().parent / "results" / "transition_time.json"


def _plan(gpus: int, cluster_gpus: int, max_response: int) -> Plan:
    workload = with_max_response(workload_preset("ppo"), max_response)
    request = PlanRequest(cluster_preset("h100", cluster_gpus), models_for(workload, None), workload, gpus)
    return make_plan(request).best


def pairs(gpus: int) -> dict[str, tuple[Plan, Plan]]:
    short, long = _plan(gpus, gpus, 1000), _plan(gpus, gpus, 8000)
    smaller = _plan(gpus * 3 // 4, gpus, 8000)
    return {
        "seq-growth": (short, long.model_copy(update={"workload": short.workload})),
        "pool-shrink": (long, smaller),
    }


def measure(plan_a: Plan, plan_b: Plan, runs: int) -> dict[str, object]:
    result = build_transition(plan_a, plan_b)  # the one the table describes (and a warm-up)
    times, cpu_times = [], []
    for _ in range(runs):
        started, cpu_started = time.perf_counter(), time.process_time()
        timed = build_transition(plan_a, plan_b)
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)
        del timed  # freed outside the timed part
    return {
        "median_ms": statistics.median(times) * 1000,
        "median_cpu_ms": statistics.median(cpu_times) * 1000,
        "runs_ms": {"wall": [t * 1000 for t in times], "cpu": [t * 1000 for t in cpu_times]},
        "min_cpu_ms": min(cpu_times) * 1000,
        "checker_violations": len(check_result(result, plan_a, plan_b)) if result.feasible else None,
        "rule": result.priority_rule,
        "primitives": len(result.primitives),
        "kinds": dict(Counter(p.kind for p in result.primitives)),
        "copies": sum(len(p.adds) for p in result.primitives if p.kind == "extend"),
        "feasible": result.feasible,
        "makespan_s": result.makespan_s,
        "bytes_moved": result.bytes_moved,
        "lower_bound_bytes": result.lower_bound_bytes,
    }


def reference_loop_ms() -> float:
    """CPU milliseconds of a fixed pure-Python loop (best of 5): the machine's speed right now."""
    best = float("inf")
    for _ in range(5):
        started = time.process_time()
        sum(range(10**6))
        best = min(best, time.process_time() - started)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="timed repetitions per case (median reported)")
    args = parser.parse_args()
    recording = begin()
    rows = []
    load_before, reference_before = os.getloadavg()[0], reference_loop_ms()
    for gpus in GPU_COUNTS:
        for drift, (plan_a, plan_b) in pairs(gpus).items():
            rows.append({"gpus": gpus, "drift": drift, **measure(plan_a, plan_b, args.runs)})
    header = (
        f"{'GPUs':>5} {'drift':<12} {'wall ms':>9} {'CPU ms':>9} {'min CPU':>8} {'primitives':>10} {'copies':>6} "
        f"{'feasible':>8} {'checker':>7} {'makespan s':>10} {'moved/LB':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = r["bytes_moved"] / r["lower_bound_bytes"] if r["lower_bound_bytes"] else float("nan")  # type: ignore[operator]
        print(
            f"{r['gpus']:>5} {r['drift']:<12} {r['median_ms']:>9.2f} {r['median_cpu_ms']:>9.2f} "
            f"{r['min_cpu_ms']:>8.2f} {r['primitives']:>10} {r['copies']:>6} {r['feasible']!s:>8} "
            f"{r['checker_violations']!s:>7} {r['makespan_s']:>10.2f} {ratio:>8.2f}"
        )
    load = {"before": load_before, "after": os.getloadavg()[0]}
    reference = {"before": reference_before, "after": reference_loop_ms()}
    print(f"1-minute load average: {load['before']:.2f} before, {load['after']:.2f} after ({os.cpu_count()} CPUs)")
    print(f"reference loop, CPU ms: {reference['before']:.1f} before, {reference['after']:.1f} after")
    repetitions = {f"{r['gpus']} {r['drift']}": r.pop("runs_ms") for r in rows}
    payload = {
        "benchmark": "transition_time",
        "runs": args.runs,
        "python": platform.python_version(),
        "load_average_1min": load,
        "reference_loop_ms": reference,
        "cpus": os.cpu_count(),
        "results": rows,
    }
    write_result(RESULTS, payload, recording, {"build_ms": repetitions})
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

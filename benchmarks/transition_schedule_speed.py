"""Benchmark: time of `build_transition` on the seeded random plan pairs of the test suite.

The pairs are tests/solver/test_transition_check.py's `random_pair(random.Random(seed))`
(the seeded sweep's), taken from this script's tree whatever tree's `nereus` is imported. Three commands:

  time     alternate --rounds runs of the sweep over --seeds, one per tree in --trees and
           round (each a fresh interpreter with that tree first on PYTHONPATH, one thread; wall
           and process CPU seconds, the first seed run once untimed); writes the medians and
           every run to benchmarks/results/transition_schedule_speed.json.
  digests  write the test module's `digest` per seed of everything `build_transition` returns
           (DAG, schedule, makespan, bytes, peaks, feasibility, blocking cycle, rule) to --out:
           run once on the old tree, it is what the seeded sweep test compares the new one with
           (tests/solver/transition_sweep_digests.json).
  sweep    (used by `time`) the sweep once in this interpreter; prints its seconds.

    PYTHONPATH=. .venv/bin/python benchmarks/transition_schedule_speed.py time --trees /old /new --seeds 0:40
    PYTHONPATH=/old .venv/bin/python benchmarks/transition_schedule_speed.py digests --seeds 0:200 --out F.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _record import begin, write_result

RESULT = Path(__file__).resolve().parent / "results" / "transition_schedule_speed.json"


def seeds_of(text: str) -> range:
    """'a:b' -> range(a, b)."""
    first, _, last = text.partition(":")
    return range(int(first), int(last))


def _test_module() -> Any:
    """tests/solver/test_transition_check.py of this script's tree (its `random_pair` and
    `digest`), whichever tree's `nereus` is imported."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path[:0] = [str(tests / "solver"), str(tests)]
    import test_transition_check

    return test_transition_check


def sweep(seeds: range) -> dict[int, Any]:
    """`build_transition` on each seed's pair."""
    from nereus.solver.transition import build_transition

    random_pair = _test_module().random_pair
    return {seed: build_transition(*random_pair(random.Random(seed))) for seed in seeds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["time", "digests", "sweep"])
    parser.add_argument("--seeds", default="0:40", help="a:b, the seeds of random_pair (default 0:40)")
    parser.add_argument("--trees", nargs="+", default=[], help="time: source trees to compare (run alternately)")
    parser.add_argument("--rounds", type=int, default=3, help="time: runs per tree (default 3)")
    parser.add_argument("--out", type=Path, help="digests: the JSON file to write")
    args = parser.parse_args()
    seeds = seeds_of(args.seeds)
    if args.command == "sweep":
        sweep(seeds[:1])  # imports and first-call costs out of the timing
        started, cpu = time.perf_counter(), time.process_time()
        sweep(seeds)
        print(f"{time.perf_counter() - started:.3f} {time.process_time() - cpu:.3f}")
        return
    if args.command == "digests":
        if args.out is None:
            parser.error("digests needs --out")
        digest = _test_module().digest
        out = {"seeds": args.seeds, "digests": {str(k): digest(v) for k, v in sweep(seeds).items()}}
        args.out.write_text(json.dumps(out, indent=0) + "\n", encoding="utf-8")
        return
    if not args.trees:
        parser.error("time needs --trees")
    started = begin()
    runs: dict[str, list[float]] = {tree: [] for tree in args.trees}
    cpu: dict[str, list[float]] = {tree: [] for tree in args.trees}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for _ in range(args.rounds):
        for tree in args.trees:  # alternated, so load drifts hit both trees alike
            command = [sys.executable, __file__, "sweep", "--seeds", args.seeds]
            done = subprocess.run(command, env={**env, "PYTHONPATH": tree}, capture_output=True, text=True, check=True)
            wall_s, cpu_s = done.stdout.split()[-2:]
            runs[tree].append(float(wall_s))
            cpu[tree].append(float(cpu_s))
            print(f"{tree}: {wall_s} s wall, {cpu_s} s CPU", flush=True)
    medians = {tree: statistics.median(times) for tree, times in runs.items()}
    cpu_medians = {tree: statistics.median(times) for tree, times in cpu.items()}
    payload = {
        "what": "build_transition over tests/solver/test_transition_check.py random_pair(seed) for the seeds",
        "seeds": args.seeds,
        "trees": {tree: _commit(tree) for tree in args.trees},
        "median_wall_s": medians,
        "median_cpu_s": cpu_medians,
    }
    if len(args.trees) == 2:
        old, new = args.trees
        payload["speedup_wall"] = medians[old] / medians[new]
        payload["speedup_cpu"] = cpu_medians[old] / cpu_medians[new]
    write_result(RESULT, payload, started, repetitions={"sweep_wall_s": runs, "sweep_cpu_s": cpu})
    print(json.dumps(payload, indent=1))


def _commit(tree: str) -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


if __name__ == "__main__":
    main()

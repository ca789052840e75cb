"""Benchmark: the collectives' two transports on 2 ranks of one host, shared memory against gloo.

For every operation of `nereus.runtime.comm.collectives` that has a shared-memory path
(`host_collectives`: all-reduce, all-gather, broadcast, and the object all-gather and
broadcast), that path against `torch.distributed` on the same gloo world, for messages of
4 B to 256 KiB (tensors of that many bytes; objects pickling to about that many): per point,
REPETITIONS timed loops of many calls, each loop's mean per call taken on the slower rank,
their median reported (one loop can catch a descheduled rank), one thread per rank.
`collectives.HOST_PATH_OPS` keeps the host path for the operations it wins. Prints a table and
writes benchmarks/results/collectives.json.

    .venv/bin/python benchmarks/collectives.py [--budget-s 0.2]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _record import begin, write_result

from nereus.runtime.comm import host_collectives
from nereus.runtime.comm.spawn import spawn

RESULTS = Path(__file__).resolve().parent / "results" / "collectives.json"
SIZES = (4, 1024, 32 * 1024, 256 * 1024)
NUM_RANKS = 2
REPETITIONS = 3
OPERATIONS = ("all_reduce", "all_gather", "broadcast", "all_gather_object", "broadcast_object_list")


def calls(size: int) -> dict[str, Callable[[], None]]:
    """Per operation, its host-path call and its gloo call ("<op> host", "<op> gloo")."""
    tensor = torch.ones(max(1, size // 4))
    parts = [torch.empty_like(tensor) for _ in range(NUM_RANKS)]
    payload = b"x" * size
    gathered: list[Any] = [None] * NUM_RANKS
    shared: list[Any] = [payload]
    return {
        "all_reduce host": lambda: host_collectives.all_reduce(tensor),
        "all_reduce gloo": lambda: dist.all_reduce(tensor),
        "all_gather host": lambda: host_collectives.all_gather(parts, tensor),
        "all_gather gloo": lambda: dist.all_gather(parts, tensor),
        "broadcast host": lambda: host_collectives.broadcast(tensor, 0),
        "broadcast gloo": lambda: dist.broadcast(tensor, 0),
        "all_gather_object host": lambda: host_collectives.all_gather_object(gathered, payload),
        "all_gather_object gloo": lambda: dist.all_gather_object(gathered, payload),
        "broadcast_object_list host": lambda: host_collectives.broadcast_object_list(shared, 0),
        "broadcast_object_list gloo": lambda: dist.broadcast_object_list(shared, 0),
    }


def seconds_per_call(call: Callable[[], None], budget_s: float) -> float:
    """Mean over a repeat count both ranks agree on (the larger estimate)."""
    for _ in range(3):
        call()
    started = time.perf_counter()
    call()
    wanted = torch.tensor([max(5.0, budget_s / max(time.perf_counter() - started, 1e-7))])
    dist.all_reduce(wanted, op=dist.ReduceOp.MAX)
    repeats = int(min(wanted.item(), 5000))
    dist.barrier()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats


def _worker(rank: int, world: int, budget_s: float) -> dict[str, dict[int, list[float]]]:
    timings: dict[str, dict[int, list[float]]] = {}
    for size in SIZES:
        for name, call in calls(size).items():
            timings.setdefault(name, {})[size] = [seconds_per_call(call, budget_s) for _ in range(REPETITIONS)]
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=0.2, help="wall seconds per timed loop")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where the JSON results go")
    args = parser.parse_args()
    recording = begin()
    load_before = os.getloadavg()[0]
    per_rank = spawn(_worker, NUM_RANKS, args.budget_s)
    # Per repetition the slower rank's mean, then the median over repetitions.
    by_repetition = {
        name: {size: [max(r[name][size][k] for r in per_rank) for k in range(REPETITIONS)] for size in SIZES}
        for name in per_rank[0]
    }
    slowest = {name: {size: statistics.median(row[size]) for size in SIZES} for name, row in by_repetition.items()}
    print(f"{NUM_RANKS} ranks x 1 thread on one host; load average before {load_before:.2f}")
    print(f"{'operation':>22} {'bytes':>7} {'host':>12} {'gloo':>12}  speed-up")
    faster: dict[str, bool] = {}
    for op in OPERATIONS:
        for size in SIZES:
            host, gloo = slowest[f"{op} host"][size], slowest[f"{op} gloo"][size]
            print(f"{op:>22} {size:>7} {host * 1e6:>9.1f} us {gloo * 1e6:>9.1f} us  {gloo / host:>6.1f}x")
        faster[op] = all(slowest[f"{op} host"][s] < slowest[f"{op} gloo"][s] for s in SIZES)
    print("host path faster at every size:", ", ".join(op for op in OPERATIONS if faster[op]) or "none")
    record: dict[str, Any] = {
        "benchmark": "collectives",
        "num_ranks": NUM_RANKS,
        "threads_per_rank": 1,
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "machine": platform.platform(),
        "torch": torch.__version__,
        "seconds_per_call": {name: {str(size): value for size, value in row.items()} for name, row in slowest.items()},
        "host_path_faster_at_every_size": faster,
    }
    # Each number is one timed loop's mean per call; by rank, then by repetition.
    per_rank_s = {name: {str(s): [r[name][s] for r in per_rank] for s in SIZES} for name in per_rank[0]}
    write_result(args.output, record, recording, {"seconds_per_call_by_rank": per_rank_s})


if __name__ == "__main__":
    main()

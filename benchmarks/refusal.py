"""Benchmark: wall time of `nereus plan`'s refusal (issue 47), against an older checkout.

A refusal searches the request, builds the closest shortfall and finds the smallest GPU counts
that fit. Issue 47 made that last part exact (every count below a fitting whole-node count is
probed, not whole nodes by bisection); this times the whole refusal (`make_plan` raising) on the
issue's requests and a few larger ones, in a worker process per checkout, alternating run by run
so both see the same load, and reports both medians and the median of the paired ratios. It also
records what each checkout said (the smallest count it gave).
Prints a table and writes benchmarks/results/refusal.json.

    git archive 0b167e8 nereus | tar -x -C /tmp/old    # the refusal before issue 47
    .venv/bin/python benchmarks/refusal.py --baseline /tmp/old --runs 7
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from _record import begin, write_result

RESULTS = Path(__file__).resolve().parent / "results" / "refusal.json"
#: (GPUs, model preset, workload preset, --seq-len or 0): the issue's refusals, then larger ones.
CASES = (
    (2, "llama-3.3-70b", "ppo", 0),
    (8, "llama-3.3-70b", "ppo", 0),
    (16, "llama-3.3-70b", "grpo", 0),
    (1, "llama-3.1-8b", "grpo", 0),
    (8, "llama-65b", "ppo", 0),
    (8, "llama-3.3-70b", "ppo", 32768),
    (8, "llama-3.3-70b", "ppo", 131072),
)

#: A worker: reads "gpus model workload seq_len" lines, answers each with the seconds of one
#: refusal (after a warm-up) and the message's last clause.
WORKER = """
import sys, time
from nereus.errors import NereusError
from nereus.solver.plan_search import PlanRequest
from nereus.solver.planner import make_plan
from nereus.spec.presets import cluster_preset, models_for, workload_preset
from nereus.spec.workload import with_max_response
import nereus
print(nereus.__file__, flush=True)

def refuse(request):
    started = time.perf_counter()
    try:
        make_plan(request)
    except NereusError as exc:
        return time.perf_counter() - started, str(exc).split("; the smallest", 1)[-1]
    raise SystemExit(f"a plan fits: {request.num_gpus} GPUs")

requests = {}
for line in sys.stdin:
    gpus, model, algorithm, seq_len = line.split()
    if line not in requests:
        workload = workload_preset(algorithm, actor=model)
        if int(seq_len):
            workload = with_max_response(workload, int(seq_len))
        requests[line] = PlanRequest(cluster_preset("h100", int(gpus)), models_for(workload, None), workload, int(gpus))
        refuse(requests[line])
    seconds, said = refuse(requests[line])
    print(seconds, said.replace(chr(10), " "), flush=True)
"""


class Worker:
    """A refusal timer in its own process, importing nereus from `root`."""

    def __init__(self, root: Path) -> None:
        env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=root
        )
        assert self.process.stdout is not None
        imported = Path(self.process.stdout.readline().strip())
        if root not in imported.parents:
            raise RuntimeError(f"the worker for {root} imported nereus from {imported}")

    def refuse(self, case: tuple[int, str, str, int]) -> tuple[float, str]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(" ".join(map(str, case)) + "\n")
        self.process.stdin.flush()
        seconds, said = self.process.stdout.readline().split(" ", 1)
        return float(seconds) * 1000, said.strip()

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of older code to time beside this")
    parser.add_argument("--runs", type=int, default=7, help="timed refusals per case and checkout (median reported)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    recording = begin()
    root = Path(__file__).resolve().parent.parent
    workers = (Worker(args.baseline.resolve()), Worker(root))
    rows = []
    for case in CASES:
        baseline, current, said = [], [], {}
        for run in range(args.runs):
            for worker in workers[:: 1 if run % 2 == 0 else -1]:
                ms, text = worker.refuse(case)
                (baseline if worker is workers[0] else current).append(ms)
                said["baseline" if worker is workers[0] else "current"] = text
        rows.append(
            {
                "gpus": case[0],
                "model": case[1],
                "workload": case[2],
                "seq_len": case[3] or None,
                "baseline_median_ms": statistics.median(baseline),
                "current_median_ms": statistics.median(current),
                "paired_ratio_median": statistics.median(c / b for b, c in zip(baseline, current, strict=True)),
                "baseline_said": said["baseline"],
                "current_said": said["current"],
                "baseline_ms_runs": baseline,
                "current_ms_runs": current,
            }
        )
    for worker in workers:
        worker.close()
    header = f"{'case':<36} {'baseline ms':>11} {'this ms':>8} {'ratio':>6}  smallest count said (baseline | this)"
    print(header)
    print("-" * len(header))
    for r in rows:
        case = f"{r['model']} {r['workload']} on {r['gpus']}" + (f" seq {r['seq_len']}" if r["seq_len"] else "")
        print(
            f"{case:<36} {r['baseline_median_ms']:>11.0f} {r['current_median_ms']:>8.0f} "
            f"{r['paired_ratio_median']:>6.2f}  {r['baseline_said']} | {r['current_said']}"
        )
    payload = {"benchmark": "refusal", "cluster": "h100", "runs": args.runs, "baseline": str(args.baseline)}
    keys = [f"{r['model']}-{r['workload']}-{r['gpus']}-{r['seq_len']}" for r in rows]
    repetitions = {
        "baseline_ms": {key: r["baseline_ms_runs"] for key, r in zip(keys, rows, strict=True)},
        "current_ms": {key: r["current_ms_runs"] for key, r in zip(keys, rows, strict=True)},
    }
    payload["results"] = rows
    write_result(args.output, payload, recording, repetitions)


if __name__ == "__main__":
    main()

"""Benchmark: `nereus plan` refusing Llama-3.3-70B PPO on 8 H100s, against older checkouts.

The refusal says the smallest GPU count that fits, found by probing every count below a fitting
whole-node one. Once context-parallel ranks shared the training state (dp x cp), proving that 9
GPUs hold no plan took the first-fit search behind `fits` about 1.2M visits (host memory binds
there); `fits` now decides memory pool by pool. This runs the command as a subprocess per checkout
(this tree and each --baseline), alternating the order run by run so all see the same load, and
reports per checkout the median wall seconds, the median CPU seconds (user + system: less
sensitive to the machine's load) and the count it said.
Prints a table and writes benchmarks/results/infeasible_probe.json.

    git archive fd3b521 nereus | tar -x -C /tmp/probe-before     # the first-fit probe
    git archive 7a554eb nereus | tar -x -C /tmp/probe-7a554eb    # before cp ranks shared the state
    .venv/bin/python benchmarks/infeasible_probe.py --baseline /tmp/probe-before --baseline /tmp/probe-7a554eb
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _record import begin, write_result

RESULTS = Path(__file__).resolve().parent / "results" / "infeasible_probe.json"
ARGS = ("plan", "--gpus", "8", "--cluster", "h100", "--model", "llama-3.3-70b", "--workload", "ppo")


def refuse(root: Path) -> tuple[float, float, str]:
    """One `nereus plan` refusal with the package under `root`: (wall s, CPU s, what it said of
    the smallest count)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = _python(root, "-m", "nereus", *ARGS)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    if done.returncode != 1 or "the smallest GPU count that fits is" not in done.stderr:
        raise SystemExit(f"{root}: expected a refusal naming the smallest count, got exit {done.returncode}")
    return wall, cpu, done.stderr.split("; the smallest", 1)[1].strip()


def _python(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """This Python with `argv`, importing nereus from `root` first."""
    env = {"PYTHONPATH": str(root), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return subprocess.run([sys.executable, *argv], env=env, cwd=root, capture_output=True, text=True)


def imported_from(root: Path) -> Path:
    return Path(_python(root, "-c", "import nereus; print(nereus.__file__)").stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, action="append", default=[], help="an older checkout (repeatable)")
    parser.add_argument("--runs", type=int, default=5, help="timed refusals per checkout (median reported)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    recording = begin()
    roots = [Path(__file__).resolve().parent.parent, *(b.resolve() for b in args.baseline)]
    for root in roots:
        if root not in imported_from(root).parents:
            raise SystemExit(f"the package under {root} is not the one Python imports there")
    walls: dict[str, list[float]] = {str(r): [] for r in roots}
    cpus: dict[str, list[float]] = {str(r): [] for r in roots}
    said: dict[str, str] = {}
    for run in range(args.runs):
        for root in roots[run % len(roots) :] + roots[: run % len(roots)]:
            wall, cpu, text = refuse(root)
            walls[str(root)].append(wall)
            cpus[str(root)].append(cpu)
            said[str(root)] = text
    rows = [
        {
            "checkout": "this tree" if root == roots[0] else str(root),
            "median_wall_s": statistics.median(walls[str(root)]),
            "median_cpu_s": statistics.median(cpus[str(root)]),
            "said": said[str(root)],
        }
        for root in roots
    ]
    header = f"{'checkout':<28} {'wall s':>7} {'CPU s':>7}  smallest count said"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['checkout']:<28} {r['median_wall_s']:>7.2f} {r['median_cpu_s']:>7.2f}  {r['said']}")
    payload = {"benchmark": "infeasible_probe", "command": "nereus " + " ".join(ARGS), "runs": args.runs, "rows": rows}
    write_result(args.output, payload, recording, {"wall_s": walls, "cpu_s": cpus})


if __name__ == "__main__":
    main()

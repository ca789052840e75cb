"""Benchmark: the fused actor-critic pipeline schedule against bounds and serial baselines.

Grid (as in RLHFuse's evaluation): actor stages 4/8/16; critic:actor stage ratio 1 and 1/2
(the critic then runs as two replicas); micro-batches per model 1x, 2x, 4x the actor's
stages; model pairs LLaMA-33B/13B and LLaMA-65B/33B (actor/critic). Forward time per stage
is proportional to layers-per-stage x hidden^2, activation to layers-per-stage x hidden,
backward = 2 x forward. Cases with at most --exact-ops ops are also solved with CP-SAT,
which certifies the heuristic optimal when they agree, and CP-SAT then looks for the least
peak activation among schedules as fast as the heuristic's (proved when "optimal").
Each case builds list schedules, improves the best few by forward-backward passes, then
anneals --seeds seeds in parallel processes for what is left of --time-limit seconds (all
seeds together; latency first, then peak memory at no latency cost; under 1.7x the memory
bound wherever a start fits under it, except where the fastest start does and already meets
the lower bound), then gives --window-share of the time to CP-SAT: shortening the fastest
schedule towards the lower bound, the endgame and peak windows at that makespan, and a
second shortening where it is still above the bound; the starts and lower bounds count
within --time-limit, the baselines come on top, and all are included in the reported search
time.
The lower bound is the largest of critical path, node work, average work, arrival + work +
tail and the one-machine bound with rank releases and tails (see nereus/solver/pipeline/bounds.py);
"reached" means makespan <= bound (1e-9 relative). Memory: peak activation per node against
the serial 1F1B first-stage peak ("1F1B", the issue's memory bound: a reference, not a lower
bound at the schedule's makespan) and against the provable lower bound on the peak of every
schedule as fast ("lb@mk", `bounds.memory_bound_at`, with each stage's node work counted).
"windows" is the peak the annealing left: the sequenced starts (interleaved 1F1B with a
few extra warm-up forwards per model, `starts.sequenced_starts`, `SearchPolicy.sequence_share` of the time
limit) are lean and often a fraction of a percent slower. Within --window-share of the time
limit, CP-SAT first shortens the fastest schedule towards the lower bound where it is above
it (`window.shorten`: the ops that start last re-sequenced, their makespan minimised from
the schedule's own times), then re-sequences the last ops of the nearest lean starts to end
by that makespan (`window.meet_makespan`, the leanest winner kept), and the result goes to
the CP-SAT peak windows (`window.lower_peak`); a schedule still above the bound is then
shortened once more from the windows' result.

Targets: the latency lower bound reached in most cases, >= 1.15x faster than serial 1F1B,
peak / memory bound at most 1.3 on average and 1.7 at worst, <= 60 s of search per case on
2 cores. Prints a table, writes benchmarks/results/schedule_fuse.json.

    .venv/bin/python benchmarks/schedule_fuse.py                  # 36 cases, 57 s each
    .venv/bin/python benchmarks/schedule_fuse.py --time-limit 2 --stages 4 8
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from _record import begin, write_result

from nereus.solver.pipeline.exact import solve_exact, solve_memory_at
from nereus.solver.pipeline.model import ModelTimes
from nereus.solver.pipeline.search import FusedResult, SearchConfig, search_fused

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "schedule_fuse.json"
# (layers, hidden) of the LLaMA-1 sizes the paper fuses.
LLAMA = {"13B": (40, 5120), "33B": (60, 6656), "65B": (80, 8192)}
PAIRS = (("33B", "13B"), ("65B", "33B"))
TARGET_SPEEDUP = 1.15
TARGET_SEARCH_S = 60.0
TARGET_MEAN_MEMORY = 1.3
TARGET_MAX_MEMORY = 1.7
#: Search seconds per case (starts, bounds and CP-SAT included), with room for the baselines
#: and the CP-SAT windows' last solve within TARGET_SEARCH_S.
DEFAULT_TIME_LIMIT_S = 57.0


def model_times(name: str, size: str, stages: int, microbatches: int) -> ModelTimes:
    """Stage times in ms-like units: layers/stage x hidden^2 / 1e8; activation in layers/stage x hidden / 1e4."""
    layers, hidden = LLAMA[size]
    per_stage = layers / stages
    forward = per_stage * hidden**2 / 1e8
    return ModelTimes.uniform(name, stages, microbatches, forward, 2 * forward, per_stage * hidden / 1e4)


def capped_case(actor: ModelTimes, critic: ModelTimes, result: FusedResult, cap_s: float) -> dict[str, Any]:
    """The trade under `--act-cap`: the fastest schedule holding at most TARGET_MAX_MEMORY x the
    memory bound (searched only where the fused schedule holds more; else it is that one)."""
    ev, bounds = result.evaluation, result.bounds
    cap = TARGET_MAX_MEMORY * bounds.memory
    search_s = 0.0
    if ev.max_peak_memory > cap * (1 + 1e-9):
        started = time.perf_counter()
        capped = search_fused(actor, critic, SearchConfig(time_limit_s=cap_s, seeds=2), activation_cap=cap)
        ev, search_s = capped.evaluation, time.perf_counter() - started
    return {"cap": cap, "makespan": ev.makespan, "peak_memory": ev.max_peak_memory,
            "makespan_over_bound": ev.makespan / bounds.latency, "search_s": search_s}  # fmt: skip


def run_case(
    pair: tuple[str, str],
    stages: int,
    ratio: float,
    factor: int,
    config: SearchConfig,
    exact_ops: int,
    exact_s: float,
    cap_s: float,
) -> dict[str, Any]:
    critic_stages = int(stages * ratio)
    microbatches = factor * stages
    actor = model_times("actor", pair[0], stages, microbatches)
    critic = model_times("critic", pair[1], critic_stages, microbatches)
    started = time.perf_counter()
    result = search_fused(actor, critic, config)
    wall = time.perf_counter() - started
    ev, bounds = result.evaluation, result.bounds
    serial = result.baselines["serial-1f1b"]
    chimera = result.baselines["serial-chimera"]
    exact: dict[str, Any] | None = None
    exact_memory: dict[str, Any] | None = None
    if result.instance.num_ops <= exact_ops:
        solved = solve_exact(result.instance, exact_s, workers=2, minimise_memory=False)
        exact = {"status": solved.status, "makespan": solved.makespan, "bound": solved.bound, "wall_s": solved.wall_s}
        lean = solve_memory_at(result.instance, result.orders, exact_s, workers=2)
        exact_memory = {"status": lean.status, "peak_memory": lean.peak_memory, "bound": lean.bound,
                        "makespan": lean.makespan, "wall_s": lean.wall_s}  # fmt: skip
    return {
        "pair": f"{pair[0]}/{pair[1]}",
        "actor_stages": stages,
        "critic_stages": critic_stages,
        "microbatches": microbatches,
        "makespan": ev.makespan,
        "lower_bound": bounds.latency,
        "bounds": {
            "critical_path": bounds.critical_path,
            "node_work": bounds.node_work,
            "arrival_work_tail": bounds.arrival_work_tail,
            "one_machine": bounds.one_machine,
        },
        "makespan_over_bound": ev.makespan / bounds.latency,
        "reached_bound": ev.makespan <= bounds.latency * (1 + 1e-9),
        "peak_memory": ev.max_peak_memory,
        "memory_bound": bounds.memory,
        "memory_over_bound": ev.max_peak_memory / bounds.memory,
        # A true lower bound on the peak of every schedule as fast as this one.
        "memory_lower_bound_at_makespan": result.memory_lower_bound,
        # The peak windows: solved, kept, and the peak the annealing left them.
        "windows": {"solved": result.windows[0], "kept": result.windows[1], "peak_before": result.windows[2]},
        # A lean start brought to the makespan by CP-SAT on its last ops won (`search._lean_endgame`).
        "endgame": None if result.endgame is None else {"try": result.endgame[0], "peak_before": result.endgame[1]},
        "memory_over_lower_bound_at_makespan": ev.max_peak_memory / result.memory_lower_bound,
        "greedy_makespan": result.greedy.makespan,
        "serial_1f1b": serial.makespan,
        "serial_1f1b_peak_memory": serial.peak_memory,
        "serial_chimera": chimera.makespan,
        "speedup_vs_serial_1f1b": serial.makespan / ev.makespan,
        "speedup_vs_serial_chimera": chimera.makespan / ev.makespan,
        # No schedule beats the lower bound, so no schedule is faster than this against serial 1F1B.
        "attainable_speedup_vs_serial_1f1b": serial.makespan / bounds.latency,
        "bubble_ratio": ev.bubble_ratio,
        "at_cap": capped_case(actor, critic, result, cap_s),
        # What holding less costs: each lean start's cap, makespan and peak (`starts.lean_starts`).
        "lean": [{"cap": s.cap, "makespan": s.makespan, "peak_memory": s.peak} for s in result.lean],
        "lean_within_1pct_memory_over_bound": _lean_within(result, 1.01) / bounds.memory,
        "search_s": wall,
        "iterations": result.iterations,
        "exact": exact,
        # CP-SAT's least peak among schedules as fast as the heuristic's (its status says if proved).
        "exact_memory": exact_memory,
        # CP-SAT proved no schedule is faster than the heuristic's.
        "certified_optimal": bool(
            exact and exact["status"] == "optimal" and ev.makespan <= exact["makespan"] * (1 + 1e-9)
        ),
    }


def _lean_within(result: FusedResult, slack: float) -> float:
    """The least peak among the fused schedule and the lean starts at most `slack` x its makespan."""
    limit = result.evaluation.makespan * slack
    return min([result.evaluation.max_peak_memory] + [s.peak for s in result.lean if s.makespan <= limit])


def _exact_text(row: dict[str, Any]) -> str:
    """What CP-SAT said: the heuristic proved optimal, or CP-SAT's status, makespan and bound."""
    exact = row["exact"]
    if exact is None:
        return ""
    if row["certified_optimal"]:
        return "heuristic optimal"
    found = "none" if exact["makespan"] is None else f"{exact['makespan']:.1f}"
    return f"{exact['status']} {found}, bound {exact['bound'] or 0:.1f}"


def _exact_memory_text(row: dict[str, Any]) -> str:
    lean = row["exact_memory"]
    if lean is None or lean["peak_memory"] is None:
        return ""
    return f"; mem {lean['status']} {lean['peak_memory']:.1f}"


def _row_text(row: dict[str, Any]) -> str:
    cells = [
        f"{row['pair']:9} {row['actor_stages']:>3} {row['critic_stages']:>3} {row['microbatches']:>3}",
        f"{row['makespan']:>9.1f} {row['lower_bound']:>9.1f} {row['makespan_over_bound']:>7.3f}",
        f"{row['peak_memory']:>7.1f} {row['memory_bound']:>6.1f} {row['memory_over_bound']:>6.2f}",
        f"{row['memory_lower_bound_at_makespan']:>6.1f} {row['memory_over_lower_bound_at_makespan']:>6.2f}",
        f"{row['windows']['peak_before']:>7.1f} {row['lean_within_1pct_memory_over_bound']:>6.2f}",
        f"{row['at_cap']['makespan_over_bound']:>7.3f} {row['speedup_vs_serial_1f1b']:>7.3f}x",
        f"{row['speedup_vs_serial_chimera']:>7.3f}x {row['greedy_makespan']:>9.1f} {row['search_s']:>6.1f}s",
        _exact_text(row) + _exact_memory_text(row),
    ]
    return " ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT_S,
        help=f"search s per case, all phases ({DEFAULT_TIME_LIMIT_S:g})",
    )
    parser.add_argument("--seeds", type=int, default=2, help="parallel annealing seeds (default 2)")
    parser.add_argument(
        "--window-share",
        type=float,
        default=SearchConfig.window_share,
        help=(
            "share of the time limit for CP-SAT: shortening, endgame, peak windows "
            f"(default {SearchConfig.window_share:g})"
        ),
    )
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8, 16], help="actor stage counts")
    parser.add_argument("--exact-ops", type=int, default=300, help="run CP-SAT on cases with at most this many ops")
    parser.add_argument("--exact-time-limit", type=float, default=10.0, help="CP-SAT seconds per solve (two per case)")
    parser.add_argument(
        "--cap-time-limit", type=float, default=6.0, help="annealing s of the search capped at 1.7x the memory bound"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    recording = begin()
    config = SearchConfig(time_limit_s=args.time_limit, seeds=args.seeds, window_share=args.window_share)
    rows = []
    header = f"{'pair':9} {'Sa':>3} {'Sc':>3} {'m':>3} {'fused':>9} {'bound':>9} {'/bound':>7} {'peak':>7} {'1F1B':>6} {'/1F1B':>6} {'lb@mk':>6} {'/lb':>6} {'windows':>7} {'+1%/m':>6} {'@1.7x':>7} {'vs 1F1B':>8} {'vs Chim':>8} {'greedy':>9} {'search':>7} exact"  # noqa: E501
    print(header)
    for pair in PAIRS:
        for stages in args.stages:
            for ratio in (1.0, 0.5):
                for factor in (1, 2, 4):
                    limits = (args.exact_ops, args.exact_time_limit, args.cap_time_limit)
                    row = run_case(pair, stages, ratio, factor, config, *limits)
                    rows.append(row)
                    print(_row_text(row), flush=True)
    reached = sum(r["reached_bound"] for r in rows)
    speedups = [r["speedup_vs_serial_1f1b"] for r in rows]
    lean_ratios = [r["lean_within_1pct_memory_over_bound"] for r in rows]
    capped = [r["at_cap"]["makespan_over_bound"] for r in rows]
    summary = {
        "cases": len(rows),
        "reached_lower_bound": reached,
        "mean_makespan_over_bound": statistics.mean(r["makespan_over_bound"] for r in rows),
        "max_makespan_over_bound": max(r["makespan_over_bound"] for r in rows),
        "mean_memory_over_bound": statistics.mean(r["memory_over_bound"] for r in rows),
        "max_memory_over_bound": max(r["memory_over_bound"] for r in rows),
        "mean_memory_over_lower_bound_at_makespan": statistics.mean(
            r["memory_over_lower_bound_at_makespan"] for r in rows
        ),
        "max_memory_over_lower_bound_at_makespan": max(r["memory_over_lower_bound_at_makespan"] for r in rows),
        "mean_memory_over_bound_before_windows": statistics.mean(
            r["windows"]["peak_before"] / r["memory_bound"] for r in rows
        ),
        "mean_lean_within_1pct_memory_over_bound": statistics.mean(lean_ratios),
        "max_lean_within_1pct_memory_over_bound": max(lean_ratios),
        "mean_makespan_over_bound_at_cap": statistics.mean(capped),
        "max_makespan_over_bound_at_cap": max(capped),
        "reached_lower_bound_at_cap": sum(c <= 1 + 1e-9 for c in capped),
        "min_speedup_vs_serial_1f1b": min(speedups),
        "geomean_speedup_vs_serial_1f1b": statistics.geometric_mean(speedups),
        "cases_at_least_target_speedup": sum(s >= TARGET_SPEEDUP for s in speedups),
        "cases_where_target_speedup_is_attainable": sum(
            r["attainable_speedup_vs_serial_1f1b"] >= TARGET_SPEEDUP for r in rows
        ),
        "geomean_speedup_vs_serial_chimera": statistics.geometric_mean(r["speedup_vs_serial_chimera"] for r in rows),
        "max_search_s": max(r["search_s"] for r in rows),
        "memory_lower_bound_reached": sum(
            r["peak_memory"] <= r["memory_lower_bound_at_makespan"] * (1 + 1e-9) for r in rows
        ),
        "cases_with_exact": sum(r["exact"] is not None for r in rows),
        "exact_memory_optimal": sum(bool(r["exact_memory"] and r["exact_memory"]["status"] == "optimal") for r in rows),
        "heuristic_peak_equals_exact_memory": sum(
            bool(
                r["exact_memory"]
                and r["exact_memory"]["peak_memory"] is not None
                and r["peak_memory"] <= r["exact_memory"]["peak_memory"] * (1 + 1e-9)
            )
            for r in rows
        ),
        "certified_optimal": sum(r["certified_optimal"] for r in rows),
        "lean_endgame_won": sum(r["endgame"] is not None for r in rows),
        "targets": {
            "speedup_vs_serial_1f1b": TARGET_SPEEDUP,
            "search_s": TARGET_SEARCH_S,
            "mean_memory_over_bound": TARGET_MEAN_MEMORY,
            "max_memory_over_bound": TARGET_MAX_MEMORY,
        },
    }
    print(
        f"\nlower bound reached in {reached}/{len(rows)} cases (mean makespan/bound "
        f"{summary['mean_makespan_over_bound']:.3f}, worst {summary['max_makespan_over_bound']:.3f}); "
        f"speedup vs serial 1F1B: geomean {summary['geomean_speedup_vs_serial_1f1b']:.3f}x, min "
        f"{summary['min_speedup_vs_serial_1f1b']:.3f}x, >= {TARGET_SPEEDUP}x in "
        f"{summary['cases_at_least_target_speedup']}/{len(rows)} (the bound allows it in "
        f"{summary['cases_where_target_speedup_is_attainable']}); vs serial Chimera-style geomean "
        f"{summary['geomean_speedup_vs_serial_chimera']:.3f}x; peak memory / bound mean "
        f"{summary['mean_memory_over_bound']:.2f} (worst {summary['max_memory_over_bound']:.2f}; before the "
        f"windows mean {summary['mean_memory_over_bound_before_windows']:.2f}), over the lower bound at the "
        f"makespan mean {summary['mean_memory_over_lower_bound_at_makespan']:.2f} "
        f"(worst {summary['max_memory_over_lower_bound_at_makespan']:.2f}); "
        f"within 1% of the makespan (lean starts) mean {summary['mean_lean_within_1pct_memory_over_bound']:.2f} "
        f"(worst {summary['max_lean_within_1pct_memory_over_bound']:.2f}); "
        f"capped at {TARGET_MAX_MEMORY}x the memory bound: makespan/bound mean "
        f"{summary['mean_makespan_over_bound_at_cap']:.4f}, worst {summary['max_makespan_over_bound_at_cap']:.4f}, "
        f"bound reached in {summary['reached_lower_bound_at_cap']}; "
        f"search at most {summary['max_search_s']:.1f} s; CP-SAT certifies "
        f"the heuristic optimal in {summary['certified_optimal']}/{summary['cases_with_exact']} cases it solved; "
        f"CP-SAT's least peak at the heuristic's makespan: proved in {summary['exact_memory_optimal']}, "
        f"the heuristic's peak no higher in "
        f"{summary['heuristic_peak_equals_exact_memory']}/{summary['cases_with_exact']}"
    )
    payload = {
        "benchmark": "schedule_fuse",
        "config": {
            "time_limit_s": args.time_limit,
            "seeds": args.seeds,
            "stages": args.stages,
            "window_share": args.window_share,
        },
        # Other work on the machine slows the time-limited search: the load averages say how busy it was.
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_average": os.getloadavg()},
        "summary": summary,
        "cases": rows,
    }
    # One time-limited search per case (in case order); its time is the raw number.
    write_result(args.out, payload, recording, {"search_s": [r["search_s"] for r in rows]})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

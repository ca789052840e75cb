"""Benchmark: how far the transition list scheduler is from the optimal makespan.

Seeded random small transitions (random relayouts of examples/plan-tiny-ppo-4rank.yaml,
and random pairs of plans on a 2 x 4 GPU cluster), some with GPU memory shrunk until it
binds. For each: time `build_transition` (the heuristic; median of --runs), solve the same
DAG with CP-SAT (`solve_cpsat`, --time-limit s, 1 worker) and report the heuristic's gap
to the CP-SAT optimum (instances proved optimal) or to CP-SAT's lower bound (the rest).
Memory-tight instances use a capacity between the least at which CP-SAT finds any
schedule (bisected to 256 bytes) and the heuristic's peak with ample memory.
Prints a table and writes benchmarks/results/transition_gap.json.

    .venv/bin/python benchmarks/transition_gap.py                # 60 instances, 5 s each
    .venv/bin/python benchmarks/transition_gap.py --instances 10 --time-limit 2
    .venv/bin/python benchmarks/transition_gap.py --show 16     # one instance, both schedules
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

from _record import begin, write_result

from nereus.cost.calibration import Calibration
from nereus.solver.transition import TransitionResult, build_transition
from nereus.solver.transition.exact import solve_cpsat
from nereus.spec.io import load_document
from nereus.spec.plan import Plan, Pool, StagePlan

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "transition_gap.json"
TINY = ROOT / "examples" / "plan-tiny-ppo-4rank.yaml"
TARGET_GAP_PCT = 5.0
FAMILIES = ("tiny", "2x4", "2x4-many")  # instance `seed` is of family FAMILIES[seed % 3]


def layouts(gpus: int) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) with tp * pp * dp == gpus."""
    return [
        (tp, pp, gpus // (tp * pp)) for tp in range(1, gpus + 1) for pp in range(1, gpus + 1) if gpus % (tp * pp) == 0
    ]


def random_stage(rng: random.Random, entry: StagePlan, gpus: list[int], pool: str) -> StagePlan:
    """`entry` on a random layout over a random order of `gpus`."""
    tp, pp, dp = rng.choice(layouts(len(gpus)))
    order = rng.sample(gpus, len(gpus))
    emus = [order[i * tp * pp : (i + 1) * tp * pp] for i in range(dp)]
    return StagePlan(
        model_stage=entry.model_stage, pool=pool, tp=tp, pp=pp, dp=dp, emus=emus, micro_batches=entry.micro_batches
    )


def with_stages(plan: Plan, stages: list[StagePlan], **update: Any) -> Plan:
    return plan.model_copy(update={"stages": stages, "predictions": None, **update})


def tiny_relayout(rng: random.Random, base: Plan) -> tuple[Plan, Plan]:
    """A: the example, or it with one model-stage relaid out; B: 1-3 model-stages relaid out."""
    gpus = [0, 1, 2, 3]

    def relayout(plan: Plan, count: int) -> Plan:
        chosen = set(rng.sample([e.model_stage for e in plan.stages], count))
        stages = [random_stage(rng, e, gpus, e.pool) if e.model_stage in chosen else e for e in plan.stages]
        return with_stages(plan, stages)

    plan_a = relayout(base, 1) if rng.random() < 0.5 else base
    return plan_a, relayout(plan_a, rng.randint(1, 3))


def random_pair(rng: random.Random, base: Plan, changes: tuple[int, int] = (2, 3)) -> tuple[Plan, Plan]:
    """Two random plans on 2 nodes x 4 GPUs; B re-places `changes` (a range) model-stages of A."""
    cluster = base.cluster.model_copy(update={"name": "cpu-2x4", "num_nodes": 2})
    gpus = list(range(8))
    pools = [Pool(name="all", gpus=gpus)]

    def placed(entry: StagePlan) -> StagePlan:
        size = rng.choice([2, 4, 4, 8])
        return random_stage(rng, entry, sorted(rng.sample(gpus, size)), "all")

    stages_a = [placed(e) for e in base.stages]
    plan_a = with_stages(base, stages_a, cluster=cluster, pools=pools)
    chosen = set(rng.sample([e.model_stage for e in stages_a], rng.randint(*changes)))
    plan_b = with_stages(plan_a, [placed(e) if e.model_stage in chosen else e for e in stages_a])
    return plan_a, plan_b


def shrink_memory(plan_a: Plan, plan_b: Plan, capacity: float, calibration: Calibration) -> tuple[Plan, Plan]:
    """Both plans on GPUs whose usable memory is about `capacity` bytes."""
    usable = 1 - calibration.memory_headroom - calibration.workspace_fraction
    gpu = plan_a.cluster.gpu.model_copy(update={"memory_bytes": max(1, math.ceil(capacity / usable))})
    cluster = plan_a.cluster.model_copy(update={"gpu": gpu})
    return plan_a.model_copy(update={"cluster": cluster}), plan_b.model_copy(update={"cluster": cluster})


def least_capacity(result: TransitionResult, low: float, high: float) -> float:
    """Least capacity (to 256 bytes) at which CP-SAT finds any schedule, between `low` and `high` bytes."""
    lo, hi = math.floor(low), math.ceil(high) + 1  # lo: no schedule assumed, hi: one exists
    while hi - lo > 256:
        mid = (lo + hi) // 2
        found = solve_cpsat(result.primitives, result.initial_bytes, mid, 2.0, hint=False)
        if found.status in ("optimal", "feasible"):
            hi = mid
        else:  # infeasible, or unknown within the limit (counted as too tight)
            lo = mid
    return float(hi)


def timed_heuristic(
    plan_a: Plan, plan_b: Plan, calibration: Calibration, runs: int
) -> tuple[TransitionResult, list[float]]:
    times, result = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        result = build_transition(plan_a, plan_b, calibration)
        times.append(time.perf_counter() - t0)
    assert result is not None
    return result, times


def instance(seed: int, base: Plan, calibration: Calibration) -> tuple[str, Plan, Plan, float | None]:
    """(family, plan A, plan B, memory fraction or None) of instance `seed`, with primitives."""
    rng = random.Random(seed)
    family = FAMILIES[seed % len(FAMILIES)]
    for _ in range(100):
        if family == "tiny":
            plan_a, plan_b = tiny_relayout(rng, base)
        else:
            plan_a, plan_b = random_pair(rng, base, (2, 3) if family == "2x4" else (4, 7))
        if build_transition(plan_a, plan_b, calibration).primitives:
            break
    tight = rng.random() < 0.4
    if not tight:
        return family, plan_a, plan_b, None
    ample = build_transition(plan_a, plan_b, calibration)
    held = max(ample.initial_bytes.values())
    peak = max((ample.initial_bytes.get(g, 0.0) + x for g, x in ample.peak_extra_bytes.items()), default=held)
    if peak <= held:  # nothing allocates: memory cannot bind
        return family, plan_a, plan_b, None
    least = least_capacity(ample, held, peak)
    fraction = rng.choice([0.0, 0.1, 0.25, 0.5])
    plan_a, plan_b = shrink_memory(plan_a, plan_b, least + 512 + fraction * max(0.0, peak - least), calibration)
    return family, plan_a, plan_b, fraction


def measure(seed: int, base: Plan, calibration: Calibration, time_limit: float, runs: int) -> dict[str, Any]:
    family, plan_a, plan_b, fraction = instance(seed, base, calibration)
    heuristic, heuristic_runs = timed_heuristic(plan_a, plan_b, calibration, runs)
    heuristic_s = statistics.median(heuristic_runs)
    exact = solve_cpsat(
        heuristic.primitives,
        heuristic.initial_bytes,
        heuristic.capacity_bytes,
        time_limit,
        workers=1,
        schedule=heuristic.schedule,
    )
    h = heuristic.makespan_s if heuristic.feasible else None
    gap = bound_gap = None
    if h is not None and exact.status == "optimal" and exact.makespan_s:
        gap = 100.0 * (h - exact.makespan_s) / exact.makespan_s
    if h is not None and exact.bound_s:
        bound_gap = 100.0 * (h - exact.bound_s) / exact.bound_s
    return {
        "seed": seed,
        "family": family,
        "memory_fraction": fraction,
        "capacity_bytes": heuristic.capacity_bytes,
        "primitives": len(heuristic.primitives),
        "gpus": len({g for p in heuristic.primitives for g in p.gpus}),
        "heuristic_feasible": heuristic.feasible,
        "heuristic_makespan_s": h,
        "heuristic_s": heuristic_s,
        "heuristic_runs_s": heuristic_runs,
        "cpsat_status": exact.status,
        "cpsat_makespan_s": exact.makespan_s,
        "cpsat_bound_s": exact.bound_s,
        "cpsat_wall_s": exact.wall_s,
        "gap_pct": gap,
        "gap_to_bound_pct": bound_gap,
        "stages_changed": sorted(
            a.model_stage for a, b in zip(plan_a.stages, plan_b.stages, strict=True) if a.emus != b.emus
        ),
    }


def show(seed: int, base: Plan, calibration: Calibration, time_limit: float) -> None:
    """Print one instance: what changes, and each primitive under the heuristic and CP-SAT."""
    family, plan_a, plan_b, fraction = instance(seed, base, calibration)
    print(f"seed {seed}: family {family}, memory fraction {fraction}")
    for a, b in zip(plan_a.stages, plan_b.stages, strict=True):
        if (a.tp, a.pp, a.emus) != (b.tp, b.pp, b.emus):
            print(f"  {a.model_stage}: tp{a.tp} pp{a.pp} {a.emus} -> tp{b.tp} pp{b.pp} {b.emus}")
    result = build_transition(plan_a, plan_b, calibration)
    exact = solve_cpsat(
        result.primitives, result.initial_bytes, result.capacity_bytes, time_limit, schedule=result.schedule
    )
    print(f"heuristic {result.makespan_s * 1e3:.3f} ms {result.blocking_cycle or ''}")
    print(f"cp-sat {exact.status} {fmt(exact.makespan_s, 1e3, 3)} ms, capacity {result.capacity_bytes:.0f} B")
    times = result.schedule
    for p in sorted(result.primitives, key=lambda p: (times.start_s(p), p.id)):
        cp = exact.starts.get(p.id)
        print(
            f"  {p.id:3} {p.kind:8} {p.model_stage:20} gpus {p.gpus!s:16} deps {p.deps!s:12} "
            f"{p.duration_s * 1e3:7.3f} ms  heuristic @ {times.start_s(p) * 1e3:8.3f}  cp-sat @ {fmt(cp, 1e3, 3):>8}"
        )


def fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=60)
    parser.add_argument("--time-limit", type=float, default=5.0, help="CP-SAT seconds per instance")
    parser.add_argument("--runs", type=int, default=5, help="heuristic timings per instance (median)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--show", type=int, metavar="SEED", help="print one instance's two schedules and exit")
    args = parser.parse_args()
    recording = begin()
    calibration = Calibration()
    base = load_document(TINY)
    assert isinstance(base, Plan)
    if args.show is not None:
        show(args.show, base, calibration, args.time_limit)
        return
    rows = []
    header = (
        f"{'seed':>4} {'family':>8} {'mem':>5} {'prims':>5} {'heur ms':>9} {'cpsat ms':>9} {'bound ms':>9} "
        f"{'status':>10} {'gap %':>7} {'h time ms':>9} {'cp s':>6}"
    )
    print(header)
    for seed in range(args.first_seed, args.first_seed + args.instances):
        row = measure(seed, base, calibration, args.time_limit, args.runs)
        rows.append(row)
        gap = row["gap_pct"] if row["gap_pct"] is not None else row["gap_to_bound_pct"]
        mark = "" if row["gap_pct"] is not None else ("<=" if gap is not None else "")
        print(
            f"{seed:>4} {row['family']:>8} {fmt(row['memory_fraction']):>5} {row['primitives']:>5} "
            f"{fmt(row['heuristic_makespan_s'], 1e3, 3):>9} {fmt(row['cpsat_makespan_s'], 1e3, 3):>9} "
            f"{fmt(row['cpsat_bound_s'], 1e3, 3):>9} {row['cpsat_status']:>10} {mark + fmt(gap):>7} "
            f"{fmt(row['heuristic_s'], 1e3, 3):>9} {fmt(row['cpsat_wall_s']):>6}",
            flush=True,
        )
    optimal = [r for r in rows if r["gap_pct"] is not None]
    gaps = [r["gap_pct"] for r in optimal]
    summary = {
        "instances": len(rows),
        "proved_optimal": len(optimal),
        "cpsat_status_counts": {
            s: sum(r["cpsat_status"] == s for r in rows) for s in sorted({r["cpsat_status"] for r in rows})
        },
        "heuristic_blocked": sum(not r["heuristic_feasible"] for r in rows),
        "heuristic_blocked_but_cpsat_feasible": [
            r["seed"] for r in rows if not r["heuristic_feasible"] and r["cpsat_status"] in ("optimal", "feasible")
        ],
        "max_gap_pct": max(gaps, default=None),
        "mean_gap_pct": statistics.fmean(gaps) if gaps else None,
        "median_gap_pct": statistics.median(gaps) if gaps else None,
        "heuristic_optimal_count": sum(g <= 1e-3 for g in gaps),
        "target_gap_pct": TARGET_GAP_PCT,
        "above_target": [
            {"seed": r["seed"], "gap_pct": r["gap_pct"]} for r in optimal if r["gap_pct"] > TARGET_GAP_PCT
        ],
        "worst_gap_to_bound_pct_not_proved": max(
            (r["gap_to_bound_pct"] for r in rows if r["gap_pct"] is None and r["gap_to_bound_pct"] is not None),
            default=None,
        ),
        "heuristic_s_max": max(r["heuristic_s"] for r in rows),
        "heuristic_s_median": statistics.median(r["heuristic_s"] for r in rows),
        "cpsat_wall_s_max": max(r["cpsat_wall_s"] for r in rows),
        "cpsat_wall_s_median": statistics.median(r["cpsat_wall_s"] for r in rows),
    }
    print()
    print(
        f"{summary['proved_optimal']}/{len(rows)} proved optimal; gap over those: "
        f"max {fmt(summary['max_gap_pct'])} %, mean {fmt(summary['mean_gap_pct'])} %, "
        f"heuristic optimal on {summary['heuristic_optimal_count']}; target <= {TARGET_GAP_PCT} %: "
        f"{len(summary['above_target'])} above ({[a['seed'] for a in summary['above_target']]})"
    )
    print(
        f"heuristic blocked (no safe order found) on {summary['heuristic_blocked']}, of which CP-SAT found a schedule "
        f"for {summary['heuristic_blocked_but_cpsat_feasible']}"
    )
    print(
        f"heuristic build_transition median {summary['heuristic_s_median'] * 1e3:.2f} ms "
        f"(max {summary['heuristic_s_max'] * 1e3:.2f} ms); CP-SAT median {summary['cpsat_wall_s_median']:.2f} s"
    )
    payload = {
        "benchmark": "transition_gap",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "time_limit_s": args.time_limit,
        "workers": 1,
        "summary": summary,
        "rows": rows,
    }
    runs = {str(r["seed"]): r.pop("heuristic_runs_s") for r in rows}
    write_result(args.out, payload, recording, {"heuristic_s": runs})
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()

"""Benchmark: does ordering the local DAGs globally keep memory safe on shared GPUs?

For --pairs seeded random plan pairs (PPO's seven model-stages sharing one pool of
4-16 GPUs on 1-2 nodes, tiny models, random layouts and random disjoint EMU GPU sets),
it runs
  global    build_transition: every local DAG scheduled together, memory aware;
  baseline  each model-stage's local DAG scheduled alone with unlimited memory, all
            started together at t=0 ("local DAGs executed independently"),
and replays both with the independent checker (nereus.solver.transition.check) at the
real capacity. A pair succeeds when it is scheduled and the checker finds no violation.

Usable memory per GPU (--capacity-mode):
  witness  f x the peak of a witness schedule, f drawn from --capacity (default 1.0-1.25):
           the changed model-stages one after another in a random order, each local DAG
           one primitive at a time in id order. The witness fits, so every pair has a safe
           order and the global DAG must schedule all of them.
  busiest  f x the busiest GPU of either plan (default 1.2-1.6): some pairs then have no
           safe order of these primitives at all; build_transition's exhaustive order
           search tells those ("infeasible") from ones it gave up on ("undecided").
Prints a table and writes benchmarks/results/transition_coordination[-busiest].json.

    .venv/bin/python benchmarks/transition_coordination.py [--pairs 1000] [--capacity-mode busiest] [--workers 4]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from _record import begin, write_result

from nereus.cost.calibration import Calibration
from nereus.cost.plan_cost import replica_state_bytes
from nereus.solver.transition import Primitive, Schedule, build_transition, local_dag, plan_emus, priced
from nereus.solver.transition.check import check_result, check_transition
from nereus.solver.transition.schedule import Replay, held_bytes, list_schedule, primitive_duration
from nereus.spec.check import kv_heads_rule
from nereus.spec.io import load_document
from nereus.spec.model import Model
from nereus.spec.plan import Plan, Pool
from nereus.spec.presets import MODELS

ROOT = Path(__file__).resolve().parent
RESULTS = {
    "witness": ROOT / "results" / "transition_coordination.json",
    "busiest": ROOT / "results" / "transition_coordination-busiest.json",
}
DEFAULT_FACTORS = {"witness": (1.0, 1.25), "busiest": (1.2, 1.6)}
CALIBRATION = Calibration()
MODEL_CHOICES = (
    MODELS["tiny"],
    MODELS["tiny-wide"],
    Model(
        name="six", num_layers=6, hidden_dim=96, num_heads=6, num_kv_heads=2, head_dim=16, ffn_dim=256, vocab_size=64
    ),
    Model(
        name="odd", num_layers=3, hidden_dim=96, num_heads=12, num_kv_heads=4, head_dim=8, ffn_dim=200, vocab_size=80
    ),
)


def _base() -> Plan:
    plan = load_document(ROOT.parent / "examples" / "plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan, Plan)
    return plan


def random_setting(rng: random.Random, base: Plan) -> Plan:
    """The example PPO plan on 1-2 nodes of 4 or 8 GPUs, one pool of all GPUs, random models per role."""
    nodes, per_node = rng.choice((1, 2)), rng.choice((4, 8))
    models = {role: rng.choice(MODEL_CHOICES) for role in ("actor", "critic", "reference", "reward")}
    cluster = base.cluster.model_copy(update={"num_nodes": nodes, "gpus_per_node": per_node})
    workload = base.workload.model_copy(update={role: m.name for role, m in models.items()})
    return base.model_copy(
        update={
            "cluster": cluster,
            "models": list({m.name: m for m in models.values()}.values()),
            "workload": workload,
            "pools": [Pool(name="all", gpus=list(range(nodes * per_node)))],
        }
    )


def random_stages(rng: random.Random, setting: Plan) -> Plan:
    """A random valid layout and random disjoint GPU sets for every model-stage."""
    gpus = setting.pools[0].gpus
    stages = []
    for entry in setting.stages:
        model = setting.model(setting.workload.model_name(entry.role))
        layouts = [
            (tp, pp)
            for tp in range(1, len(gpus) + 1)
            for pp in range(1, len(gpus) // tp + 1)
            if kv_heads_rule(model, tp) is None and model.num_layers % pp == 0
        ]
        tp, pp = rng.choice(layouts)
        dp = rng.randint(1, len(gpus) // (tp * pp))
        chosen = rng.sample(gpus, dp * tp * pp)
        emus = [chosen[i : i + tp * pp] for i in range(0, len(chosen), tp * pp)]
        stages.append(entry.model_copy(update={"tp": tp, "pp": pp, "dp": dp, "emus": emus}))
    return setting.model_copy(update={"stages": stages, "predictions": None})


def with_capacity(plan: Plan, capacity: float) -> Plan:
    """The plan on GPUs whose usable memory (after headroom and workspace) is about `capacity` bytes."""
    usable = 1 - CALIBRATION.memory_headroom - CALIBRATION.workspace_fraction
    gpu = plan.cluster.gpu.model_copy(update={"memory_bytes": math.ceil(capacity / usable)})
    return plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"gpu": gpu})})


def sizes_of(plan: Plan) -> dict[str, float]:
    return {e.model_stage: replica_state_bytes(plan, e.model_stage, CALIBRATION) for e in plan.stages}


def witness_peak(rng: random.Random, plan_a: Plan, plan_b: Plan) -> float:
    """The most bytes any GPU holds when the changed model-stages run one after another
    (in a random order), each local DAG one primitive at a time in id order."""
    emus_a, emus_b, sizes = plan_emus(plan_a), plan_emus(plan_b), sizes_of(plan_b)
    usage = held_bytes(plan_a, sizes)
    peak = max(usage.values())
    changed = [name for name in emus_b if set(emus_a[name]) != set(emus_b[name])]
    rng.shuffle(changed)
    for name in changed:
        for primitive in local_dag(name, sizes[name], emus_a[name], emus_b[name]):  # ids are topological
            for gpu, nbytes in primitive.alloc.items():
                usage[gpu] = usage.get(gpu, 0.0) + nbytes
                peak = max(peak, usage[gpu])
            for gpu, nbytes in primitive.free.items():
                usage[gpu] -= nbytes
    return peak


def random_pair(rng: random.Random, base: Plan, factors: tuple[float, float], mode: str) -> tuple[Plan, Plan, float]:
    setting = random_setting(rng, base)
    plan_a, plan_b = random_stages(rng, setting), random_stages(rng, setting)
    if mode == "witness":
        reference = witness_peak(rng, plan_a, plan_b)
    else:
        reference = max(max(held_bytes(p, sizes_of(p)).values()) for p in (plan_a, plan_b))
    factor = rng.uniform(*factors)
    return with_capacity(plan_a, factor * reference), with_capacity(plan_b, factor * reference), factor


def independent_local_dags(plan_a: Plan, plan_b: Plan, initial: dict[int, float]) -> tuple[list[Primitive], Schedule]:
    """Each changed model-stage's local DAG, scheduled alone with unlimited memory, all from t=0."""
    emus_a, emus_b, sizes = plan_emus(plan_a), plan_emus(plan_b), sizes_of(plan_b)
    out: list[Primitive] = []
    times = Schedule()
    for name in emus_b:
        if set(emus_a[name]) == set(emus_b[name]):
            continue
        dag = local_dag(name, sizes[name], emus_a[name], emus_b[name], next_id=len(out))
        dag = priced(dag, [primitive_duration(primitive, plan_b.cluster, CALIBRATION) for primitive in dag])
        replay = Replay(dict(initial), math.inf)
        assert list_schedule(dag, replay) == []
        alone = replay.schedule()
        times.start.update(alone.start)
        times.end.update(alone.end)
        times.ownership.update(alone.ownership)
        out += dag
    return out, times


def category(violation: str) -> str:
    if "capacity" in violation or "frees more" in violation:
        return "memory"
    if " runs primitive " in violation:
        return "gpu_overlap"
    if "replica" in violation:
        return "replica"
    return "dependency"


@dataclass
class Outcome:
    """What happened to one plan pair."""

    seed: int
    gpus: int
    capacity_factor: float
    primitives: int
    global_feasible: bool
    global_violations: list[str]
    global_blocking_cycle: list[str]
    global_makespan_s: float
    baseline_violations: dict[str, int]  # violation kind -> count
    baseline_makespan_s: float
    global_rule: str  # how build_transition found its schedule
    blocked_verdict: str | None  # blocked pairs: "infeasible" (proved) or "undecided"

    @property
    def global_ok(self) -> bool:
        return self.global_feasible and not self.global_violations

    @property
    def baseline_ok(self) -> bool:
        return not self.baseline_violations


def run_pair(seed: int, base: Plan, factors: tuple[float, float], mode: str) -> Outcome:
    plan_a, plan_b, factor = random_pair(random.Random(seed), base, factors, mode)
    result = build_transition(plan_a, plan_b, CALIBRATION)
    baseline, baseline_times = independent_local_dags(plan_a, plan_b, result.initial_bytes)
    emus_a, emus_b = plan_emus(plan_a), plan_emus(plan_b)
    base_violations = check_transition(
        baseline, baseline_times, emus_a, emus_b, result.initial_bytes, result.capacity_bytes
    )
    global_violations = check_result(result, plan_a, plan_b) if result.feasible else []
    verdict = None
    if not result.feasible:
        verdict = "infeasible" if "exhaustive search" in result.blocking_cycle[-1] else "undecided"
    return Outcome(
        seed=seed,
        gpus=plan_a.cluster.num_gpus,
        capacity_factor=round(factor, 4),
        primitives=len(result.primitives),
        global_feasible=result.feasible,
        global_violations=global_violations,
        global_blocking_cycle=result.blocking_cycle,
        global_makespan_s=result.makespan_s,
        baseline_violations=dict(Counter(category(v) for v in base_violations)),
        baseline_makespan_s=max((baseline_times.end_s(p) for p in baseline), default=0.0),
        global_rule=result.priority_rule,
        blocked_verdict=verdict,
    )


def _method(rule: str) -> str:
    """Which stage of build_transition's search gave the schedule."""
    if rule.startswith("local search"):
        return "local search"
    if rule.startswith("serial: "):
        return "serial generator"
    if rule.startswith("pilot: "):
        return "pilot method"
    if rule.startswith(("one-model-stage", "order search")):
        return rule.split(":")[0]
    return "list scheduler"


def summarize(rows: list[Outcome]) -> dict[str, object]:
    feasible = [r for r in rows if r.global_feasible]
    blocked = [r for r in rows if not r.global_feasible]
    kinds: Counter[str] = Counter(kind for r in rows for kind in r.baseline_violations)
    ratios = [r.global_makespan_s / r.baseline_makespan_s for r in rows if r.global_ok and r.baseline_makespan_s > 0]
    return {
        "pairs": len(rows),
        "global_scheduled": len(feasible),
        "global_success": sum(r.global_ok for r in rows),
        "global_scheduled_but_violating": sum(not r.global_ok for r in feasible),
        "global_blocked": len(blocked),
        "baseline_success": sum(r.baseline_ok for r in rows),
        "baseline_memory_safe": sum("memory" not in r.baseline_violations for r in rows),
        "baseline_memory_safe_where_global_scheduled": sum("memory" not in r.baseline_violations for r in feasible),
        "baseline_memory_safe_where_global_blocked": sum("memory" not in r.baseline_violations for r in blocked),
        "baseline_failing_pairs_by_kind": dict(kinds),
        "blocked_no_order_exists": sum(r.blocked_verdict == "infeasible" for r in rows),
        "blocked_undecided": sum(r.blocked_verdict == "undecided" for r in rows),
        "scheduled_by": dict(Counter(_method(r.global_rule) for r in feasible)),
        "median_makespan_global_over_longest_local": round(statistics.median(ratios), 3) if ratios else None,
    }


ROWS = (
    ("global DAG: scheduled (no blocking cycle)", "global_scheduled"),
    ("global DAG: success (scheduled, 0 violations)", "global_success"),
    ("global DAG: scheduled but violating", "global_scheduled_but_violating"),
    ("global DAG: blocked (blocking cycle)", "global_blocked"),
    ("independent local DAGs: success (0 violations)", "baseline_success"),
    ("independent local DAGs: memory-safe", "baseline_memory_safe"),
    ("  ... memory-safe where global is scheduled", "baseline_memory_safe_where_global_scheduled"),
    ("  ... memory-safe where global is blocked", "baseline_memory_safe_where_global_blocked"),
    ("blocked: no order of the DAG's primitives fits", "blocked_no_order_exists"),
    ("blocked: search undecided (budget)", "blocked_undecided"),
)


def print_table(summary: dict[str, object]) -> None:
    n = summary["pairs"]
    assert isinstance(n, int)
    print(f"{'':<48} {'pairs':>20}")
    print("-" * 69)
    for label, key in ROWS:
        k = summary[key]
        assert isinstance(k, int)
        print(f"{label:<48} {k:>6} / {n} ({100 * k / n:5.1f}%)")
    print(f"global DAG schedules found by: {summary['scheduled_by']}")
    print(f"independent local DAGs, failing pairs by violation kind: {summary['baseline_failing_pairs_by_kind']}")
    ratio = summary["median_makespan_global_over_longest_local"]
    print(f"median makespan, global DAG / longest local DAG run alone (global successes): {ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1000, help="random plan pairs (seeds seed..seed+pairs-1)")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument(
        "--capacity-mode", choices=("witness", "busiest"), default="witness", help="what the capacity scales"
    )
    parser.add_argument(
        "--capacity",
        type=float,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="range of the capacity factor (default 1.0-1.25 for witness, 1.2-1.6 for busiest)",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="processes running pairs side by side (the results do not depend on it)"
    )
    args = parser.parse_args()
    recording = begin()
    base = _base()
    started = time.perf_counter()
    factors = tuple(args.capacity) if args.capacity else DEFAULT_FACTORS[args.capacity_mode]
    seeds = range(args.seed, args.seed + args.pairs)
    if args.workers > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.workers) as pool:
            jobs = [pool.submit(run_pair, seed, base, factors, args.capacity_mode) for seed in seeds]
            rows = [job.result() for job in jobs]
    else:
        rows = [run_pair(seed, base, factors, args.capacity_mode) for seed in seeds]
    elapsed = time.perf_counter() - started
    summary = summarize(rows)
    print_table(summary)
    print(f"{args.pairs} pairs in {elapsed:.1f} s")
    results = RESULTS[args.capacity_mode]
    payload = {
        "benchmark": "transition_coordination",
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "settings": {
            "pairs": args.pairs,
            "seed": args.seed,
            "capacity_mode": args.capacity_mode,
            "capacity_factor": list(factors),
        },
        "elapsed_s": elapsed,
        "summary": summary,
    }
    pairs = ",\n  ".join(json.dumps(asdict(r)) for r in rows)  # one pair a line
    # Deterministic schedules, one build per pair: the whole sweep's time is the timed number.
    write_result(
        results,
        payload,
        recording,
        {"elapsed_s": [elapsed]},
        render=lambda record: f'{json.dumps(record, indent=1)[:-2]},\n "pairs": [\n  {pairs}\n ]\n}}\n',
    )
    print(f"wrote {results.relative_to(ROOT.parent)}")


if __name__ == "__main__":
    main()

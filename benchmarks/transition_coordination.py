"""Benchmark: does ordering the local DAGs globally keep memory safe on shared GPUs?

For --pairs seeded random plan pairs (PPO's seven model-stages sharing one pool of
4-16 GPUs on 1-2 nodes, tiny models, random layouts and random disjoint EMU GPU sets),
with usable memory per GPU of f x the busiest GPU of either plan (f drawn from
--capacity, default 1.2-1.6), it runs
  global    build_transition: every local DAG list-scheduled together, memory aware;
  baseline  each model-stage's local DAG scheduled alone with unlimited memory, all
            started together at t=0 ("local DAGs executed independently"),
and replays both with the independent checker (nereus.solver.transition.check) at the
real capacity. A pair succeeds when it is scheduled (no blocking cycle) and the checker
finds no violation. Pairs the global scheduler reports as blocked are counted apart,
and for each an exhaustive search (OrderSearch, --budget states) asks whether some
order of the same primitives fits after all: "order found" (checked by the checker)
means the list scheduler missed it; "infeasible" means no order of these primitives
fits (another DAG might); "undecided" means the search ran out of budget.
Prints a table and writes benchmarks/results/transition_coordination.json.

    .venv/bin/python benchmarks/transition_coordination.py [--pairs 1000] [--seed 0]
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

from nereus.cost.calibration import Calibration
from nereus.solver.transition import Primitive, build_transition, local_dag, plan_emus, state_bytes
from nereus.solver.transition.check import check_result, check_transition
from nereus.solver.transition.schedule import Replay, held_bytes, list_schedule, primitive_duration
from nereus.spec.check import kv_heads_rule
from nereus.spec.io import load_document
from nereus.spec.model import Model
from nereus.spec.plan import Plan, Pool
from nereus.spec.presets import MODELS

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "transition_coordination.json"
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
    return {e.model_stage: state_bytes(plan, e.model_stage, CALIBRATION) for e in plan.stages}


def random_pair(rng: random.Random, base: Plan, factors: tuple[float, float]) -> tuple[Plan, Plan, float]:
    setting = random_setting(rng, base)
    plan_a, plan_b = random_stages(rng, setting), random_stages(rng, setting)
    busiest = max(max(held_bytes(p, sizes_of(p)).values()) for p in (plan_a, plan_b))
    factor = rng.uniform(*factors)
    return with_capacity(plan_a, factor * busiest), with_capacity(plan_b, factor * busiest), factor


def independent_local_dags(plan_a: Plan, plan_b: Plan, initial: dict[int, float]) -> list[Primitive]:
    """Each changed model-stage's local DAG, scheduled alone with unlimited memory, all from t=0."""
    emus_a, emus_b, sizes = plan_emus(plan_a), plan_emus(plan_b), sizes_of(plan_b)
    out: list[Primitive] = []
    for name in emus_b:
        if set(emus_a[name]) == set(emus_b[name]):
            continue
        dag = local_dag(name, sizes[name], emus_a[name], emus_b[name], next_id=len(out))
        for primitive in dag:
            primitive.duration_s = primitive_duration(primitive, plan_b.cluster, CALIBRATION)
        assert list_schedule(dag, Replay(dict(initial), math.inf)) == []
        out += dag
    return out


class OrderSearch:
    """Is there an order of the primitives, run one at a time, that fits in memory?

    One at a time is no loss: running any valid schedule's primitives serially in order
    of start time never holds more on a GPU. Primitives that allocate nothing (Destroy,
    Merge) run as soon as they are ready, which only lowers memory. The search tries
    random greedy orders first, then a depth-first search over the sets of done
    primitives, pruned by a bound: before a primitive P runs, a GPU holds at least what
    it holds now, plus P's undone ancestors' net bytes, less the most any other
    model-stage can free there (the best dependency-closed set of its primitives: local
    DAGs share no edges) and less every free of P's own model-stage not ordered with P.
    """

    def __init__(self, primitives: list[Primitive], initial: dict[int, float], capacity: float) -> None:
        self.prims, self.initial, self.limit = primitives, initial, capacity * (1 + 1e-9)
        n = len(primitives)
        index = {p.id: i for i, p in enumerate(primitives)}
        self.needs = [sum(1 << index[d] for d in p.deps) for p in primitives]
        self.anc = [0] * n
        for i in sorted(range(n), key=lambda i: primitives[i].id):  # local DAG ids are topological
            for d in primitives[i].deps:
                self.anc[i] |= 1 << index[d] | self.anc[index[d]]
        self.desc = [sum(1 << j for j in range(n) if self.anc[j] >> i & 1) for i in range(n)]
        self.stages = sorted({p.model_stage for p in primitives})
        self.stage_mask = {m: sum(1 << i for i, p in enumerate(primitives) if p.model_stage == m) for m in self.stages}
        assert all(self.anc[i] & ~self.stage_mask[p.model_stage] == 0 for i, p in enumerate(primitives))
        self.net = [{g: p.alloc.get(g, 0.0) - p.free.get(g, 0.0) for g in {*p.alloc, *p.free}} for p in primitives]
        self.gains: dict[tuple[str, int, int], float] = {}
        self.seen: set[int] = set()

    @staticmethod
    def bits(mask: int) -> list[int]:
        out = []
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out

    def gain(self, stage: str, gpu: int, done: int) -> float:
        """The most bytes `stage`'s undone primitives can free on `gpu` (a best closed set)."""
        key = (stage, gpu, done & self.stage_mask[stage])
        if key not in self.gains:
            todo = self.stage_mask[stage] & ~done
            releases = [i for i in self.bits(todo) if gpu in self.prims[i].free]
            best = 0.0
            for subset in range(1, 1 << min(len(releases), 12)):
                closed = 0
                for k, i in enumerate(releases[:12]):
                    if subset >> k & 1:
                        closed |= (1 << i | self.anc[i]) & todo
                best = max(best, -sum(self.net[i].get(gpu, 0.0) for i in self.bits(closed)))
            if len(releases) > 12:  # too many to enumerate: every free counts
                best = sum(self.prims[i].free[gpu] for i in releases)
            self.gains[key] = best
        return self.gains[key]

    def dead(self, done: int, usage: dict[int, float]) -> bool:
        todo = (1 << len(self.prims)) - 1 & ~done
        for p in self.bits(todo):
            prim = self.prims[p]
            if not prim.alloc:
                continue
            before, loose = self.anc[p] & todo, self.stage_mask[prim.model_stage] & todo & ~self.anc[p] & ~self.desc[p]
            for gpu, nbytes in prim.alloc.items():
                low = usage.get(gpu, 0.0) + nbytes + sum(self.net[i].get(gpu, 0.0) for i in self.bits(before))
                low -= sum(self.gain(m, gpu, done) for m in self.stages if m != prim.model_stage)
                low -= sum(self.prims[i].free.get(gpu, 0.0) for i in self.bits(loose & ~(1 << p)))
                if low > self.limit:
                    return True
        return False

    def ready(self, done: int) -> list[int]:
        return [i for i in range(len(self.prims)) if not done >> i & 1 and self.needs[i] & done == self.needs[i]]

    def fits(self, i: int, usage: dict[int, float]) -> bool:
        return all(usage.get(g, 0.0) + b <= self.limit for g, b in self.prims[i].alloc.items())

    def apply(self, i: int, usage: dict[int, float], sign: float = 1.0) -> None:
        for gpu, nbytes in self.net[i].items():
            usage[gpu] = usage.get(gpu, 0.0) + sign * nbytes

    def greedy(self, rng: random.Random, sticky: float) -> list[int] | None:
        """One random order: releases first, else an allocation that fits (same model-stage with odds `sticky`)."""
        done, usage, order, last = 0, dict(self.initial), [], ""
        while done != (1 << len(self.prims)) - 1:
            ready = self.ready(done)
            batch = [i for i in ready if not self.prims[i].alloc]
            if not batch:
                fitting = [i for i in ready if self.fits(i, usage)]
                same = [i for i in fitting if self.prims[i].model_stage == last]
                if not fitting:
                    return None
                batch = [rng.choice(same if same and rng.random() < sticky else fitting)]
                last = self.prims[batch[0]].model_stage
            for i in batch:
                self.apply(i, usage)
                done |= 1 << i
                order.append(i)
        return order

    def dfs(self, done: int, usage: dict[int, float], order: list[int], budget: int) -> bool:
        released = []
        while releases := [i for i in self.ready(done) if not self.prims[i].alloc]:
            for i in releases:
                self.apply(i, usage)
                done |= 1 << i
            released += releases
        order.extend(released)
        if done == (1 << len(self.prims)) - 1:
            return True
        if done not in self.seen and len(self.seen) < budget:
            self.seen.add(done)
            if not self.dead(done, usage):
                for i in (i for i in self.ready(done) if self.fits(i, usage)):
                    self.apply(i, usage)
                    order.append(i)
                    if self.dfs(done | 1 << i, usage, order, budget):
                        return True
                    order.pop()
                    self.apply(i, usage, -1.0)
        for i in released:
            self.apply(i, usage, -1.0)
        del order[len(order) - len(released) :]
        return False

    def search(self, budget: int) -> list[int] | None:
        """Depth first from scratch: an order, or None (`self.seen` tells exhausted from out of budget)."""
        order: list[int] = []
        self.seen = set()
        return order if self.dfs(0, dict(self.initial), order, budget) else None

    def run(self, tries: int, budget: int) -> list[int] | str:
        """An order of primitive ids, laid out one after another; else "infeasible" or "undecided".

        A short search first (the bound often proves infeasibility at once), then `tries`
        random greedy orders, then the full search.
        """
        quick = min(200, budget)
        order = self.search(quick)
        if order is None and len(self.seen) < quick:
            return "infeasible"
        rng = random.Random(0)
        for k in range(tries if order is None else 0):
            order = self.greedy(rng, sticky=0.8 * (k % 2))
            if order is not None:
                break
        order = order or self.search(budget)
        if order is None:
            return "undecided" if len(self.seen) >= budget else "infeasible"
        now = 0.0
        for i in order:
            p = self.prims[i]
            p.start_s, p.end_s, p.ownership_deps = now, now + p.duration_s, []
            now = p.end_s
        return [self.prims[i].id for i in order]


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
    blocked_search: str | None  # blocked pairs: "order found" / "infeasible" / "undecided"
    blocked_order_violations: list[str]  # the checker on the order found, one at a time

    @property
    def global_ok(self) -> bool:
        return self.global_feasible and not self.global_violations

    @property
    def baseline_ok(self) -> bool:
        return not self.baseline_violations


def run_pair(seed: int, base: Plan, factors: tuple[float, float], budget: int) -> Outcome:
    plan_a, plan_b, factor = random_pair(random.Random(seed), base, factors)
    result = build_transition(plan_a, plan_b, CALIBRATION)
    baseline = independent_local_dags(plan_a, plan_b, result.initial_bytes)
    emus_a, emus_b = plan_emus(plan_a), plan_emus(plan_b)
    base_violations = check_transition(baseline, emus_a, emus_b, result.initial_bytes, result.capacity_bytes)
    global_violations = check_result(result, plan_a, plan_b) if result.feasible else []
    search, order_violations = None, []
    if not result.feasible:  # is there an order the list scheduler missed?
        order = OrderSearch(result.primitives, result.initial_bytes, result.capacity_bytes).run(100, budget)
        search = order if isinstance(order, str) else "order found"
        if not isinstance(order, str):
            order_violations = check_result(result, plan_a, plan_b)
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
        baseline_makespan_s=max((p.end_s for p in baseline), default=0.0),
        blocked_search=search,
        blocked_order_violations=order_violations,
    )


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
        "blocked_order_found": sum(r.blocked_search == "order found" for r in rows),
        "blocked_order_found_but_violating": sum(bool(r.blocked_order_violations) for r in rows),
        "blocked_no_order_exists": sum(r.blocked_search == "infeasible" for r in rows),
        "blocked_undecided": sum(r.blocked_search == "undecided" for r in rows),
        "known_feasible": len(feasible) + sum(r.blocked_search == "order found" for r in rows),
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
    ("blocked: a one-at-a-time order fits (missed)", "blocked_order_found"),
    ("blocked: ... but that order violates a rule", "blocked_order_found_but_violating"),
    ("blocked: no order of the DAG's primitives fits", "blocked_no_order_exists"),
    ("blocked: search undecided (budget)", "blocked_undecided"),
    ("pairs with a valid order known (scheduled+found)", "known_feasible"),
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
    print(f"independent local DAGs, failing pairs by violation kind: {summary['baseline_failing_pairs_by_kind']}")
    ratio = summary["median_makespan_global_over_longest_local"]
    print(f"median makespan, global DAG / longest local DAG run alone (global successes): {ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1000, help="random plan pairs (seeds seed..seed+pairs-1)")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--capacity", type=float, nargs=2, default=(1.2, 1.6), metavar=("LO", "HI"))
    parser.add_argument("--budget", type=int, default=3000, help="search states per blocked pair")
    args = parser.parse_args()
    base = _base()
    started = time.perf_counter()
    factors = (args.capacity[0], args.capacity[1])
    rows = [run_pair(seed, base, factors, args.budget) for seed in range(args.seed, args.seed + args.pairs)]
    elapsed = time.perf_counter() - started
    summary = summarize(rows)
    print_table(summary)
    print(f"{args.pairs} pairs in {elapsed:.1f} s")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "transition_coordination",
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "settings": {
            "pairs": args.pairs,
            "seed": args.seed,
            "capacity_factor": list(args.capacity),
            "budget": args.budget,
        },
        "elapsed_s": elapsed,
        "summary": summary,
    }
    pairs = ",\n  ".join(json.dumps(asdict(r)) for r in rows)  # one pair a line
    RESULTS.write_text(f'{json.dumps(payload, indent=1)[:-2]},\n "pairs": [\n  {pairs}\n ]\n}}\n')
    print(f"wrote {RESULTS.relative_to(ROOT.parent)}")


if __name__ == "__main__":
    main()

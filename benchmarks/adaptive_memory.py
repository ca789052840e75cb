"""Benchmark (measured, not simulated): the adaptive run where memory binds, on 2 CPU ranks
with one thread each.

The capacity emulates GPU memory pressure on a CPU. A CPU rank has no device memory to run
out of, so every plan's cluster says each GPU has `--capacity-mib` of memory, and every policy
keeps to it by the same rule: a plan is run only where the cost model's memory model (the
states resident on the rank, the KV cache the engine will hold, the activations) fits the
capacity, and generation is priced and run in the KV pool the runtime gives it (the memory
left after the states on the rank, times the pool's utilisation fraction;
`nereus.runtime.generation.kv_cache`, `nereus.cost.fit.with_engine_budget`). As the trace's responses grow
(default 8 -> 256 tokens, 8 prompts x 8 samples a step) the fixed initial layout keeps its
layout within that rule: its micro-batches shrink, its training recomputes activations, and its
generation runs in waves (a KV budget of what its ranks have left: newest-first preemption,
recomputed on re-admission), while layouts that leave more memory for the KV cache keep the
batch whole. Every policy plans with the memory-saving choices the runtime executes
(`RUNTIME_CHOICES`: recompute, token budgets, ZeRO-1, KV budgets, full sharding, ...).

Three things are measured, every run alternating with the others so slow spells of this
shared machine hit all:

* `fixed`: the planner's best plan for the first length, its layout kept for the whole growth
  trace (the fixed policy: dp scaling, more micro-batches, generation in waves);
* `nereus`: the same start under the online controller (cost model refitted after every
  step, live transitions), as `benchmarks/adaptive_run.py` runs it;
* the oracle bound: every candidate layout (the planner's top plans for every length of the
  growth, on the same capacity) timed through a staircase of the lengths under the fixed
  policy, and at every length the fastest candidate the rule lets run there (the fixed
  policy's own plan included, timed in its run), transitions free.

`nereus_lower_than_fixed` is the median over repetitions of 1 - nereus / fixed (mean wall
time per step, transitions and controller included); `oracle_lower_than_fixed` is
1 - oracle / fixed over the same trace, both mean step times weighted by the steps the trace
spends at each length. The table of KV pools shows, per plan and length, the blocks the
runtime's pool gets against the blocks its replica's batch needs at its longest (`-`: the rule
does not let it run there), and the plan the fixed policy runs at each length.
Writes benchmarks/results/adaptive_memory.json.

    .venv/bin/python benchmarks/adaptive_memory.py [--steps 18] [--lengths 8 32 64 128 192 256]
        [--capacity-mib 16] [--samples-per-prompt 8] [--repeats 2] [--steps-per-length 1] [--top-k 1] [--output FILE]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch
from _record import begin, write_result
from adaptive_bound import candidates, describe, growth_weights, measure, staircase
from adaptive_run import (
    BASE_PLAN,
    NUM_RANKS,
    growth_trace,
    lengths,
    print_repeat,
    run_policy,
    summarise_repeats,
)

from nereus.cost.calibration import Calibration
from nereus.cost.fit import engineless_stages
from nereus.cost.kv_pool import KV_ELEMENT_BYTES
from nereus.cost.stage import kv_bytes_per_token
from nereus.runtime.generation.kv_cache import KVBudget, blocks_for, pool_blocks
from nereus.solver.admission import state_bytes_by_rank
from nereus.solver.layouts import RUNTIME_CHOICES
from nereus.solver.policy.replan import Replanner
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig
from nereus.spec.stages import ACTOR_GENERATION
from nereus.spec.workload import ResponseLengths

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "adaptive_memory.json"
#: The longest response of each equal segment of the run: 8 -> 256 tokens, 32x.
GROWTH = (8, 32, 64, 128, 192, 256)
#: Emulated memory per rank: the fixed layout, its training down to one row per micro-batch,
#: runs its 32 sequences per replica whole up to 128 tokens and in waves at 192 and 256.
CAPACITY_MIB = 16.0
#: 8 prompts x 8 samples: 32 sequences per generation replica under dp=2.
SAMPLES_PER_PROMPT = 8


def memory_bound_base(capacity_bytes: int, samples_per_prompt: int) -> Plan:
    """The base plan with `capacity_bytes` of memory per GPU (the emulated capacity) and
    `samples_per_prompt` samples per prompt: a generation batch whose KV cache, not the
    training activations, is what memory limits first as responses grow."""
    base = load_document(BASE_PLAN)
    assert isinstance(base, Plan)
    gpu = base.cluster.gpu.model_copy(update={"memory_bytes": capacity_bytes})
    cluster = base.cluster.model_copy(update={"gpu": gpu, "name": f"{base.cluster.name}-capped"})
    # Responses of the growth's first length: the run starts there (the trace sets each step's).
    first = ResponseLengths(median=GROWTH[0], p99=GROWTH[0], max=GROWTH[0])
    workload = base.workload.model_copy(update={"samples_per_prompt": samples_per_prompt, "response_len": first})
    return base.model_copy(update={"cluster": cluster, "workload": workload})


def kv_pool(plan: Plan, tokens: int) -> tuple[int, int]:
    """(blocks the runtime's KV pool gets, blocks its replica's batch needs at its longest) on the
    busiest rank of the plan's generation, for responses of `tokens` (what `nereus run` sizes)."""
    entry = next(s for s in plan.stages if s.model_stage == ACTOR_GENERATION)
    workload = plan.workload
    model = plan.model(workload.actor)
    held = state_bytes_by_rank(plan, RLConfig(task="sort"))
    block = KVBudget().block_tokens
    block_bytes = block * kv_bytes_per_token(model, entry.tp, entry.pp, KV_ELEMENT_BYTES)
    share = -(-workload.prompts_per_step * workload.samples_per_prompt // entry.dp)
    demand = share * blocks_for(workload.prompt_len + tokens, block)
    pools = [
        pool_blocks(
            KVBudget(entry.kv_budget_bytes, plan.cluster.gpu.memory_bytes, held.get(gpu, 0)),
            block_bytes,
            demand,
            torch.device("cpu"),
        )
        for gpu in entry.gpus
    ]
    return min(pools), demand


def rule(initial: Plan, calibration: Calibration) -> Replanner:
    """The controller's replanner (`nereus run --policy`): the runtime's memory-saving choices,
    generation priced in the engine's pool; what it calls infeasible no policy runs."""
    engineless = engineless_stages(initial, RLConfig(task="sort"))
    return Replanner(initial, calibration=calibration, choices=RUNTIME_CHOICES, engineless=engineless)


def feasible(plans: dict[str, Plan], replanner: Replanner, growth: list[int]) -> dict[str, list[int]]:
    """Per plan, the lengths the rule lets it run at (the oracle chooses only among those)."""
    return {
        name: [t for t in growth if replanner.step_time(plan, lengths(t), 1.0) is not None]
        for name, plan in plans.items()
    }


def print_pools(
    plans: dict[str, Plan], growth: list[int], allowed: dict[str, list[int]]
) -> dict[str, dict[int, list[int]]]:
    """Per plan and length, the pool's blocks against the batch's need (`*`: waves, `-`: not allowed)."""
    print("KV pool blocks / blocks the replica's batch needs at its longest (* = waves, - = overflows the capacity)")
    print(f"{'plan':<9}" + "".join(f"{t:>10}" for t in growth) + "  layout")
    table = {name: {t: list(kv_pool(plan, t)) for t in growth} for name, plan in plans.items()}
    for name, plan in plans.items():
        cells = "".join(
            f"{f'{a}/{b}' + ('*' if a < b else ' '):>10}" if t in allowed[name] else f"{'-':>10}"
            for t, (a, b) in table[name].items()
        )
        print(f"{name:<9}{cells}  {describe(plan)}")
    return table


def refit_pools(initial: Plan, replanner: Replanner, growth: list[int]) -> dict[int, dict[str, Any]]:
    """Per length, the plan the fixed policy runs there (`Replanner.refit`: its layout, more
    micro-batches, generation in waves) and its KV pool against its batch's need."""
    table: dict[int, dict[str, Any]] = {}
    for tokens in growth:
        refit = replanner.refit(initial, NUM_RANKS, lengths(tokens), 1.0)
        if refit is None:
            table[tokens] = {"plan": None, "kv_pool_blocks_vs_needed": None}
            continue
        table[tokens] = {"plan": describe(refit), "kv_pool_blocks_vs_needed": list(kv_pool(refit, tokens))}
    print("fixed policy: " + "; ".join(f"{t} tokens {row['kv_pool_blocks_vs_needed']}" for t, row in table.items()))
    return table


def distinct(plans: dict[str, Plan]) -> dict[str, Plan]:
    """The first plan of every distinct layout (tp/pp/dp, GPUs and micro-batches per model-stage)."""
    seen: dict[str, str] = {}
    for name, plan in plans.items():
        seen.setdefault(describe(plan), name)
    return {name: plans[name] for name in seen.values()}


def oracle(
    plans: dict[str, Plan], steps_per_length: int, growth: list[int], folder: Path
) -> dict[str, dict[int, list[float]]]:
    """One repetition of the oracle's staircase: every candidate's step seconds at every length."""
    ladder = staircase(steps_per_length, growth)
    return {name: measure(plan, ladder, folder / f"oracle-{name}") for name, plan in plans.items()}


def by_length(run: dict[str, Any]) -> dict[int, list[float]]:
    """A run's step seconds at each response length."""
    found: dict[int, list[float]] = {}
    for tokens, seconds in zip(run["response_len_max"], run["step_seconds"], strict=True):
        found.setdefault(tokens, []).append(seconds)
    return found


def oracle_bound(
    times: dict[str, dict[int, float]], allowed: dict[str, list[int]], weights: dict[int, int]
) -> dict[str, Any]:
    """The oracle's mean step time (at every length the fastest plan allowed there; `fixed`, the
    fixed policy's own plan, always is) against the fixed policy's, weighted by `weights`."""
    best = {t: min((n for n in times if t in allowed[n]), key=lambda n: times[n][t]) for t in weights}
    total = sum(weights.values())
    oracle = sum(n * times[best[t]][t] for t, n in weights.items()) / total
    fixed = sum(n * times["fixed"][t] for t, n in weights.items()) / total
    return {
        "best_per_length": best,
        "oracle_mean_step_s": oracle,
        "fixed_mean_step_s": fixed,
        "bound": 1 - oracle / fixed,
    }


def print_oracle(times: dict[str, dict[int, float]], allowed: dict[str, list[int]], result: dict[str, Any]) -> None:
    growth = list(result["best_per_length"])
    print("median step seconds per length (* = the oracle's pick, - = overflows the capacity there)")
    print(f"{'plan':<9}" + "".join(f"{t:>9}" for t in growth))
    for name in times:
        cells = "".join(
            f"{times[name][t]:>8.3f}" + ("*" if result["best_per_length"][t] == name else " ")
            if t in allowed[name]
            else f"{'-':>9}"
            for t in growth
        )
        print(f"{name:<9}{cells}")
    print(
        f"oracle {result['oracle_mean_step_s']:.3f} s/step vs fixed {result['fixed_mean_step_s']:.3f} s/step over "
        f"the growth trace: bound {100 * result['bound']:.1f}%"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=18, help="RL steps of the growth trace (fixed and nereus)")
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=list(GROWTH), help="response length of each equal segment"
    )
    parser.add_argument("--capacity-mib", type=float, default=CAPACITY_MIB, help="emulated memory per rank, MiB")
    parser.add_argument(
        "--samples-per-prompt", type=int, default=SAMPLES_PER_PROMPT, help="samples per prompt (8 prompts a step)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="repetitions (fixed, nereus, oracle alternating)")
    parser.add_argument("--steps-per-length", type=int, default=1, help="oracle: steps per candidate and length")
    parser.add_argument("--top-k", type=int, default=1, help="oracle: planner plans per length and calibration")
    parser.add_argument("--calibration", type=Path, help="starting Calibration YAML (`nereus fit`); default: built-in")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where to write the results JSON")
    parser.add_argument("--pools-only", action="store_true", help="print the KV pool tables, run and write nothing")
    args = parser.parse_args()
    recording = begin()
    start = load_document(args.calibration) if args.calibration else Calibration()
    assert isinstance(start, Calibration)
    base = memory_bound_base(int(args.capacity_mib * 2**20), args.samples_per_prompt)
    plans = distinct(candidates([start], args.top_k, args.lengths, base.cluster, base))
    initial = plans["initial"]
    replanner = rule(initial, start)
    # The fixed policy's own plan is a candidate at every length (the rule lets it run there).
    allowed = {**feasible(plans, replanner, args.lengths), "fixed": list(args.lengths)}
    pools = print_pools(plans, args.lengths, allowed)
    fixed_pools = refit_pools(initial, replanner, args.lengths)
    if args.pools_only:
        return
    trace = growth_trace(args.steps, tuple(args.lengths))
    policies = ["fixed", "nereus"]
    # The initial plan's staircase is the fixed policy's run: the other candidates climb one.
    others = {name: plan for name, plan in plans.items() if name != "initial"}
    repeats: list[list[dict[str, Any]]] = []
    samples: dict[str, dict[int, list[float]]] = {name: {} for name in ["fixed", *others]}
    calibration = start if args.calibration else None
    with tempfile.TemporaryDirectory(prefix="nereus-memory-") as folder:
        for repeat in range(args.repeats):
            where = Path(folder) / f"repeat-{repeat}"
            run = partial(run_policy, plan=initial, trace=trace, calibration=calibration, num_steps=args.steps)
            repeats.append([run(p, out=where / p) for p in policies])
            print_repeat(repeat, repeats[-1])
            measured = {
                "fixed": by_length(repeats[-1][0]),
                **oracle(others, args.steps_per_length, args.lengths, where),
            }
            for name, seconds_by_length in measured.items():
                for tokens, seconds in seconds_by_length.items():
                    samples[name].setdefault(tokens, []).extend(seconds)
            print(f"repeat {repeat}: oracle staircase done", flush=True)
    times = {name: {t: statistics.median(s) for t, s in per.items()} for name, per in samples.items()}
    limit = oracle_bound(times, allowed, growth_weights(args.steps, args.lengths))
    print_oracle(times, allowed, limit)
    summary = summarise_repeats(policies, repeats)
    gain = summary["nereus"]["median_change_vs_fixed"]
    share = gain / limit["bound"] if limit["bound"] > 0 else float("nan")
    print(
        f"nereus vs fixed: median {100 * gain:+.1f}% lower (per repeat "
        f"{', '.join(f'{100 * c:+.1f}%' for c in summary['nereus']['change_vs_fixed'])}); oracle bound "
        f"{100 * limit['bound']:.1f}%; nereus took {100 * share:.0f}% of the oracle's gain "
        f"(targets: >= 20% and >= 80%)"
    )
    record = {
        "benchmark": "adaptive_memory",
        "measured": True,
        "emulated": "a per-rank memory capacity emulates GPU memory pressure on a CPU (no device memory binds "
        "here): every policy runs only plans the cost model's memory model fits into it, generation in the "
        "KV pool the runtime sizes from it",
        "capacity_bytes_per_rank": base.cluster.gpu.memory_bytes,
        "samples_per_step": base.workload.samples_per_step,
        "num_ranks": NUM_RANKS,
        "threads_per_rank": 1,
        "trace": trace.model_dump(mode="json"),
        "initial_plan": describe(initial),
        "calibration": str(args.calibration) if args.calibration else "default",
        "machine": platform.platform(),
        "repeats": args.repeats,
        "nereus_lower_than_fixed": gain,
        "oracle_lower_than_fixed": limit["bound"],
        "share_of_oracle_gain": share,
        "kv_pool_blocks_vs_needed": pools,
        "allowed_lengths": allowed,
        "fixed_policy_plans": fixed_pools,
        "plans": {name: describe(plan) for name, plan in plans.items()},
        "oracle": {**limit, "median_step_seconds": times, "steps_per_length": args.steps_per_length},
        "summary": summary,
        "results": repeats,
    }
    walls = {p: [results[k]["mean_step_wall_s"] for results in repeats] for k, p in enumerate(policies)}
    write_result(args.output, record, recording, {"mean_step_wall_s_by_policy": walls, "oracle_step_seconds": samples})


if __name__ == "__main__":
    main()

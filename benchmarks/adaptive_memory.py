"""Benchmark (measured, not simulated): the adaptive run where memory binds, on 2 CPU ranks
with one thread each.

A CPU rank has no device memory to run out of, so this benchmark gives each rank a capacity
that emulates GPU memory pressure: the plans' cluster says every GPU has `--capacity-mib` of
memory. The planner then sizes layouts and KV budgets to it, and the runtime sizes each
generation replica's KV pool from it (the memory left after the engine states resident on
the rank, times the pool's utilisation fraction; `nereus.runtime.kv_cache`). As the trace's
responses grow (default 8 -> 256 tokens) the fixed initial layout's pool stops holding its
replica's batch, so its generation runs in waves (newest-first preemption, recomputed on
re-admission), while a layout that leaves more memory for the KV cache keeps its batch whole.

Three things are measured, every run alternating with the others so slow spells of this
shared machine hit all:

* `fixed`: the planner's best plan for the first length, kept for the whole growth trace;
* `nereus`: the same start under the online controller (cost model refitted after every
  step, live transitions), as `benchmarks/adaptive_run.py` runs it;
* the oracle bound of `benchmarks/adaptive_bound.py`: every candidate layout (the planner's
  top plans for every length of the growth, on the same capacity) timed through a staircase of
  the lengths under the fixed policy, the fastest taken at every length, transitions free.

`nereus_lower_than_fixed` is the median over repetitions of 1 - nereus / fixed (mean wall
time per step, transitions and controller included); `oracle_lower_than_fixed` is the bound's
1 - oracle / initial over the same trace. The table of KV pools shows, per plan and length,
the blocks the runtime's pool gets against the blocks its replica's batch needs at its longest,
for every candidate as planned and for the plan the fixed policy runs at each length.
Writes benchmarks/results/adaptive_memory.json.

    .venv/bin/python benchmarks/adaptive_memory.py [--steps 18] [--lengths 8 32 64 128 192 256]
        [--capacity-mib 12.8] [--samples-per-prompt 4] [--repeats 2] [--steps-per-length 1] [--top-k 1] [--output FILE]
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
from adaptive_bound import bound, candidates, describe, growth_weights, measure, print_table, staircase
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
from nereus.runtime.kv_cache import KVBudget, blocks_for, pool_blocks, replica_kv_bytes_per_token
from nereus.runtime.rl.setup import state_bytes_by_rank
from nereus.solver.layouts import RUNTIME_CHOICES
from nereus.solver.policy.replan import Replanner
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig
from nereus.spec.workload import ResponseLengths

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "adaptive_memory.json"
#: The longest response of each equal segment of the run: 8 -> 256 tokens, 32x.
GROWTH = (8, 32, 64, 128, 192, 256)
#: Emulated memory per rank: the initial layout's pool holds its 16 sequences up to 128 tokens, not at 192 and 256.
CAPACITY_MIB = 12.8
#: 8 prompts x 4 samples: 16 sequences per generation replica under dp=2.
SAMPLES_PER_PROMPT = 4
KV_ELEMENT_BYTES = 4  # the engine's KV cache is fp32, its compute dtype


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
    entry = next(s for s in plan.stages if s.model_stage == "actor/generation")
    workload = plan.workload
    model = plan.model(workload.actor)
    held = state_bytes_by_rank(plan, RLConfig(task="sort"))
    block = KVBudget().block_tokens
    block_bytes = block * replica_kv_bytes_per_token(model, entry.tp, entry.pp, KV_ELEMENT_BYTES)
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


def print_pools(plans: dict[str, Plan], growth: list[int]) -> dict[str, dict[int, list[int]]]:
    """Per plan and length, the pool's blocks against the batch's need (`*`: waves)."""
    print("KV pool blocks / blocks the replica's batch needs at its longest (* = it runs in waves)")
    print(f"{'plan':<9}" + "".join(f"{t:>10}" for t in growth) + "  layout")
    table = {name: {t: list(kv_pool(plan, t)) for t in growth} for name, plan in plans.items()}
    for name, plan in plans.items():
        cells = "".join(f"{f'{a}/{b}' + ('*' if a < b else ' '):>10}" for a, b in table[name].values())
        print(f"{name:<9}{cells}  {describe(plan)}")
    return table


def refit_pools(initial: Plan, growth: list[int]) -> dict[int, list[int]]:
    """Per length, the KV pool of the plan the fixed policy runs there against its batch's need:
    a predicted memory violation makes every policy move, and the fixed one keeps its layouts
    (`Replanner.refit`: more micro-batches, generation in smaller waves)."""
    replanner = Replanner(initial, calibration=Calibration(), choices=RUNTIME_CHOICES)
    table = {}
    for tokens in growth:
        refit = replanner.refit(initial, NUM_RANKS, lengths(tokens), 1.0)
        table[tokens] = [-1, -1] if refit is None else list(kv_pool(refit, tokens))
    print("fixed policy: " + ", ".join(f"{t} tokens {a}/{b}" for t, (a, b) in table.items()))
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
    pools = print_pools(plans, args.lengths)
    fixed_pools = refit_pools(initial, args.lengths)
    if args.pools_only:
        return
    trace = growth_trace(args.steps, tuple(args.lengths))
    policies = ["fixed", "nereus"]
    repeats: list[list[dict[str, Any]]] = []
    samples: dict[str, dict[int, list[float]]] = {name: {} for name in plans}
    calibration = start if args.calibration else None
    with tempfile.TemporaryDirectory(prefix="nereus-memory-") as folder:
        for repeat in range(args.repeats):
            where = Path(folder) / f"repeat-{repeat}"
            run = partial(run_policy, plan=initial, trace=trace, calibration=calibration, num_steps=args.steps)
            repeats.append([run(p, out=where / p) for p in policies])
            print_repeat(repeat, repeats[-1])
            for name, by_length in oracle(plans, args.steps_per_length, args.lengths, where).items():
                for tokens, seconds in by_length.items():
                    samples[name].setdefault(tokens, []).extend(seconds)
            print(f"repeat {repeat}: oracle staircase done", flush=True)
    times = {name: {t: statistics.median(s) for t, s in by_length.items()} for name, by_length in samples.items()}
    limit = bound(times, growth_weights(args.steps, args.lengths))
    print_table(plans, times, limit)
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
        "emulated": "a per-rank memory capacity emulates GPU memory pressure on a CPU (no device memory binds here)",
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
        "fixed_policy_kv_pool_blocks_vs_needed": fixed_pools,
        "plans": {name: describe(plan) for name, plan in plans.items()},
        "oracle": {**limit, "median_step_seconds": times, "steps_per_length": args.steps_per_length},
        "summary": summary,
        "results": repeats,
    }
    walls = {p: [results[k]["mean_step_wall_s"] for results in repeats] for k, p in enumerate(policies)}
    write_result(args.output, record, recording, {"mean_step_wall_s_by_policy": walls, "oracle_step_seconds": samples})


if __name__ == "__main__":
    main()

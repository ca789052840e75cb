"""Benchmark (measured, not simulated): the most any layout policy could gain under
`adaptive_run.py`'s sequence-growth trace on this machine, 2 CPU ranks with one thread each.

Candidates: the planner's `--top-k` plans for every length of the trace, under the default
calibration and under `--calibration` (deduplicated), plus `adaptive_run`'s initial plan.
Each candidate runs once under the fixed policy (no online calibration, no replanning)
through a staircase of the trace's lengths, `--steps-per-length` steps each, every response
exactly that long (`stop_at_eos: false`), `--repeats` times, the candidates alternating; a
length's time is the median of its steps over the repeats.

The bound is an oracle's: at every length of the growth trace, the fastest candidate, with
free transitions; `1 - sum(steps x fastest) / sum(steps x initial)`. A real policy pays for
its transitions, its controller and its prediction errors, so it cannot beat the bound by
more than this machine's noise. Prints a table and writes benchmarks/results/adaptive_bound.json.

    .venv/bin/python benchmarks/adaptive_bound.py [--trace-steps 48] [--steps-per-length 5] [--top-k 4]
        [--calibration benchmarks/results/cost_fit_calibration.yaml] [--output FILE] [--keep DIR]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any

from _record import begin, write_result
from adaptive_run import GROWTH, NUM_RANKS, growth_trace, initial_plan, planned, run_policy

from nereus.cost.calibration import Calibration
from nereus.solver.policy.replan import plan_key
from nereus.spec.cluster import Cluster
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.trace import Trace

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "adaptive_bound.json"
FITTED = ROOT / "benchmarks" / "results" / "cost_fit_calibration.yaml"


def candidates(
    calibrations: list[Calibration],
    top_k: int,
    growth: list[int],
    cluster: Cluster | None = None,
    base: Plan | None = None,
) -> dict[str, Plan]:
    """`adaptive_run`'s initial plan first, then the planner's top-k for every length of
    `growth`, under every calibration, deduplicated (on `cluster` and for `base`: see `planned`)."""
    found = {"initial": initial_plan(calibrations[0], cluster, growth[0], base)}
    seen = {plan_key(found["initial"])}
    for calibration in calibrations:
        for tokens in growth:
            for plan in planned(calibration, cluster, tokens, top_k, base):
                if plan_key(plan) not in seen:
                    seen.add(plan_key(plan))
                    found[f"c{len(found)}"] = plan
    return found


def staircase(steps_per_length: int, growth: list[int]) -> Trace:
    """Every length of the growth, held for `steps_per_length` steps."""
    return growth_trace(steps_per_length * len(growth), tuple(growth))


def measure(plan: Plan, trace: Trace, folder: Path) -> dict[int, list[float]]:
    """Step seconds of `plan` at each length of `trace` (fixed policy without online
    calibration, exact lengths)."""
    run = run_policy("fixed", plan, trace, None, trace.num_steps, folder, fixed_calibrates=False)
    by_length: dict[int, list[float]] = {}
    for tokens, seconds in zip(run["response_len_max"], run["step_seconds"], strict=True):
        by_length.setdefault(tokens, []).append(seconds)
    return dict(sorted(by_length.items()))


def bound(times: dict[str, dict[int, float]], weights: dict[int, int]) -> dict[str, Any]:
    """The oracle's mean step time (fastest candidate at every length) against each candidate's
    kept for the whole trace; `bound` is against the initial plan's."""
    best = {tokens: min(times, key=lambda name: times[name][tokens]) for tokens in weights}
    total = sum(weights.values())
    oracle = sum(n * times[best[tokens]][tokens] for tokens, n in weights.items()) / total
    means = {name: sum(n * times[name][tokens] for tokens, n in weights.items()) / total for name in times}
    return {
        "best_per_length": best,
        "oracle_mean_step_s": oracle,
        "mean_step_s": means,
        "bound_from": {name: 1 - oracle / mean for name, mean in means.items()},
        "bound": 1 - oracle / means["initial"],
    }


def growth_weights(trace_steps: int, growth: list[int]) -> dict[int, int]:
    """Steps `adaptive_run`'s growth trace of `trace_steps` steps spends at each length."""
    trace = growth_trace(trace_steps, tuple(growth))
    starts = [(0, trace.response_len.max)] + [(e.step, e.response_len.max) for e in trace.events if e.response_len]
    ends = [step for step, _ in starts[1:]] + [trace_steps]
    return {tokens: end - start for (start, tokens), end in zip(starts, ends, strict=True)}


def print_table(plans: dict[str, Plan], times: dict[str, dict[int, float]], result: dict[str, Any]) -> None:
    growth = list(result["best_per_length"])
    print(f"{'plan':<9}" + "".join(f"{t:>8}" for t in growth) + f"{'mean':>8}{'bound':>7}  layout")
    for name, plan in plans.items():
        row = "".join(
            f"{times[name][t]:>7.3f}" + ("*" if result["best_per_length"][t] == name else " ") for t in growth
        )
        tail = f"{result['mean_step_s'][name]:>7.3f}{100 * result['bound_from'][name]:>7.1f}%"
        print(f"{name:<9}{row}{tail}  {describe(plan)}")
    print(
        f"oracle {result['oracle_mean_step_s']:.3f} s/step vs initial {result['mean_step_s']['initial']:.3f} s/step "
        f"over the growth trace: bound {100 * result['bound']:.1f}% (* = fastest at that length; mean: over the "
        "growth trace, kept throughout; bound: the oracle's gain against keeping it)"
    )


def describe(plan: Plan) -> str:
    """Each model-stage's tp/pp/dp, its GPUs and its micro-batches: `act-gen 1/1/1 g1 m1`."""
    return ", ".join(
        f"{s.role[:3]}-{s.stage[:3]} {s.tp}/{s.pp}/{s.dp} g{''.join(map(str, s.gpus))} m{s.micro_batches}"
        for s in plan.stages
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace-steps", type=int, default=48, help="steps of the growth trace the bound weights")
    parser.add_argument("--steps-per-length", type=int, default=5, help="steps each candidate runs per length")
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=list(GROWTH), help="the growth's response lengths (as adaptive_run)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per candidate (medians over all their steps)")
    parser.add_argument("--top-k", type=int, default=4, help="planner plans per length and calibration")
    parser.add_argument("--calibration", type=Path, default=FITTED, help="a second calibration to plan with")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where to write the results JSON")
    parser.add_argument("--keep", type=Path, help="keep the run folders here (for `nereus fit`)")
    args = parser.parse_args()
    recording = begin()
    fitted = load_document(args.calibration)
    assert isinstance(fitted, Calibration)
    plans = candidates([Calibration(), fitted], args.top_k, args.lengths)
    trace = staircase(args.steps_per_length, args.lengths)
    print(f"{len(plans)} candidates, {trace.num_steps} steps each, lengths {args.lengths}")
    samples: dict[str, dict[int, list[float]]] = {name: {} for name in plans}
    with tempfile.TemporaryDirectory(prefix="nereus-bound-") as scratch:
        folder = args.keep or Path(scratch)
        # Candidates alternate within each repeat, so slow spells of this shared machine hit all.
        for repeat in range(args.repeats):
            for name, plan in plans.items():
                for tokens, seconds in measure(plan, trace, folder / f"{name}-{repeat}").items():
                    samples[name].setdefault(tokens, []).extend(seconds)
            print(f"repeat {repeat} done", flush=True)
    times = {name: {t: statistics.median(s) for t, s in by_length.items()} for name, by_length in samples.items()}
    weights = growth_weights(args.trace_steps, args.lengths)
    result = bound(times, weights)
    print_table(plans, times, result)
    record = {
        "benchmark": "adaptive_bound",
        "measured": True,
        "num_ranks": NUM_RANKS,
        "threads_per_rank": 1,
        "staircase": trace.model_dump(mode="json"),
        "growth_steps_per_length": weights,
        "calibrations": ["default", str(args.calibration)],
        "machine": platform.platform(),
        "plans": {name: describe(plan) for name, plan in plans.items()},
        "repeats": args.repeats,
        "median_step_seconds": times,
        "step_seconds": samples,
        **result,
    }
    write_result(args.output, record, recording, {"step_seconds_by_plan_and_length": samples})


if __name__ == "__main__":
    main()

"""Benchmark: the closed-form continuous-batching decode against the reference engine.

Random cases over a wider domain than the unit test's (medians from 16 tokens, budgets down
to one maximum-length sequence, up to 256 sequences, prompts to 2,048): for each, the closed
form (`decode_profile` + `priced_decode`) against the mean of the iteration-by-iteration
reference (`simulate_continuous_batching`) over --orders arrival orders, and against each
order alone. Prints median / p95 / worst |error| by how many maximum-length sequences the
budget holds, and writes benchmarks/results/continuous_batching.json.

    .venv/bin/python benchmarks/continuous_batching.py            # 400 cases, 4 orders
    .venv/bin/python benchmarks/continuous_batching.py --cases 60 # quicker
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from _record import begin, write_result

from nereus.cost.continuous_batching import decode_profile, priced_decode, quantile_batch, reference_runs
from nereus.spec.workload import ResponseLengths

RESULTS = Path(__file__).resolve().parent / "results" / "continuous_batching.json"
#: Bands of the budget in maximum-length sequences (lower edges).
BANDS = (1.0, 3.0, 6.0)


def draw_case(rng: np.random.Generator) -> dict[str, float]:
    """One random case: lengths, prompt, batch, budget and an iteration cost's coefficients."""
    median = int(rng.integers(16, 401))
    p99 = int(rng.integers(median * 11 // 10, median * 12 + 1))
    longest = int(rng.integers(p99, p99 * 3 + 1))
    prompt, n = int(rng.integers(8, 2049)), int(rng.integers(2, 257))
    sequences = float(np.exp(rng.uniform(0.0, np.log(n + 6))))  # log-uniform: 1 max-length one to past the batch
    return {
        "median": median,
        "p99": p99,
        "max": longest,
        "prompt": prompt,
        "n": n,
        "capacity": int((prompt + longest) * sequences),
        "sequences": sequences,
        "kv": float(10 ** rng.uniform(-5, -3)),
        "dense": float(10 ** rng.uniform(-3, -1)),
        "attention": float(10 ** rng.uniform(-6, -4)),
    }


def measure(case: dict[str, float], orders: int) -> dict[str, float]:
    lengths = ResponseLengths(median=int(case["median"]), p99=int(case["p99"]), max=int(case["max"]))
    prompt, n, capacity = int(case["prompt"]), int(case["n"]), int(case["capacity"])

    def cost(running, tokens):  # memory- or compute-bound, whichever is slower, plus a fixed cost
        return np.maximum(case["dense"] * running + case["attention"] * tokens, 1.0 + case["kv"] * tokens) + 0.1

    runs = reference_runs(lengths, prompt, n, capacity, lambda r, t: float(cost(r, t)), orders)
    longest = float(max(quantile_batch(lengths, n, 0)))
    fast = float(priced_decode(decode_profile(lengths, prompt, n, capacity, longest), cost))
    times = [run.time_s for run in runs]
    return {
        **case,
        "closed_form_s": fast,
        "reference_mean_s": float(np.mean(times)),
        "error_vs_mean": fast / float(np.mean(times)) - 1,
        "worst_error_vs_one_order": max(abs(fast / t - 1) for t in times),
        "preemptions": float(np.mean([run.preemptions for run in runs])),
    }


def summary(rows: list[dict[str, float]], key: str) -> dict[str, float]:
    errors = np.abs([r[key] for r in rows])
    return {
        "cases": len(rows),
        "median": float(np.median(errors)),
        "p95": float(np.percentile(errors, 95)),
        "worst": float(errors.max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=400, help="random cases")
    parser.add_argument("--orders", type=int, default=4, help="arrival orders the reference runs per case")
    parser.add_argument("--seed", type=int, default=0, help="seed of the case draw")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    args = parser.parse_args()
    recording = begin()
    rng = np.random.default_rng(args.seed)
    rows = [measure(draw_case(rng), args.orders) for _ in range(args.cases)]
    table = {}
    print(
        f"{'budget (max-length seqs)':<26} {'cases':>5} {'vs mean: median':>15} {'p95':>7} {'worst':>7}   "
        f"{'vs one order: p95':>17} {'worst':>7}"
    )
    for low, high in zip(BANDS, (*BANDS[1:], np.inf), strict=True):
        band = [r for r in rows if low <= r["sequences"] < high]
        if not band:
            continue
        mean, one = summary(band, "error_vs_mean"), summary(band, "worst_error_vs_one_order")
        label = f">= {low:g}" if high == np.inf else f"{low:g} - {high:g}"
        table[label] = {"vs_mean": mean, "vs_one_order": one}
        print(
            f"{label:<26} {mean['cases']:>5} {mean['median']:>15.3f} {mean['p95']:>7.3f} {mean['worst']:>7.3f}   "
            f"{one['p95']:>17.3f} {one['worst']:>7.3f}"
        )
    payload = {
        "benchmark": "continuous_batching",
        "orders": args.orders,
        "seed": args.seed,
        "bands": table,
        "results": rows,
    }
    write_result(args.output, payload, recording, {"error_vs_mean": [r["error_vs_mean"] for r in rows]})
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

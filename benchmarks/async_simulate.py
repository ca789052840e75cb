"""Benchmark (simulator): async RL at paper scale, GRPO with Llama-3.1-8B and Qwen3-32B on
64, 128 and 256 H100s through a 1000-step response-length growth trace (500 -> 8000 tokens).

Three jobs per case, each starting on the best plan for the trace's first lengths:
- async nereus: `execution: async`, max_staleness 1, the nereus policy replanning (the async
  split search) at step boundaries, each a weight-sync boundary;
- async fixed: the same async start plan, the `fixed` policy (initial tp/pp, dp scaling), the
  closest thing here to a fixed async pipeline such as Laminar's;
- sync nereus: the synchronous workload, the nereus policy.
Mean step latency (adaptation and pipeline refills included) and total time.

These are SIMULATOR results: step times come from the cost model (the async steady state
max(generation pool, training pool), a refill G + T after every plan change), transition times
from the transition DAG. Prints a table and writes benchmarks/results/async_simulate.json.

    .venv/bin/python benchmarks/async_simulate.py [--steps 1000]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from _record import begin, write_result

from nereus.solver.plan_search import PlanRequest
from nereus.solver.planner import make_plan
from nereus.solver.policy import make_policy
from nereus.solver.simulate import simulate
from nereus.solver.traces import GrowthConfig, sequence_growth_trace
from nereus.spec.plan import Plan
from nereus.spec.presets import cluster_preset, models_for, workload_preset

MODELS = ("llama-3.1-8b", "qwen3-32b")
GPU_COUNTS = (64, 128, 256)
JOBS = (("async nereus", "async", "nereus"), ("async fixed", "async", "fixed"), ("sync nereus", "sync", "nereus"))
RESULTS = Path(__file__).resolve().parent / "results" / "async_simulate.json"


def start_plan(model: str, gpus: int, execution: str, growth: GrowthConfig) -> Plan:
    preset = "grpo-async" if execution == "async" else "grpo"
    workload = workload_preset(preset, model).model_copy(update={"response_len": growth.lengths(growth.start_tokens)})
    request = PlanRequest(cluster_preset("h100", gpus), models_for(workload, None), workload, gpus)
    return make_plan(request).best


def main() -> None:
    started = begin()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    growth = GrowthConfig()
    cases: list[dict[str, Any]] = []
    wall: dict[str, list[float]] = {}
    print(f"{'model':<14}{'GPUs':>6}  {'job':<14}{'mean step s':>12}{'total h':>9}{'moves':>7}{'fills':>7}")
    for model in MODELS:
        for gpus in GPU_COUNTS:
            trace = sequence_growth_trace(args.steps, gpus, growth, seed=0)
            case: dict[str, Any] = {"model": model, "gpus": gpus, "jobs": {}}
            for job, execution, policy in JOBS:
                t0 = time.perf_counter()
                plan = start_plan(model, gpus, execution, growth)
                result = simulate(trace, make_policy(policy, plan))
                wall.setdefault(f"{model}/{gpus}/{job}", []).append(time.perf_counter() - t0)
                summary = result.summary()
                summary["start_step_s"] = plan.predictions.step_time_s if plan.predictions else None
                case["jobs"][job] = summary
                moves = result.num_transitions + result.num_restarts
                print(
                    f"{model:<14}{gpus:>6}  {job:<14}{result.mean_step_latency_s:>12.2f}"
                    f"{result.total_time_s / 3600:>9.2f}{moves:>7}{result.num_pipeline_fills:>7}"
                )
            jobs = case["jobs"]
            case["async_vs_sync"] = 1 - jobs["async nereus"]["total_time_s"] / jobs["sync nereus"]["total_time_s"]
            case["async_vs_fixed_async"] = (
                1 - jobs["async nereus"]["total_time_s"] / jobs["async fixed"]["total_time_s"]
            )
            cases.append(case)
            print(
                f"{'':<20}async nereus: {case['async_vs_sync']:.1%} less time than sync nereus, "
                f"{case['async_vs_fixed_async']:.1%} less than async fixed"
            )
    payload = {
        "benchmark": "async RL in the simulator: GRPO, sequence-growth trace",
        "simulator": "cost-model step times, not measured",
        "steps": args.steps,
        "growth": {"start_tokens": growth.start_tokens, "end_tokens": growth.end_tokens},
        "cases": cases,
    }
    write_result(RESULTS, payload, started, repetitions={"wall_s": wall})
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

"""Benchmark (planner, paper-scale, SIMULATED by the cost model): expert parallelism for
mixture-of-experts GRPO.

For Qwen3-30B-A3B and Qwen3-235B-A22B, GRPO (the `grpo` workload preset: 512 samples per step,
prompts of 1024 tokens, responses up to 8192) on 8 to 128 H100s (the `h100` cluster preset):
nereus's plan with ep searched on every model-stage (`MemoryChoices.expert_parallel` = search)
against the best plan with ep pinned to 1, each the exact search's optimum. Per case: predicted
step time, each model-stage's layout, the peak memory per GPU and the step-time gain of ep.
Nothing runs on a GPU: every number is the cost model's prediction (the planner's search time
is measured).

Then the published mixture-of-experts set-ups (nereus/spec/moe_setups.py: verl's GRPO examples
for Qwen3-30B-A3B and Qwen3-235B-A22B on Megatron, slime's Qwen3-30B-A3B script), each on its
own GPU count of H100s: nereus's best plan against the recipe's layout (`published_plan`, with
the rollout's memory share less its weights as KV budget) priced by the same cost model
(`evaluate_plan`), or the reason nereus cannot express that layout (`plan_problems`).

Targets (issue 46): a feasible nereus plan wherever a published set-up exists, and a step time
no worse than the published layout's. Prints a table and writes benchmarks/results/moe_plans.json.

    .venv/bin/python benchmarks/moe_plans.py
    .venv/bin/python benchmarks/moe_plans.py --gpus 16 32 --runs 1
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from _record import begin, write_result
from long_context import timed_plan

from nereus.cost.calibration import DEFAULT_CALIBRATION
from nereus.cost.plan_cost import evaluate_plan, stage_cost_model
from nereus.solver.layouts import MemoryChoices
from nereus.solver.plan_search import PlanRequest
from nereus.spec.check import plan_problems
from nereus.spec.moe_setups import SETUPS, MoESetup, published_plan
from nereus.spec.plan import Plan
from nereus.spec.presets import cluster_preset, models_for, workload_preset
from nereus.spec.stages import ACTOR_GENERATION, ACTOR_TRAINING
from nereus.spec.workload import DTYPE_BYTES

RESULTS = Path(__file__).resolve().parent / "results" / "moe_plans.json"
GIB = 2**30
MODELS = ("qwen3-30b-a3b", "qwen3-235b-a22b")
GPU_COUNTS = (8, 16, 32, 64, 128)


def _layouts(plan: Plan) -> dict[str, str]:
    return {
        e.model_stage: f"tp={e.tp} ep={e.ep} pp={e.pp} dp={e.dp} m={e.micro_batches}"
        + (f" recompute={e.recompute}" if e.recompute != "none" else "")
        + (f" train_offload={e.train_offload}" if e.train_offload != "none" else "")
        + (" full_shard" if e.full_shard else "")
        + (" offload" if e.offload else "")
        for e in plan.stages
    }


def _summary(plan: Plan) -> dict[str, Any]:
    assert plan.predictions is not None
    return {
        "step_time_s": plan.predictions.step_time_s,
        "stage_times_s": {k: v.time_s for k, v in plan.predictions.model_stages.items()},
        "peak_gib": max(p.peak_memory_bytes for p in plan.predictions.model_stages.values()) / GIB,
        "layouts": _layouts(plan),
        "ep_stages": {e.model_stage: e.ep for e in plan.stages if e.ep > 1},
    }


def measure(model: str, gpus: int, runs: int) -> dict[str, Any]:
    workload = workload_preset("grpo", actor=model)
    base = PlanRequest(cluster_preset("h100", gpus), models_for(workload, None), workload, gpus)
    row: dict[str, Any] = {"model": model, "gpus": gpus}
    row["with_ep"] = timed_plan(base, runs, _summary)
    row["without_ep"] = timed_plan(
        dataclasses.replace(base, choices=MemoryChoices(expert_parallel=(False,))), runs, _summary
    )
    with_ep, without = row["with_ep"], row["without_ep"]
    if "step_time_s" in with_ep and "step_time_s" in without:
        row["gain"] = 1 - with_ep["step_time_s"] / without["step_time_s"]
    return row


def _kv_budget(setup: MoESetup, plan: Plan) -> int:
    """The rollout engine's memory share of a GPU less its weights (vLLM's gpu_memory_utilization)."""
    rollout = plan.stage_plan(ACTOR_GENERATION)
    model = stage_cost_model(plan, rollout.role, rollout.stage, DEFAULT_CALIBRATION)
    weights = model.params_per_gpu(rollout.tp, rollout.pp, rollout.ep) * DTYPE_BYTES[plan.workload.dtype]
    return int(setup.rollout_memory_fraction * plan.cluster.gpu.memory_bytes - weights)


def measure_published(name: str, setup: MoESetup, runs: int) -> dict[str, Any]:
    """nereus's best plan (exact search, ep searched) for the set-up's workload and GPUs against
    the recipe's layout priced by the same cost model, or why nereus cannot express it."""
    workload = setup.workload()
    cluster = cluster_preset("h100", setup.gpus)
    row: dict[str, Any] = {"setup": name, "url": setup.url, "model": workload.actor, "gpus": setup.gpus}
    row["published_layout"], row["published_gpu"] = setup.published, setup.gpu
    request = PlanRequest(cluster, models_for(workload, None), workload, setup.gpus)
    row["nereus"] = timed_plan(request, runs, _summary)
    plan = published_plan(setup, cluster)
    problems = [p.format("published layout") for p in plan_problems(plan) if p.severity == "error"]
    if problems:
        row["published"] = {"not_expressible": problems}
    else:
        plan = published_plan(setup, cluster, _kv_budget(setup, plan))
        evaluation = evaluate_plan(plan)
        row["published"] = {
            **_summary(plan.model_copy(update={"predictions": evaluation.predictions})),
            "fits": evaluation.feasible,
            "memory_problems": evaluation.memory_problems,
        }
        if "step_time_s" in row["nereus"]:
            row["ratio"] = row["nereus"]["step_time_s"] / evaluation.predictions.step_time_s
            row["no_worse"] = row["ratio"] <= 1.0
    row["meets_feasible_target"] = "step_time_s" in row["nereus"]
    return row


def _cell(summary: dict[str, Any]) -> str:
    if "no_plan" in summary:
        return "no plan fits"
    if "not_expressible" in summary:
        return "not expressible: " + summary["not_expressible"][0]
    layouts = summary["layouts"]
    return (
        f"{summary['step_time_s']:7.1f} s  gen {layouts[ACTOR_GENERATION]}; train {layouts[ACTOR_TRAINING]}; "
        f"peak {summary['peak_gib']:.1f} GiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=list(GPU_COUNTS))
    parser.add_argument("--runs", type=int, default=3, help="searches per case (their median search time)")
    args = parser.parse_args()
    started = begin()
    rows = []
    for model in MODELS:
        for gpus in args.gpus:
            row = measure(model, gpus, args.runs)
            rows.append(row)
            gain = f"{row['gain']:+.1%}" if row.get("gain") is not None else "-"
            print(f"{model:16} {gpus:4} GPUs  ep gain {gain:>7}")
            print(f"    with ep:    {_cell(row['with_ep'])}")
            print(f"    without ep: {_cell(row['without_ep'])}")
    published = []
    for name, setup in SETUPS.items():
        row = measure_published(name, setup, args.runs)
        published.append(row)
        ratio = f"{row['ratio']:.2f}" if "ratio" in row else "-"
        print(f"{name:28} {setup.gpus:3} GPUs  nereus / published {ratio}")
        print(f"    nereus:    {_cell(row['nereus'])}")
        extra = ""
        if "fits" in row["published"]:
            extra = (
                ", fits"
                if row["published"]["fits"]
                else ", DOES NOT FIT: " + "; ".join(row["published"]["memory_problems"])
            )
        print(f"    published: {_cell(row['published'])}{extra}")
    payload = {
        "benchmark": "moe_plans",
        "simulated": True,
        "what": "planner predictions (cost model), no GPU run; search times measured",
        "workload": "grpo preset (512 samples per step, prompts 1024, responses median 500, p99 2500, max 8192)",
        "cluster": "h100",
        "results": rows,
        "published": published,
        "published_what": (
            "nereus's best plan (exact search, ep searched) for each published MoE set-up "
            "(nereus/spec/moe_setups.py) on h100 GPUs, against the recipe's layout in nereus's terms "
            "(published_plan, KV budget = the rollout's memory share less its weights) priced by evaluate_plan"
        ),
    }
    repetitions = {
        f"{r['model']}/{r['gpus']}/{k}_search_ms": r[k]["search_ms_runs"]
        for r in rows
        for k in ("with_ep", "without_ep")
    }
    repetitions |= {f"{r['setup']}/nereus_search_ms": r["nereus"]["search_ms_runs"] for r in published}
    write_result(RESULTS, payload, started, repetitions)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

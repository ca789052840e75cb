"""Benchmark: step time of one RL workload under several plans, next to the cost model's prediction.

The tiny PPO workload of examples/plan-tiny-ppo-4rank.yaml (16 prompts, responses up to 12
tokens) runs on 2 CPU ranks with one thread each (this machine has 2 cores; more ranks
than cores would measure contention, not the plan) under four plans:

    colocated-dp2   every model-stage dp=2 on ranks 0 and 1
    tp2             every model-stage tp=2
    tp2-gen-pp2     generation and inference tp=2, training pp=2 (weights resharded each step)
    split-1+1       actor, reference and reward on rank 0; the critic on rank 1 (dp=1 each)

Each plan runs `--steps` RL steps through the same launcher as `nereus run`; the first
`--warmup` steps are dropped. The prediction is the cost model's step time for the plan with
the default calibration (its CPU "GPU" numbers are nominal, not measured: `nereus fit`
calibrates them). Prints a table and writes benchmarks/results/rl_plans.json.

    .venv/bin/python benchmarks/rl_plans.py [--steps 10] [--warmup 2]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any

from _record import begin, write_result

from nereus.cost.plan_cost import evaluate_plan
from nereus.runtime.run.launch import launch
from nereus.runtime.run.run_setup import RunSetup
from nereus.solver.admission import plan_problems
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig, RunConfig
from nereus.spec.stages import ACTOR_TRAINING, CRITIC_INFERENCE, CRITIC_TRAINING

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "plan-tiny-ppo-4rank.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "rl_plans.json"
NUM_RANKS = 2
#: (tp, pp, dp, emus, micro_batches) of every model-stage, by plan; a missing model-stage
#: takes the plan's `*` entry.
LAYOUTS: dict[str, dict[str, tuple[int, int, int, list[list[int]], int]]] = {
    "colocated-dp2": {"*": (1, 1, 2, [[0], [1]], 1)},
    "tp2": {"*": (2, 1, 1, [[0, 1]], 1)},
    "tp2-gen-pp2": {
        "*": (2, 1, 1, [[0, 1]], 1),
        ACTOR_TRAINING: (1, 2, 1, [[0, 1]], 2),
        CRITIC_TRAINING: (1, 2, 1, [[0, 1]], 2),
    },
    "split-1+1": {
        "*": (1, 1, 1, [[0]], 1),
        CRITIC_INFERENCE: (1, 1, 1, [[1]], 1),
        CRITIC_TRAINING: (1, 1, 1, [[1]], 1),
    },
}


def make_plan(name: str) -> Plan:
    """The example's models and workload with the named layouts on 2 ranks."""
    example = load_document(EXAMPLE)
    assert isinstance(example, Plan)
    document = example.model_dump(mode="json")
    document["cluster"]["gpus_per_node"] = NUM_RANKS
    layouts = LAYOUTS[name]
    stages, pools = [], {}
    for entry in document["stages"]:
        tp, pp, dp, emus, micro_batches = layouts.get(entry["model_stage"], layouts["*"])
        gpus = sorted({gpu for emu in emus for gpu in emu})
        pool = "rank" + "-".join(map(str, gpus))
        pools[pool] = gpus
        stages.append(
            {**entry, "pool": pool, "tp": tp, "pp": pp, "dp": dp, "emus": emus, "micro_batches": micro_batches}
        )
    document["stages"] = stages
    document["pools"] = [{"name": pool, "gpus": gpus} for pool, gpus in pools.items()]
    document.pop("predictions", None)
    return Plan.model_validate(document)


def measure(name: str, num_steps: int, warmup: int, config: RLConfig) -> dict[str, Any]:
    plan = make_plan(name)
    problems = plan_problems(plan, NUM_RANKS, config)
    assert not problems, problems
    predicted = evaluate_plan(plan).predictions
    with tempfile.TemporaryDirectory(prefix="nereus-rl-plans-") as folder:
        run = RunConfig(rl=config, num_steps=num_steps, checkpoint_every=num_steps)
        setup = RunSetup(run, plan, NUM_RANKS, Path(folder) / "run", 0, None, planned=False)
        records = launch(setup)[warmup:]
    stage_names = sorted(records[0].stage_seconds)
    return {
        "plan": name,
        "measured_step_s": statistics.mean(m.step_seconds for m in records),
        "measured_step_s_stdev": statistics.stdev(m.step_seconds for m in records) if len(records) > 1 else 0.0,
        "predicted_step_s": predicted.step_time_s,
        "measured_stage_s": {n: statistics.mean(m.stage_seconds[n] for m in records) for n in stage_names},
        "predicted_stage_s": {n: p.time_s for n, p in predicted.model_stages.items()},
        "rewards": [m.reward for m in records],
        "step_seconds": [m.step_seconds for m in records],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="RL steps per plan")
    parser.add_argument("--warmup", type=int, default=2, help="first steps dropped")
    parser.add_argument("--plans", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    recording = begin()
    config = RLConfig(task="sort", seed=0)
    results = [measure(name, args.steps, args.warmup, config) for name in args.plans]
    fastest = min(r["measured_step_s"] for r in results)
    print(f"{'plan':<16}{'measured s':>11}{'(stdev)':>9}{'predicted s':>12}{'pred/meas':>10}{'vs fastest':>11}")
    for r in results:
        print(
            f"{r['plan']:<16}{r['measured_step_s']:>11.3f}{r['measured_step_s_stdev']:>9.3f}"
            f"{r['predicted_step_s']:>12.4f}{r['predicted_step_s'] / r['measured_step_s']:>10.3f}"
            f"{r['measured_step_s'] / fastest:>10.2f}x"
        )
    step_seconds = {r["plan"]: r.pop("step_seconds") for r in results}
    record = {
        "workload": "tiny PPO, 16 prompts, sort task",
        "num_ranks": NUM_RANKS,
        "threads_per_rank": 1,
        "steps": args.steps,
        "warmup": args.warmup,
        "machine": platform.platform(),
        "runs": results,
    }
    write_result(RESULTS, record, recording, {"step_s_after_warmup": step_seconds})


if __name__ == "__main__":
    main()

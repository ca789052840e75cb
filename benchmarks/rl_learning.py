"""Benchmark: does the plan-driven RL loop learn? PPO and GRPO on the sort task, 2 CPU ranks.

The tiny models of examples/plan-tiny-ppo-4rank.yaml start from random weights; every
model-stage runs colocated as dp=2 on ranks 0 and 1 (one thread each). PPO: 16 prompts
per step; GRPO: 8 prompts x 4 samples. Prints the reward curve (mean per 5 steps), the
mean reward of the first and last 10 steps, the mean step time per model-stage, and writes
benchmarks/results/rl_learning.json.

`--main-job` runs the README's main job instead, `examples/run-learn.yaml` as it is (4 ranks,
its supervised warm-start, 130 GRPO steps), and writes benchmarks/results/rl_main_job.json:
the per-step rewards, the mean of the first and last 10 steps and the wall time.

    .venv/bin/python benchmarks/rl_learning.py [--steps 50] [--algorithms ppo grpo]
    .venv/bin/python benchmarks/rl_learning.py --main-job
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _record import begin, write_result

from nereus.runtime.run.launch import launch
from nereus.runtime.run.run_setup import RunSetup
from nereus.runtime.run.summary import reward_means, summarize
from nereus.solver.admission import plan_problems
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig, RunConfig
from nereus.spec.run_folder import StepMetrics

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "plan-tiny-ppo-4rank.yaml"
MAIN_JOB = EXAMPLE.with_name("run-learn.yaml")
RESULTS = Path(__file__).resolve().parent / "results" / "rl_learning.json"
MAIN_JOB_RESULTS = RESULTS.with_name("rl_main_job.json")
NUM_RANKS = 2


def colocated_plan(algorithm: str) -> Plan:
    """The example's workload and models with every model-stage as dp=2 over ranks 0 and 1."""
    example = load_document(EXAMPLE)
    assert isinstance(example, Plan)
    document = example.model_dump(mode="json")
    document["cluster"]["gpus_per_node"] = NUM_RANKS
    document["pools"] = [{"name": "all", "gpus": list(range(NUM_RANKS))}]
    grpo = algorithm == "grpo"
    document["workload"].update(
        algorithm=algorithm,
        critic=None if grpo else "tiny",
        prompts_per_step=8 if grpo else 16,
        samples_per_prompt=4 if grpo else 1,
    )
    document["stages"] = [
        {**entry, "tp": 1, "pp": 1, "dp": NUM_RANKS, "emus": [[rank] for rank in range(NUM_RANKS)], "micro_batches": 1}
        for entry in document["stages"]
        if not (grpo and entry["model_stage"].startswith("critic"))
    ]
    return Plan.model_validate(document)


def run(algorithm: str, num_steps: int, config: RLConfig) -> dict[str, Any]:
    plan = colocated_plan(algorithm)
    problems = plan_problems(plan, NUM_RANKS, config)
    assert not problems, problems
    start = time.perf_counter()
    # What `nereus run` runs (checkpoints and metrics.jsonl included), in a throwaway run folder.
    with tempfile.TemporaryDirectory(prefix="rl-learning-") as folder:
        setup = RunSetup(
            RunConfig(rl=config, num_steps=num_steps), plan, NUM_RANKS, Path(folder) / "run", 0, None, False
        )
        metrics: list[StepMetrics] = launch(setup)
        wall = time.perf_counter() - start
        summary = summarize(setup.out, metrics, wall, num_ranks=NUM_RANKS, first_step=0, num_steps=num_steps)
    return {
        "algorithm": algorithm,
        "steps": num_steps,
        "wall_s": wall,
        "reward_first10": summary.reward_first10,
        "reward_last10": summary.reward_last10,
        "rewards": [m.reward for m in metrics],
        "kl": [m.kl for m in metrics],
        "response_len_mean": [m.response_len_mean for m in metrics],
        "mean_stage_seconds": summary.mean_stage_s,
    }


def main_job() -> None:
    """The README's main job: `nereus run examples/run-learn.yaml` as a user runs it (its
    output is printed as it comes); the per-step rewards of its run folder on record."""
    import subprocess
    import sys

    from nereus.spec.run_folder import read_metrics

    recording = begin()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rl-main-job-") as folder:
        out = Path(folder) / "run"
        command = [sys.executable, "-m", "nereus", "run", str(MAIN_JOB), "--out", str(out)]
        subprocess.run(command, check=True)
        records = read_metrics(out)
    wall = time.perf_counter() - start
    rewards = [record["reward"] for record in records]
    first, last = reward_means(rewards)
    assert first is not None and last is not None, "the main job ran no step"
    curve = [statistics.mean(rewards[i : i + 10]) for i in range(0, len(rewards), 10)]
    print(f"main job: reward per 10 steps {' '.join(f'{r:.3f}' for r in curve)}")
    print(f"mean reward: first 10 steps {first:.3f}, last 10 steps {last:.3f} ({last / first:.2f}x) in {wall:.1f} s")
    record = {
        "config": str(MAIN_JOB.relative_to(MAIN_JOB.parent.parent)),
        "wall_s": wall,
        "reward_first10": first,
        "reward_last10": last,
        "rewards": rewards,
        "kl": [record["kl"] for record in records],
        "step_seconds": [record["step_seconds"] for record in records],
    }
    write_result(MAIN_JOB_RESULTS, record, recording, {"reward": rewards, "wall_s": [wall]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--algorithms", nargs="+", default=["ppo", "grpo"], choices=["ppo", "grpo", "remax"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--main-job", action="store_true", help="run examples/run-learn.yaml as the README does")
    args = parser.parse_args()
    if args.main_job:
        main_job()
        return
    recording = begin()
    config = RLConfig(task="sort", seed=args.seed)
    results = [run(algorithm, args.steps, config) for algorithm in args.algorithms]
    for result in results:
        curve = [statistics.mean(result["rewards"][i : i + 5]) for i in range(0, len(result["rewards"]), 5)]
        print(f"{result['algorithm']}: reward per 5 steps {' '.join(f'{r:.3f}' for r in curve)}")
    print(f"{'algorithm':<10}{'steps':>6}{'first10':>9}{'last10':>9}{'wall s':>8}  mean seconds per model-stage")
    for result in results:
        stages = ", ".join(f"{k} {v:.3f}" for k, v in result["mean_stage_seconds"].items())
        print(
            f"{result['algorithm']:<10}{result['steps']:>6}{result['reward_first10']:>9.3f}"
            f"{result['reward_last10']:>9.3f}{result['wall_s']:>8.1f}  {stages}"
        )
    record = {"config": config.model_dump(), "num_ranks": NUM_RANKS, "machine": platform.platform(), "runs": results}
    # One deterministic run per algorithm: its per-step rewards are the raw numbers.
    write_result(RESULTS, record, recording, {"reward": {r["algorithm"]: r["rewards"] for r in results}})


if __name__ == "__main__":
    main()

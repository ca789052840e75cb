"""Benchmark: generation tokens/s of nereus's continuous-batching engine, the static engine it
replaced, and transformers' `generate`, on the same model, prompts and lengths.

The model is a random Llama made and saved by `transformers` (4 layers, hidden 256, 8 heads
over 4 KV heads, vocabulary 1024, fp32), loaded by nereus from the saved folder. The batch:
`--samples` prompts of 8-24 random tokens; EOS off, every sample stopping at its own length
budget, either all equal (`uniform`) or drawn from a long-tailed log-normal (`long-tail`:
median, p99 and cap below). Greedy and sampled (temperature 1, top-p 0.9).

nereus runs on 1 rank (tp=1) and on 2 ranks (tp=2), one thread per rank; transformers runs
in one process with as many threads as nereus has ranks. `generate` cannot stop rows at
different lengths, so it decodes every row to the longest budget (`min_new_tokens` =
`max_new_tokens`): that is what a static batch does to a long tail. tokens/s counts the
tokens the workload asked for (the sum of the budgets) over wall time for every engine,
median over `--reps` repetitions; nereus's two engines alternate repetitions, transformers
runs after them. nereus's engines must give identical samples (checked), and nereus's greedy
tokens are compared with transformers' on the uniform mix.

`long-tail-kv` is the long tail where memory binds: each rank's KV cache may hold only
`--kv-fraction` of the batch's tokens (at tp=1; tp=2 ranks hold half the heads, so twice the
tokens), an emulation of GPU memory pressure on a CPU. The static engine and transformers then
run the batch in waves of rows preallocated to their prompt width plus longest budget; nereus
admits and preempts by what the sequences actually hold.

    .venv/bin/python benchmarks/generation.py
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _record import begin, write_result

from nereus.runtime.dist import spawn
from nereus.runtime.engine import Engine
from nereus.runtime.generate import SamplingConfig, generate
from nereus.runtime.hf.load import load_engine
from nereus.runtime.kv_cache import KVBudget, replica_kv_bytes_per_token
from nereus.runtime.shard_layout import RankLayout
from nereus.spec.hf_config import model_from_hf_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "generation.json"
ENGINES = ("continuous", "static")
MODES = ("greedy", "sampled")


def make_model(folder: Path, seed: int) -> Path:
    """A random fp32 Llama saved by transformers, with O(0.1) weights so tokens vary."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
    model.save_pretrained(folder)
    return folder


def workload(args: argparse.Namespace) -> tuple[list[list[int]], dict[str, tuple[list[int], float | None]]]:
    """The prompts, and each mix's length budgets and KV budget (a share of the whole batch's
    cache at tp=1; None: unbounded), seeded."""
    rng = np.random.default_rng(args.seed)
    prompts = [[int(t) for t in rng.integers(1, 1024, int(n))] for n in rng.integers(8, 25, args.samples)]
    sigma = np.log(args.p99 / args.median) / 2.326
    drawn = np.round(args.median * np.exp(sigma * rng.standard_normal(args.samples)))
    tail = np.clip(drawn, 1, args.max)
    tail_budgets = [int(n) for n in tail]
    return prompts, {
        "uniform": ([args.uniform] * args.samples, None),
        "long-tail": (tail_budgets, None),
        "long-tail-kv": (tail_budgets, args.kv_fraction),
    }


def sampling(mode: str, longest: int, seed: int) -> SamplingConfig:
    if mode == "greedy":
        return SamplingConfig(longest, seed=seed)
    return SamplingConfig(longest, temperature=1.0, top_p=0.9, seed=seed)


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def static_waves(prompts: list[list[int]], budgets: list[int], kv_tokens: float) -> list[tuple[int, int]]:
    """Consecutive row ranges a static engine runs one after another when its KV cache may hold
    `kv_tokens` tokens: it preallocates every row to the batch's prompt width plus its longest budget."""
    waves, start = [], 0
    while start < len(prompts):
        stop = start + 1
        while stop < len(prompts):
            width = max(len(p) for p in prompts[start : stop + 1]) + max(budgets[start : stop + 1])
            if (stop + 1 - start) * width > kv_tokens:
                break
            stop += 1
        waves.append((start, stop))
        start = stop
    return waves


def kv_budget_bytes(model: Any, prompts: list[list[int]], budgets: list[int], fraction: float | None) -> int | None:
    """Per-rank bytes of `fraction` of the whole batch's KV cache on one rank (None: unbounded)."""
    if fraction is None:
        return None
    return int(fraction * sum(len(p) + n for p, n in zip(prompts, budgets, strict=True)) * token_bytes(model, 1))


def token_bytes(model: Any, tp: int) -> int:
    return replica_kv_bytes_per_token(model, tp, 1, 4)


def timed_engine(engine: Engine, name: str, prompts: list, config: SamplingConfig, budgets: list, kv: int | None):
    """(slowest rank's seconds, responses) of one engine on the batch under `kv` bytes per rank."""
    dist.barrier()
    started = time.perf_counter()
    if name == "continuous":
        responses = generate(engine, prompts, config, budgets=budgets, kv_budget=KVBudget(budget_bytes=kv)).responses()
    else:
        tokens = math.inf if kv is None else kv / token_bytes(engine.model, engine.groups.tp.size)
        responses = []
        for a, b in static_waves(prompts, budgets, tokens):
            part = generate(engine, prompts[a:b], config, range(a, b), budgets[a:b], strategy="static")
            responses += part.responses()
    return slowest(time.perf_counter() - started), responses


def nereus_worker(rank: int, world: int, folder: Path, prompts: list[list[int]], mixes: dict, args: Any) -> dict:
    torch.set_num_threads(1)
    model = model_from_hf_config(folder)
    engine = Engine.create(model, "lm", RankLayout(world, 1, 1, tuple(range(world))))
    assert engine is not None and load_engine(engine, folder) == []
    out: dict[str, Any] = {}
    for mix, (budgets, fraction) in mixes.items():
        kv = kv_budget_bytes(model, prompts, budgets, fraction)
        for mode in MODES:
            config = sampling(mode, max(budgets), args.seed)
            times: dict[str, list[float]] = {name: [] for name in ENGINES}
            responses: dict[str, Any] = {}
            for rep in range(args.warmup + args.reps):
                for name in ENGINES:
                    elapsed, responses[name] = timed_engine(engine, name, prompts, config, budgets, kv)
                    if rep >= args.warmup:
                        times[name].append(elapsed)
            out[f"{mix}/{mode}"] = {
                "times": times,
                "same_samples": responses["continuous"] == responses["static"],
                "responses": responses["continuous"],
                "kv_budget_bytes": kv,
            }
    return out


def transformers_times(
    folder: Path, prompts: list[list[int]], budgets: list[int], mode: str, args: Any, threads: int, kv_tokens: float
) -> tuple[list[float], list[list[int]]]:
    """Wall times of transformers' generate on the batch (left-padded; in the static engine's
    waves when the KV cache is bounded), and its tokens."""
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    options: dict[str, Any] = {"do_sample": False} if mode == "greedy" else {"do_sample": True, "top_p": 0.9}
    times, generated = [], []
    for rep in range(args.warmup + args.reps):
        torch.manual_seed(args.seed + rep)
        started = time.perf_counter()
        generated = []
        for a, b in static_waves(prompts, budgets, kv_tokens):
            wave, longest = prompts[a:b], max(budgets[a:b])
            width = max(len(p) for p in wave)
            tokens = torch.tensor([[0] * (width - len(p)) + p for p in wave])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in wave])
            with torch.no_grad():
                out = model.generate(
                    input_ids=tokens,
                    attention_mask=mask,
                    max_new_tokens=longest,
                    min_new_tokens=longest,
                    pad_token_id=0,
                    temperature=1.0,
                    **options,
                )
            generated += out[:, width:].tolist()
        if rep >= args.warmup:
            times.append(time.perf_counter() - started)
    return times, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=32, help="prompts in the batch")
    parser.add_argument("--uniform", type=int, default=48, help="response length of the uniform mix")
    parser.add_argument("--median", type=int, default=16, help="long-tail mix: median response length")
    parser.add_argument("--p99", type=int, default=160, help="long-tail mix: 99th percentile")
    parser.add_argument("--max", type=int, default=192, help="long-tail mix: cap")
    parser.add_argument("--kv-fraction", type=float, default=0.25, help="long-tail-kv: KV cache share of the batch")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions of each engine")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, prompts, lengths and sampling")
    args = parser.parse_args()
    recording = begin()
    prompts, mixes = workload(args)
    tail = mixes["long-tail"][0]
    rows, repetitions = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(Path(tmp) / "llama", args.seed)
        model = model_from_hf_config(folder)
        for ranks in (1, 2):
            measured = spawn(nereus_worker, ranks, folder, prompts, mixes, args)[0]
            for case, result in measured.items():
                mix, mode = case.split("/")
                budgets, fraction = mixes[mix]
                kv = kv_budget_bytes(model, prompts, budgets, fraction)
                kv_tokens = math.inf if kv is None else kv / token_bytes(model, 1)
                hf_times, hf_tokens = transformers_times(folder, prompts, budgets, mode, args, ranks, kv_tokens)
                wanted = sum(budgets)
                times = {**result["times"], "transformers": hf_times}
                rate = {name: wanted / statistics.median(t) for name, t in times.items()}
                agree = None
                if mode == "greedy" and mix == "uniform":
                    pairs = zip(result["responses"], hf_tokens, strict=True)
                    agree = sum(ours == theirs for ours, theirs in pairs) / len(prompts)
                key = f"tp{ranks}/{mix}/{mode}"
                repetitions[key] = times
                rows.append(
                    {
                        "ranks": ranks,
                        "tp": ranks,
                        "mix": mix,
                        "mode": mode,
                        "tokens": wanted,
                        "tokens_per_s": {
                            "nereus": rate["continuous"],
                            "static": rate["static"],
                            "transformers": rate["transformers"],
                        },
                        "nereus_over_transformers": rate["continuous"] / rate["transformers"],
                        "nereus_over_static": rate["continuous"] / rate["static"],
                        "same_samples_nereus_static": result["same_samples"],
                        "kv_budget_bytes_per_rank": result["kv_budget_bytes"],
                        "greedy_same_as_transformers": agree,
                    }
                )
                print(
                    f"tp={ranks} {mix:>9} {mode:>7}: nereus {rate['continuous']:8.0f} tok/s, static "
                    f"{rate['static']:8.0f}, transformers {rate['transformers']:8.0f} -> "
                    f"{rate['continuous'] / rate['transformers']:.2f}x transformers, "
                    f"{rate['continuous'] / rate['static']:.2f}x static; same samples {result['same_samples']}"
                    + ("" if agree is None else f"; greedy = transformers for {agree:.0%} of rows")
                )
    payload = {
        "benchmark": "generation",
        "model": "random Llama: 4 layers, hidden 256, 8 heads / 4 KV heads, vocab 1024, fp32",
        "samples": args.samples,
        "lengths": {"uniform": args.uniform, "long_tail": {"median": args.median, "p99": args.p99, "max": args.max}},
        "drawn_long_tail": {"median": float(np.median(tail)), "max": max(tail)},
        "kv_fraction": args.kv_fraction,
        "kv_note": (
            "long-tail-kv: each rank's KV cache may hold kv_fraction of the whole batch's tokens at tp=1 "
            "(emulating GPU memory pressure on a CPU); the static engine and transformers then run the batch "
            "in waves of rows preallocated to prompt width + longest budget, nereus batches continuously "
            "(tp=2 ranks hold half the heads, so the same bytes hold twice the tokens)"
        ),
        "reps": args.reps,
        "threads_per_rank": 1,
        "transformers_threads": "as many as nereus has ranks",
        "tokens_per_s_counts": "tokens the workload asked for (sum of budgets) / median wall time",
        "rows": rows,
    }
    write_result(RESULTS, payload, recording, repetitions)
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

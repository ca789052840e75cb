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

    .venv/bin/python benchmarks/generation.py
"""

from __future__ import annotations

import argparse
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


def workload(args: argparse.Namespace) -> tuple[list[list[int]], dict[str, list[int]]]:
    """The prompts and each mix's length budgets (seeded)."""
    rng = np.random.default_rng(args.seed)
    prompts = [[int(t) for t in rng.integers(1, 1024, int(n))] for n in rng.integers(8, 25, args.samples)]
    sigma = np.log(args.p99 / args.median) / 2.326
    drawn = np.round(args.median * np.exp(sigma * rng.standard_normal(args.samples)))
    tail = np.clip(drawn, 1, args.max)
    return prompts, {"uniform": [args.uniform] * args.samples, "long-tail": [int(n) for n in tail]}


def sampling(mode: str, longest: int, seed: int) -> SamplingConfig:
    if mode == "greedy":
        return SamplingConfig(longest, seed=seed)
    return SamplingConfig(longest, temperature=1.0, top_p=0.9, seed=seed)


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def nereus_worker(rank: int, world: int, folder: Path, prompts: list[list[int]], mixes: dict, args: Any) -> dict:
    torch.set_num_threads(1)
    model = model_from_hf_config(folder)
    engine = Engine.create(model, "lm", RankLayout(world, 1, 1, tuple(range(world))))
    assert engine is not None and load_engine(engine, folder) == []
    out: dict[str, Any] = {}
    for mix, budgets in mixes.items():
        for mode in MODES:
            config = sampling(mode, max(budgets), args.seed)
            times: dict[str, list[float]] = {name: [] for name in ENGINES}
            responses: dict[str, Any] = {}
            for rep in range(args.warmup + args.reps):
                for name in ENGINES:
                    dist.barrier()
                    started = time.perf_counter()
                    result = generate(engine, prompts, config, budgets=budgets, strategy=name)  # type: ignore[arg-type]
                    elapsed = slowest(time.perf_counter() - started)
                    if rep >= args.warmup:
                        times[name].append(elapsed)
                    responses[name] = result.responses()
            out[f"{mix}/{mode}"] = {
                "times": times,
                "same_samples": responses["continuous"] == responses["static"],
                "responses": responses["continuous"],
            }
    return out


def transformers_times(folder: Path, prompts: list[list[int]], budgets: list[int], mode: str, args: Any, threads: int):
    """Wall times of transformers' generate on the whole batch (left-padded), and its tokens."""
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    longest = max(budgets)
    options: dict[str, Any] = {"do_sample": False} if mode == "greedy" else {"do_sample": True, "top_p": 0.9}
    times, generated = [], None
    for rep in range(args.warmup + args.reps):
        torch.manual_seed(args.seed + rep)
        started = time.perf_counter()
        with torch.no_grad():
            generated = model.generate(
                input_ids=tokens,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=0,
                temperature=1.0,
                top_k=0,
                **options,
            )
        if rep >= args.warmup:
            times.append(time.perf_counter() - started)
    assert generated is not None
    return times, generated[:, width:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=32, help="prompts in the batch")
    parser.add_argument("--uniform", type=int, default=48, help="response length of the uniform mix")
    parser.add_argument("--median", type=int, default=16, help="long-tail mix: median response length")
    parser.add_argument("--p99", type=int, default=160, help="long-tail mix: 99th percentile")
    parser.add_argument("--max", type=int, default=192, help="long-tail mix: cap")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions of each engine")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, prompts, lengths and sampling")
    args = parser.parse_args()
    recording = begin()
    prompts, mixes = workload(args)
    rows, repetitions = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(Path(tmp) / "llama", args.seed)
        for ranks in (1, 2):
            measured = spawn(nereus_worker, ranks, folder, prompts, mixes, args)[0]
            for case, result in measured.items():
                mix, mode = case.split("/")
                hf_times, hf_tokens = transformers_times(folder, prompts, mixes[mix], mode, args, ranks)
                wanted = sum(mixes[mix])
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
        "drawn_long_tail": {"median": float(np.median(mixes["long-tail"])), "max": max(mixes["long-tail"])},
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

"""Benchmark: generation tokens/s of nereus's continuous-batching engine and transformers'
`generate`, on the same model, prompts and lengths.

The model is a random Llama made and saved by `transformers` (`--model default`: 4 layers,
hidden 256, 8 heads over 4 KV heads, vocabulary 1024, fp32; `--model tiny`: the size
benchmarks/trl_compare.py trains, 4 layers, hidden 64, 4 heads over 2 KV heads, vocabulary 40,
tied embeddings, where per-op overhead, not arithmetic, sets the speed), loaded by nereus from
the saved folder. The batch:
`--samples` prompts of 8-24 random tokens; EOS off, every sample stopping at its own length
budget, either all equal (`uniform`) or RLHFuse's long tail (`long-tail`: most samples short,
log-normal around --median and at most a quarter of the cap, --long-fraction of them near the
cap, uniform over its last 15%, at seeded random positions). Greedy and sampled (temperature 1, top-p 0.9).

nereus runs on 1 rank (tp=1) and on 2 ranks (tp=2), one thread per rank
(torch.set_num_threads(1)). transformers runs in the same rank processes, also one thread
each: on 1 rank it generates the whole batch, on 2 ranks each rank generates its half (data
parallel, the fastest way two one-thread processes run it; one process with two threads
spends the second core less well). `generate` cannot stop rows at different lengths, so it
decodes every row to its batch's longest budget (`min_new_tokens` = `max_new_tokens`): that
is what a static batch does to a long tail. tokens/s counts the tokens the workload asked for
(the sum of the budgets) over the slowest rank's wall time for both engines. Each repetition
runs nereus and transformers back to back, in an order alternated every repetition, so both
see the same machine load; the ratios quoted are medians of the per-repetition (paired)
ratios, tokens/s the median over repetitions. nereus's greedy tokens are compared with
transformers' on the uniform mix. (Until the static engine left nereus, a third column timed
it; benchmarks/README.md keeps those numbers.)

`long-tail-kv` is the long tail where memory binds: each rank's KV cache may hold only
`--kv-fraction` of the batch's tokens (at tp=1; tp=2 ranks hold half the heads, so twice the
tokens), an emulation of GPU memory pressure on a CPU. transformers then runs the batch in
waves of rows preallocated to their prompt width plus longest budget; nereus admits and
preempts by what the sequences actually hold.

The compute floor beside the engines: the time, on one thread, of the model's matrix
multiplications alone (every linear layer and the LM head, this rank's tensor-parallel shard of
each weight) for the same token counts the continuous engine feeds them: one prefill of every
prompt, then one decode step per generated token over the rows still running (the unbounded
schedule, so a floor for the KV-bound mix too). It counts no attention, norms, sampling or
Python, so no engine can reach it; how far each is from it is the overhead left.

    .venv/bin/python benchmarks/generation.py
    .venv/bin/python benchmarks/generation.py --model tiny
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

from nereus.cost.kv_pool import KV_ELEMENT_BYTES
from nereus.cost.stage import kv_bytes_per_token
from nereus.runtime.comm.spawn import spawn
from nereus.runtime.generation.continuous import BatchingDecoder
from nereus.runtime.generation.generate import SamplingConfig, generate
from nereus.runtime.generation.kv_cache import KVBudget
from nereus.runtime.hf.load import load_engine
from nereus.runtime.model.engine import Engine
from nereus.runtime.state.shard_layout import RankLayout
from nereus.runtime.state.sharded_state import even_split
from nereus.spec.hf_config import model_from_hf_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = {"default": ROOT / "benchmarks" / "results" / "generation.json"}
RESULTS["tiny"] = ROOT / "benchmarks" / "results" / "generation_tiny.json"
#: The models timed, as transformers LlamaConfig fields.
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "default": {
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 1024,
        "tie_word_embeddings": False,
    },
    "tiny": {  # benchmarks/trl_compare.py's model
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 40,
        "tie_word_embeddings": True,
    },
}
MODEL_NOTES = {
    "default": "random Llama: 4 layers, hidden 256, 8 heads / 4 KV heads, vocab 1024, fp32",
    "tiny": "random Llama of trl_compare's size: 4 layers, hidden 64, 4 heads / 2 KV heads, vocab 40, tied, fp32",
}
ENGINES = ("continuous", "transformers")
MODES = ("greedy", "sampled")


def make_model(folder: Path, seed: int, size: str) -> Path:
    """A random fp32 Llama of `MODEL_SIZES[size]` saved by transformers, with O(0.1) weights so tokens vary."""
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        **MODEL_SIZES[size],
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
    vocab = MODEL_SIZES[args.model]["vocab_size"]
    prompts = [[int(t) for t in rng.integers(1, vocab, int(n))] for n in rng.integers(8, 25, args.samples)]
    num_long = round(args.long_fraction * args.samples)
    short = np.clip(np.rint(args.median * np.exp(0.4 * rng.standard_normal(args.samples - num_long))), 1, args.max // 4)
    long = rng.integers(math.ceil(0.85 * args.max), args.max + 1, num_long)
    tail_budgets = [int(n) for n in rng.permutation(np.concatenate([short, long]))]
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
    """Consecutive row ranges a static batch (transformers') runs one after another when its KV
    cache may hold `kv_tokens` tokens: it preallocates every row to the batch's prompt width plus
    its longest budget."""
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
    return kv_bytes_per_token(model, tp, 1, KV_ELEMENT_BYTES)


def timed_engine(engine: Engine, prompts: list, config: SamplingConfig, budgets: list, kv: int | None):
    """(slowest rank's seconds, responses) of nereus's engine on the batch under `kv` bytes per rank."""
    dist.barrier()
    started = time.perf_counter()
    responses = generate(engine, prompts, config, budgets=budgets, kv_budget=KVBudget(budget_bytes=kv)).responses()
    return slowest(time.perf_counter() - started), responses


def transformers_generate(model: Any, prompts: list, budgets: list, mode: str, kv_tokens: float, seed: int) -> list:
    """transformers' generate on these rows (left-padded; in waves when the KV cache is
    bounded, `static_waves`): each row's generated tokens."""
    options: dict[str, Any] = {"do_sample": False} if mode == "greedy" else {"do_sample": True, "top_p": 0.9}
    torch.manual_seed(seed)
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
    return generated


def timed_transformers(model: Any, prompts: list, budgets: list, mode: str, kv_tokens: float, seed: int):
    """(slowest rank's seconds, every row's tokens): each rank generates its contiguous share,
    its KV cache holding `kv_tokens` tokens."""
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = even_split(len(prompts), world)[rank]
    dist.barrier()
    started = time.perf_counter()
    mine = transformers_generate(model, prompts[a:b], budgets[a:b], mode, kv_tokens, seed + rank)
    elapsed = slowest(time.perf_counter() - started)
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, mine)
    return elapsed, [row for share in shares for row in share]


def floor_steps(prompts: list[list[int]], budgets: list[int]) -> list[tuple[int, int]]:
    """(tokens through the layers, rows through the LM head) of each forward of the continuous
    engine when every sequence runs at once: the prefill of every prompt, then one decode step
    per generated token (a sample of budget n takes n - 1 of them) over the rows still running."""
    steps = [(sum(len(p) for p in prompts), len(prompts))]
    for step in range(1, max(budgets)):
        rows = sum(budget > step for budget in budgets)
        steps.append((rows, rows))
    return steps


def matmul_floor_s(engine: Engine, steps: list[tuple[int, int]], reps: int = 3) -> float:
    """Seconds (slowest rank, median of `reps`) of this rank's linear layers alone, on one
    thread, over `steps` (`floor_steps`): every layer's weight shard for the tokens, the LM head
    for each row's last token only (the least an engine must compute)."""
    head_name = "lm_head.weight" if "lm_head.weight" in engine.params else "embed.weight"
    layers = [p.detach() for n, p in engine.params.items() if p.dim() == 2 and n not in ("embed.weight", head_name)]
    head = engine.params[head_name].detach()
    widths = {w.shape[1] for w in layers} | {head.shape[1]}
    inputs = {m: {width: torch.randn(m, width) for width in widths} for m in {n for step in steps for n in step}}
    times = []
    for _ in range(reps + 1):  # the first warms up
        dist.barrier()
        started = time.perf_counter()
        with torch.no_grad():
            for tokens, rows in steps:
                for weight in layers:
                    torch.nn.functional.linear(inputs[tokens][weight.shape[1]], weight)
                torch.nn.functional.linear(inputs[rows][head.shape[1]], head)
        times.append(slowest(time.perf_counter() - started))
    return statistics.median(times[1:])


def nereus_worker(rank: int, world: int, folder: Path, prompts: list[list[int]], mixes: dict, args: Any) -> dict:
    import transformers

    torch.set_num_threads(1)
    model = model_from_hf_config(folder)
    engine = Engine.create(model, "lm", RankLayout(world, 1, 1, tuple(range(world))))
    assert engine is not None and load_engine(engine, folder) == []
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out: dict[str, Any] = {}
    for mix, (budgets, fraction) in mixes.items():
        kv = kv_budget_bytes(model, prompts, budgets, fraction)
        kv_tokens = math.inf if kv is None else kv / token_bytes(model, 1)  # transformers keeps tp=1 caches
        for mode in MODES:
            config = sampling(mode, max(budgets), args.seed)
            times: dict[str, list[float]] = {name: [] for name in ENGINES}
            responses: dict[str, Any] = {}
            for rep in range(args.warmup + args.reps):
                shift = rep % len(ENGINES)
                for name in ENGINES[shift:] + ENGINES[:shift]:
                    if name == "transformers":
                        elapsed, responses[name] = timed_transformers(
                            hf, prompts, budgets, mode, kv_tokens, args.seed + rep
                        )
                    else:
                        elapsed, responses[name] = timed_engine(engine, prompts, config, budgets, kv)
                    if rep >= args.warmup:
                        times[name].append(elapsed)
            out[f"{mix}/{mode}"] = {
                "times": times,
                "responses": responses["continuous"],
                "transformers_responses": responses["transformers"],
                "kv_budget_bytes": kv,
            }
        out[f"{mix}/floor_s"] = matmul_floor_s(engine, floor_steps(prompts, budgets))
    out["step_ms"] = decode_step_ms(engine, prompts, args.seed)
    return out


def decode_step_ms(engine: Engine, prompts: list[list[int]], seed: int) -> dict[int, float]:
    """Median milliseconds of one greedy decode step (prefill excluded) by running rows: what
    a long tail's last steps cost against a full batch's."""
    steps: dict[int, float] = {}
    for rows in (1, 4, len(prompts)):
        decoder = BatchingDecoder(engine, SamplingConfig(32, seed=seed), KVBudget())
        decoder.start(prompts[:rows], range(rows), [32] * rows)
        decoder.step()  # admits and prefills
        times = []
        while decoder.num_active:
            dist.barrier()
            started = time.perf_counter()
            decoder.step()
            times.append(slowest(time.perf_counter() - started))
        steps[rows] = 1e3 * statistics.median(times)
    return steps


def paired(times: dict[str, list[float]], slower: str) -> float:
    """Median over repetitions of `slower`'s time over nereus's in the same repetition."""
    return statistics.median(t / n for t, n in zip(times[slower], times["continuous"], strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="default", help="model size (see above)")
    parser.add_argument("--samples", type=int, default=32, help="prompts in the batch")
    parser.add_argument("--uniform", type=int, default=48, help="response length of the uniform mix")
    parser.add_argument("--median", type=int, default=16, help="long-tail mix: median length of the short samples")
    parser.add_argument("--long-fraction", type=float, default=0.1, help="long-tail mix: share of samples near the cap")
    parser.add_argument("--max", type=int, default=192, help="long-tail mix: cap")
    parser.add_argument("--mixes", type=str, default="uniform,long-tail,long-tail-kv", help="length mixes timed")
    parser.add_argument("--ranks", type=str, default="1,2", help="rank counts timed (tp = ranks)")
    parser.add_argument("--kv-fraction", type=float, default=0.25, help="long-tail-kv: KV cache share of the batch")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions of each engine")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, prompts, lengths and sampling")
    args = parser.parse_args()
    recording = begin()
    prompts, every_mix = workload(args)
    mixes = {name: every_mix[name] for name in args.mixes.split(",")}
    tail = every_mix["long-tail"][0]
    rows, repetitions, steps = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(Path(tmp) / "llama", args.seed, args.model)
        for ranks in [int(n) for n in args.ranks.split(",")]:
            measured = spawn(nereus_worker, ranks, folder, prompts, mixes, args)[0]
            step_ms = measured.pop("step_ms")
            steps[f"tp{ranks}"] = step_ms
            print(f"tp={ranks} nereus decode step: " + ", ".join(f"{r} rows {ms:.1f} ms" for r, ms in step_ms.items()))
            floors = {case.split("/")[0]: measured.pop(case) for case in list(measured) if case.endswith("/floor_s")}
            for case, result in measured.items():
                mix, mode = case.split("/")
                budgets, _ = mixes[mix]
                wanted = sum(budgets)
                times = result["times"]
                rate = {name: wanted / statistics.median(t) for name, t in times.items()}
                floor = floors[mix]
                over_floor = {name: statistics.median(t) / floor for name, t in times.items()}
                over_hf = paired(times, "transformers")
                agree = None
                if mode == "greedy" and mix == "uniform":
                    pairs = zip(result["responses"], result["transformers_responses"], strict=True)
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
                            "transformers": rate["transformers"],
                        },
                        "matmul_floor_tokens_per_s": wanted / floor,
                        "time_over_matmul_floor": {
                            "nereus": over_floor["continuous"],
                            "transformers": over_floor["transformers"],
                        },
                        "nereus_over_transformers": over_hf,
                        "kv_budget_bytes_per_rank": result["kv_budget_bytes"],
                        "greedy_same_as_transformers": agree,
                    }
                )
                print(
                    f"tp={ranks} {mix:>9} {mode:>7}: nereus {rate['continuous']:8.0f} tok/s, transformers "
                    f"{rate['transformers']:8.0f}, matmul floor {wanted / floor:8.0f} (nereus "
                    f"{over_floor['continuous']:.1f}x its time) -> {over_hf:.2f}x transformers (paired medians)"
                    + ("" if agree is None else f"; greedy = transformers for {agree:.0%} of rows")
                )
    payload = {
        "benchmark": "generation",
        "model": MODEL_NOTES[args.model],
        "matmul_floor": (
            "one thread per rank, the model's linear layers alone (this rank's tp shard; the LM head for each "
            "row's last token only) for the continuous engine's token counts when every sequence runs at once; "
            "time_over_matmul_floor: each engine's median time over it"
        ),
        "samples": args.samples,
        "lengths": {
            "uniform": args.uniform,
            "long_tail": {"short_median": args.median, "long_fraction": args.long_fraction, "max": args.max},
        },
        "drawn_long_tail": {"median": float(np.median(tail)), "max": max(tail), "budgets": tail},
        "kv_fraction": args.kv_fraction,
        "kv_note": (
            "long-tail-kv: each rank's KV cache may hold kv_fraction of the whole batch's tokens at tp=1 "
            "(emulating GPU memory pressure on a CPU); transformers then runs the batch "
            "in waves of rows preallocated to prompt width + longest budget, nereus batches continuously "
            "(tp=2 ranks hold half the heads, so the same bytes hold twice the tokens)"
        ),
        "reps": args.reps,
        "threads_per_rank": 1,
        "transformers": "in the same rank processes, one thread each; on 2 ranks each generates half the batch",
        "ratios": "median over repetitions of the paired ratio (same repetition, order rotated)",
        "tokens_per_s_counts": "tokens the workload asked for (sum of budgets) / median wall time",
        "rows": rows,
        "nereus_decode_step_ms_by_running_rows": steps,
    }
    results = RESULTS[args.model]
    write_result(results, payload, recording, repetitions)
    print(f"wrote {results.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

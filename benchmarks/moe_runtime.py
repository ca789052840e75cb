"""Benchmark: a tiny Qwen3-MoE GRPO step on 2 ranks with expert parallelism (ep=2) against
data parallelism (ep=1, dp=2).

One gloo world of 2 CPU ranks (one thread each) holds both engines of a tiny Qwen3-MoE
(4 layers, 8 experts of width 64, 2 per token, layer 1 dense; fp32), loaded with the same
seeded weights. A GRPO step on each: sample `--prompts` x `--samples` responses (seeded, so the
same sample ids draw the same tokens on either layout), reward each by its share of even
tokens, group-normalise the rewards into advantages, compute the old log-probs and take one
clipped-policy AdamW update over the whole batch. Under ep=1 each replica samples and scores
its half of the prompts (the results gathered); under ep=2 the one replica's two ranks run
every prompt (the `replicated` dispatch of inference and generation) and split the training
rows (all-to-all dispatch). The two layouts' steps alternate, step by step, so load falls on
both alike. Reports per rank the median step time, each part's median, the state bytes each
engine holds, the process's peak resident memory, and the largest difference between the two
layouts' parameters after the steps (the logical results: target below 1e-5).

Predicted vs measured peak per rank (`--parts peaks`): one `nereus run` of two GRPO steps per
layout of a larger Qwen3-MoE (`PEAK_MODEL`, ~26M parameters, so model state dominates the
peak), every model-stage colocated on both ranks as memory_parity.py's `colocated-fp32` case,
actor training at ep=2 (dp=1) or ep=1 (dp=2); memory_parity.py's `measured_rows` reads each
(model-stage, rank)'s measured peak and the cost model's prediction from the last step's
metrics (target: within 10%).

    .venv/bin/python benchmarks/moe_runtime.py [--steps 7] [--warmup 2] [--parts steps,peaks]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _record import begin, write_result
from memory_parity import TARGET, fixed_mmap_threshold, measured_rows, plan_document

from nereus.runtime.comm import collectives
from nereus.runtime.comm.spawn import spawn
from nereus.runtime.generation.generate import SamplingConfig, generate
from nereus.runtime.model.adamw import AdamWConfig
from nereus.runtime.model.engine import Engine, EngineConfig
from nereus.runtime.model.initialization import init_logical_params
from nereus.runtime.model.transformer import Batch
from nereus.runtime.rl.objectives import PolicyObjective
from nereus.runtime.state.shard_layout import RankLayout, local_box, param_infos
from nereus.runtime.state.sharded_state import even_split
from nereus.spec.model import Model, MoE
from nereus.spec.presets import MODELS
from nereus.spec.stages import ACTOR_TRAINING

RESULTS = Path(__file__).resolve().parent / "results" / "moe_runtime.json"
TOLERANCE = 1e-5
MODEL: Model = MODELS["tiny"].model_copy(
    update={
        "name": "tiny-qwen3-moe",
        "tied_embeddings": False,
        "qk_norm": True,
        "moe": MoE(num_experts=8, experts_per_token=2, expert_ffn_dim=64, norm_topk_prob=True, dense_layers=[1]),
    }
)
LAYOUTS = {"ep1_dp2": RankLayout(1, 1, 2, (0, 1)), "ep2": RankLayout(1, 1, 1, (0, 1), ep=2)}
PROMPT_LEN = 16
#: The peak cases' model: 6 layers of hidden 384 (layer 1 dense), 8 experts of width 384, 2 per
#: token, an 8000-token vocabulary; fp32 (~26M parameters, ~21M of them in the experts).
PEAK_MODEL: Model = MODEL.model_copy(
    update={
        "name": "qwen3-moe-26m",
        "num_layers": 6,
        "hidden_dim": 384,
        "num_heads": 6,
        "num_kv_heads": 2,
        "head_dim": 64,
        "ffn_dim": 1024,
        "vocab_size": 8000,
        "moe": MoE(num_experts=8, experts_per_token=2, expert_ffn_dim=384, norm_topk_prob=True, dense_layers=[1]),
    }
)
PEAK_NEW_TOKENS = 4


def peak_plan(ep: int) -> dict[str, Any]:
    """memory_parity.py's colocated fp32 GRPO plan on 2 ranks with `PEAK_MODEL`, actor training
    at `ep` (ep=2: one replica over both ranks; ep=1: dp=2)."""
    document = plan_document("colocated-fp32")
    model = {"kind": "Model", **PEAK_MODEL.model_dump(mode="json")}
    document["models"] = [model]
    for role in ("actor", "reference", "reward"):
        document["workload"][role] = PEAK_MODEL.name
    training = document["stages"][-1]
    assert training["model_stage"] == ACTOR_TRAINING
    if ep > 1:
        training.update({"dp": 1, "ep": ep, "emus": [[0, 1]]})
    return document


def peak_rows(root: Path) -> list[dict[str, Any]]:
    """Predicted and measured peak per (layout, model-stage, rank) of one `nereus run` per layout."""
    fixed_mmap_threshold()
    rows = []
    for ep in (2, 1):
        layout = f"ep{ep}" if ep > 1 else "ep1_dp2"
        found = measured_rows(peak_plan(ep), root / layout, PEAK_NEW_TOKENS)
        rows += [{"layout": layout, **row} for row in found]
    return rows


def grpo_step(engine: Engine, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, float]:
    """One GRPO step; seconds of each part."""
    seconds: dict[str, float] = {}
    g = engine.groups
    ids = list(range(len(prompts)))
    start, stop = even_split(len(prompts), g.layout.dp)[g.replica]
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, seed=args.seed)
    began = time.perf_counter()
    mine = generate(engine, prompts[start:stop], sampling, sample_ids=ids[start:stop])
    seconds["generation"] = time.perf_counter() - began
    parts = collectives.all_gathered_objects((g.replica, mine.tokens, mine.attention_mask))
    by_replica = {replica: (tokens, mask) for replica, tokens, mask in parts}
    tokens = torch.cat([by_replica[d][0] for d in range(g.layout.dp)])
    mask = torch.cat([by_replica[d][1] for d in range(g.layout.dp)])
    loss_mask = mask.clone()
    loss_mask[:, :PROMPT_LEN] = False
    rewards = ((tokens % 2 == 0) & loss_mask).sum(1).float() / loss_mask.sum(1).clamp(min=1)
    groups = rewards.view(-1, args.samples)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).view(-1)
    began = time.perf_counter()
    old = torch.zeros(tokens.shape)
    rows = even_split(tokens.shape[0], g.layout.dp)[g.replica]
    replica_batch = Batch(tokens[rows[0] : rows[1]], mask[rows[0] : rows[1]])
    mine_old = engine.log_probs(replica_batch)
    old_by_replica = dict(collectives.all_gathered_objects((g.replica, mine_old)))
    old[:, 1:] = torch.cat([old_by_replica[d] for d in range(g.layout.dp)])
    seconds["old_log_probs"] = time.perf_counter() - began
    fields = {
        "loss_mask": loss_mask,
        "old_log_probs": old * loss_mask,
        "advantages": advantages[:, None].expand_as(old).contiguous(),
    }
    objective = PolicyObjective(clip_eps=0.2, kl_loss_coef=0.0, entropy_coef=0.0, loss_agg="token-mean")
    began = time.perf_counter()
    engine.train_step(Batch(tokens, mask, fields), objective, num_microbatches=1)
    seconds["training"] = time.perf_counter() - began
    return seconds


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    logical = init_logical_params(MODEL, "lm", seed=args.seed, randomize_all=True)
    engines = {}
    for name, layout in LAYOUTS.items():
        engine = Engine.create(MODEL, "lm", layout, EngineConfig(optimizer=AdamWConfig(lr=1e-3)))
        assert engine is not None
        engine.load_logical_params(logical)
        engines[name] = engine
    generator = torch.Generator().manual_seed(args.seed)
    times: dict[str, list[float]] = {name: [] for name in engines}
    part_times: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
    for step in range(args.warmup + args.steps):
        prompt_rows = torch.randint(3, MODEL.vocab_size, (args.prompts, PROMPT_LEN), generator=generator)
        prompts = [row for row in prompt_rows.tolist() for _ in range(args.samples)]
        for name, engine in engines.items():  # alternated, step by step
            dist.barrier()
            began = time.perf_counter()
            parts = grpo_step(engine, prompts, args)
            elapsed = time.perf_counter() - began
            if step >= args.warmup:
                times[name].append(elapsed)
                for part, seconds in parts.items():
                    part_times[name].setdefault(part, []).append(seconds)
    # the logical results: the ep=2 rank's shard against the same box of the ep=1 replica's whole weights
    whole, sharded = engines["ep1_dp2"], engines["ep2"]
    g = sharded.groups
    difference = 0.0
    for info in param_infos(MODEL, "lm"):
        box = local_box(info, MODEL, 1, 0, 2, g.ep.rank)
        reference = whole.params[info.name][tuple(slice(s, s + n) for s, n in box)]
        difference = max(difference, float((sharded.params[info.name] - reference).detach().abs().max()))
    return {
        "rank": rank,
        "median_step_s": {name: statistics.median(t) for name, t in times.items()},
        "median_part_s": {
            name: {p: statistics.median(t) for p, t in parts.items()} for name, parts in part_times.items()
        },
        "state_bytes": {name: engine.state_bytes() for name, engine in engines.items()},
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "max_param_difference": difference,
        "times_s": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="Samples per prompt (a GRPO group).")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--parts", default="steps,peaks", help="Comma-separated: steps, peaks.")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"steps", "peaks"}:
        parser.error(f"--parts {args.parts}: choose from steps, peaks")
    started = begin()
    payload: dict[str, Any] = {"ranks": 2, "threads_per_rank": 1}
    repetitions: dict[str, list[float]] = {}
    if "steps" in parts:
        rows = spawn(rank_main, 2, args)
        for row in rows:
            steps = ", ".join(f"{name} {s:.4f} s" for name, s in row["median_step_s"].items())
            ratio = row["median_step_s"]["ep2"] / row["median_step_s"]["ep1_dp2"]
            print(
                f"rank {row['rank']}: {steps} (ep2 / ep1 {ratio:.2f}x); state bytes {row['state_bytes']}; "
                f"parameters differ by at most {row['max_param_difference']:.2e}"
            )
        payload |= {
            "model": MODEL.model_dump(mode="json"),
            "layouts": {n: {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep} for n, lay in LAYOUTS.items()},
            "prompts": args.prompts,
            "samples_per_prompt": args.samples,
            "prompt_len": PROMPT_LEN,
            "new_tokens": args.new_tokens,
            "steps": args.steps,
            "tolerance": TOLERANCE,
            "identical_within_tolerance": all(row["max_param_difference"] < TOLERANCE for row in rows),
            "rows": [{k: v for k, v in row.items() if k != "times_s"} for row in rows],
        }
        repetitions = {f"rank{row['rank']}/{name}_s": t for row in rows for name, t in row["times_s"].items()}
    if "peaks" in parts:
        with tempfile.TemporaryDirectory(prefix="nereus-moe-peaks-") as root:
            peaks = peak_rows(Path(root))
        print(f"{'layout':8} {'model-stage':22} rank {'predicted MB':>12} {'measured MB':>12} {'error':>7}")
        for row in peaks:
            if "model_stage" in row:
                print(
                    f"{row['layout']:8} {row['model_stage']:22} {row['rank']:4} {row['predicted_bytes'] / 1e6:12.1f} "
                    f"{row['measured_bytes'] / 1e6:12.1f} {100 * row['error']:+6.1f}%"
                )
        payload |= {
            "peak_model": PEAK_MODEL.model_dump(mode="json"),
            "peak_target": TARGET,
            "peaks_within_target": sum(bool(row.get("within_target")) for row in peaks),
            "peak_rows": peaks,
        }
    write_result(args.output, payload, started, repetitions=repetitions)


if __name__ == "__main__":
    main()

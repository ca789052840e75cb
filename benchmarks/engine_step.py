"""Benchmark: the training engine's step at an older commit against the working tree's, same plans.

The old engine is the `nereus` package of `--old` (a git ref, by default the merge-base of HEAD
and `main`), exported with `git archive` into a temporary folder; the new one is this checkout's.
Each measurement is its own process whose `PYTHONPATH` puts one tree first, so the two engines
never share a process. For every model (the `tiny` preset and the ~100M decoder of
memory_parity.py) and layout (tp=2 and dp=2: one gloo world of 2 CPU ranks, one thread each,
bf16 with fp32 masters as `nereus run` trains), the two trees are measured in alternating rounds
(old then new, new then old, ...), so load on the shared machine falls on both alike; each
round times `--iters` steps (`Engine.train_step`: zero_grad, forward and backward, gradient
reduction, AdamW) after `--warmup` untimed ones. Reports each tree's median step over all
rounds and the ratio new / old (target: at most 1.1), and the paired ratio: the median over
rounds of each round's new / old (the two trees of a round run back to back, so load that
changes between rounds cancels). The step's loss (`--objective`): next-token cross-entropy, or
`ppo-entropy`, the actor's clipped PPO loss with an entropy bonus of 0.01 (its fields random).
Writes benchmarks/results/engine_step.json.

    .venv/bin/python benchmarks/engine_step.py [--old REF] [--models tiny,decoder-100m] [--layouts tp2,dp2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from _record import ROOT, begin, write_result
from memory_parity import MODEL  # the ~100M decoder, handed to workers: an old tree needs only `nereus`

RESULTS = Path(__file__).resolve().parent / "results" / "engine_step.json"
TARGET = 1.1
#: Layout name -> (tp, pp, dp) on the 2 ranks.
LAYOUTS = {"tp2": (2, 1, 1), "dp2": (1, 1, 2)}
MODELS = ("tiny", "decoder-100m")
#: The step's loss: next-token cross-entropy, or PPO's clipped policy loss with an entropy bonus.
OBJECTIVES = ("next-token", "ppo-entropy")


def time_steps(rank: int, world: int, args: dict[str, Any]) -> list[float]:
    """One rank's step times (runs inside a worker, on whichever tree it imported)."""
    import torch

    from nereus.runtime.model.adamw import AdamWConfig, Precision
    from nereus.runtime.model.engine import Engine, EngineConfig
    from nereus.runtime.model.losses import NextTokenLoss
    from nereus.runtime.model.transformer import Batch
    from nereus.runtime.rl.objectives import PolicyObjective
    from nereus.runtime.state.shard_layout import RankLayout
    from nereus.spec.model import Model
    from nereus.spec.presets import MODELS as PRESETS

    torch.set_num_threads(1)
    model = PRESETS["tiny"] if args["model"] == "tiny" else Model.model_validate(args["model_document"])
    tp, pp, dp = LAYOUTS[args["layout"]]
    config = EngineConfig(AdamWConfig(), precision=Precision("bfloat16", master_weights=True))
    engine = Engine.create(model, "lm", RankLayout(tp, pp, dp, tuple(range(world))), config)
    assert engine is not None
    generator = torch.Generator().manual_seed(0)
    shape = (args["rows"], args["seq"])
    tokens = torch.randint(0, model.vocab_size, shape, generator=generator)
    objective: Any = NextTokenLoss()
    batch = Batch(tokens)
    if args["objective"] == "ppo-entropy":
        objective = PolicyObjective(0.2, 0.0, 0.01, "token-mean")
        fields = {
            "loss_mask": torch.ones(shape),
            "old_log_probs": -10.0 + 0.1 * torch.randn(shape, generator=generator),
            "advantages": torch.randn(shape, generator=generator),
        }
        batch = Batch(tokens, torch.ones(shape, dtype=torch.bool), fields)
    times = []
    for step in range(args["warmup"] + args["iters"]):
        torch.distributed.barrier()
        started = time.perf_counter()
        engine.train_step(batch, objective)
        if step >= args["warmup"]:
            times.append(time.perf_counter() - started)
    return times


def worker(args: argparse.Namespace) -> None:
    """Measure one (model, layout) on the tree first on sys.path; print the times as JSON."""
    import nereus
    from nereus.runtime.comm.spawn import spawn

    tree = Path(args.tree).resolve()
    if not Path(nereus.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"worker imported nereus from {nereus.__file__}, not from {tree}")
    settings = {k: getattr(args, k) for k in ("model", "layout", "rows", "seq", "warmup", "iters", "objective")}
    settings["model_document"] = json.loads(args.model_document)
    per_rank = spawn(time_steps, 2, settings)
    print(json.dumps(per_rank))


def export_tree(ref: str, folder: Path) -> str:
    """Write `ref`'s nereus package into `folder`; return the commit it names."""
    commit = subprocess.run(["git", "rev-parse", ref], cwd=ROOT, capture_output=True, text=True, check=True)
    archive = folder / "old.tar"
    subprocess.run(["git", "archive", "-o", str(archive), ref, "nereus"], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    return commit.stdout.strip()


def measure(tree: Path, model: str, layout: str, args: argparse.Namespace) -> list[list[float]]:
    """Per-rank step times of one round in a fresh process on `tree`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(Path(__file__).resolve().parent)])}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", str(tree)]
    command += ["--model", model, "--layout", layout, "--rows", str(args.rows), "--seq", str(args.seq)]
    command += ["--warmup", str(args.warmup), "--iters", str(args.iters), "--model-document", json.dumps(MODEL)]
    command += ["--objective", args.objective]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"worker on {tree} ({model}, {layout}) failed:\n{done.stderr[-2000:]}")
    result: list[list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def default_old() -> str:
    merge_base = subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, capture_output=True, text=True)
    return merge_base.stdout.strip() if merge_base.returncode == 0 else "HEAD"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default=None, help="Git ref of the old engine (default: merge-base of HEAD, main).")
    parser.add_argument("--models", default=",".join(MODELS), help=f"Comma-separated: {', '.join(MODELS)}.")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"Comma-separated: {', '.join(LAYOUTS)}.")
    parser.add_argument("--rows", type=int, default=4, help="Sequences in the global batch.")
    parser.add_argument("--seq", type=int, default=64, help="Tokens per sequence.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed steps per round.")
    parser.add_argument("--iters", type=int, default=5, help="Timed steps per round.")
    parser.add_argument("--objective", choices=OBJECTIVES, default="next-token", help="The step's loss (see above).")
    parser.add_argument("--rounds", type=int, default=2, help="Rounds per tree (alternated).")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-document", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    unknown = sorted(set(args.models.split(",")) - set(MODELS)) + sorted(set(args.layouts.split(",")) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown models or layouts {unknown}")
    started = begin()
    old_ref = args.old or default_old()
    layouts = args.layouts.split(",")
    rows, repetitions = [], {}
    with tempfile.TemporaryDirectory(prefix="engine_step_") as temp:
        old_commit = export_tree(old_ref, Path(temp))
        trees = {"old": Path(temp), "new": ROOT}
        for model in args.models.split(","):
            for layout in layouts:
                times: dict[str, list[float]] = {"old": [], "new": []}
                round_ratios = []  # each round's new / old medians: load that shifts between rounds cancels
                for round_index in range(args.rounds):
                    order = ("old", "new") if round_index % 2 == 0 else ("new", "old")
                    this_round = {}
                    for which in order:
                        per_rank = measure(trees[which], model, layout, args)
                        this_round[which] = [t for rank_times in per_rank for t in rank_times]
                        times[which] += this_round[which]
                    round_ratios.append(statistics.median(this_round["new"]) / statistics.median(this_round["old"]))
                medians = {which: statistics.median(t) for which, t in times.items()}
                ratio, paired = medians["new"] / medians["old"], statistics.median(round_ratios)
                print(
                    f"{model:14} {layout}: old {medians['old']:.4f} s, new {medians['new']:.4f} s, {ratio:.2f}x "
                    f"(paired {paired:.2f}x)"
                )
                rows.append(
                    {
                        "model": model,
                        "layout": layout,
                        "median_step_s": medians,
                        "ratio": ratio,
                        "paired_ratio": paired,
                        "round_ratios": round_ratios,
                    }
                )
                repetitions.update({f"{model}/{layout}/{which}_s": t for which, t in times.items()})
    payload = {
        "target_ratio": TARGET,
        "old": {"ref": old_ref, "commit": old_commit},
        "new": "working tree (provenance.commit, plus provenance.dirty_files)",
        "ranks": 2,
        "threads_per_rank": 1,
        "layouts": {name: dict(zip(("tp", "pp", "dp"), LAYOUTS[name], strict=True)) for name in layouts},
        "dtype": "bfloat16 with fp32 masters",
        "objective": args.objective,
        "rows_per_batch": args.rows,
        "seq": args.seq,
        "steps_per_round": args.iters,
        "rounds_per_tree": args.rounds,
        "rows": rows,
        "within_target": all(row["ratio"] <= TARGET for row in rows),
    }
    write_result(args.output, payload, started, repetitions=repetitions)


if __name__ == "__main__":
    main()

"""Benchmark: actor+critic training, the fused bidirectional pipeline against serial 1F1B.

Two gloo ranks (one thread each) hold the actor (pp=2 on ranks 0, 1) and the critic (pp=2 on
ranks 1, 0: the fused layout). Each repetition trains one mini-batch of --rows sequences of
--seq tokens on both models, each split into --microbatches micro-batches:

    serial  actor `train_step` with 1F1B, then critic `train_step` with 1F1B;
    fused   `fused_train_step` running the plan's fused schedule (`fused_schedule(plan)`, the
            schedule `nereus run` executes under fusion.intra_stage).

The models are the tiny preset scaled up (hidden 256, MLP 688, 8 heads, 4 layers, vocab 64)
so that compute dominates the gloo messages. The actor trains with the LM loss, the critic
with the value loss (the engine's objectives; PPO's clipped objectives cost the same passes).
Modes alternate repetition by repetition (same load on both); after --warmup untimed
rounds, the median of --reps timed ones is reported, each from a barrier to a barrier.

Predicted speed-ups come from the solver's evaluator: the schedule's own (cost-model times:
serial 1F1B makespan / fused makespan), and the same two orders re-timed with the forward
and backward times the fused run measured on this machine (median compute time per op kind,
stage and model). Prints a table and writes benchmarks/results/fused_training.json.

    .venv/bin/python benchmarks/fused_training.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nereus.runtime.dist import spawn
from nereus.runtime.engine import Engine, EngineConfig, NextTokenLoss, ValueLoss
from nereus.runtime.fused_pipeline import FusedPart, OpTiming, fused_train_step
from nereus.runtime.fused_schedule import fused_schedule, intra_stage_problems
from nereus.runtime.model import Batch
from nereus.runtime.shard_layout import RankLayout
from nereus.solver.pipeline.baselines import pair_baselines
from nereus.solver.pipeline.document import orders_of, problem_of
from nereus.solver.pipeline.evaluate import evaluate
from nereus.solver.pipeline.model import ModelTimes, build_instance
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.presets import MODELS
from nereus.spec.schedule import Schedule

RESULTS = Path(__file__).resolve().parent / "results" / "fused_training.json"
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "plan-tiny-ppo-4rank.yaml"
#: The tiny preset scaled up: 4 layers as tiny, 4x the width.
MODEL = MODELS["tiny"].model_copy(
    update={"name": "tiny-x4", "hidden_dim": 256, "num_heads": 8, "num_kv_heads": 4, "head_dim": 32, "ffn_dim": 688}
)


def fused_plan(microbatches: int) -> Plan:
    """A 2-rank PPO plan of the scaled model with intra-stage fusion: actor training pp=2 on
    [0, 1], critic training pp=2 on [1, 0]; every other model-stage dp=2."""
    example = load_document(EXAMPLE)
    assert isinstance(example, Plan)
    document = example.model_dump(mode="json")
    document["models"] = [MODEL.model_dump(mode="json")]
    for role in ("actor", "critic", "reference", "reward"):
        document["workload"][role] = MODEL.name
    document["workload"]["mini_batches"] = 1
    document["cluster"]["gpus_per_node"] = 2
    document["pools"] = [{"name": "all", "gpus": [0, 1]}]
    layouts = {entry["model_stage"]: (1, 1, 2, [[0], [1]], 1) for entry in document["stages"]}
    layouts["actor/training"] = (1, 2, 1, [[0, 1]], microbatches)
    layouts["critic/training"] = (1, 2, 1, [[1, 0]], microbatches)
    document["stages"] = [
        {"model_stage": name, "pool": "all", "tp": tp, "pp": pp, "dp": dp, "emus": emus, "micro_batches": mb}
        for name, (tp, pp, dp, emus, mb) in layouts.items()
    ]
    document["fusion"] = {"intra_stage": True}
    plan = Plan.model_validate(document)
    problems = intra_stage_problems(plan)
    assert not problems, problems
    return plan


def make_batch(rows: int, seq: int, head: str) -> Batch:
    generator = torch.Generator().manual_seed(1 if head == "value" else 0)
    tokens = torch.randint(0, MODEL.vocab_size, (rows, seq), generator=generator)
    fields = {"value_targets": torch.randn(rows, seq, generator=generator)} if head == "value" else {}
    return Batch(tokens, None, fields)


def timed_rounds(rank: int, world: int, args: argparse.Namespace, schedule: Schedule) -> dict[str, Any]:
    torch.set_num_threads(1)
    actor = Engine.create(MODEL, "lm", RankLayout(1, 2, 1, (0, 1)), EngineConfig(init_seed=1))
    critic = Engine.create(MODEL, "value", RankLayout(1, 2, 1, (1, 0)), EngineConfig(init_seed=2))
    assert actor is not None and critic is not None
    actor_batch, critic_batch = make_batch(args.rows, args.seq, "lm"), make_batch(args.rows, args.seq, "value")
    parts = [
        FusedPart("actor", actor, actor_batch, NextTokenLoss()),
        FusedPart("critic", critic, critic_batch, ValueLoss()),
    ]
    seconds: dict[str, list[float]] = {"serial": [], "fused": []}
    timings: list[OpTiming] = []
    for round_index in range(args.warmup + args.reps):
        for mode in ("fused", "serial") if round_index % 2 else ("serial", "fused"):
            dist.barrier()
            started = time.perf_counter()
            if mode == "serial":
                actor.train_step(actor_batch, NextTokenLoss(), args.microbatches)
                critic.train_step(critic_batch, ValueLoss(), args.microbatches)
            else:
                _, round_timings = fused_train_step(parts, schedule)
                if round_index >= args.warmup:
                    timings += round_timings
            dist.barrier()
            if round_index >= args.warmup:
                seconds[mode].append(time.perf_counter() - started)
    return {"seconds": seconds, "timings": timings}


def measured_times(timings: list[OpTiming], schedule: Schedule) -> dict[str, ModelTimes]:
    """Each model's median compute time per stage and op kind, as the schedule's ModelTimes."""
    out = {}
    for record in schedule.models:
        stages = range(len(record.forward))

        def median(kind: str, stage: int, name: str = record.name) -> float:
            spans = [t.end - t.ready for t in timings if (t.model, t.kind, t.stage) == (name, kind, stage)]
            return statistics.median(spans)

        out[record.name] = ModelTimes(
            record.name,
            record.microbatches,
            tuple(median("F", s) for s in stages),
            tuple(median("B", s) for s in stages),
            tuple(record.activation),
        )
    return out


def retimed_speedup(schedule: Schedule, times: dict[str, ModelTimes]) -> tuple[float, float, float]:
    """(serial 1F1B makespan, fused makespan, speed-up) of the schedule's orders under `times`."""
    models = [
        record.model_copy(
            update={"forward": list(times[record.name].forward), "backward": list(times[record.name].backward)}
        )
        for record in schedule.models
    ]
    retimed = schedule.model_copy(update={"models": models})
    inst = build_instance(problem_of(retimed))
    orders, _, _, unknown = orders_of(inst, retimed)
    assert not unknown, unknown
    fused = evaluate(inst, orders).makespan
    serial = pair_baselines(times["actor"], times["critic"])["serial-1f1b"].makespan
    return serial, fused, serial / fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="sequences in the mini-batch (both models)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per model")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    parser.add_argument("--reps", type=int, default=10, help="timed rounds (each runs both modes)")
    args = parser.parse_args()
    plan = fused_plan(args.microbatches)
    schedule = fused_schedule(plan)
    load_before = os.getloadavg()[0]
    outcomes = spawn(timed_rounds, 2, args, schedule)
    # A round's wall time is the slower rank's (both leave the closing barrier together).
    serial_runs = [max(pair) for pair in zip(*(o["seconds"]["serial"] for o in outcomes), strict=True)]
    fused_runs = [max(pair) for pair in zip(*(o["seconds"]["fused"] for o in outcomes), strict=True)]
    serial_s, fused_s = statistics.median(serial_runs), statistics.median(fused_runs)
    times = measured_times([t for o in outcomes for t in o["timings"]], schedule)
    retimed = retimed_speedup(schedule, times)
    summary = schedule.summary
    print(
        f"{MODEL.name} actor + critic, pp=2 on 2 gloo ranks (1 thread each), mini-batch {args.rows} x {args.seq} "
        f"tokens, {args.microbatches} micro-batches per model, median of {args.reps} (machine load "
        f"{load_before:.1f} before the run)"
    )
    print(f"{'':<34} {'serial 1F1B':>12} {'fused':>10} {'speed-up':>9}")
    print(f"{'measured wall time (ms)':<34} {serial_s * 1e3:>12.1f} {fused_s * 1e3:>10.1f} {serial_s / fused_s:>8.2f}x")
    print(
        f"{'schedule, cost-model times (ms)':<34} {summary.serial_1f1b_makespan * 1e3:>12.3f} "
        f"{summary.makespan * 1e3:>10.3f} {summary.speedup_vs_serial:>8.2f}x"
    )
    serial_retimed, fused_retimed, speedup_retimed = retimed
    print(
        f"{'schedule, measured op times (ms)':<34} {serial_retimed * 1e3:>12.1f} {fused_retimed * 1e3:>10.1f} "
        f"{speedup_retimed:>8.2f}x"
    )
    result = {
        "benchmark": "fused_training",
        "model": MODEL.model_dump(mode="json"),
        "rows": args.rows,
        "seq": args.seq,
        "microbatches_per_model": args.microbatches,
        "ranks": 2,
        "threads_per_rank": 1,
        "backend": "gloo",
        "warmup": args.warmup,
        "reps": args.reps,
        "load_average_1m_before": load_before,
        "serial_1f1b_s": {"median": serial_s, "runs": serial_runs},
        "fused_s": {"median": fused_s, "runs": fused_runs},
        "measured_speedup": serial_s / fused_s,
        "predicted_speedup_cost_model": summary.speedup_vs_serial,
        "predicted_speedup_measured_op_times": speedup_retimed,
        "measured_op_times_s": {
            name: {"forward": list(t.forward), "backward": list(t.backward)} for name, t in times.items()
        },
        "schedule_nodes": [[f"{op.model}:{op.kind}{op.microbatch}" for op in node.ops] for node in schedule.nodes],
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

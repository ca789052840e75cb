"""Benchmark: actor+critic training, the fused bidirectional pipeline against serial 1F1B.

Two gloo ranks (one thread each) hold the actor (pp=2 on ranks 0, 1) and the critic (pp=2 on
ranks 1, 0: the fused layout). Each repetition trains one mini-batch of --rows sequences of
--seq tokens on both models, each split into --microbatches micro-batches:

    serial        actor `train_step` with 1F1B, then critic `train_step` with 1F1B;
    fused         `fused_train_step` running the plan's fused schedule (`fused_schedule(plan)`,
                  the schedule `nereus run` executes under fusion.intra_stage);
    serial order  `fused_train_step` running the serial order (each node: the actor's 1F1B,
                  then the critic's), so the fused executor's per-op timings split both
                  orders into computing and waiting for input.

The models are the tiny preset scaled up (--hidden 256: MLP 688, 8 heads, 4 layers, vocab
64) so that compute dominates the gloo messages; --critic-hidden narrows the critic (its
faster, smaller micro-batches give the search room to trade memory: `--critic-hidden 192
--microbatches 16`). The actor trains with the LM loss, the critic
with the value loss (the engine's objectives; PPO's clipped objectives cost the same passes).
The modes rotate round by round (same load on all); after --warmup untimed rounds, the
median of --reps timed ones is reported, each from a barrier to a barrier.

The per-op timings also give each rank's time in the ops alone (computing plus waiting for
input, in its median round): what the schedule models, without the optimizer step, the
gradient and loss collectives and the barriers, which neither order overlaps.

Predicted speed-ups come from the solver's evaluator: the schedule's own (cost-model times:
serial 1F1B makespan / fused makespan), and the same two orders re-timed with the forward
and backward times the fused run measured on this machine (median compute time per op kind,
stage and model).

Peaks: after the timed rounds each rank runs one more step of each of four schedules of the
same pipelines and reports what its executor held at its fullest (`activation_peak`: the
micro-batches forwarded and not yet backwarded, weighted by the schedule's activation per
micro-batch, and the bytes autograd kept saved for them), beside the peak the solver's
evaluator predicts for its node (`schedule_peaks`):

    fused         the run-time schedule (`fused_schedule(plan)`, the search's work budget);
    previous      the run-time search as it was before, a flat 3000-neighbour budget;
    serial order  the serial 1F1B order above;
    capped        the search under an activation cap of the memory reference (serial 1F1B's
                  first-stage peak): leaner, slower.

Prints a table and writes benchmarks/results/fused_training.json.

    .venv/bin/python benchmarks/fused_training.py
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _record import begin, write_result

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.engine import Engine, EngineConfig
from nereus.runtime.model.fused_pipeline import (
    ActivationPeak,
    FusedPart,
    OpTiming,
    activation_peak,
    fused_train_step,
    schedule_peaks,
)
from nereus.runtime.model.fused_schedule import SEARCH_TIME_LIMIT_S, fused_schedule, intra_stage_problems
from nereus.runtime.model.losses import NextTokenLoss, ValueLoss
from nereus.runtime.model.pipeline import one_f_one_b
from nereus.runtime.model.transformer import Batch
from nereus.runtime.state.shard_layout import RankLayout
from nereus.solver.pipeline.baselines import pair_baselines
from nereus.solver.pipeline.document import orders_of, problem_of, to_document
from nereus.solver.pipeline.evaluate import evaluate
from nereus.solver.pipeline.from_plan import plan_pipelines
from nereus.solver.pipeline.model import ModelTimes, build_instance
from nereus.solver.pipeline.search import SearchConfig, search_fused
from nereus.spec.io import load_document
from nereus.spec.model import Model
from nereus.spec.plan import Plan
from nereus.spec.presets import MODELS
from nereus.spec.schedule import Schedule

RESULTS = Path(__file__).resolve().parent / "results" / "fused_training.json"
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "plan-tiny-ppo-4rank.yaml"


def scaled_tiny(hidden: int) -> Model:
    """The tiny preset (4 layers, vocab 64) at width `hidden`: 32-dim heads, half as many KV
    heads, MLP 688/256 of the width (256 gives 8 heads and MLP 688)."""
    heads = hidden // 32
    return MODELS["tiny"].model_copy(
        update={
            "name": f"tiny-h{hidden}",
            "hidden_dim": hidden,
            "num_heads": heads,
            "num_kv_heads": max(1, heads // 2),
            "head_dim": 32,
            "ffn_dim": hidden * 688 // 256,
        }
    )


def fused_plan(model: Model, microbatches: int, critic: Model | None = None) -> Plan:
    """A 2-rank PPO plan of the scaled model with intra-stage fusion: actor training pp=2 on
    [0, 1], critic training pp=2 on [1, 0]; every other model-stage dp=2. The critic (and
    the reward model) is `critic` where given, else the same model."""
    critic = critic or model
    example = load_document(EXAMPLE)
    assert isinstance(example, Plan)
    document = example.model_dump(mode="json")
    models = {m.name: m.model_dump(mode="json") for m in (model, critic)}
    document["models"] = list(models.values())
    for role in ("actor", "reference"):
        document["workload"][role] = model.name
    for role in ("critic", "reward"):
        document["workload"][role] = critic.name
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


def make_batch(model: Model, rows: int, seq: int, head: str) -> Batch:
    generator = torch.Generator().manual_seed(1 if head == "value" else 0)
    tokens = torch.randint(0, model.vocab_size, (rows, seq), generator=generator)
    fields = {"value_targets": torch.randn(rows, seq, generator=generator)} if head == "value" else {}
    return Batch(tokens, None, fields)


#: The run-time search's budget before it grew with the problem (the "previous" schedule).
PREVIOUS_ITERATIONS = 3000


def peak_schedules(plan: Plan, schedule: Schedule) -> dict[str, Schedule]:
    """The schedules whose held activations the ranks measure (see the module's docstring)."""
    pipelines = plan_pipelines(plan)
    config = SearchConfig(time_limit_s=SEARCH_TIME_LIMIT_S, seeds=1, max_iterations=PREVIOUS_ITERATIONS)

    def searched(cap: float) -> Schedule:
        result = search_fused(pipelines.actor, pipelines.critic, config, activation_cap=cap)
        return to_document(result, time_unit="s", memory_unit="GiB")

    return {
        "fused": schedule,
        "previous": searched(pipelines.activation_cap),
        "serial order": serial_order(schedule),
        "capped": searched(schedule.summary.memory_bound),
    }


def timed_rounds(
    rank: int, world: int, args: argparse.Namespace, schedule: Schedule, peaks: dict[str, Schedule]
) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, critic_model = scaled_tiny(args.hidden), scaled_tiny(args.critic_hidden or args.hidden)
    actor = Engine.create(model, "lm", RankLayout(1, 2, 1, (0, 1)), EngineConfig(init_seed=1))
    critic = Engine.create(critic_model, "value", RankLayout(1, 2, 1, (1, 0)), EngineConfig(init_seed=2))
    assert actor is not None and critic is not None
    actor_batch, critic_batch = (
        make_batch(model, args.rows, args.seq, "lm"),
        make_batch(model, args.rows, args.seq, "value"),
    )
    parts = [
        FusedPart("actor", actor, actor_batch, NextTokenLoss()),
        FusedPart("critic", critic, critic_batch, ValueLoss()),
    ]
    orders = {"fused": schedule, "serial order": serial_order(schedule)}
    seconds: dict[str, list[float]] = {"serial": [], "fused": [], "serial order": []}
    timings: dict[str, list[OpTiming]] = {"fused": [], "serial order": []}
    modes = list(seconds)
    for round_index in range(args.warmup + args.reps):
        # Rotate the modes' order so that none always runs first (after the same other one).
        for mode in modes[round_index % 3 :] + modes[: round_index % 3]:
            dist.barrier()
            started = time.perf_counter()
            if mode == "serial":
                actor.train_step(actor_batch, NextTokenLoss(), args.microbatches)
                critic.train_step(critic_batch, ValueLoss(), args.microbatches)
            else:
                _, round_timings = fused_train_step(parts, orders[mode])
                if round_index >= args.warmup:
                    timings[mode] += round_timings
            dist.barrier()
            if round_index >= args.warmup:
                seconds[mode].append(time.perf_counter() - started)
    held = {}
    for name, order in peaks.items():
        _, step_timings = fused_train_step(parts, order)
        held[name] = activation_peak(step_timings, order, actor.groups.pp_rank)  # actor stage s is node s
    return {"seconds": seconds, "timings": timings, "node": actor.groups.pp_rank, "held": held}


def serial_order(schedule: Schedule) -> Schedule:
    """The fused schedule's ops in serial 1F1B order on every node: the actor's 1F1B, then
    the critic's (the serial baseline, run by the fused executor so its op timings compare)."""
    nodes = []
    for node in schedule.nodes:
        ops = {(op.model, op.stage, op.kind, op.microbatch): op for op in node.ops}
        serial = []
        for record in schedule.models:
            stage = record.replica_nodes[0].index(node.node)
            for op in one_f_one_b(len(record.forward), record.microbatches)[stage]:
                serial.append(ops[(record.name, stage, op.kind, record.replica_microbatches[0][op.microbatch])])
        nodes.append(node.model_copy(update={"ops": serial}))
    return schedule.model_copy(update={"nodes": nodes})


def split_time(timings: list[OpTiming], reps: int) -> tuple[float, float]:
    """(computing, waiting for input) seconds of the rank's ops in the median round (by their sum)."""
    per_round = len(timings) // reps
    rounds = [timings[i * per_round : (i + 1) * per_round] for i in range(reps)]
    splits = sorted((sum(t.end - t.ready for t in ops), sum(t.ready - t.start for t in ops)) for ops in rounds)
    return min(splits, key=lambda split: abs(sum(split) - statistics.median(sum(s) for s in splits)))


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


def held_table(peaks: dict[str, Schedule], outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per schedule: its makespan and, per node, the predicted peak against what the node's
    rank held (printed as a table; the result file's `held_activations`)."""
    print(
        "held activations per rank: predicted = the schedule evaluator's peak of the node, held = the executor's "
        "lanes after each op (cost-model MiB, and micro-batches), saved = bytes autograd kept for them"
    )
    print(
        f"{'schedule':<14} {'makespan ms':>12} {'node':>5} {'predicted MiB':>14} {'held MiB':>9} {'held mbs':>9} "
        f"{'saved MiB':>10}"
    )
    table: dict[str, Any] = {}
    for name, order in peaks.items():
        predicted = schedule_peaks(order)
        inst = build_instance(problem_of(order))
        makespan = evaluate(inst, orders_of(inst, order)[0]).makespan  # the serial order keeps the fused times
        rows = []
        for outcome in sorted(outcomes, key=lambda o: o["node"]):
            node, peak = outcome["node"], outcome["held"][name]
            assert isinstance(peak, ActivationPeak)
            rows.append(
                {
                    "node": node,
                    "predicted_gib": predicted[node],
                    "held_gib": peak.activation,
                    "held_microbatches": peak.microbatches,
                    "saved_bytes": peak.saved_bytes,
                }
            )
            print(
                f"{name:<14} {makespan * 1e3:>12.3f} {node:>5} {predicted[node] * 2**10:>14.2f} "
                f"{peak.activation * 2**10:>9.2f} {peak.microbatches:>9} {peak.saved_bytes / 2**20:>10.2f}"
            )
        table[name] = {"makespan_s": makespan, "peak_gib": max(predicted), "nodes": rows}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=RESULTS, help="where to write the JSON result")
    parser.add_argument("--hidden", type=int, default=256, help="model width (multiple of 64)")
    parser.add_argument(
        "--critic-hidden", type=int, default=None, help="the critic's width (multiple of 64; default --hidden)"
    )
    parser.add_argument("--rows", type=int, default=16, help="sequences in the mini-batch (both models)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per model")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    parser.add_argument("--reps", type=int, default=10, help="timed rounds (each runs every mode)")
    args = parser.parse_args()
    model, critic_model = scaled_tiny(args.hidden), scaled_tiny(args.critic_hidden or args.hidden)
    plan = fused_plan(model, args.microbatches, critic_model)
    schedule = fused_schedule(plan)
    recording = begin()
    load_before = os.getloadavg()[0]
    peaks = peak_schedules(plan, schedule)
    outcomes = spawn(timed_rounds, 2, args, schedule, peaks)
    # A round's wall time is the slower rank's (both leave the closing barrier together).
    runs = {
        mode: [max(pair) for pair in zip(*(o["seconds"][mode] for o in outcomes), strict=True)]
        for mode in ("serial", "fused", "serial order")
    }
    median = {mode: statistics.median(values) for mode, values in runs.items()}
    serial_s, fused_s = median["serial"], median["fused"]
    times = measured_times([t for o in outcomes for t in o["timings"]["fused"]], schedule)
    serial_retimed, fused_retimed, speedup_retimed = retimed_speedup(schedule, times)
    # Per rank in its median round, averaged over the ranks: seconds computing and waiting for input.
    split = {
        mode: [
            statistics.mean(values)
            for values in zip(*(split_time(o["timings"][mode], args.reps) for o in outcomes), strict=True)
        ]
        for mode in ("serial order", "fused")
    }
    summary = schedule.summary
    print(
        f"{model.name} actor + {critic_model.name} critic, pp=2 on 2 gloo ranks (1 thread each), "
        f"mini-batch {args.rows} x {args.seq} tokens, {args.microbatches} micro-batches per model, "
        f"median of {args.reps} (machine load {load_before:.1f} before the run)"
    )
    print(f"{'':<40} {'serial 1F1B':>12} {'fused':>10} {'speed-up':>9}")
    print(f"{'measured wall time (ms)':<40} {serial_s * 1e3:>12.1f} {fused_s * 1e3:>10.1f} {serial_s / fused_s:>8.2f}x")
    serial_order_s = median["serial order"]
    print(
        f"{'  serial order in the fused executor (ms)':<40} {serial_order_s * 1e3:>12.1f} {fused_s * 1e3:>10.1f} "
        f"{serial_order_s / fused_s:>8.2f}x"
    )
    print(
        f"{'schedule, cost-model times (ms)':<40} {summary.serial_1f1b_makespan * 1e3:>12.3f} "
        f"{summary.makespan * 1e3:>10.3f} {summary.speedup_vs_serial:>8.2f}x"
    )
    print(
        f"{'schedule, measured op times (ms)':<40} {serial_retimed * 1e3:>12.1f} {fused_retimed * 1e3:>10.1f} "
        f"{speedup_retimed:>8.2f}x"
    )
    for mode, (compute, waiting) in split.items():
        print(f"{f'per rank, {mode}: compute / wait (ms)':<40} {compute * 1e3:>12.1f} {waiting * 1e3:>10.1f}")
    serial_ops, fused_ops = sum(split["serial order"]), sum(split["fused"])
    print(
        f"{'per rank, ops only: compute + wait (ms)':<40} {serial_ops * 1e3:>12.1f} {fused_ops * 1e3:>10.1f} "
        f"{serial_ops / fused_ops:>8.2f}x"
    )
    held = held_table(peaks, outcomes)
    result = {
        "benchmark": "fused_training",
        "model": model.model_dump(mode="json"),
        "critic_model": critic_model.model_dump(mode="json"),
        "rows": args.rows,
        "seq": args.seq,
        "microbatches_per_model": args.microbatches,
        "ranks": 2,
        "threads_per_rank": 1,
        "backend": "gloo",
        "warmup": args.warmup,
        "reps": args.reps,
        "load_average_1m_before": load_before,
        "serial_1f1b_s": {"median": serial_s, "runs": runs["serial"]},
        "fused_s": {"median": fused_s, "runs": runs["fused"]},
        "serial_order_in_fused_executor_s": {"median": serial_order_s, "runs": runs["serial order"]},
        "per_rank_compute_and_wait_s": {mode: {"compute": c, "wait": w} for mode, (c, w) in split.items()},
        "ops_only_speedup": serial_ops / fused_ops,
        "measured_speedup": serial_s / fused_s,
        "predicted_speedup_cost_model": summary.speedup_vs_serial,
        "predicted_speedup_measured_op_times": speedup_retimed,
        "measured_op_times_s": {
            name: {"forward": list(t.forward), "backward": list(t.backward)} for name, t in times.items()
        },
        "schedule_nodes": [[f"{op.model}:{op.kind}{op.microbatch}" for op in node.ops] for node in schedule.nodes],
        "held_activations": held,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    write_result(args.output, result, recording, {"round_s": runs})
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

"""Benchmark: one pp=2 training step by the runtime's own pipeline executor against torch's
`torch.distributed.pipelining` schedules, on the same engine, weights, micro-batches and loss.

The measurement behind issue 44's decision on torch's pipelining (item 1). One gloo world of 2
CPU ranks (one thread each), pp=2, tp=dp=1, float32 by default. Every implementation runs the
engine's `forward_backward` of the same global batch in `--microbatches` equal micro-batches,
and differs only in what runs the micro-batches' forwards and backwards:

* `nereus`: `Engine.forward_backward`, as `nereus run` trains: the engine's `PipelineExecutor`
  runs the 1F1B op lists (`pipeline.one_f_one_b`) with tagged isend / blocking recv over gloo;
* `torch_gpipe`, `torch_1f1b`: `Engine.begin_forward_backward`, then torch's `ScheduleGPipe` /
  `Schedule1F1B` over a `PipelineStage` wrapping the engine's `DecoderPipelineStage` (the same
  module and parameters), then `Engine.finish_forward_backward`. The stage module calls the
  engine job's forward step, so the last stage computes the same loss inside its forward (the
  chunked LM head, normalised by the global batch's token weight); the schedule's `loss_fn`
  hands that scalar on and `scale_grads=False` keeps the gradient the engine's sum. Each
  `PipelineStage` is given `input_args` / `output_args` (static metadata: no shape inference
  run at its first step, none at any step), and its schedule is built once and reused.

Before timing, the benchmark checks on every rank that all three give the same loss and the
same gradient of every parameter (fp32: within 1e-5 relative, 1e-6 absolute; after the
tied embedding's first/last-stage sum, which `finish_forward_backward` does for all three).
Then it times `--iters` steps after `--warmup`, the implementations alternated step by step
(so load on the shared machine falls on all alike), each step started by a barrier, and
reports medians and the ratio to `nereus`, and each step's CPU time (the rank process's, all
threads: what the step costs whatever the load). Each torch schedule's first step (its one-time
P2P warm-up vote) is timed separately, beside a (warm) nereus step. `--breakdown` also splits
every step into compute (the stage's forward steps and the backwards), point-to-point waits
(for the neighbour's data, for sends to be taken) and the rest (the executor's or schedule's own
work), each a median over the timed steps (`breakdown`).
Writes benchmarks/results/pp_torch.json.

    python benchmarks/pp_torch.py [--models tiny,decoder-100m] [--iters 7] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _record import begin, rank_times, write_result
from memory_parity import MODEL
from torch import nn

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.adamw import AdamWConfig, Precision
from nereus.runtime.model.engine import Engine, EngineConfig, TrainingJob
from nereus.runtime.model.losses import NextTokenLoss
from nereus.runtime.model.micro_batches import split_micro_batches
from nereus.runtime.model.transformer import Batch
from nereus.runtime.state.shard_layout import RankLayout
from nereus.spec.model import Model
from nereus.spec.presets import MODELS

RESULTS = Path(__file__).resolve().parent / "results" / "pp_torch.json"
IMPLEMENTATIONS = ("nereus", "torch_gpipe", "torch_1f1b")
PP = 2


def models() -> dict[str, Model]:
    return {"tiny": MODELS["tiny"], str(MODEL["name"]): Model.model_validate(MODEL)}


class Clock:
    """Seconds one step spent in its compute and in its point-to-point waits (`--breakdown`)."""

    def __init__(self) -> None:
        self.seconds = {"compute": 0.0, "p2p_wait": 0.0}

    @contextmanager
    def region(self, what: str) -> Any:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[what] += time.perf_counter() - started


class EngineStageModule(nn.Module):
    """torch's stage module: the engine's `DecoderPipelineStage` run as the engine's current
    job runs one micro-batch (its forward step: the stage's forward, on the last stage with
    the job's loss inside). `microbatch` is the micro-batch's index, a keyword argument that
    torch splits by micro-batch and hands to every stage."""

    def __init__(self, engine: Engine):
        super().__init__()
        self.stage = engine.pipeline_stage
        self.job: TrainingJob | None = None

    def forward(self, inputs: torch.Tensor, microbatch: torch.Tensor) -> torch.Tensor:
        assert self.job is not None
        # the first stage's input is its micro-batch's token ids (the job's own, checked equal once)
        return self.job.forward_step(int(microbatch), None if self.stage.is_first else inputs)


def torch_stage(engine: Engine, module: EngineStageModule, rows: int, seq: int) -> Any:
    """A `PipelineStage` of `module` with static metadata for micro-batches of `rows` x `seq`."""
    from torch.distributed.pipelining import PipelineStage

    link = engine.groups.link
    hidden = torch.empty(rows, seq, engine.model.hidden_dim, dtype=engine.dtype, requires_grad=True)
    loss = torch.empty((), dtype=torch.float32, requires_grad=True)
    inputs = torch.zeros(rows, seq, dtype=torch.long) if link.is_first else hidden
    outputs = loss if link.is_last else hidden
    return PipelineStage(
        module, link.pp_rank, link.num_stages, engine.device, input_args=inputs, output_args=outputs, group=link.group
    )


def keep_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss_fn: the stage's output is already the micro-batch's loss."""
    return output


class TorchPipeline:
    """The engine's training step with torch's schedule `kind` running the micro-batches."""

    def __init__(self, engine: Engine, kind: str, num_microbatches: int, rows: int, seq: int):
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        self.engine = engine
        self.module = EngineStageModule(engine)
        self.num_microbatches = num_microbatches
        stage = torch_stage(engine, self.module, rows // num_microbatches, seq)
        schedule_class = {"torch_gpipe": ScheduleGPipe, "torch_1f1b": Schedule1F1B}[kind]
        self.schedule = schedule_class(stage, num_microbatches, loss_fn=keep_loss, scale_grads=False)

    def forward_backward(self, batch: Batch) -> float:
        engine, count = self.engine, self.num_microbatches
        job = engine.begin_forward_backward(batch, NextTokenLoss(), count)
        self.module.job = job
        indices = torch.arange(count)
        losses: list[torch.Tensor] = []
        args = (batch.tokens,) if engine.groups.link.is_first else ()
        target = indices if engine.groups.link.is_last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, microbatch=indices)
        self.module.job = None
        return engine.finish_forward_backward(job, {mb: loss.detach() for mb, loss in enumerate(losses)})


def nereus_forward_backward(engine: Engine, batch: Batch, count: int) -> float:
    return engine.forward_backward(batch, NextTokenLoss(), count)


def grads(engine: Engine) -> dict[str, torch.Tensor]:
    return {name: param.grad.detach().clone() for name, param in engine.params.items() if param.grad is not None}


def check_same(engine: Engine, steps: dict[str, Callable[[], float]], tolerance: tuple[float, float]) -> dict[str, Any]:
    """Run each implementation once from zeroed gradients; assert every loss and gradient
    matches `nereus`'s. Returns the largest differences seen."""
    results = {}
    for impl, step in steps.items():
        engine.zero_grad()
        loss = step()
        results[impl] = (loss, grads(engine))
    base_loss, base_grads = results["nereus"]
    rtol, atol = tolerance
    report: dict[str, Any] = {"loss": {impl: loss for impl, (loss, _) in results.items()}}
    for impl, (loss, held) in results.items():
        assert abs(loss - base_loss) <= atol + rtol * abs(base_loss), (impl, loss, base_loss)
        assert held.keys() == base_grads.keys() and held, (impl, sorted(held), sorted(base_grads))
        worst = 0.0
        for name, grad in held.items():
            torch.testing.assert_close(grad, base_grads[name], rtol=rtol, atol=atol, msg=f"{impl} {name}")
            worst = max(worst, float((grad - base_grads[name]).abs().max()))
        report[f"{impl}_max_abs_grad_diff"] = worst
    return report


def time_model(rank: int, name: str, args: argparse.Namespace) -> dict[str, Any]:
    model = models()[name]
    precision = Precision(args.dtype, master_weights=args.dtype != "float32")
    config = EngineConfig(AdamWConfig(), precision=precision)
    engine = Engine.create(model, "lm", RankLayout(1, PP, 1, tuple(range(PP))), config)
    assert engine is not None
    generator = torch.Generator().manual_seed(0)
    batch = Batch(torch.randint(0, model.vocab_size, (args.rows, args.seq), generator=generator))
    count = args.microbatches
    # torch's schedules split the batch into equal chunks along the rows: the engine's micro-batches
    chunks = torch.tensor_split(batch.tokens, count)
    parts = split_micro_batches(batch, count)
    assert all(torch.equal(chunk, part.tokens) for chunk, part in zip(chunks, parts, strict=True))
    pipelines = {impl: TorchPipeline(engine, impl, count, args.rows, args.seq) for impl in IMPLEMENTATIONS[1:]}
    steps: dict[str, Callable[[], float]] = {"nereus": partial(nereus_forward_backward, engine, batch, count)}
    steps.update({impl: partial(pipeline.forward_backward, batch) for impl, pipeline in pipelines.items()})
    steps["nereus"]()  # the process's first step (allocations, first calls), untimed
    first_step_s = {}
    for impl in IMPLEMENTATIONS:  # each torch schedule's first step (its one-time warm-up), beside a nereus step
        dist.barrier()
        started = time.perf_counter()
        steps[impl]()
        first_step_s[impl] = time.perf_counter() - started
    tolerance = (1e-5, 1e-6) if args.dtype == "float32" else (2e-2, 2e-3)
    check = check_same(engine, steps, tolerance)
    times: dict[str, list[float]] = {impl: [] for impl in IMPLEMENTATIONS}
    cpu_s: dict[str, list[float]] = {impl: [] for impl in IMPLEMENTATIONS}
    parts_s: dict[str, dict[str, list[float]]] = {impl: {"compute": [], "p2p_wait": []} for impl in IMPLEMENTATIONS}
    for step in range(args.warmup + args.iters):
        for impl in IMPLEMENTATIONS:  # alternated, step by step
            clock = Clock() if args.breakdown else None
            with breakdown(engine, clock):
                engine.zero_grad()
                dist.barrier()
                started, cpu_started = time.perf_counter(), time.process_time()
                steps[impl]()
                elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            if step >= args.warmup:
                times[impl].append(elapsed)
                cpu_s[impl].append(cpu)
                for what, seconds in ({} if clock is None else clock.seconds).items():
                    parts_s[impl][what].append(seconds)
    medians = {impl: statistics.median(t) for impl, t in times.items()}
    row: dict[str, Any] = {
        "model": name,
        "rank": rank,
        "check": check,
        "first_step_s": first_step_s,
        "median_step_s": medians,
        "over_nereus": {impl: medians[impl] / medians["nereus"] for impl in IMPLEMENTATIONS[1:]},
        "median_cpu_s": {impl: statistics.median(c) for impl, c in cpu_s.items()},
        "times_s": times,
    }
    if args.breakdown:  # medians of each part, and of what is left of each step
        row["breakdown_median_s"] = {impl: median_parts(times[impl], parts_s[impl]) for impl in IMPLEMENTATIONS}
    return row


def median_parts(times: list[float], parts: dict[str, list[float]]) -> dict[str, float]:
    """The median of each part of the steps and of the rest of them."""
    rest = [t - sum(part[i] for part in parts.values()) for i, t in enumerate(times)]
    return {**{what: statistics.median(part) for what, part in parts.items()}, "rest": statistics.median(rest)}


@contextmanager
def breakdown(engine: Engine, clock: Clock | None) -> Any:
    """Under `clock`, split the step: compute (every forward step, and every backward:
    `torch.autograd.backward`, which both executors call, the last stage's `loss.backward`
    included) and point-to-point waits (the executor's blocking `dist.recv` and its final wait
    on its sends; torch's schedules' waits on their batched isend/irecv, `_wait_batch_p2p`).
    What is left of the step is bookkeeping: splitting, posting, the schedule's own code."""
    if clock is None:
        yield
        return
    from torch.distributed.pipelining import schedules

    from nereus.runtime.model import pipeline

    def timed(what: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with clock.region(what):
                return call(*args, **kwargs)

        return run

    original_begin = engine.begin_forward_backward

    def timed_begin(*args: Any, **kwargs: Any) -> TrainingJob:
        job = original_begin(*args, **kwargs)
        return TrainingJob(job.ops, timed("compute", job.forward_step), job.input_shape, job.earlier_grads)

    # each looked up at its call: a module attribute or a class's method
    patches = [
        (torch.autograd, "backward", timed("compute", torch.autograd.backward)),
        (dist, "recv", timed("p2p_wait", dist.recv)),
        (pipeline.Sends, "wait", timed("p2p_wait", pipeline.Sends.wait)),
        (schedules, "_wait_batch_p2p", timed("p2p_wait", schedules._wait_batch_p2p)),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    engine.begin_forward_backward = timed_begin  # type: ignore[method-assign]
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
        del engine.begin_forward_backward


def time_steps(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [time_model(rank, name, args) for name in args.models.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(models()), help="Comma-separated: tiny, decoder-100m.")
    parser.add_argument("--rows", type=int, default=8, help="Sequences in the global batch.")
    parser.add_argument("--seq", type=int, default=64, help="Tokens per sequence.")
    parser.add_argument("--microbatches", type=int, default=4, help="Micro-batches per step (divides --rows).")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument(
        "--breakdown", action="store_true", help="Also split each step into compute, p2p waits and the rest."
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    unknown = sorted(set(args.models.split(",")) - set(models()))
    if unknown:
        parser.error(f"unknown models {unknown}: choose from {', '.join(models())}")
    if args.microbatches < PP or args.rows % args.microbatches:
        parser.error(f"--microbatches must be at least {PP} (1F1B) and divide --rows {args.rows}")
    started = begin()
    rows = [row for per_rank in spawn(time_steps, PP, args) for row in per_rank]
    for row in rows:
        steps = ", ".join(f"{impl} {s:.4f} s" for impl, s in row["median_step_s"].items())
        ratios = ", ".join(f"{impl} {r:.2f}x" for impl, r in row["over_nereus"].items())
        print(f"{row['model']:14} rank {row['rank']}: {steps}; over nereus: {ratios}")
        print(f"{'':14} cpu: " + ", ".join(f"{impl} {s:.4f} s" for impl, s in row["median_cpu_s"].items()))
        for impl, parts in row.get("breakdown_median_s", {}).items():
            print(f"{'':14} {impl:12} " + ", ".join(f"{what} {s:.4f} s" for what, s in parts.items()))
    kept, repetitions = rank_times(rows)
    payload = {
        "ranks": PP,
        "threads_per_rank": 1,
        "layout": {"tp": 1, "pp": PP, "dp": 1},
        "implementations": list(IMPLEMENTATIONS),
        "dtype": args.dtype,
        "rows_per_batch": args.rows,
        "seq": args.seq,
        "microbatches": args.microbatches,
        "warmup": args.warmup,
        "iters": args.iters,
        "rows": kept,
    }
    write_result(args.output, payload, started, repetitions=repetitions)


if __name__ == "__main__":
    main()

"""The loop of an async run (`execution: async`) on every rank: generation and training on
their own pools, overlapping, with bounded staleness (issue 49; docs/async.md, "The run loop").

The plan puts actor/generation on ranks of its own (the generation pool); every other
model-stage's ranks, and rank 0, form the training pool. Each pool's exchanges stay inside it
(`ModelStageRuntime.pool`); the two meet once per step, in the weight sync and the gather of
the step's record right after it (the world's collectives).

With k = `Workload.staleness`, step t (tick t on both pools):

- the generation pool holds version t (the weights after t updates) and generates every batch
  up to t + k not generated yet (at the start batches 0..k, all at version 0; then one a step,
  batch t + k) into the hand-off folder `async/` of the run folder (`async_queue.write_batch`);
- the training pool puts the batches it finds there into its `StalenessQueue` (waiting for
  batch t if it is not there yet), takes batch t, trains on it (phases 2 to 5 of
  `step.train_phases`, the same code as a synchronous step) and syncs the weights: version t + 1.

Batch b is thus generated at version max(0, b - k): no trained sample is more than k versions
old (the queue asserts it), generation runs k batches ahead, and k = 0 takes turns, which is
the synchronous run bitwise (same prompts, seeds, weights and order of the same operations).
Every draw is a function of (seed, batch), and the schedule is fixed, so a run is the same
whatever the timing; a checkpoint after step t holds the queue (batches t + 1..t + k, each
sample with its version; `StalenessQueue.save`, checksummed in the manifest) and a resume's
generator continues at its `next_index`: no sample is lost or repeated.

Under partial rollout (`partial_rollout: true`) at k >= 2 the generation pool generates every
batch over the k ticks of its window instead, at most ceil(L / k) tokens a sample a tick, all
batches in flight in one engine, pausing each unfinished sample at the weight sync and continuing
it under the new weights (`partial_rollout`: the rule, the samples in flight and their
checkpoint); each token keeps the version that sampled it and its behaviour log-prob.

Under vLLM generation (`generation.engine: vllm`) the generation pool samples with vLLM engines,
which keep every token's log-prob (the behaviour log-probs), and the weight sync pushes the
trained weights into them; every training rank starts a vLLM engine that stands by, since
vLLM's external launcher builds its groups over the whole world (`start_async_engine`).
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nereus.cost.vllm_engine import engine_sleep_level
from nereus.errors import NereusError
from nereus.runtime.comm import collectives
from nereus.runtime.comm.world import collective_timeout, device
from nereus.runtime.generation.engine_choice import generation_engine, max_model_len
from nereus.runtime.generation.generate import continue_generate
from nereus.runtime.generation.sampling import SamplingConfig, sample_seed
from nereus.runtime.generation.vllm_engine import (
    VLLMEngine,
    continuation_seed,
    continue_generation,
    sleep_mode_available,
    start_engine,
)
from nereus.runtime.observe import timeline
from nereus.runtime.observe.memory import PeakTracker
from nereus.runtime.rl.async_queue import StalenessQueue, VersionedSample, read_batch, remove_batch, write_batch
from nereus.runtime.rl.optimization import with_decay_horizon
from nereus.runtime.rl.partial_rollout import (
    STATE_FILE,
    TENSORS_FILE,
    PartialRollout,
    Piece,
    longest_by_version,
    version_spans,
)
from nereus.runtime.rl.rollout import kv_budget, rollout, rollout_kv_bytes, sampled, token_aligned
from nereus.runtime.rl.run_data import StepInputs, step_inputs
from nereus.runtime.rl.scoring import infer
from nereus.runtime.rl.stages import ModelStageRuntime, Rollout, by_replica, rollout_batch
from nereus.runtime.rl.step import begin_step, draw_prompts, metric_names, plan_peaks, step_seed, train_phases
from nereus.runtime.rl.tasks import get_task
from nereus.runtime.rl.timing import step_totals, timed
from nereus.runtime.rl.update import WeightSync, sync_weights
from nereus.runtime.rl.warm_start import warm_start
from nereus.runtime.run.checkpoints import save_run_checkpoint
from nereus.runtime.run.hold import hold_before
from nereus.runtime.run.rank_loop import in_force_schedule, prepare_rank, record_step, run_state
from nereus.runtime.run.run_setup import RunSetup
from nereus.runtime.state.sharded_state import even_split
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig
from nereus.spec.stages import ACTOR_GENERATION

#: The hand-off folder in the run folder: the generated batches not yet trained.
HANDOFF_NAME = "async"
#: The busy times each pool adds to the step's gathered seconds (then moved to `async_step`).
GENERATION_BUSY, TRAINING_BUSY, BATCH_WAIT = "async_generation_busy", "async_training_busy", "async_batch_wait"
#: The CPU seconds (`time.process_time`) the generation pool's leading rank spent generating:
#: its work, which other jobs on the machine's cores stretch less than its busy wall seconds.
GENERATION_CPU = "async_generation_cpu"
#: When (time.time()) each pool's work of the step began and ended: the generation pool's
#: generation (its leading rank's), the training pool's inference and training (rank 0's); the
#: other ranks report 0 and the gather takes the largest.
GENERATION_SPAN = ("async_generation_start", "async_generation_end")
TRAINING_SPAN = ("async_training_start", "async_training_end")
#: Every time above: what an async step gathers besides the synchronous step's `metric_names`.
ASYNC_SECONDS = (GENERATION_BUSY, GENERATION_CPU, TRAINING_BUSY, BATCH_WAIT, *GENERATION_SPAN, *TRAINING_SPAN)
#: How often the training pool looks for a batch it waits for.
POLL_S = 0.002
#: The hand-off folder's copies of the samples in flight after a checkpoint's tick (partial rollout).
IN_FLIGHT_PREFIX = "in-flight-"


@dataclass(frozen=True)
class Pools:
    """The ranks of an async run's two pools."""

    generation: tuple[int, ...]
    """actor/generation's ranks."""
    training: tuple[int, ...]
    """Every other rank (every other model-stage's, rank 0 among them)."""


def pools_of(plan: Plan, world_size: int) -> Pools:
    """The pools of an async `plan` on `world_size` ranks (disjoint: checked before the run)."""
    generation = tuple(sorted(plan.stage_plan(ACTOR_GENERATION).gpus))
    training = tuple(rank for rank in range(world_size) if rank not in generation)
    assert training and training[0] == 0, ("generation takes the last ranks", generation)
    return Pools(generation, training)


def run_async(rank: int, world_size: int, setup: RunSetup) -> int:
    """The whole async run on this rank (the module docstring); returns the steps finished."""
    config, plan = setup.config, setup.plan
    pools = pools_of(plan, world_size)
    start_engine = functools.partial(start_async_engine, setup, pools, rank)
    tracker, stages, syncs, engine = prepare_rank(rank, setup, start_engine)  # the weights: version start_step
    inputs = step_inputs(config.rl, setup.data)
    handoff = setup.out / HANDOFF_NAME
    with timeline.recording(timeline.Timeline(setup.out, rank)) as spans:
        if setup.checkpoint is None and config.rl.sft_steps:  # over the world, before the pools part
            spans.step = 0
            warm_start(stages, config.rl, get_task(config.rl.task), syncs)
        for ranks in (pools.generation, pools.training):  # made by every rank, in one order
            collectives.subgroup(ranks)
        for name, stage in stages.items():
            stage.pool = pools.generation if name == ACTOR_GENERATION else pools.training
        queue = start_queue(setup)
        if rank == 0:  # batches a killed run generated past its checkpoint are generated again
            handoff.mkdir(exist_ok=True)
            for stale in handoff.glob("batch-*"):
                stale.unlink()
            for stale in handoff.glob(IN_FLIGHT_PREFIX + "*"):
                shutil.rmtree(stale)
        collectives.barrier()
        loop = AsyncLoop(setup, rank, pools, (stages, syncs), tracker, inputs, queue, handoff)
        for step in range(setup.start_step, config.num_steps):
            hold_before(step, rank)
            spans.step = step
            if rank in pools.generation:
                loop.generation_step(step, rank == pools.generation[0])
            else:
                loop.training_step(step, rank)
            done = step + 1
            if done % config.checkpoint_every == 0 or done == config.num_steps:
                with timeline.span("checkpoint", f"step-{done:06d}"):
                    loop.checkpoint(done, rank)
            if rank == 0:  # every training rank took it before the step's world collectives
                remove_batch(handoff, step)
            spans.flush()
    if engine is not None:
        engine.close()
    return config.num_steps


def start_async_engine(
    setup: RunSetup, pools: Pools, rank: int, stages: dict[str, ModelStageRuntime]
) -> VLLMEngine | None:
    """Under vLLM generation, this rank's vLLM engine (collective over the world); None under
    nereus's own engine. vLLM's external launcher builds its groups over the whole world, so every
    rank starts one, in tp-sized blocks (`engine_choice.vllm_layout_problem`): a generation rank's
    engine is its actor/generation replica's, sized as a synchronous run sizes it and filled by
    the weight sync; a training rank's stands by (so that vLLM's groups form), is never loaded and
    never generates, but takes the same KV pool: vLLM's external launcher sizes every engine's pool
    to the smallest any rank of the world asks for (a MIN all-reduce over the world)."""
    config, plan = setup.config, setup.plan
    on_cuda = device().type == "cuda"
    if generation_engine(config, plan, on_cuda) != "vllm":
        return None
    assert plan.weights is not None, "checked before the ranks started"
    stage = stages[ACTOR_GENERATION]
    generates = rank in pools.generation
    assert generates == (stage.engine is not None), (rank, pools)
    engine = start_engine(
        Path(plan.weights["actor"]),
        stage.plan.tp,
        stage.compute_dtype,
        rollout_kv_bytes(plan, stages),
        max_model_len(plan),
        config.rl.seed,
        stage.engine.groups.tp.group if stage.engine is not None else None,
        engine_sleep_level(plan, on_cuda and sleep_mode_available()) if generates else None,
    )
    if stage.engine is not None:  # vLLM counts its blocks over the world; the plan its replicas over the pool
        engine.replica = stage.engine.groups.replica
    stage.rollout_engine = engine
    return engine


def start_queue(setup: RunSetup) -> StalenessQueue:
    """The queue a run starts with: its checkpoint's (a resume), else empty."""
    workload = setup.plan.workload
    if setup.checkpoint is None:
        return StalenessQueue(workload.staleness, workload.samples_per_step)
    queue = StalenessQueue.load(setup.checkpoint)
    saved = (queue.max_staleness, queue.batch_size, queue.version)
    if saved != (workload.staleness, workload.samples_per_step, setup.start_step):
        raise NereusError(
            f"{setup.checkpoint}: the async queue was saved with max_staleness {saved[0]}, {saved[1]} samples a "
            f"step at version {saved[2]}; this run has {workload.staleness}, {workload.samples_per_step} at "
            f"step {setup.start_step}: resume with the plan's workload unchanged"
        )
    return queue


class AsyncLoop:
    """What one rank carries through an async run's steps (the module docstring)."""

    def __init__(
        self,
        setup: RunSetup,
        rank: int,
        pools: Pools,
        engines: tuple[dict[str, ModelStageRuntime], list[WeightSync]],
        tracker: PeakTracker,
        inputs: StepInputs,
        queue: StalenessQueue,
        handoff: Path,
    ) -> None:
        self.setup, self.pools, self.tracker = setup, pools, tracker
        self.stages, self.syncs = engines
        self.plan = setup.plan
        self.config: RLConfig = with_decay_horizon(setup.config.rl, setup.config.num_steps)
        self.inputs, self.queue, self.handoff = inputs, queue, handoff
        self.batch_size = queue.batch_size
        self.next_batch = queue.next_index // queue.batch_size
        """The next batch the generation pool generates (a resume: the checkpoint's queue's end)."""
        self.names = [*metric_names(self.plan, self.stages), *ASYNC_SECONDS]
        self.state = run_state(setup, self.plan) if rank == 0 else None
        self.schedule = in_force_schedule(self.plan, setup.fused_schedule)
        self.peaks = plan_peaks(self.plan, self.stages)
        self.partial = start_partial(setup, queue) if rank in pools.generation else None
        """The samples in flight under partial rollout at k >= 2 (None otherwise: every batch is
        generated whole within one tick)."""

    # ---- the generation pool ----

    def generation_step(self, step: int, leads: bool) -> None:
        """Step `step` on a generation rank: generate every batch up to step + k at version
        `step` (the leading rank hands each over), then the weight sync and the step's record."""
        start, cpu_start = time.perf_counter(), time.process_time()
        seconds = begin_step(self.stages, self.tracker)
        if self.partial is not None:
            self.partial_tick(step, leads, seconds)
        last = min(step + self.queue.max_staleness, self.setup.config.num_steps - 1)
        if self.partial is None and self.next_batch <= last and leads:
            seconds[GENERATION_SPAN[0]] = time.time()
        while self.partial is None and self.next_batch <= last:
            batch = self.next_batch
            with timeline.span("async", f"generate batch {batch}", version=step):
                samples = self.generate(batch, step, seconds)
                if leads:  # stamped before the hand-off: a trainer waiting for it starts after
                    seconds[GENERATION_SPAN[1]] = time.time()
                    write_batch(self.handoff, batch, samples)
            self.next_batch += 1
        seconds[GENERATION_BUSY] = time.perf_counter() - start
        if leads:
            seconds[GENERATION_CPU] = time.process_time() - cpu_start
        with timed(seconds, "weight_sync"):
            sync_weights(self.syncs)
        self.engine_phases(seconds)
        seconds["step"] = time.perf_counter() - start
        step_totals(seconds, self.names, self.stages)  # the training pool's rank 0 records the step

    def generate(self, batch: int, version: int, seconds: dict[str, float]) -> list[VersionedSample]:
        """Batch `batch`'s samples (collective over the generation pool): the responses to the
        batch's prompts (the draw of a synchronous step `batch`) and their behaviour log-probs,
        the generating engine's log-prob of every response token: vLLM's, kept as it sampled
        (`raw_logprobs`), or under nereus's own engine, which does not keep them while it decodes,
        a teacher-forced pass of the generation engine over the rollout."""
        _, prompts, sampling = draw_prompts(self.plan.workload, self.config, self.inputs, batch)
        generated = rollout(self.plan, self.stages, prompts, sampling, self.plan.fusion, seconds, [])
        behaviour = generated.rollout_log_probs  # vLLM's, as it sampled
        if behaviour is None:
            with timed(seconds, ACTOR_GENERATION):
                behaviour = infer(self.stages[ACTOR_GENERATION], generated.batch, "log_probs")
        width = max(len(prompt) for prompt in prompts)
        samples = []
        for row, (prompt, response) in enumerate(zip(prompts, generated.responses, strict=True)):
            tensors = {
                "prompt": torch.tensor(prompt, dtype=torch.long),
                "response": torch.tensor(response, dtype=torch.long),
                "log_probs": behaviour[row, width : width + len(response)].float().clone(),
                "versions": torch.full((len(response),), version, dtype=torch.long),
            }
            if generated.greedy is not None:
                tensors["greedy"] = torch.tensor(generated.greedy[row], dtype=torch.long)
            samples.append(VersionedSample(batch * self.batch_size + row, version, tensors, {"batch": batch}))
        return samples

    def partial_tick(self, step: int, leads: bool, seconds: dict[str, float]) -> None:
        """Tick `step` of a partial rollout (collective over the generation pool;
        `partial_rollout`'s rule): admit the batches whose window opens here, continue every
        sample in flight by at most its batch's cap under version `step`, hand over the whole
        batches (the leading rank), and at a checkpoint's tick save the samples in flight."""
        partial = self.partial
        assert partial is not None
        _, _, sampling = draw_prompts(self.plan.workload, self.config, self.inputs, step)  # its seed is not used
        for batch in partial.admitted_at(step):
            _, prompts, drawn = draw_prompts(self.plan.workload, self.config, self.inputs, batch)
            greedy = None
            if self.plan.workload.algorithm == "remax":  # ReMax's baseline: greedy, whole, at admission
                with timed(seconds, ACTOR_GENERATION):
                    stage = self.stages[ACTOR_GENERATION]
                    greedy_sampling = dataclasses.replace(drawn, temperature=0.0)
                    greedy = sampled(stage, prompts, greedy_sampling, kv_budget=kv_budget(self.plan, self.stages))[0]
            partial.admit(batch, prompts, greedy)
        pieces = partial.work()
        if pieces and leads:
            seconds[GENERATION_SPAN[0]] = time.time()
        if pieces:
            with timeline.span("async", f"generate tick {step}", version=step, samples=len(pieces)):
                tokens, log_probs = self.continue_pieces(pieces, sampling, seconds)
                partial.record(pieces, tokens, log_probs, step, sampling.stop_tokens)
        for batch, samples in partial.hand_over(step):
            if leads:
                write_batch(self.handoff, batch, samples)
        if pieces and leads:  # stamped after the hand-off: a trainer waiting for it starts after
            seconds[GENERATION_SPAN[1]] = time.time()
        done = step + 1
        if leads and (done % self.setup.config.checkpoint_every == 0 or done == self.setup.config.num_steps):
            partial.save(
                self.handoff / f"{IN_FLIGHT_PREFIX}{step:06d}", step
            )  # before the sync: the checkpoint copies it

    def continue_pieces(
        self, pieces: list[Piece], sampling: SamplingConfig, seconds: dict[str, float]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Every piece's new tokens (at most its cap, each replica of actor/generation
        continuing its contiguous share) and their behaviour log-probs under the weights now
        held: vLLM's as it sampled, or a teacher-forced pass of nereus's own engine over each
        sample's prompt and tokens (collective over the generation pool)."""
        stage = self.stages[ACTOR_GENERATION]
        assert stage.engine is not None, "a generation rank"
        seed, batch_size = self.config.seed, self.batch_size
        start, stop = even_split(len(pieces), stage.layout.dp)[stage.engine.groups.replica]
        mine = pieces[start:stop]
        rows = [(step_seed(seed, p.sample.batch), p.sample.index - p.sample.batch * batch_size) for p in mine]
        with timed(seconds, ACTOR_GENERATION):
            if stage.rollout_engine is not None:
                generated = continue_generation(
                    stage.rollout_engine,
                    [p.sample.prompt + p.sample.tokens for p in mine],
                    [
                        continuation_seed(b_seed, row, len(p.sample.tokens))
                        for (b_seed, row), p in zip(rows, mine, strict=True)
                    ],
                    [p.cap for p in mine],
                    sampling,
                )
                part: tuple[list[list[int]], list[list[float]] | None] = (generated.responses, generated.log_probs)
            elif mine:
                responses = continue_generate(
                    stage.engine,
                    [p.sample.prompt + p.sample.tokens for p in mine],
                    [len(p.sample.prompt) for p in mine],
                    [len(p.sample.tokens) + p.cap for p in mine],
                    [p.sample.index for p in mine],
                    [sample_seed(b_seed, row) for b_seed, row in rows],
                    sampling,
                    kv_budget(self.plan, self.stages),
                )
                part = ([r[len(p.sample.tokens) :] for r, p in zip(responses, mine, strict=True)], None)
            else:
                part = ([], None)
            shares = by_replica(stage, part)
            tokens = [row for rows_of, _ in shares for row in rows_of]
            if all(values is not None for _, values in shares):
                return tokens, [row for _, values in shares for row in values]
            # nereus's own engine keeps no log-probs while it decodes: a teacher-forced pass now,
            # under the weights that sampled the tick's tokens.
            prompts = [p.sample.prompt for p in pieces]
            whole = [p.sample.tokens + new for p, new in zip(pieces, tokens, strict=True)]
            behaviour = infer(stage, rollout_batch(prompts, whole, self.inputs.tokenizer.pad_id), "log_probs")
            width = max(len(prompt) for prompt in prompts)
            log_probs = [
                behaviour[row, width + len(p.sample.tokens) : width + len(whole[row])].float().tolist()
                for row, p in enumerate(pieces)
            ]
            return tokens, log_probs

    def engine_phases(self, seconds: dict[str, float]) -> None:
        """The vLLM engine's start-up and weight loads since the last step, into its record."""
        engine = self.stages[ACTOR_GENERATION].rollout_engine
        if engine is not None:
            seconds.update(engine.drain_phases())

    # ---- the training pool ----

    def training_step(self, step: int, rank: int) -> None:
        """Step `step` on a training rank: take batch `step` from the queue (waiting for it if
        need be), train on it as a synchronous step would, sync, and (rank 0) record the step."""
        start = time.perf_counter()
        seconds = begin_step(self.stages, self.tracker)
        with timeline.span("async", f"wait for batch {step}") as late:
            waited = self.wait_for_batch(step)
            late["queued_samples"] = len(self.queue)
        depth = len(self.queue)
        taken = self.queue.take(step)
        staleness = self.queue.staleness(taken, step)
        spans = version_spans(taken)
        problems, prompts, _ = draw_prompts(self.plan.workload, self.config, self.inputs, step)
        generated = self.rollout_of(taken, prompts)
        if rank == 0:  # the training pool's span is rank 0's (the others report 0)
            seconds[TRAINING_SPAN[0]] = time.time()
        trained = train_phases(
            self.plan,
            self.config,
            self.stages,
            self.syncs,
            step,
            (problems, prompts, generated),
            seconds,
            self.plan.fusion,
            self.inputs,
            self.schedule,
        )
        if rank == 0:
            seconds[TRAINING_SPAN[1]] = time.time() - seconds.get("weight_sync", 0.0)
        self.engine_phases(seconds)
        seconds["step"] = time.perf_counter() - start
        seconds[BATCH_WAIT] = waited
        seconds[TRAINING_BUSY] = seconds["step"] - waited - seconds.get("weight_sync", 0.0)
        totals = step_totals(seconds, self.names, self.stages)
        if rank != 0:
            return
        metrics = trained.metrics(self.plan, self.stages, step, seconds, self.peaks, totals)
        step_s = metrics.step_seconds
        record: dict[str, Any] = {
            "version": step,
            "samples": index_runs([sample.index for sample in taken]),
            "staleness": {str(lag): count for lag, count in staleness.items()},
            "version_spans": {str(span): count for span, count in spans.items()},
            "continued": sum(count for span, count in spans.items() if span > 1),
            "longest_by_version": {str(version): n for version, n in longest_by_version(taken).items()},
            "queue_depth": depth,
            "max_staleness": self.queue.max_staleness,
            "generation_busy_s": totals.seconds[GENERATION_BUSY],
            "generation_cpu_s": totals.seconds[GENERATION_CPU],
            "training_busy_s": totals.seconds[TRAINING_BUSY],
            "batch_wait_s": totals.seconds[BATCH_WAIT],
            "overlap_s": overlap(totals.seconds),
            "generation_busy": totals.seconds[GENERATION_BUSY] / step_s if step_s > 0 else 0.0,
            "training_busy": totals.seconds[TRAINING_BUSY] / step_s if step_s > 0 else 0.0,
        }
        metrics = dataclasses.replace(metrics, async_step=record)
        assert self.state is not None
        record_step(self.setup, self.state, self.plan, metrics, trained.samples, self.inputs.scorer, False)

    def ingest(self, last: int) -> None:
        """Put every handed-over batch up to `last` not queued yet into the queue, in order."""
        while self.queue.next_index // self.batch_size <= last:
            batch = self.queue.next_index // self.batch_size
            samples = read_batch(self.handoff, batch)
            if samples is None:
                return
            for sample in samples:
                if not self.queue.put(sample):
                    raise AssertionError(f"sample {sample.index} (version {sample.version}) refused by the queue")

    def wait_for_batch(self, step: int) -> float:
        """Queue the batches handed over so far until batch `step` is queued; the seconds waited."""
        start = time.perf_counter()
        deadline = time.monotonic() + collective_timeout().total_seconds()
        while True:
            self.ingest(step + self.queue.max_staleness)
            if self.queue.ready():
                return time.perf_counter() - start
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {step} did not arrive from the generation pool in {self.handoff}")
            time.sleep(POLL_S)

    def rollout_of(self, samples: list[VersionedSample], prompts: list[list[int]]) -> Rollout:
        """The rollout the training pool trains on, from the queue's samples: as the
        synchronous step's `rollout` gives it, with the behaviour log-probs."""
        for sample, prompt in zip(samples, prompts, strict=True):  # the stream's order: the step's draw
            assert sample.tensors["prompt"].tolist() == prompt, (sample.index, sample.info)
        pad = self.inputs.tokenizer.pad_id
        responses = [sample.tensors["response"].tolist() for sample in samples]
        batch = rollout_batch(prompts, responses, pad)
        greedy = greedy_batch = None
        if "greedy" in samples[0].tensors:
            greedy = [sample.tensors["greedy"].tolist() for sample in samples]
            greedy_batch = rollout_batch(prompts, greedy, pad)
        behaviour = token_aligned(prompts, [s.tensors["log_probs"].tolist() for s in samples], batch.tokens.shape)
        return Rollout(responses, batch, None, greedy, greedy_batch, behaviour)

    # ---- checkpoints ----

    def save_queue(self, done: int, folder: Path) -> None:
        """What rank 0 adds to the checkpoint `folder` after `done` steps: the queue and, under
        partial rollout, the samples in flight after tick done - 1 (the generation pool's leading
        rank wrote them into the hand-off folder before the step's weight sync)."""
        self.queue.save(folder)
        workload = self.plan.workload
        if workload.partial_rollout and workload.staleness >= 2:
            written = self.handoff / f"{IN_FLIGHT_PREFIX}{done - 1:06d}"
            for name in (TENSORS_FILE, STATE_FILE):
                shutil.copyfile(written / name, folder / name)
            shutil.rmtree(written)

    def checkpoint(self, done: int, rank: int) -> None:
        """Checkpoint after `done` steps (collective): the models as a synchronous run saves them,
        and the queue (rank 0): every batch generated and not trained, with its versions (under
        partial rollout, every batch whole and handed over; the rest are in flight)."""
        extra = None
        if rank in self.pools.training:
            # Every batch up to done - 1 + k was handed over before the step's weight sync; under
            # partial rollout every batch due by tick done - 1 (up to done) and those whole early.
            last = min(done - 1 + self.queue.max_staleness, self.setup.config.num_steps - 1)
            self.ingest(last)
            due = min(done, last) if self.plan.workload.partial_rollout else last
            assert (due + 1) * self.batch_size <= self.queue.next_index <= (last + 1) * self.batch_size, (
                self.queue.next_index,
                due,
                last,
            )
            if rank == 0:
                extra = functools.partial(self.save_queue, done)
        save_run_checkpoint(self.setup, self.plan, self.stages, done, rank, self.state, extra)


def start_partial(setup: RunSetup, queue: StalenessQueue) -> PartialRollout | None:
    """A generation rank's partial rollout (`partial_rollout: true` at k >= 2; None otherwise,
    where no window spans two ticks): empty, or a resume's samples in flight after the
    checkpoint's tick, which must continue where the checkpoint's queue ends."""
    workload, config = setup.plan.workload, setup.config
    if not (workload.partial_rollout and workload.staleness >= 2):
        return None
    partial = PartialRollout(workload.staleness, workload.samples_per_step, config.rl.max_new_tokens, config.num_steps)
    if setup.checkpoint is None:
        return partial
    partial.load(setup.checkpoint, setup.start_step - 1)
    admitted = min(setup.start_step - 1 + workload.staleness, config.num_steps - 1)
    queued_through = queue.next_index // queue.batch_size - 1
    if partial.batches and min(partial.batches) != queued_through + 1:
        raise NereusError(
            f"{setup.checkpoint}: the samples in flight start at batch {min(partial.batches)} but the queue "
            f"ends before batch {queued_through + 1}; the checkpoint is not one this run wrote"
        )
    last_admitted = max(queued_through, *partial.batches)
    if last_admitted < admitted:  # going on past the steps the checkpoint's run had (`--resume --steps N`)
        partial.catch_up_from = last_admitted + 1
    return partial


def overlap(gathered: dict[str, float]) -> float:
    """Seconds the step's generation and its training ran at the same time, from their
    timestamps (0 when the step generated nothing: the last k steps)."""
    if gathered[GENERATION_SPAN[0]] == 0:
        return 0.0
    start = max(gathered[GENERATION_SPAN[0]], gathered[TRAINING_SPAN[0]])
    end = min(gathered[GENERATION_SPAN[1]], gathered[TRAINING_SPAN[1]])
    return max(0.0, end - start)


def index_runs(indices: list[int]) -> list[list[int]]:
    """`indices` as [start, stop) runs of consecutive numbers, in order."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][1] == index:
            runs[-1][1] += 1
        else:
            runs.append([index, index + 1])
    return runs

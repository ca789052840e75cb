"""Inter-stage fusion (RLHFuse): sample-level generation and inference with one long-tail migration.

Run on every rank of the world (collective). The actor/generation replicas decode their
contiguous shares of the prompts, counting the samples still generating over all replicas
every `COUNT_EVERY` steps. Once at most `threshold x batch` remain, they migrate to the
fewest replicas that fit them: a replica fits as many samples as it started with (its cache
held them and its decode step ran them; the simulator's stricter rule, a destination's step
no slower than the slowest replica's now, refuses any move while decoding is bound by KV
reads). Those with the most remaining samples keep theirs, moved samples go to the least
loaded. Each moved row's KV cache goes from every (stage, tensor rank) of its replica to the
same position of the destination, or only its tokens go and the destination recomputes the
prefix, whichever the cost model says is cheaper (`inter_stage.migration_mechanism`). Sampling is per sample
(`generate.sample_seed`), so a sample's tokens do not depend on where it is decoded.

The destinations decode the tail. Meanwhile every inference model-stage replica clear of the
destinations' ranks runs its share of the samples already finished (reference and actor
log-probs, critic values, reward-model values), in chunks of `EARLY_CHUNK` samples, until
every destination rank has marked its tail done in the process group's store. Then the samples not yet
inferred are split over every replica of each stage, and one exchange gives every rank the
whole batch, laid out exactly as the unfused step's rollout batch. Each rank also returns
its events.

Under vLLM (`generation.engine: vllm`) each replica's decoder is its vLLM engine stepped
request by request (`vllm_engine.VLLMDecoder`): a migrated sample is aborted on its source
engine and continued on the destination from its prompt plus the tokens it has (re-prefill,
so the mechanism is always `recompute`), and every response token's engine log-prob comes
back with the responses (`FusedRollout.log_probs`).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from nereus.runtime.comm import collectives
from nereus.runtime.comm.world import device as rank_device
from nereus.runtime.generation.continuous import BatchingDecoder
from nereus.runtime.generation.decoding import HandOff
from nereus.runtime.generation.kv_cache import KVBudget
from nereus.runtime.generation.sampling import SamplingConfig
from nereus.runtime.generation.vllm_engine import VLLMDecoder
from nereus.runtime.model.transformer import Batch
from nereus.runtime.rl.inter_stage import MigrationSettings, migration_mechanism
from nereus.runtime.rl.scoring import replica_infer
from nereus.runtime.rl.stages import ModelStageRuntime, leads, rollout_batch
from nereus.runtime.rl.timing import timed
from nereus.runtime.state.sharded_state import even_split
from nereus.spec.stages import ACTOR_GENERATION, INFERENCE_OUTPUTS, INFERENCE_STAGES, ModelStageName

Decoder = BatchingDecoder | VLLMDecoder
"""One replica's decoder: nereus's continuous batching, or a vLLM engine stepped request by request."""

#: What a `RolloutEvent` records.
EVENT_KINDS = (
    "generation_start",
    "sample_finished",
    "migration_start",
    "migration_end",
    "generation_end",
    "inference_start",
    "inference_end",
)


@dataclass(frozen=True)
class RolloutEvent:
    """One moment of the fused rollout on one rank."""

    kind: str
    """One of `EVENT_KINDS`."""
    rank: int
    time_s: float
    """`time.perf_counter()` on that rank (one monotonic clock for all local ranks)."""
    model_stage: str | None = None
    """The inference model-stage (inference_start/end), else None."""
    samples: tuple[int, ...] = ()
    """Samples concerned: finished at this step, migrated, or inferred."""


@dataclass(frozen=True)
class Migration:
    """The long-tail migration the rollout made (the same on every rank)."""

    remaining: int
    """Samples still generating when it triggered."""
    destinations: tuple[int, ...]
    """Generation replicas that decoded the tail."""
    moved: tuple[int, ...]
    """Samples that changed replica."""
    mechanism: str
    """`kv-transfer` or `recompute` (`none` when no sample moved)."""


@dataclass(frozen=True)
class FusedRollout:
    """Responses and inference results of the batch, as the unfused step gets them."""

    responses: list[list[int]]
    inferred: dict[str, torch.Tensor]
    """Per inference model-stage, [batch, seq] aligned with `rollout_batch(prompts, responses)`."""
    events: list[RolloutEvent]
    """This rank's events, in time order."""
    migration: Migration | None
    """None when the batch finished, or left no replica free, before the threshold."""
    log_probs: list[list[float]] | None = None
    """Under vLLM engines: the raw log-probability of every response token, from the engine
    that sampled it (a migrated sample's from both); None under nereus's own engine."""


class _Recorder:
    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.events: list[RolloutEvent] = []

    def note(self, kind: str, model_stage: str | None = None, samples: Sequence[int] = ()) -> None:
        self.events.append(RolloutEvent(kind, self.rank, time.perf_counter(), model_stage, tuple(samples)))


def _active_counts(generation: ModelStageRuntime, decoder: Decoder | None) -> list[int]:
    """Samples still generating on every generation replica (collective over the world)."""
    counts = torch.zeros(generation.layout.dp, dtype=torch.float64, device=rank_device())
    if decoder is not None and leads(generation):
        assert generation.engine is not None
        counts[generation.engine.groups.replica] = decoder.num_active
    collectives.all_reduce(counts)
    return [int(count) for count in counts.tolist()]


def plan_moves(
    active: Sequence[Sequence[int]], num_destinations: int
) -> tuple[list[int], dict[tuple[int, int], list[int]]]:
    """The `num_destinations` replicas with the most active samples (fewest moves) and the
    samples each other replica sends each destination (to the least loaded first)."""
    order = sorted(range(len(active)), key=lambda replica: (-len(active[replica]), replica))
    destinations = sorted(order[:num_destinations])
    load = {d: len(active[d]) for d in destinations}
    moves: dict[tuple[int, int], list[int]] = {}
    for source in range(len(active)):
        if source in load:
            continue
        for sample in active[source]:
            target = min(destinations, key=lambda d: (load[d], d))
            moves.setdefault((source, target), []).append(sample)
            load[target] += 1
    return destinations, moves


def _send(hand_off: HandOff, dst: int) -> None:
    shapes = None if hand_off.kv is None else [tuple(kv.shape) for kv in hand_off.kv]
    dist.send_object_list([replace(hand_off, kv=None), shapes], dst=dst)
    if hand_off.kv is not None:
        dist.send(torch.cat([kv.reshape(-1) for kv in hand_off.kv]).to(rank_device()), dst=dst)


def _receive(src: int) -> HandOff:
    header: list[Any] = [None, None]
    dist.recv_object_list(header, src=src)
    hand_off, shapes = header
    if shapes is None:
        return hand_off
    flat = torch.empty(sum(math.prod(shape) for shape in shapes), device=rank_device())
    dist.recv(flat, src=src)
    pieces = flat.cpu().split([math.prod(shape) for shape in shapes])
    return replace(hand_off, kv=[piece.view(shape) for piece, shape in zip(pieces, shapes, strict=True)])


def _migrate(
    generation: ModelStageRuntime, decoder: Decoder | None, moves: dict[tuple[int, int], list[int]], cache: bool
) -> None:
    """Each move's rows go from every (stage, tensor rank) of the source replica to the same
    position of the destination. Sources only send and destinations only receive, in one
    global order, so the point-to-point messages cannot deadlock."""
    layout, rank = generation.layout, dist.get_rank()
    for (source, target), samples in sorted(moves.items()):
        for stage in range(layout.pp):
            for tp_rank in range(layout.tp):
                src, dst = layout.rank_at(source, stage, tp_rank), layout.rank_at(target, stage, tp_rank)
                if rank == src:
                    assert decoder is not None
                    _send(decoder.take(samples, cache), dst)
                elif rank == dst:
                    assert decoder is not None
                    decoder.receive(_receive(src))


def _share(samples: list[int], replicas: list[int], replica: int) -> list[int]:
    """Replica `replica`'s contiguous share of `samples` split over `replicas`."""
    if replica not in replicas:
        return []
    start, stop = even_split(len(samples), len(replicas))[replicas.index(replica)]
    return samples[start:stop]


def _clear_replicas(stage: ModelStageRuntime, busy_ranks: set[int]) -> list[int]:
    layout = stage.layout
    size = layout.replica_size
    return [d for d in range(layout.dp) if not set(layout.ranks[d * size : (d + 1) * size]) & busy_ranks]


def _place(
    batch: Batch, prompts: Sequence[list[int]], parts: list[tuple[list[int], torch.Tensor, int]]
) -> torch.Tensor:
    """Rows computed on sub-batches, moved into the whole rollout batch's columns (zeros off
    the real tokens, which every consumer masks out)."""
    width = max(len(p) for p in prompts)
    lengths = batch.mask().sum(dim=1)
    out = torch.zeros(batch.tokens.shape, dtype=torch.float32)
    for samples, rows, sub_width in parts:
        for row, sample in enumerate(samples):
            start, real = len(prompts[sample]), int(lengths[sample])
            out[sample, width - start : width - start + real] = rows[row, sub_width - start : sub_width - start + real]
    return out


def _plan_migration(
    generation: ModelStageRuntime,
    decoder: Decoder | None,
    counts: list[int],
    capacity: int,
    settings: MigrationSettings,
    mechanism: str | None,
) -> tuple[Migration, dict[tuple[int, int], list[int]], dict[int, list[int]]] | None:
    """The migration (same on every rank), its moves and the responses finished so far; None
    when nothing is left to generate or the tail needs every replica (collective)."""
    remaining = sum(counts)
    if remaining == 0 or math.ceil(remaining / capacity) >= len(counts):
        return None
    mine = None
    if decoder is not None and leads(generation):
        lengths = decoder.context_lengths()
        assert generation.engine is not None
        replica = generation.engine.groups.replica
        mine = (replica, decoder.sample_ids, dict(zip(decoder.sample_ids, lengths, strict=True)), decoder.responses)
    active: list[list[int]] = [[] for _ in counts]
    context: dict[int, int] = {}
    finished: dict[int, list[int]] = {}
    for part in collectives.all_gathered_objects(mine):
        if part is None:
            continue
        replica, active[replica], lengths_by_sample, done = part
        context.update(lengths_by_sample)
        finished.update(done)
    destinations, moves = plan_moves(active, math.ceil(remaining / capacity))
    moved = tuple(sorted(s for samples in moves.values() for s in samples))
    layout = generation.layout
    chosen = mechanism or migration_mechanism(
        settings.profile, sum(context[s] for s in moved), len(moves) * layout.replica_size
    )
    migration = Migration(remaining, tuple(destinations), moved, chosen if moved else "none")
    return migration, moves, finished


#: Decode steps between counts of the samples still generating: a count is a world collective
#: that holds the replicas in lock-step, so it is taken only every few steps (the migration
#: may start up to this many steps minus one after the threshold is reached).
COUNT_EVERY = 4

#: Samples per early inference call: a freed rank checks between calls whether the tail has
#: ended, so that the rest of the finished samples are shared with the destinations.
EARLY_CHUNK = 8


#: Numbers the rollouts (every rank runs the same ones in the same order) to key their signals.
_ROLLOUT_IDS = itertools.count()


class _TailSignal:
    """Whether every rank decoding the tail has finished, through the process group's store:
    a destination rank sets its key when done, a freed rank checks the keys between chunks
    without blocking (gloo's point-to-point receives complete only when waited on)."""

    def __init__(self, busy: set[int], rollout: int):
        # The default group's store (rendezvous): torch exposes it only under this name.
        self.store = dist.distributed_c10d._get_default_store()
        self.prefix = f"nereus/fused-rollout/{rollout}/tail-done/"
        self.keys = [f"{self.prefix}{rank}" for rank in sorted(busy)]

    def announce(self, rank: int) -> None:
        self.store.set(f"{self.prefix}{rank}", "1")

    def ended(self) -> bool:
        return self.store.check(self.keys)


def _replica_agrees(stage: ModelStageRuntime, flag: bool) -> bool:
    """`flag` OR-ed over the ranks of this rank's replica of `stage` (over its tensor then its
    pipeline group), so that they stop together."""
    engine = stage.engine
    assert engine is not None
    value = torch.tensor([float(flag)], device=rank_device())
    for group in (engine.groups.tp.group, engine.groups.link.group):
        if group is not None:
            collectives.all_reduce(value, group, op="max")
    return bool(value.item() > 0)


def _early_inference(
    stages: dict[str, ModelStageRuntime],
    busy: set[int],
    finished: dict[int, list[int]],
    prompts: Sequence[list[int]],
    signal: _TailSignal,
    recorder: _Recorder,
    parts: list[tuple[str, list[int], torch.Tensor, int]],
    seconds: dict[str, float],
) -> dict[str, list[int]]:
    """On every inference replica clear of the tail's ranks: the finished samples' share, in
    chunks, until the tail ends. The samples this rank's replicas inferred, where it leads them."""
    done: dict[str, list[int]] = {}
    if not finished or dist.get_rank() in busy:
        return done
    for name in INFERENCE_STAGES:
        stage = stages.get(name)
        if stage is None or stage.engine is None:
            continue
        clear = _clear_replicas(stage, busy)
        mine = _share(sorted(finished), clear, stage.engine.groups.replica)
        for first in range(0, len(mine), EARLY_CHUNK):
            # Every rank of the replica checks before every chunk, so they stop at the same one.
            if _replica_agrees(stage, signal.ended()):
                break
            chunk = mine[first : first + EARLY_CHUNK]
            _infer(stage, name, chunk, [stage.engine.groups.replica], prompts, finished, recorder, parts, seconds)
            if leads(stage):
                done.setdefault(name, []).extend(chunk)
    return done


def fused_rollout(
    stages: dict[str, ModelStageRuntime],
    prompts: list[list[int]],
    sampling: SamplingConfig,
    settings: MigrationSettings,
    seconds: dict[str, float],
    budgets: list[int] | None = None,
    mechanism: str | None = None,
    kv_budget: KVBudget | None = None,
) -> FusedRollout:
    """Generate every prompt's response and run the inference model-stages on it, fused.
    Prompt i is sample i; `budgets[i]` caps its length (default `sampling.max_new_tokens`);
    `mechanism` forces `kv-transfer` or `recompute` (None: the cost model picks); each
    replica's KV pool follows `kv_budget` (default: room for its share at the longest)."""
    if mechanism not in (None, "kv-transfer", "recompute"):
        raise ValueError(f"mechanism must be kv-transfer, recompute or None (the cost model picks), got {mechanism!r}")
    recorder = _Recorder()
    generation = stages[ACTOR_GENERATION]
    layout = generation.layout
    caps = budgets if budgets is not None else [sampling.max_new_tokens] * len(prompts)
    shares = even_split(len(prompts), layout.dp)
    capacity = max(b - a for a, b in shares)
    start = time.perf_counter()
    recorder.note("generation_start")
    decoder: Decoder | None = None
    if generation.rollout_engine is not None:  # vLLM: requests step by step; a migration re-prefills
        decoder = VLLMDecoder(generation.rollout_engine, sampling)
        mechanism = "recompute"
    elif generation.engine is not None:
        # Sized for a destination's load: as many samples as a share, at the batch's longest.
        longest = max(len(p) for p in prompts) + max(caps)
        decoder = BatchingDecoder(generation.engine, sampling, kv_budget or KVBudget(), (capacity, longest))
    if decoder is not None:
        assert generation.engine is not None, "a vLLM engine is its engine's replica (`start_rollout_engine`)"
        first, stop = shares[generation.engine.groups.replica]
        if stop > first:
            decoder.start(prompts[first:stop], range(first, stop), caps[first:stop])
    # Decode until at most `allowed` samples are still generating over all replicas.
    allowed = math.floor(settings.threshold * len(prompts))
    for step in itertools.count(1):
        _decode_step(decoder, recorder)
        if step % COUNT_EVERY == 0:
            counts = _active_counts(generation, decoder)
            if sum(counts) <= allowed:
                break
    planned = _plan_migration(generation, decoder, counts, capacity, settings, mechanism)
    migration, moves, finished = planned if planned is not None else (None, {}, {})
    busy = set(layout.ranks)
    if migration is not None:
        recorder.note("migration_start", samples=migration.moved)
        _migrate(generation, decoder, moves, migration.mechanism == "kv-transfer")
        recorder.note("migration_end", samples=migration.moved)
        size = layout.replica_size
        busy = {r for d in migration.destinations for r in layout.ranks[d * size : (d + 1) * size]}
    rank = dist.get_rank()
    signal = _TailSignal(busy, next(_ROLLOUT_IDS))
    if rank in busy:
        while decoder is not None and decoder.num_active:
            _decode_step(decoder, recorder)
        if migration is not None:
            signal.announce(rank)
    recorder.note("generation_end")
    seconds[ACTOR_GENERATION] = seconds.get(ACTOR_GENERATION, 0.0) + time.perf_counter() - start
    parts: list[tuple[str, list[int], torch.Tensor, int]] = []
    early = _early_inference(stages, busy, finished, prompts, signal, recorder, parts, seconds)
    with timed(seconds, "exchange"):
        responses: dict[int, list[int]] = {}
        log_probs: dict[int, list[float]] = {}
        inferred_early: dict[str, set[int]] = {name: set() for name in INFERENCE_STAGES}
        mine = decoder.responses if decoder is not None and leads(generation) else None
        mine_log_probs = decoder.log_probs if isinstance(decoder, VLLMDecoder) and leads(generation) else None
        generated = 0
        for part, part_log_probs, done in collectives.all_gathered_objects((mine, mine_log_probs, early)):
            generated += len(part or {})
            responses.update(part or {})
            log_probs.update(part_log_probs or {})
            for name, samples in done.items():
                inferred_early[name].update(samples)
    assert generated == len(prompts) and sorted(responses) == list(range(len(prompts))), "every sample once"
    for name in INFERENCE_STAGES:
        if name in stages:
            rest = [s for s in range(len(prompts)) if s not in inferred_early[name]]
            replicas = list(range(stages[name].layout.dp))
            _infer(stages[name], name, rest, replicas, prompts, responses, recorder, parts, seconds)
    ordered = [responses[s] for s in range(len(prompts))]
    batch = rollout_batch(prompts, ordered, sampling.pad_token_id)
    with timed(seconds, "exchange"):
        gathered = [item for chunk in collectives.all_gathered_objects(parts) for item in chunk]
    inferred: dict[str, torch.Tensor] = {
        name: _place(batch, prompts, [(ids, rows, width) for stage, ids, rows, width in gathered if stage == name])
        for name in INFERENCE_STAGES
        if name in stages
    }
    engine_log_probs = None
    if generation.rollout_engine is not None or log_probs:  # a vLLM engine sampled them
        assert sorted(log_probs) == list(range(len(prompts))), "every sample's log-probs once"
        engine_log_probs = [log_probs[s] for s in range(len(prompts))]
    return FusedRollout(ordered, inferred, recorder.events, migration, engine_log_probs)


def _decode_step(decoder: Decoder | None, recorder: _Recorder) -> None:
    if decoder is not None and decoder.num_active:
        finished = decoder.step()
        if finished:
            recorder.note("sample_finished", samples=finished)


def _infer(
    stage: ModelStageRuntime,
    name: ModelStageName,
    samples: list[int],
    replicas: list[int],
    prompts: Sequence[list[int]],
    responses: dict[int, list[int]],
    recorder: _Recorder,
    parts: list[tuple[str, list[int], torch.Tensor, int]],
    seconds: dict[str, float],
) -> None:
    """This rank's replica of `stage` (when among `replicas`) infers its share of `samples`;
    the replica's lead keeps the sample ids, their token-aligned rows and their batch's prompt
    width for the exchange."""
    engine = stage.engine
    mine = _share(samples, replicas, engine.groups.replica) if engine is not None else []
    if engine is None or not mine:
        return
    recorder.note("inference_start", name, mine)
    with timed(seconds, name):
        # Pads are masked out of attention: their id does not change any real token's row.
        batch = rollout_batch([prompts[s] for s in mine], [responses[s] for s in mine], 0)
        rows = replica_infer(engine, batch, INFERENCE_OUTPUTS[name], min(stage.plan.micro_batches, len(mine)))
    recorder.note("inference_end", name, mine)
    if leads(stage):
        parts.append((name, mine, rows, max(len(prompts[s]) for s in mine)))

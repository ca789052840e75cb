"""Inter-stage fusion: generation with long-tail migration, simulated; the threshold swept.

Generation runs on `num_instances` replicas, each decoding its samples in lock-step: a step
emits one token per active sample and takes

    max(weight read + context tokens x KV read per token, active samples x compute per token)

(memory bound until the batch passes the ridge point). Response lengths are log-normal,
truncated at the maximum. Without fusion, inference (old log-probs, reference, reward,
critic) starts once the last sample is done and is spread evenly over every instance.

With fusion at threshold R, once at most R x batch samples remain they migrate to the
fewest destinations satisfying both (a) decode throughput: a destination's step with its
share of the remaining samples is no slower than the slowest instance's step just before
the migration, so the long tail does not decode slower, and (b) KV memory: every
remaining sample fits at its maximum length. Destinations are the
instances with the most remaining samples (fewest moves). Each migrated sample either
ships its KV cache over the inter-node link or ships its tokens and re-runs the prefill on
the destination, whichever costs less overall; destinations pause while they receive.
The freed instances at once run inference on finished samples, each destination joins
them when its own samples are done, and samples finishing later queue up (a fluid queue
of instance-seconds). Inference work is proportional to each sample's tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from nereus.cost.calibration import DEFAULT_CALIBRATION, Calibration
from nereus.cost.plan_cost import evaluate_plan, stage_cost_model, stage_room
from nereus.errors import ArgumentError, NereusError
from nereus.spec.plan import Plan
from nereus.spec.stages import ACTOR_GENERATION, stage_of
from nereus.spec.workload import DTYPE_BYTES, ResponseLengths

Progress = Callable[[int, int], None]

#: Thresholds swept: 5%, 10%, ..., 95% of the batch.
THRESHOLDS = tuple(round(0.05 * k, 2) for k in range(1, 20))


@dataclass(frozen=True)
class GenerationProfile:
    """Per-instance decode costs of one generation layout, and the batch it generates."""

    num_instances: int
    """Generation replicas (dp of actor/generation)."""
    samples_per_instance: int
    """Samples each replica generates per step."""
    prompt_len: int
    """Prompt tokens per sample."""
    lengths: ResponseLengths
    """Response-length distribution (log-normal, truncated at its max)."""
    weight_read_s: float
    """Seconds to stream one replica's weights once (a memory-bound decode step's floor)."""
    kv_read_s_per_token: float
    """Extra step seconds per context token held in the KV cache."""
    compute_s_per_token: float
    """Compute seconds per generated token (per active sample in a step)."""
    prefill_s_per_token: float
    """Seconds to recompute one context token's prefill on a replica."""
    kv_capacity_tokens: float
    """KV-cache tokens a replica holds once its weights are resident."""
    kv_bytes_per_token: float
    """KV-cache bytes per token of one replica (all its GPUs)."""
    transfer_bytes_per_s: float
    """Bytes per second a replica sends or receives KV cache with (its GPUs in parallel)."""
    transfer_latency_s: float
    """Latency of one KV transfer."""
    inference_s_per_token: float
    """Replica-seconds of inference (every inference model-stage) per sample token."""

    @property
    def ridge_batch(self) -> float:
        """Active samples at which a step turns compute bound (the throughput constraint)."""
        return max(1.0, self.weight_read_s / self.compute_s_per_token)

    def step_s(self, active: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        memory = self.weight_read_s + context_tokens * self.kv_read_s_per_token
        return np.maximum(memory, active * self.compute_s_per_token)


@dataclass(frozen=True)
class FusionOutcome:
    """One batch at one threshold."""

    total_s: float
    """Generation + inference time."""
    generation_s: float
    migration_s: float
    """When the migration started (0 when none)."""
    destinations: int
    mechanism: str
    """`kv-transfer`, `recompute` or `none`."""


@dataclass(frozen=True)
class ThresholdPoint:
    """A threshold's mean over the sampled batches."""

    threshold: float
    total_s: float
    destinations: float
    mechanism: str


@dataclass(frozen=True)
class SweepResult:
    """The threshold sweep: baseline, every point, the best."""

    profile: GenerationProfile
    baseline_generation_s: float
    baseline_inference_s: float
    points: list[ThresholdPoint]
    best: ThresholdPoint
    num_batches: int

    @property
    def baseline_s(self) -> float:
        return self.baseline_generation_s + self.baseline_inference_s

    @property
    def speedup(self) -> float:
        return self.baseline_s / self.best.total_s

    def to_json(self) -> dict[str, Any]:
        return {
            "instances": self.profile.num_instances,
            "samples_per_instance": self.profile.samples_per_instance,
            "max_length": self.profile.lengths.max,
            "batches": self.num_batches,
            "without_fusion_s": {
                "generation": self.baseline_generation_s,
                "inference": self.baseline_inference_s,
                "total": self.baseline_s,
            },
            "with_fusion_s": self.best.total_s,
            "best_threshold": self.best.threshold,
            "speedup": self.speedup,
            "destinations": self.best.destinations,
            "mechanism": self.best.mechanism,
            "points": [
                {
                    "threshold": p.threshold,
                    "total_s": p.total_s,
                    "destinations": p.destinations,
                    "mechanism": p.mechanism,
                }
                for p in self.points
            ],
        }


def sample_lengths(profile: GenerationProfile, rng: np.random.Generator) -> np.ndarray:
    """Response lengths per instance (rows), log-normal truncated to 1..max."""
    lengths = profile.lengths
    draws = lengths.median * np.exp(
        lengths.sigma * rng.standard_normal((profile.num_instances, profile.samples_per_instance))
    )
    return np.clip(np.rint(draws), 1, lengths.max).astype(np.int64)


def step_ends(profile: GenerationProfile, generated: np.ndarray, final: np.ndarray, start_s: float) -> np.ndarray:
    """End time of each decode step of one instance taking its samples from `generated` to `final` tokens."""
    left = final - generated
    if left.size == 0 or left.max() <= 0:
        return np.zeros(0)
    order = np.argsort(left, kind="stable")
    sorted_left = left[order]
    prefix = np.concatenate(([0], np.cumsum((profile.prompt_len + generated)[order])))
    steps = np.arange(1, int(sorted_left[-1]) + 1)
    first_active = np.searchsorted(sorted_left, steps, side="left")  # samples from here on still decode
    active = left.size - first_active
    context = (prefix[-1] - prefix[first_active]) + active * steps
    return start_s + np.cumsum(profile.step_s(active, context))


def decode_finish_times(
    profile: GenerationProfile, generated: np.ndarray, final: np.ndarray, start_s: float
) -> np.ndarray:
    """When each sample of one instance finishes, decoding from `generated` to `final` tokens from `start_s`."""
    ends = step_ends(profile, generated, final, start_s)
    left = final - generated
    if ends.size == 0:
        return np.full(final.shape, start_s, dtype=float)
    return np.where(left > 0, ends[np.maximum(left, 1) - 1], start_s)


def _inference_end(
    profile: GenerationProfile, arrivals: list[tuple[float, float]], capacity: list[tuple[float, int]]
) -> float:
    """Fluid queue: work (time, replica-seconds) arrives; `capacity` (time, +replicas) grows; when is it all done?"""
    events = sorted([(t, 0, w) for t, w in arrivals] + [(t, 1, float(c)) for t, c in capacity])
    now, backlog, servers = 0.0, 0.0, 0.0
    for time_s, kind, value in events:
        if servers > 0:
            backlog = max(0.0, backlog - servers * (time_s - now))
        now = max(now, time_s)
        if kind == 0:
            backlog += value
        else:
            servers += value
    assert servers > 0, "every replica joins inference by the end of generation"
    return now + backlog / servers


def run_batch(profile: GenerationProfile, lengths: np.ndarray, threshold: float | None) -> FusionOutcome:
    """Generation + inference of one batch; `threshold` None runs without fusion."""
    prompt, rate = profile.prompt_len, profile.inference_s_per_token
    zeros = np.zeros_like(lengths)
    finish = np.stack([decode_finish_times(profile, zeros[i], lengths[i], 0.0) for i in range(len(lengths))])
    work = (prompt + lengths) * rate
    generation_end = float(finish.max())
    if threshold is None:
        total = generation_end + float(work.sum()) / profile.num_instances
        return FusionOutcome(total, generation_end, 0.0, 0, "none")
    # Migrate the moment at most threshold x batch samples are still generating.
    allowed = math.floor(threshold * lengths.size)
    if allowed < 1:
        return run_batch(profile, lengths, None)
    t_m = float(np.sort(finish.ravel())[lengths.size - allowed - 1])
    return _migrate(profile, lengths, finish, work, finish > t_m, t_m)


def _tokens_at(profile: GenerationProfile, lengths: np.ndarray, t_m: float) -> np.ndarray:
    """Tokens each sample has generated by `t_m`."""
    generated = np.zeros_like(lengths)
    for i, row in enumerate(lengths):
        steps_done = int(np.searchsorted(step_ends(profile, np.zeros_like(row), row, 0.0), t_m, side="right"))
        generated[i] = np.minimum(row, steps_done)
    return generated


def _destinations(profile: GenerationProfile, remaining: np.ndarray, generated: np.ndarray) -> int:
    """The fewest destinations whose decode steps are no slower than the slowest instance's now
    (throughput) and whose KV cache holds every remaining sample at its maximum length (memory)."""
    count = int(remaining.sum())
    context = np.where(remaining, profile.prompt_len + generated, 0)
    slowest_now = float(profile.step_s(remaining.sum(axis=1), context.sum(axis=1)).max())
    total_context = float(context.sum())
    by_memory = math.ceil(count * (profile.prompt_len + profile.lengths.max) / profile.kv_capacity_tokens)
    k = max(1, by_memory)
    while k < profile.num_instances:
        step = float(profile.step_s(np.array(math.ceil(count / k)), np.array(total_context / k)))
        if step <= slowest_now * (1 + 1e-9):
            break
        k += 1
    return min(profile.num_instances, k)


def _migrate(
    profile: GenerationProfile,
    lengths: np.ndarray,
    finish: np.ndarray,
    work: np.ndarray,
    remaining: np.ndarray,
    t_m: float,
) -> FusionOutcome:
    generated = _tokens_at(profile, lengths, t_m)
    k = _destinations(profile, remaining, generated)
    per_instance = remaining.sum(axis=1)
    dests = [int(i) for i in np.argsort(-per_instance, kind="stable")[:k]]
    moving = [(i, j) for i in range(len(lengths)) if i not in dests for j in map(int, np.flatnonzero(remaining[i]))]
    received: dict[int, list[tuple[int, int]]] = {d: [] for d in dests}
    load = {d: int(per_instance[d]) for d in dests}
    for i, j in moving:
        d = min(dests, key=lambda x: (load[x], x))
        received[d].append((i, j))
        load[d] += 1
    context = {d: sum(profile.prompt_len + int(generated[i, j]) for i, j in received[d]) for d in dests}
    transfer = {d: (profile.transfer_latency_s if context[d] else 0.0)
                + context[d] * profile.kv_bytes_per_token / profile.transfer_bytes_per_s for d in dests}  # fmt: skip
    recompute = {d: context[d] * profile.prefill_s_per_token for d in dests}
    mechanism = "kv-transfer" if sum(transfer.values()) <= sum(recompute.values()) else "recompute"
    delay = transfer if mechanism == "kv-transfer" else recompute
    arrivals = [
        (float(min(finish[i, j], t_m)), float(work[i, j])) for i, j in zip(*np.nonzero(~remaining), strict=True)
    ]
    capacity = [(t_m, profile.num_instances - k)] if profile.num_instances > k else []
    generation_end = t_m
    for d in dests:
        members = [(d, int(j)) for j in np.flatnonzero(remaining[d])] + received[d]
        gen = np.array([generated[i, j] for i, j in members])
        final = np.array([lengths[i, j] for i, j in members])
        ends = decode_finish_times(profile, gen, final, t_m + delay[d])
        arrivals += [(float(e), float(work[i, j])) for e, (i, j) in zip(ends, members, strict=True)]
        done = float(ends.max()) if ends.size else t_m + delay[d]
        capacity.append((done, 1))
        generation_end = max(generation_end, done)
    total = _inference_end(profile, arrivals, capacity)
    return FusionOutcome(total, generation_end, t_m, k, mechanism if moving else "none")


def sweep_thresholds(
    profile: GenerationProfile, num_batches: int = 4, seed: int = 0, progress: Progress | None = None
) -> SweepResult:
    """Mean generation + inference time per threshold over sampled batches; the best threshold."""
    if num_batches < 1:
        raise ArgumentError(f"`num_batches` must be at least 1, got {num_batches}", "num_batches")
    rng = np.random.default_rng(seed)
    batches = [sample_lengths(profile, rng) for _ in range(num_batches)]
    baseline = [run_batch(profile, b, None) for b in batches]
    base_gen = float(np.mean([o.generation_s for o in baseline]))
    base_total = float(np.mean([o.total_s for o in baseline]))
    points = []
    for step, threshold in enumerate(THRESHOLDS, 1):
        outcomes = [run_batch(profile, b, threshold) for b in batches]
        mechanisms = [o.mechanism for o in outcomes]
        points.append(
            ThresholdPoint(
                threshold,
                float(np.mean([o.total_s for o in outcomes])),
                float(np.mean([o.destinations for o in outcomes])),
                max(set(mechanisms), key=mechanisms.count),
            )
        )
        if progress:
            progress(step, len(THRESHOLDS))
    best = min(points, key=lambda p: (p.total_s, p.threshold))
    return SweepResult(profile, base_gen, base_total - base_gen, points, best, num_batches)


def generation_profile(plan: Plan, calibration: Calibration = DEFAULT_CALIBRATION) -> GenerationProfile:
    """Decode costs from the plan's actor/generation layout; inference cost from its inference stages."""
    entry = plan.stage_plan(ACTOR_GENERATION)
    workload, cluster = plan.workload, plan.cluster
    cost = stage_cost_model(plan, "actor", "generation", calibration)
    dtype = DTYPE_BYTES[workload.dtype]
    hbm = cluster.gpu.hbm_bytes_per_s * calibration.decode_memory
    gpus = entry.replica_size
    free_bytes = stage_room(cluster, calibration) - float(cost.params_per_gpu(entry.tp, entry.pp, entry.ep)) * dtype
    kv_per_gpu = float(cost.kv_bytes_per_token(entry.tp, entry.pp))
    if free_bytes <= 0:
        raise NereusError("actor/generation: the weights leave no GPU memory for the KV cache; use a larger tp or pp")
    per_token_flops = float(cost.dense_flops_per_token(1))
    compute = float(cost.compute_time(per_token_flops, 0.0, entry.tp))
    bandwidth, latency = calibration.link(cluster, True)
    samples = math.ceil(workload.samples_per_step / entry.dp)
    predictions = evaluate_plan(plan, calibration).predictions
    inference_s = sum(p.time_s for name, p in predictions.model_stages.items() if stage_of(name) == "inference")
    tokens = workload.samples_per_step * (workload.prompt_len + workload.response_len.mean())
    return GenerationProfile(
        num_instances=entry.dp,
        samples_per_instance=samples,
        prompt_len=workload.prompt_len,
        lengths=workload.response_len,
        weight_read_s=float(cost.params_per_gpu(entry.tp, 1, entry.ep)) * dtype / hbm,
        kv_read_s_per_token=float(cost.kv_bytes_per_token(entry.tp, 1)) / hbm,
        compute_s_per_token=compute,
        prefill_s_per_token=compute,
        kv_capacity_tokens=free_bytes / kv_per_gpu,
        kv_bytes_per_token=kv_per_gpu * gpus,
        transfer_bytes_per_s=bandwidth * gpus,
        transfer_latency_s=latency,
        inference_s_per_token=inference_s * entry.dp / tokens,
    )

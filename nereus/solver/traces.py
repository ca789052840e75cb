"""Seeded drift-trace generators: sequence growth, spot-style availability, both combined."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

from nereus.spec.trace import Trace, TraceEvent
from nereus.spec.workload import ResponseLengths

#: The shape of the response-length distribution the generators scale (the ppo preset's).
DEFAULT_SHAPE = ResponseLengths(median=500, p99=2500, max=8192)


@dataclass(frozen=True)
class GrowthConfig:
    """Response lengths that grow geometrically, with seeded jitter."""

    start_tokens: int = 500
    """Response-length cap at step 0."""
    end_tokens: int = 8000
    """Response-length cap at the last step."""
    jitter: float = 0.03
    """Log-space standard deviation of the per-event noise around the growth curve."""
    every_steps: int = 10
    """Steps between length updates (one event each)."""
    shape: ResponseLengths = field(default_factory=lambda: DEFAULT_SHAPE)
    """Distribution that scales with the tokens (as with `nereus plan --seq-len`)."""
    grows: Literal["max", "median"] = "max"
    """Which statistic start/end_tokens set: the cap (median and p99 scale with it), or the
    median, the typical response a run's length curve reports (p99 and cap scale with it)."""
    max_tokens: int | None = None
    """With grows="median": the run's configured response cap, the lengths' ceiling (None: none)."""

    def label(self) -> str:
        """What the tokens of a trace's description are, where not the cap."""
        return "" if self.grows == "max" else f" (median; cap {self.max_tokens or 'none'})"

    def lengths(self, tokens: int) -> ResponseLengths:
        """The response-length distribution when the growing statistic is at `tokens`."""
        if self.grows == "max":
            return scaled_lengths(self.shape, tokens)
        scale = tokens / self.shape.median
        cap = round(self.shape.max * scale)
        cap = min(cap, self.max_tokens) if self.max_tokens is not None else cap
        median = min(tokens, cap)
        return ResponseLengths(median=median, p99=min(cap, max(median, round(self.shape.p99 * scale))), max=cap)


@dataclass(frozen=True)
class SpotConfig:
    """Spot-style availability: GPUs lost and regained in blocks at random times."""

    hours: float = 10.0
    """Wall time the trace's steps span; changes are spread over it."""
    num_changes: int = 12
    """Availability changes over the trace."""
    block_gpus: int = 4
    """GPUs lost or regained per change (a spot instance)."""
    min_gpus: int | None = None
    """Fewest GPUs the pool drops to; None = half the starting pool."""
    notice_fraction: float = 0.5
    """Share of losses announced in advance (spot interruption notices)."""
    notice_steps: int = 2
    """Advance notice of an announced loss, in steps."""


def scaled_lengths(shape: ResponseLengths, max_tokens: int) -> ResponseLengths:
    """`shape` rescaled so its cap is `max_tokens` (median and p99 scale alike)."""
    scale = max_tokens / shape.max
    median = max(1, round(shape.median * scale))
    return ResponseLengths(median=median, p99=min(max_tokens, max(median, round(shape.p99 * scale))), max=max_tokens)


def _growth_events(num_steps: int, config: GrowthConfig, rng: random.Random) -> dict[int, TraceEvent]:
    events: dict[int, TraceEvent] = {}
    ratio = math.log(config.end_tokens / config.start_tokens)
    last = num_steps - 1
    for step in range(config.every_steps, num_steps, config.every_steps):
        noise = rng.gauss(0.0, config.jitter) if step < last else 0.0
        tokens = max(1, round(config.start_tokens * math.exp(ratio * step / max(1, last) + noise)))
        events[step] = TraceEvent(step=step, response_len=config.lengths(tokens))
    if last > 0:
        events[last] = TraceEvent(step=last, response_len=config.lengths(config.end_tokens))
    return events


def _spot_events(num_steps: int, gpus: int, config: SpotConfig, rng: random.Random) -> dict[int, TraceEvent]:
    floor = config.min_gpus if config.min_gpus is not None else max(config.block_gpus, gpus // 2)
    if floor > gpus - config.block_gpus:
        raise ValueError(f"min_gpus={floor} leaves no room to lose a block of {config.block_gpus} of {gpus} GPUs")
    if config.num_changes >= num_steps:
        raise ValueError(f"{config.num_changes} availability changes need more than {num_steps} steps")
    steps = sorted(rng.sample(range(1, num_steps), config.num_changes))
    events: dict[int, TraceEvent] = {}
    current, previous_step = gpus, 0
    for step in steps:
        lose = current >= gpus or (current - config.block_gpus >= floor and rng.random() < 0.5)
        current = max(floor, current - config.block_gpus) if lose else min(gpus, current + config.block_gpus)
        announced = lose and rng.random() < config.notice_fraction
        notice = min(config.notice_steps, step - previous_step - 1) if announced else 0
        events[step] = TraceEvent(step=step, gpus=current, notice_steps=max(0, notice))
        previous_step = step
    return events


def _merge(*parts: dict[int, TraceEvent]) -> list[TraceEvent]:
    merged: dict[int, TraceEvent] = {}
    for part in parts:
        for step, event in part.items():
            if step in merged:
                fields: dict[str, object] = {
                    k: getattr(event, k)
                    for k in ("gpus", "response_len", "efficiency")
                    if getattr(event, k) is not None
                }
                fields["notice_steps"] = max(event.notice_steps, merged[step].notice_steps)
                merged[step] = merged[step].model_copy(update=fields)
            else:
                merged[step] = event
    return [merged[step] for step in sorted(merged)]


def sequence_growth_trace(num_steps: int, gpus: int, config: GrowthConfig, seed: int) -> Trace:
    """Responses grow from `start_tokens` to `end_tokens` over the run on a fixed pool."""
    rng = random.Random(seed)
    return Trace(
        name="seq-growth",
        description=(
            f"generated: sequence growth {config.start_tokens} -> {config.end_tokens} tokens{config.label()} over "
            f"{num_steps} steps on {gpus} GPUs, jitter {config.jitter}, seed {seed}"
        ),
        num_steps=num_steps,
        gpus=gpus,
        response_len=config.lengths(config.start_tokens),
        events=_merge(_growth_events(num_steps, config, rng)),
    )


def spot_trace(num_steps: int, gpus: int, tokens: int, config: SpotConfig, seed: int) -> Trace:
    """Spot-style availability on `gpus` GPUs at a fixed response-length cap of `tokens`."""
    rng = random.Random(seed)
    return Trace(
        name="spot",
        description=(
            f"generated: {config.num_changes} availability changes over {config.hours:g} h ({num_steps} steps) "
            f"on {gpus} GPUs in blocks of {config.block_gpus}, responses capped at {tokens} tokens, seed {seed}"
        ),
        num_steps=num_steps,
        gpus=gpus,
        response_len=scaled_lengths(DEFAULT_SHAPE, tokens),
        events=_merge(_spot_events(num_steps, gpus, config, rng)),
    )


def combined_trace(num_steps: int, gpus: int, growth: GrowthConfig, spot: SpotConfig, seed: int) -> Trace:
    """Sequence growth and spot-style availability in one run."""
    rng = random.Random(seed)
    lengths = _growth_events(num_steps, growth, rng)
    pool = _spot_events(num_steps, gpus, spot, rng)
    return Trace(
        name="combined",
        description=(
            f"generated: sequence growth {growth.start_tokens} -> {growth.end_tokens} tokens{growth.label()} and "
            f"{spot.num_changes} availability changes over {spot.hours:g} h ({num_steps} steps) on {gpus} GPUs, "
            f"seed {seed}"
        ),
        num_steps=num_steps,
        gpus=gpus,
        response_len=growth.lengths(growth.start_tokens),
        events=_merge(lengths, pool),
    )


def growing_pool_trace(num_steps: int, start_gpus: int, end_gpus: int, growth: GrowthConfig, seed: int) -> Trace:
    """A job that doubles its pool at even intervals from `start_gpus` to `end_gpus`, lengths growing."""
    if end_gpus < start_gpus or start_gpus <= 0:
        raise ValueError(f"need 0 < start GPUs <= end GPUs, got {start_gpus} and {end_gpus}")
    rng = random.Random(seed)
    sizes = []
    size = start_gpus
    while size < end_gpus:
        size = min(end_gpus, size * 2)
        sizes.append(size)
    gaps = num_steps // (len(sizes) + 1)
    pool = {gaps * (k + 1): TraceEvent(step=gaps * (k + 1), gpus=n) for k, n in enumerate(sizes)}
    return Trace(
        name="growing-pool",
        description=(
            f"generated: pool doubles {start_gpus} -> {end_gpus} GPUs and sequences grow "
            f"{growth.start_tokens} -> {growth.end_tokens} tokens over {num_steps} steps, seed {seed}"
        ),
        num_steps=num_steps,
        gpus=start_gpus,
        response_len=growth.lengths(growth.start_tokens),
        events=_merge(_growth_events(num_steps, growth, rng), pool),
    )

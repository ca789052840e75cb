"""Decode under a KV-cache budget with continuous batching, fast and by reference.

A generation replica's KV cache holds `capacity` tokens (its budget over the bytes one
token takes on a GPU). The engine admits queued sequences while their current context
fits, every running sequence writes one token per iteration, finished sequences free
their tokens at once (and the next queued ones are admitted), and when growth overflows
the budget the most recently admitted sequence is preempted back to the head of the
queue (vLLM's recompute preemption). The cost of one iteration depends on the number of
running sequences and on the tokens they hold, so a step's decode time is the sum over
iterations of that cost: `decode_profile` approximates the sequence of (running,
tokens) by a few slices in closed form, vectorised over layouts for the planner;
`simulate_continuous_batching` runs the engine iteration by iteration as the reference.

The closed form. When the budget holds every sequence's peak demand, nothing waits: the
running count follows the share of responses still generating, over the longest response.
When it holds the whole batch at its time-averaged context but not at its peak (lengths that
end together peak together), the batch runs so until the cache overflows, and the sequences
preempted then run their cut work afterwards (`_overflow_profile`: never fewer iterations, nor
less work, than the unbounded cache). Otherwise the cache runs full until the queue empties:
`capacity` less half a prompt of admission slack, shared by sequences whose time-averaged context is
p + E[L (L + 1) / 2] / E[L], so the KV token-iterations of the whole batch over that
fill give the saturated iterations. Then the sequences in flight drain; their remaining
lengths follow the length-biased residual distribution, and the longest of them ends the
drain, unless the batch's longest response ends later: its wait depends on its place in the
arrival order (the oldest places never wait, later ones are readmitted as the queue reaches
them), and its expected finish is taken over that place.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from nereus.spec.workload import ResponseLengths

Array = Any

#: Slices of the decode profile (half saturated, half drain when the budget binds).
DECODE_SLICES = 16
#: Equal-mass points of the length distribution behind the closed form's expectations.
LENGTH_POINTS = 64
#: Points of the residual-length distribution (over 0 .. max).
RESIDUAL_POINTS = 257

_NORMAL = NormalDist()


def length_points(lengths: ResponseLengths, count: int = LENGTH_POINTS) -> np.ndarray:
    """`count` equal-mass quantiles of the (capped) response-length distribution."""
    q = (np.arange(count) + 0.5) / count
    z = np.array([_NORMAL.inv_cdf(float(x)) for x in q])
    return np.minimum(float(lengths.max), lengths.median * np.exp(lengths.sigma * z))


def alive_fraction(lengths: ResponseLengths, t: np.ndarray) -> np.ndarray:
    """Share of responses longer than `t` tokens (still generating at decode iteration t)."""
    if lengths.sigma == 0:
        return np.where(t < lengths.median, 1.0, 0.0)
    z = [(math.log(x) - math.log(lengths.median)) / lengths.sigma if x > 0 else -math.inf for x in t.ravel()]
    alive = np.array([1.0 - _NORMAL.cdf(v) if v != -math.inf else 1.0 for v in z]).reshape(t.shape)
    return np.where(t >= lengths.max, 0.0, alive)


@dataclass(frozen=True)
class _Shape:
    """Per-workload constants of the closed form (independent of the layout)."""

    mean_length: float
    kv_iterations_per_sequence: float  # E[sum over its iterations of its context]
    residual_grid: np.ndarray  # r
    residual_cdf: np.ndarray  # G(r) of the length-biased residual


def _shape(lengths: ResponseLengths, prompt: float) -> _Shape:
    return _shape_of(lengths.median, lengths.p99, lengths.max, prompt)


@functools.lru_cache(maxsize=256)
def _shape_of(median: int, p99: int, maximum: int, prompt: float) -> _Shape:
    """The closed form's constants of one workload (the planner asks for them on every search)."""
    points = length_points(ResponseLengths(median=median, p99=p99, max=maximum))
    mean = float(points.mean())
    kv = float((points * (prompt + (points + 1) / 2)).mean())
    r = np.linspace(0.0, float(maximum), RESIDUAL_POINTS)
    survival = (points[None, :] > r[:, None]).mean(axis=1)
    cdf = np.concatenate([[0.0], np.cumsum((survival[1:] + survival[:-1]) / 2 * np.diff(r))]) / mean
    cdf = np.minimum(cdf, 1.0)
    r.flags.writeable = cdf.flags.writeable = False  # shared by every caller
    return _Shape(mean, kv, r, cdf)


def mean_context(lengths: ResponseLengths, prompt: float) -> float:
    """The time-averaged context of a sequence, p + E[L (L + 1) / 2] / E[L]: the KV tokens one
    running sequence holds on average over its iterations."""
    shape = _shape(lengths, prompt)
    return shape.kv_iterations_per_sequence / shape.mean_length


def decode_profile(
    lengths: ResponseLengths, prompt: float, n: Array, capacity: Array, longest: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(iterations, running sequences, KV tokens) per slice, shape (..., DECODE_SLICES), or
    (..., 2 * DECODE_SLICES) where some budget holds the batch but not its peak
    (`_overflow_profile`; the other rows then end in slices of no iterations).

    `n` sequences per replica and `capacity` KV tokens (inf: unbounded) broadcast;
    `longest` is the longest response the replica waits for.
    """
    n, capacity = (np.asarray(x, dtype=float) for x in np.broadcast_arrays(n, capacity))
    dims = n.shape
    n, capacity = n.reshape(-1), capacity.reshape(-1)
    # Unbounded: everything admitted at once, running = n * alive(t).
    t, alive = _slices(lengths, longest)
    running = np.maximum(1.0, n[:, None] * alive)
    profile = (np.full(running.shape, longest / DECODE_SLICES), running, running * (prompt + t))
    bound = capacity < _peak(n[:, None] * alive, prompt, t, n)
    if bound.any():  # the bound rows only: each row's profile is its own
        rows = _bound_profile(lengths, prompt, n[bound], capacity[bound], longest)
        if rows[0].shape[1] > DECODE_SLICES:  # slices of no iterations for the others
            profile = tuple(
                np.concatenate([x, np.full(x.shape, pad)], 1)
                for x, pad in zip(profile, (0.0, 1.0, prompt), strict=True)
            )
        for out, part in zip(profile, rows, strict=True):
            out[bound] = part
    return tuple(x.reshape(*dims, x.shape[1]) for x in profile)  # type: ignore[return-value]


def binds(lengths: ResponseLengths, prompt: float, n: Array, capacity: Array, longest: float) -> np.ndarray:
    """Whether a budget of `capacity` KV tokens holds less than the peak demand of `n` sequences
    admitted at once (a budget that does not bind decodes as the unbounded cache does)."""
    t, alive = _slices(lengths, longest)
    n = np.asarray(n, dtype=float)
    return np.asarray(capacity, dtype=float) < _peak(n[..., None] * alive, prompt, t, n)


def _slices(lengths: ResponseLengths, longest: float) -> tuple[np.ndarray, np.ndarray]:
    """The decode slices' midpoints over `longest` iterations and the share still generating."""
    return _slices_of(lengths.median, lengths.p99, lengths.max, longest)


@functools.lru_cache(maxsize=256)
def _slices_of(median: int, p99: int, maximum: int, longest: float) -> tuple[np.ndarray, np.ndarray]:
    t = (np.arange(DECODE_SLICES) + 0.5) / DECODE_SLICES * longest
    alive = alive_fraction(ResponseLengths(median=median, p99=p99, max=maximum), t)
    t.flags.writeable = alive.flags.writeable = False  # shared by every caller
    return t, alive


def _peak(running: np.ndarray, prompt: float, t: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The most KV tokens in use with nothing queued: the running sequences' contexts at the
    fullest slice, or every prompt and its first token."""
    return np.maximum((running * (prompt + t)).max(axis=-1), n * (prompt + 1))


def _bound_profile(
    lengths: ResponseLengths, prompt: float, n: np.ndarray, capacity: np.ndarray, longest: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`decode_profile` of replicas whose budget binds: a queue of sequences waiting for room
    (`_queue_profile`) where the budget holds fewer sequences than the batch at their time-averaged
    context, else the whole batch admitted and overflowing late (`_overflow_profile`)."""
    fill = np.maximum(prompt + 1.0, capacity - prompt / 2)  # admission slack
    late = fill >= n * mean_context(lengths, prompt)
    queue = _queue_profile(lengths, prompt, n[~late], capacity[~late], longest)
    if not late.any():
        return queue
    out = [np.empty((n.size, 2 * DECODE_SLICES)) for _ in range(3)]
    for whole, part in zip(out, _overflow_profile(lengths, prompt, n[late], capacity[late], longest), strict=True):
        whole[late] = part
    for whole, part, pad in zip(out, queue, (0.0, 1.0, prompt), strict=True):  # slices of no iterations
        whole[~late] = np.concatenate([part, np.full(part.shape, pad)], 1)
    return out[0], out[1], out[2]


def _overflow_profile(
    lengths: ResponseLengths, prompt: float, n: np.ndarray, capacity: np.ndarray, longest: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`decode_profile` of replicas whose budget holds the whole batch at its time-averaged context
    but not at its peak, in 2 x DECODE_SLICES slices. Every sequence runs as with an unbounded cache
    (its slices) until their contexts outgrow the budget; then the newest wait (preempted) while
    the cache stays full, and resume once the last slice that overflows ends (equal lengths: as the
    others finish). Nothing is lost: the sequence-iterations and KV token-iterations cut from the
    overflowing slices all run after it, the waiting count falling linearly from its most to none
    (twice their sequence-iterations over that most), alongside the slices still running and then,
    past the longest response, in DECODE_SLICES slices of their own. So a budget only moves work
    into more iterations: no fewer than the unbounded cache runs, more as it shrinks."""
    t, alive = _slices(lengths, longest)
    width = longest / DECODE_SLICES
    n, capacity = n[:, None], capacity[:, None]
    running = np.maximum(1.0, n * alive)  # the unbounded cache's slices
    demand = running * (prompt + t)
    kept = np.minimum(1.0, capacity / demand)
    cut_running = ((1 - kept) * running).sum(axis=1) * width  # sequence-iterations that wait
    cut_tokens = ((1 - kept) * demand).sum(axis=1) * width
    most = ((1 - kept) * running).max(axis=1)
    over = kept < 1
    resume = (DECODE_SLICES - np.argmax(over[:, ::-1], axis=1)) * width  # the end of the last overflowing slice
    span = 2 * cut_running / np.maximum(most, 1e-300)
    context = cut_tokens / np.maximum(cut_running, 1e-300)
    # The waiting sequences alongside the slices: their linear decline integrated over each slice.
    edges = np.arange(DECODE_SLICES + 1) * width
    resumed = _waiting_integral(edges[1:], resume, span, most) - _waiting_integral(edges[:-1], resume, span, most)
    main_running = kept * running + resumed / width
    main_tokens = kept * demand + resumed / width * context[:, None]
    # What still waits past the longest response, in slices of its own (midpoints: exact for a line).
    end = np.maximum(resume + span, longest)
    after = (end - longest)[:, None] * (np.arange(DECODE_SLICES) + 0.5) / DECODE_SLICES + longest
    after_running = most[:, None] * np.clip(1 - (after - resume[:, None]) / np.maximum(span, 1e-300)[:, None], 0, 1)
    return (
        np.concatenate(
            [np.full(running.shape, width), np.repeat((end - longest)[:, None] / DECODE_SLICES, DECODE_SLICES, 1)], 1
        ),
        np.concatenate([main_running, after_running], 1),
        np.concatenate([main_tokens, after_running * context[:, None]], 1),
    )


def _waiting_integral(u: np.ndarray, start: np.ndarray, span: np.ndarray, most: np.ndarray) -> np.ndarray:
    """The integral from 0 to each `u` (columns) of the waiting count per row: `most` falling
    linearly to none over `span` iterations from `start`, none before."""
    x = np.clip(u[None, :] - start[:, None], 0.0, span[:, None])
    return most[:, None] * (x - x**2 / (2 * np.maximum(span, 1e-300)[:, None]))


def _queue_profile(
    lengths: ResponseLengths, prompt: float, n: np.ndarray, capacity: np.ndarray, longest: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`decode_profile` of replicas whose budget holds fewer sequences than the batch at their
    time-averaged context: saturated with a queue, then draining."""
    half = DECODE_SLICES // 2
    shape = _shape(lengths, prompt)
    context = mean_context(lengths, prompt)
    fill = np.maximum(prompt + 1.0, capacity - prompt / 2)  # admission slack
    in_flight = np.minimum(n, np.maximum(1.0, fill / context))
    r, cdf = shape.residual_grid, shape.residual_cdf
    drain_longest = np.interp(in_flight / (in_flight + 1), cdf, r)
    drain_kv = in_flight * float(np.trapezoid(1.0 - cdf, r)) * context
    queued = np.maximum(0.0, (n * shape.kv_iterations_per_sequence - drain_kv) / fill)
    # Admitted at once: as many as fit at their prompt; the cache fills when they have grown to share it.
    started = np.minimum(n, np.maximum(1.0, np.floor(capacity / (prompt + 1.0))))
    fills_at = np.clip(fill / started - prompt, 0.0, queued)
    total = _expected_finish(queued, drain_longest, longest, in_flight / n, started / n, fills_at)
    drain = np.maximum(total - queued, 0.0)
    td = (np.arange(half) + 0.5) / half * drain[..., None]
    drain_running = np.maximum(1.0, in_flight[..., None] * (1.0 - np.interp(td, r, cdf)))
    return (
        np.concatenate(
            [np.repeat(queued[..., None] / half, half, -1), np.repeat(drain[..., None] / half, half, -1)], -1
        ),
        np.concatenate([np.repeat(in_flight[..., None], half, -1), drain_running], -1),
        np.concatenate([np.repeat(fill[..., None], half, -1), drain_running * context], -1),
    )


def _expected_finish(
    queued: np.ndarray, drain: np.ndarray, longest: float, kept: np.ndarray, started: np.ndarray, fills_at: np.ndarray
) -> np.ndarray:
    """E[max(queued + drain, longest + wait)] over the longest response's place u in the
    arrival order, uniform on [0, 1].

    Preemption takes the newest, so the running set is always the oldest unfinished sequences
    that fit: the first `kept` share of the order never waits; a later place is (re)admitted
    as the queue reaches it, at a time spread evenly from `fills_at` to `queued`, and has
    already written `fills_at` tokens if it was among the `started` share admitted at once.
    The wait is linear in u on each side of `started`, so the expectation is exact per piece.
    """
    others = queued + drain
    slope = (queued - fills_at) / np.maximum(1.0 - kept, 1e-12)  # admission time per unit of place
    edge = np.clip(started, kept, 1.0)
    # On [kept, edge) the place had written fills_at tokens already; on [edge, 1] it starts fresh.
    early = _mean_max_linear(others, longest - slope * kept, slope, kept, edge)
    late = _mean_max_linear(others, longest + fills_at - slope * kept, slope, edge, np.ones_like(edge))
    return kept * np.maximum(others, longest) + early + late


def _mean_max_linear(floor: np.ndarray, c0: np.ndarray, c1: np.ndarray, u0: np.ndarray, u1: np.ndarray) -> np.ndarray:
    """The integral over u in [u0, u1] of max(floor, c0 + c1 u), for c1 >= 0."""
    cross = np.clip((floor - c0) / np.maximum(c1, 1e-300), u0, u1)
    cross = np.where(c1 > 0, cross, np.where(c0 >= floor, u0, u1))
    return floor * (cross - u0) + c0 * (u1 - cross) + c1 * (u1**2 - cross**2) / 2


def priced_decode(
    profile: tuple[np.ndarray, np.ndarray, np.ndarray], iteration_cost: Callable[[Array, Array], Array]
) -> np.ndarray:
    """Seconds of decode: each slice's iterations at the cost of its (running, tokens)."""
    iterations, running, tokens = profile
    return (iterations * iteration_cost(running, tokens)).sum(axis=-1)


def quantile_batch(lengths: ResponseLengths, n: int, order: int) -> list[int]:
    """n equal-mass quantiles of the length distribution (whole tokens), shuffled by the seed
    `order`: one arrival order of a batch whose lengths are the distribution's own."""
    z = [_NORMAL.inv_cdf((i + 0.5) / n) for i in range(n)]
    points = [min(lengths.max, max(1, round(lengths.median * math.exp(lengths.sigma * x)))) for x in z]
    np.random.default_rng(order).shuffle(points)
    return points


def reference_runs(
    lengths: ResponseLengths,
    prompt: int,
    n: int,
    capacity: int,
    iteration_cost: Callable[[int, int], float],
    orders: int,
) -> list[BatchingRun]:
    """The reference engine on `orders` arrival orders of one batch (what the closed form's
    expectation over the longest response's place in the order is compared with)."""
    return [
        simulate_continuous_batching(quantile_batch(lengths, n, k), prompt, capacity, iteration_cost)
        for k in range(orders)
    ]


@dataclass(frozen=True)
class BatchingRun:
    """What the reference engine did for one batch."""

    time_s: float
    iterations: int
    preemptions: int


def simulate_continuous_batching(
    lengths: Sequence[int],
    prompt: int,
    capacity: int,
    iteration_cost: Callable[[int, int], float],
    max_running: int | None = None,
) -> BatchingRun:
    """Run the engine iteration by iteration: FCFS admission while the current context
    (plus the token it writes next) fits and fewer than `max_running` sequences run (None: no
    cap; vLLM's `max_num_seqs`), recompute preemption of the newest on overflow."""
    if capacity < prompt + max(lengths):
        raise ValueError(f"a KV budget of {capacity} tokens cannot hold one {prompt + max(lengths)}-token sequence")
    n = len(lengths)
    queue = list(range(n))[::-1]  # the head is the end of the list
    generated = [0] * len(lengths)
    running: list[int] = []
    used, time_s, iterations, preemptions = 0, 0.0, 0, 0
    while queue or running:
        while queue and used + prompt + generated[queue[-1]] + 1 <= capacity and len(running) < (max_running or n):
            seq = queue.pop()
            running.append(seq)
            used += prompt + generated[seq] + 1
        time_s += iteration_cost(len(running), used)
        iterations += 1
        for seq in running:
            generated[seq] += 1
        running = [seq for seq in running if generated[seq] < lengths[seq]]
        used = sum(prompt + generated[seq] + 1 for seq in running)
        while used > capacity:
            seq = running.pop()
            used -= prompt + generated[seq] + 1
            queue.append(seq)
            preemptions += 1
    return BatchingRun(time_s, iterations, preemptions)

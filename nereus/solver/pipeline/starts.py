"""The fused search's starting schedules: list schedules, lean starts and sequenced starts.

List schedules run under several priority rules and activation caps; the best few are
re-justified right and left (`improve.forward_backward`) while that shortens them. Lean starts
keep to tight caps; sequenced starts interleave every pipeline's 1F1B with a few extra warm-up
forwards. How many of each, and under which caps, is `SearchPolicy`'s.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

from nereus.errors import ArgumentError
from nereus.solver.pipeline.bounds import heads_and_tails, lower_bounds, memory_bound
from nereus.solver.pipeline.evaluate import Evaluation, evaluate, peak_memory, simulate
from nereus.solver.pipeline.greedy import GreedyRule, list_schedule, rule_key, stage_sequences, window_limits
from nereus.solver.pipeline.improve import forward_backward
from nereus.solver.pipeline.model import Instance
from nereus.solver.pipeline.policy import DEFAULT_POLICY, RELATIVE_EPS, SearchPolicy

Orders = list[list[int]]


class Start(NamedTuple):
    """A starting schedule: how it was made, its node orders and their evaluation."""

    name: str
    orders: Orders
    evaluation: Evaluation


@dataclass(frozen=True)
class LeanStart:
    """A schedule built to hold at most `cap` on every node, made as fast as it allows."""

    cap: float
    orders: Orders
    makespan: float
    peak: float


def by_speed(start: Start) -> tuple[float, float]:
    """Sort key of starts: fastest, then least memory."""
    return (start.evaluation.makespan, start.evaluation.max_peak_memory)


def parallel_workers(most: int) -> int:
    """Processes (or CP-SAT workers) for `most` parallel tasks: one per CPU, at least one."""
    return max(1, min(most, os.cpu_count() or 1))


def peak_memory_max(inst: Instance, orders: Orders) -> float:
    """The highest activation any node holds under `orders`."""
    return max(peak_memory(inst, orders), default=0.0)


def makespan_of(inst: Instance, orders: Orders) -> float:
    """The makespan of `orders`, or infinity when they deadlock."""
    state = simulate(inst, orders)
    return math.inf if state is None else state[0]


def list_schedules(inst: Instance, names: tuple[str, str], policy: SearchPolicy = DEFAULT_POLICY) -> list[Start]:
    """Every list schedule within the activation cap, fastest (then least memory) first.

    Rules: the longest remaining chain first or not, either model first on ties, with or
    without 1F1B in-flight windows; the longest-chain rules also run under tighter
    activation caps (`policy.greedy_cap_factors` x the memory bound) to find the same
    latency with less memory.
    """
    starts: list[Start] = []
    user_cap = inst.problem.activation_cap
    _, tails = heads_and_tails(inst)
    memory = memory_bound(inst.problem)
    for by_tail, model_order, windows in itertools.product((True, False), (names, names[::-1]), (True, False)):
        name = ("longest tail, " if by_tail else "") + f"{model_order[0]} first" + (", 1F1B windows" if windows else "")
        rule = GreedyRule(name, model_order, windows, tuple(tails) if by_tail else None)
        caps = [user_cap] + ([memory * f for f in policy.greedy_cap_factors] if by_tail else [])
        for cap in caps:
            if cap is not None and user_cap is not None and cap > user_cap:
                continue
            orders = list_schedule(inst, rule_key(inst, rule), window_limits(inst) if windows else None, cap)
            if orders is not None:
                label = rule.name + (f", cap {cap:g}" if cap is not None else "")
                starts.append(Start(label, orders, evaluate(inst, orders)))
    if not starts:
        raise ArgumentError(
            f"activation cap {user_cap:g} is too small: no list schedule fits (the serial 1F1B peak is "
            f"{memory:g}); raise `activation_cap`",
            "activation_cap",
        )
    return sorted(starts, key=by_speed)


def greedy_schedule(inst: Instance, names: tuple[str, str], policy: SearchPolicy = DEFAULT_POLICY) -> Start:
    """The best list schedule (latency, then memory) within the activation cap."""
    return list_schedules(inst, names, policy)[0]


def lean_starts(inst: Instance, names: tuple[str, str], policy: SearchPolicy = DEFAULT_POLICY) -> list[LeanStart]:
    """Per cap of `policy.lean_cap_factors` (within the user's cap), tightest first: the
    fastest of a few list schedules with 1F1B windows under the cap, each improved by
    forward-backward passes that keep to the cap."""
    user_cap = inst.problem.activation_cap
    memory = memory_bound(inst.problem)
    _, tails = heads_and_tails(inst)
    rules = (GreedyRule("lean", names[::-1], True), GreedyRule("lean", names, True),
             GreedyRule("lean", names, True, tuple(tails)))  # fmt: skip
    starts = []
    caps = [memory * factor for factor in policy.lean_cap_factors] + ([] if user_cap is None else [user_cap])
    for cap in sorted(caps):
        if user_cap is not None and cap > user_cap * (1 + RELATIVE_EPS):
            continue
        built = [list_schedule(inst, rule_key(inst, rule), window_limits(inst), cap) for rule in rules]
        runs = [orders for orders in built if orders is not None]
        if inst.num_ops > policy.lean_all_rules_ops:  # the passes are what costs: improve the fastest only
            runs = sorted(runs, key=lambda orders: makespan_of(inst, orders))[:1]
        improved = [forward_backward(inst, orders, cap=cap) for orders in runs]
        if improved:
            orders, makespan = min(improved, key=lambda pair: pair[1])
            starts.append(LeanStart(cap, orders, makespan, peak_memory_max(inst, orders)))
    return starts


def sequence_grid(names: tuple[str, str], policy: SearchPolicy = DEFAULT_POLICY) -> list[dict[str, int]]:
    """The (actor, critic) extra warm-ups of the sequenced starts, least extra memory first."""
    pairs = sorted(itertools.product(policy.sequence_extras, repeat=2), key=lambda p: (p[0] + p[1], max(p)))
    return [{names[0]: a, names[1]: c} for a, c in pairs]


def sequenced_starts(
    inst: Instance,
    names: tuple[str, str],
    seconds: float,
    part: int = 0,
    parts: int = 1,
    policy: SearchPolicy = DEFAULT_POLICY,
) -> list[LeanStart]:
    """Interleaved 1F1B of every pipeline: each (pipeline, stage) runs 1F1B with a few extra
    warm-up forwards (`greedy.stage_sequences`, `sequence_grid`), list scheduling interleaves
    the stages of a node (the second model first, or the first), and
    forward-backward passes capped at the schedule's own peak shorten it. Lean by
    construction (a stage holds at most its warm-up), often within a fraction of a percent
    of the fastest schedule. Extras grow until `seconds` are spent or a start reaches the
    latency lower bound (more warm-up only costs memory then); LeanStart.cap is the peak.
    With `parts`, only every parts-th grid point from `part` (for parallel workers)."""
    began = time.perf_counter()
    user_cap = inst.problem.activation_cap
    bound = lower_bounds(inst).latency
    keys = [rule_key(inst, GreedyRule("seq", order, False)) for order in (names[::-1], names)]
    starts: list[LeanStart] = []
    for extra in sequence_grid(names, policy)[part::parts]:
        sequences = stage_sequences(inst, extra)
        for key in keys:
            if time.perf_counter() - began > seconds and starts:
                return starts
            orders = list_schedule(inst, key, cap=user_cap, sequences=sequences)
            if orders is None:
                continue
            peak = peak_memory_max(inst, orders)
            orders, makespan = forward_backward(inst, orders, cap=peak)
            starts.append(LeanStart(peak, orders, makespan, peak_memory_max(inst, orders)))
            if makespan <= bound * (1 + RELATIVE_EPS):
                return starts
    return starts


def parallel_sequenced_starts(
    inst: Instance, names: tuple[str, str], seconds: float, policy: SearchPolicy = DEFAULT_POLICY
) -> list[LeanStart]:
    """`sequenced_starts` with the grid split over one process per CPU (two at most)."""
    workers = parallel_workers(2)
    if workers == 1 or seconds <= 0:
        return sequenced_starts(inst, names, seconds, policy=policy)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [
            pool.submit(sequenced_starts, inst, names, seconds, part, workers, policy) for part in range(workers)
        ]
        return [start for future in futures for start in future.result()]


def starting_schedules(
    inst: Instance, names: tuple[str, str], policy: SearchPolicy = DEFAULT_POLICY
) -> tuple[Start, list[Start]]:
    """The best list schedule, and the annealing starts: the best `policy.improved_starts`
    distinct list schedules (latency, then memory) after forward-backward improvement (whose
    passes keep to the activation cap), fastest first. Lean list schedules (1F1B windows,
    tight caps) often come out of the improvement almost as fast as the fastest at a
    fraction of its memory."""
    schedules = list_schedules(inst, names, policy)
    cap = inst.problem.activation_cap
    starts: list[Start] = []
    seen: set[tuple[float, float]] = set()
    for name, orders, ev in schedules:
        if len(starts) == policy.improved_starts:
            break
        if (ev.makespan, ev.max_peak_memory) in seen:
            continue  # the same makespan and peak usually mean the same schedule: improve distinct ones
        seen.add((ev.makespan, ev.max_peak_memory))
        improved, makespan = forward_backward(inst, orders, cap=cap)
        better = evaluate(inst, improved)
        if makespan < ev.makespan * (1 - RELATIVE_EPS):
            starts.append(Start(name + ", forward-backward", improved, better))
        else:
            starts.append(Start(name, orders, ev))
    return schedules[0], sorted(starts, key=by_speed)

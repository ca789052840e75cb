"""The fused schedule: list schedules, forward-backward improvement, then simulated annealing.

Starts: list schedules under several priority rules and activation caps; the best few are
re-justified right and left (`improve.forward_backward`) while that shortens them.
The search then minimises latency first and peak activation memory second
(lexicographically), each phase with its own share of the time limit. Phase one anneals
the makespan plus the summed lateness of ops past the lower bound (zero exactly when the
bound is met, so the walk is guided across makespan plateaus), with half of its moves
breaking an arc of the critical path (an op that waits for its node predecessor moves
ahead of it, or that predecessor behind it). Phase two keeps that makespan and anneals a
penalty that is zero exactly when a schedule is that fast and holds less than the best
peak: the lateness past the makespan plus each node's excess over a level just under the
peak, summed over the moments it stands above it. Half of its moves shift one of the
forwards nearest a high moment to after it, or a backward to before it; only schedules no
slower are kept, and each lowers the level. It stops at the memory lower bound at that
makespan (or the serial 1F1B reference). Other neighbours swap two nearby ops on one node
or move one op a few places; neighbours that deadlock or break the activation cap are
rejected. Independent seeds run in parallel processes and the best
schedule wins. Last, CP-SAT re-solves windows around the peak at that makespan
(`window.lower_peak`) for `SearchConfig.window_share` of the time limit, taken from the
memory phase.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace

from nereus.errors import ArgumentError, NereusError
from nereus.solver.pipeline.baselines import BaselineResult, pair_baselines
from nereus.solver.pipeline.bounds import (
    LowerBounds,
    follow_tails,
    heads_and_tails,
    lower_bounds,
    memory_bound,
    memory_bound_at,
    node_tails,
)
from nereus.solver.pipeline.evaluate import Evaluation, evaluate, peak_memory, resimulate, simulate
from nereus.solver.pipeline.greedy import GreedyRule, list_schedule, rule_key, stage_sequences, window_limits
from nereus.solver.pipeline.improve import forward_backward
from nereus.solver.pipeline.model import Instance, ModelTimes, Problem, build_instance, fused_problem

Progress = Callable[[int, int], None]
Orders = list[list[int]]

#: How far (in positions on a node) a move or swap reaches.
MOVE_SPAN = 8
#: Share of each seed's time (and iterations) that belongs to the memory phase.
MEMORY_PHASE_SHARE = 0.5
#: Initial temperature of the latency phase as a fraction of the starting makespan ...
LATENCY_TEMPERATURE = 0.01
#: ... and of the memory phase in its penalty's units (mean activations, mean op durations).
MEMORY_TEMPERATURE = 1.0
#: The temperature falls by this factor over a phase.
COOLING = 1e-3
RELATIVE_EPS = 1e-9


@dataclass(frozen=True)
class SearchConfig:
    """How long and how widely the fused search looks."""

    time_limit_s: float = 10.0
    """Wall-clock seconds for the whole search: bounds and starts, then the annealing gets
    what they and the CP-SAT windows leave (at least MIN_ANNEAL_SHARE of it)."""
    seeds: int = 2
    """Independent annealing runs; they run in parallel processes, one per CPU at most."""
    max_iterations: int | None = None
    """Also stop each seed after this many neighbours (a run that does not depend on CPU speed)."""
    window_share: float = 0.3
    """Share of `time_limit_s` that goes to CP-SAT after the annealing: shortening the fastest
    schedule (`window.shorten`), bringing lean starts to its makespan (`window.meet_makespan`)
    and peak windows (`window.lower_peak`), with OR-Tools installed; else the annealing keeps
    it. Not used
    with `max_iterations`: the windows' solves depend on time."""

    def __post_init__(self) -> None:
        if not 0 <= self.window_share < 1:
            raise ArgumentError(f"`window_share` must lie in [0, 1), got {self.window_share}", "window_share")
        if not self.time_limit_s > 0:
            raise ArgumentError(f"`time_limit_s` must be > 0 seconds, got {self.time_limit_s}", "time_limit_s")
        if self.seeds < 1:
            raise ArgumentError(f"`seeds` must be at least 1, got {self.seeds}", "seeds")
        if self.max_iterations is not None and self.max_iterations < 1:
            raise NereusError(f"max_iterations must be at least 1, got {self.max_iterations}")


@dataclass
class AnnealOutcome:
    """One seed's best schedule."""

    seed: int
    orders: Orders
    makespan: float
    peak: float
    iterations: int
    lean: list[LeanStart] = field(default_factory=list)
    """The lean phase's tries that got faster without reaching `makespan`: each the fastest
    schedule it found under its cap (the endgame may bring one the rest of the way)."""


@dataclass(frozen=True)
class LeanStart:
    """A schedule built to hold at most `cap` on every node, made as fast as it allows."""

    cap: float
    orders: Orders
    makespan: float
    peak: float


@dataclass
class FusedResult:
    """The fused schedule with everything needed to judge it."""

    problem: Problem
    instance: Instance
    orders: Orders
    evaluation: Evaluation
    bounds: LowerBounds
    greedy: Evaluation
    greedy_rule: str
    baselines: dict[str, BaselineResult]
    search_s: float
    seeds: int
    iterations: int
    memory_lower_bound: float = 0.0
    """Lower bound on the peak of every schedule as fast as this one (`memory_bound_at`)."""
    per_seed: list[tuple[int, float, float]] = field(default_factory=list)
    """(seed, makespan, peak memory) of every annealing run."""
    lean: list[LeanStart] = field(default_factory=list)
    """The lean starts (`lean_starts`): what holding less costs in makespan."""
    windows: tuple[int, int, float] = (0, 0, 0.0)
    """Peak windows solved, kept, and the peak before them (`window.lower_peak`)."""
    endgame: tuple[int, float] | None = None
    """When a lean start brought to the makespan won (`_lean_endgame`): its try and the
    peak of the annealing's schedule it replaced."""


#: Activation caps the greedy tries, as multiples of the memory bound (memory at no latency cost).
GREEDY_CAP_FACTORS = (1.0, 1.25, 1.5, 2.0, 3.0)


Start = tuple[str, Orders, Evaluation]
"""A starting schedule: how it was made, its node orders and evaluation."""


def list_schedules(inst: Instance, names: tuple[str, str]) -> list[Start]:
    """Every list schedule within the activation cap, fastest (then least memory) first.

    Rules: the longest remaining chain first or not, either model first on ties, with or
    without 1F1B in-flight windows; the longest-chain rules also run under tighter
    activation caps (multiples of the memory bound) to find the same latency with less memory.
    """
    starts: list[Start] = []
    user_cap = inst.problem.activation_cap
    _, tails = heads_and_tails(inst)
    memory = memory_bound(inst.problem)
    for by_tail, model_order, windows in itertools.product((True, False), (names, names[::-1]), (True, False)):
        name = ("longest tail, " if by_tail else "") + f"{model_order[0]} first" + (", 1F1B windows" if windows else "")
        rule = GreedyRule(name, model_order, windows, tuple(tails) if by_tail else None)
        caps = [user_cap] + ([memory * f for f in GREEDY_CAP_FACTORS] if by_tail else [])
        for cap in caps:
            if cap is not None and user_cap is not None and cap > user_cap:
                continue
            orders = list_schedule(inst, rule_key(inst, rule), window_limits(inst) if windows else None, cap)
            if orders is not None:
                label = rule.name + (f", cap {cap:g}" if cap is not None else "")
                starts.append((label, orders, evaluate(inst, orders)))
    if not starts:
        raise ArgumentError(
            f"activation cap {user_cap:g} is too small: no list schedule fits (the serial 1F1B peak is "
            f"{memory:g}); raise `activation_cap`",
            "activation_cap",
        )
    return sorted(starts, key=lambda s: (s[2].makespan, s[2].max_peak_memory))


#: Activation caps of the lean starts, as multiples of the memory bound.
LEAN_CAP_FACTORS = (1.1, 1.3, 1.6)


def lean_starts(inst: Instance, names: tuple[str, str]) -> list[LeanStart]:
    """Per cap of LEAN_CAP_FACTORS (within the user's cap), tightest first: the fastest of a
    few list schedules with 1F1B windows under the cap, each improved by forward-backward
    passes that keep to the cap."""
    user_cap = inst.problem.activation_cap
    memory = memory_bound(inst.problem)
    _, tails = heads_and_tails(inst)
    rules = (GreedyRule("lean", names[::-1], True), GreedyRule("lean", names, True),
             GreedyRule("lean", names, True, tuple(tails)))  # fmt: skip
    starts = []
    caps = [memory * factor for factor in LEAN_CAP_FACTORS] + ([] if user_cap is None else [user_cap])
    for cap in sorted(caps):
        if user_cap is not None and cap > user_cap * (1 + RELATIVE_EPS):
            continue
        built = [list_schedule(inst, rule_key(inst, rule), window_limits(inst), cap) for rule in rules]
        runs = [orders for orders in built if orders is not None]
        if inst.num_ops > LEAN_ALL_RULES_OPS:  # the passes are what costs: improve the fastest only
            runs = sorted(runs, key=lambda orders: _makespan(inst, orders))[:1]
        improved = [forward_backward(inst, orders, cap=cap) for orders in runs]
        if improved:
            orders, makespan = min(improved, key=lambda pair: pair[1])
            starts.append(LeanStart(cap, orders, makespan, max(peak_memory(inst, orders))))
    return starts


#: Above this many ops, lean starts improve only the fastest list schedule per cap (the
#: forward-backward passes take seconds there).
LEAN_ALL_RULES_OPS = 1000


#: Share of the time limit that builds the sequenced starts (with `max_iterations`, none:
#: their count would depend on time). They belong to the memory phase's share.
SEQUENCE_SHARE = 0.15
#: The annealing keeps at least this share of the time limit.
MIN_ANNEAL_SHARE = 0.1
#: Extra warm-up forwards per model over 1F1B's S - s that the sequenced starts try.
SEQUENCE_EXTRAS = (0, 1, 2, 3, 4, 6, 8)


def sequence_grid(names: tuple[str, str]) -> list[dict[str, int]]:
    """The (actor, critic) extra warm-ups of the sequenced starts, least extra memory first."""
    pairs = sorted(itertools.product(SEQUENCE_EXTRAS, repeat=2), key=lambda p: (p[0] + p[1], max(p)))
    return [{names[0]: a, names[1]: c} for a, c in pairs]


def sequenced_starts(
    inst: Instance, names: tuple[str, str], seconds: float, part: int = 0, parts: int = 1
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
    for extra in sequence_grid(names)[part::parts]:
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


def parallel_sequenced_starts(inst: Instance, names: tuple[str, str], seconds: float) -> list[LeanStart]:
    """`sequenced_starts` with the grid split over one process per CPU (two at most)."""
    workers = parallel_workers(2)
    if workers == 1 or seconds <= 0:
        return sequenced_starts(inst, names, seconds)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(sequenced_starts, inst, names, seconds, part, workers) for part in range(workers)]
        return [start for future in futures for start in future.result()]


def _makespan(inst: Instance, orders: Orders) -> float:
    state = simulate(inst, orders)
    return math.inf if state is None else state[0]


def greedy_schedule(inst: Instance, names: tuple[str, str]) -> Start:
    """The best list schedule (latency, then memory) within the activation cap."""
    return list_schedules(inst, names)[0]


#: Forward-backward improvement runs on this many of the best distinct list schedules.
IMPROVED_STARTS = 16
#: Seeds also start from starts at most this much slower (relative) than the fastest.
RESTART_SLACK = 0.01


def starting_schedules(inst: Instance, names: tuple[str, str]) -> tuple[Start, list[Start]]:
    """The best list schedule, and the annealing starts: the best distinct list schedules
    (latency, then memory) after forward-backward improvement (whose passes keep to the
    activation cap), fastest first. Lean list schedules (1F1B windows, tight caps) often
    come out of the improvement almost as fast as the fastest at a fraction of its memory."""
    schedules = list_schedules(inst, names)
    cap = inst.problem.activation_cap
    starts: list[Start] = []
    seen: set[tuple[float, float]] = set()
    for name, orders, ev in schedules:
        if len(starts) == IMPROVED_STARTS:
            break
        if (ev.makespan, ev.max_peak_memory) in seen:
            continue  # the same makespan and peak usually mean the same schedule: improve distinct ones
        seen.add((ev.makespan, ev.max_peak_memory))
        improved, makespan = forward_backward(inst, orders, cap=cap)
        better = evaluate(inst, improved)
        if makespan < ev.makespan * (1 - RELATIVE_EPS):
            starts.append((name + ", forward-backward", improved, better))
        else:
            starts.append((name, orders, ev))
    return schedules[0], sorted(starts, key=lambda s: (s[2].makespan, s[2].max_peak_memory))


def _neighbour(rng: random.Random, orders: Orders, movable: list[int]) -> tuple[int, list[int], int]:
    """(node, its new order, first position that changed): a swap of two nearby ops or a short move."""
    node = movable[rng.randrange(len(movable))]
    order = list(orders[node])
    i = rng.randrange(len(order))
    j = min(len(order) - 1, max(0, i + rng.randint(-MOVE_SPAN, MOVE_SPAN)))
    if i == j:
        j = i + 1 if i + 1 < len(order) else i - 1
    if rng.random() < 0.5:
        order[i], order[j] = order[j], order[i]
    else:
        order.insert(j, order.pop(i))
    return node, order, min(i, j)


def critical_node_arcs(inst: Instance, orders: Orders, start: list[float], end: list[float]) -> list[tuple[int, int]]:
    """(node, position) of every op on one critical path that waits for the op before it on its node.

    The path is walked back from the op that ends last, following at each op the constraint
    that fixes its start (a dependency, else its node predecessor). Only reordering such
    node arcs can shorten this path.
    """
    position = {}
    for node, order in enumerate(orders):
        for i, op in enumerate(order):
            position[op] = (node, i)
    makespan = max(end, default=0.0)
    tol = RELATIVE_EPS * max(1.0, makespan)
    op = max(range(inst.num_ops), key=end.__getitem__)
    arcs = []
    while start[op] > tol:
        node, i = position[op]
        pred = next((p for p, lat in inst.preds[op] if abs(end[p] + lat - start[op]) <= tol), -1)
        if pred < 0 and i and abs(end[orders[node][i - 1]] - start[op]) <= tol:
            arcs.append((node, i))
            pred = orders[node][i - 1]
        if pred < 0:
            break
        op = pred
    return arcs


def _critical_move(rng: random.Random, orders: Orders, arcs: list[tuple[int, int]]) -> tuple[int, list[int], int]:
    """Break a critical node arc: move its later op ahead of the earlier one, or the earlier op
    behind the later one (each by a random few places more)."""
    node, i = arcs[rng.randrange(len(arcs))]
    order = list(orders[node])
    if rng.random() < 0.5:
        j = max(0, i - 1 - rng.randint(0, MOVE_SPAN))
        order.insert(j, order.pop(i))
        return node, order, j
    j = min(len(order) - 1, i + rng.randint(0, MOVE_SPAN))
    order.insert(j, order.pop(i - 1))
    return node, order, i - 1


def memory_profile(delta: list[float], order: list[int], level: float) -> tuple[float, float]:
    """(peak, excess) of one node's order: its highest held activation, and the sum over its
    positions of how far the held activation stands above `level` (zero when the node never
    exceeds it; it shrinks with every moment that stops being high, so it guides the memory
    walk across plateaus of the peak the way the lateness guides the latency walk)."""
    held = peak = excess = 0.0
    for op in order:
        held += delta[op]
        if held > peak:
            peak = held
        if held > level:
            excess += held - level
    return peak, excess


def _peak_move(
    inst: Instance, rng: random.Random, orders: Orders, excess: list[float], level: float
) -> tuple[int, list[int], int]:
    """Lower a high moment: on a node above `level` (picked in proportion to its excess), at a
    position where it holds more than `level`, move one of the last few forwards before that
    moment to a few places after it, or one of the next few backwards after it to a few places
    before it. The ops nearest the moment move, so the rest of the schedule barely changes."""
    pick, node = rng.random() * sum(excess), 0
    while node < len(excess) - 1 and (excess[node] <= 0 or pick > excess[node]):
        pick -= excess[node]
        node += 1
    order = list(orders[node])
    delta = inst.memory_delta
    high, held = [], 0.0
    for i, op in enumerate(order):
        held += delta[op]
        if held > level:
            high.append(i)
    if not high:
        return node, order, len(order) - 1  # nothing above the level: an unchanged order
    at = high[rng.randrange(len(high))]
    if rng.random() < 0.5:
        forwards = [i for i in range(at, -1, -1) if delta[order[i]] > 0][:NEAREST_OPS]
        if forwards:
            i = forwards[rng.randrange(len(forwards))]
            j = min(len(order) - 1, at + rng.randint(0, MOVE_SPAN))
            order.insert(j, order.pop(i))
            return node, order, i
    backwards = [i for i in range(at + 1, len(order)) if delta[order[i]] < 0][:NEAREST_OPS]
    if not backwards:
        return node, order, len(order) - 1
    i = backwards[rng.randrange(len(backwards))]
    j = max(0, at - rng.randint(0, MOVE_SPAN))
    order.insert(j, order.pop(i))
    return node, order, j


@dataclass
class _Walk:
    """The annealing walk's current schedule."""

    orders: Orders
    start: list[float]
    end: list[float]
    makespan: float
    peaks: list[float]

    @classmethod
    def of(cls, inst: Instance, orders: Orders) -> _Walk:
        state = simulate(inst, orders)
        assert state is not None, "the walk starts from a schedule that runs"
        return cls([list(o) for o in orders], state[1], state[2], state[0], peak_memory(inst, orders))


def _lateness(end: list[float], follow: list[float], target: float) -> float:
    """How far ops end past the latest end that still lets the schedule meet `target` (the
    target less what must follow them, `node_tails`): zero exactly when the makespan is at
    most the target; it shrinks with every op that stops being late, so it guides the walk
    across makespan plateaus."""
    return sum([e + f - target for e, f in zip(end, follow, strict=True) if e + f > target])


def anneal(
    inst: Instance,
    start: Orders,
    seed: int,
    time_limit_s: float,
    target_latency: float,
    target_memory: float,
    max_iterations: int | None = None,
    fallback: Orders | None = None,
    lean: Sequence[LeanStart] = (),
    latency_share: float = 1 - MEMORY_PHASE_SHARE,
    seed_cap: float | None = None,
) -> AnnealOutcome:
    """Two-phase simulated annealing from `start`: latency, then memory at the makespan found.

    With `seed_cap`, the latency phase never lets a node hold more than it (nor the
    problem's own cap): from a lean start the seed looks for a schedule as fast as
    `fallback` (with CAPPED_LATENCY_SHARE as `latency_share`, `_run_seeds`); when it gets
    there the memory phase lowers it further, else its schedule is kept as a near miss
    (`AnnealOutcome.lean`) and the memory phase works on `fallback`.

    Each phase owns its share of the time (and iteration) budget (`latency_share` for the
    latency phase, the rest for the memory phase); a latency phase that meets
    the lower bound early hands the rest of its share to the memory phase. When `fallback`
    (the fastest start) is faster than what the latency phase reached, the memory phase
    works on it instead: only the fastest schedules can win. Then, for LEAN_SHARE more of the
    budget, the lean phase looks for an as fast, lower schedule among the `lean` starts'
    neighbours (`_lean_phase`). It runs after the descent, on its own budget, and replaces
    the descent's schedule only with a lower one: the two phases before it run exactly as
    without lean starts, so the result never holds more than theirs.
    """
    rng = random.Random(seed)
    walk = _Walk.of(inst, start)
    best = AnnealOutcome(seed, [list(o) for o in walk.orders], walk.makespan, max(walk.peaks), 0)
    movable = [n for n, order in enumerate(start) if len(order) > 1]
    if not movable:
        return best
    began = time.perf_counter()
    budget = max_iterations if max_iterations is not None else math.inf
    latency = _Phase(began + time_limit_s * latency_share, budget * latency_share)
    user_cap = inst.problem.activation_cap
    cap = user_cap if seed_cap is None else min(seed_cap, user_cap or math.inf)
    iterations = _latency_phase(inst, latency, walk, best, rng, movable, 0, target_latency, cap)
    if fallback is not None:
        faster = _Walk.of(inst, fallback)
        if faster.makespan < best.makespan * (1 - RELATIVE_EPS):
            if seed_cap is not None:  # a near miss the endgame may bring the rest of the way
                best.lean.append(LeanStart(cap, best.orders, best.makespan, best.peak))
            best = AnnealOutcome(seed, [list(o) for o in fallback], faster.makespan, max(faster.peaks), 0, best.lean)
    memory = _Phase(began + time_limit_s, budget)
    iterations = _memory_phase(inst, memory, best, rng, movable, iterations, target_memory)
    if max_iterations is not None:
        budget = iterations + max_iterations * LEAN_SHARE
    now = time.perf_counter()
    best.iterations = _lean_phase(
        inst, _Phase(now + time_limit_s * LEAN_SHARE, budget), best, rng, movable, iterations, target_memory, lean
    )
    return best


def _lean_phase(
    inst: Instance,
    phase: _Phase,
    best: AnnealOutcome,
    rng: random.Random,
    movable: list[int],
    iterations: int,
    target_memory: float,
    lean: Sequence[LeanStart],
) -> int:
    """Look for a schedule as fast as `best` under a tight activation cap: per cap of
    LEAN_TRY_FACTORS (x the memory bound) below `best`'s peak, anneal the latency from the
    fastest lean start within it towards `best`'s makespan, never above the cap, for
    LEAN_TRY_SHARE of the phase, or until it has gone LEAN_PATIENCE of the phase without
    gaining. The first that gets there replaces `best`, and the peak descent works on it
    for the rest of the phase. A fast schedule found without a cap tends to run every
    forward early, and no short move leads from there to one that interleaves the
    backwards; a lean start already does."""
    user_cap = inst.problem.activation_cap
    now = time.perf_counter()
    patience = _Patience((phase.deadline - now) * LEAN_PATIENCE, (phase.budget - iterations) * LEAN_PATIENCE)
    # Seeds alternate which cap they try first: the looser one reaches the makespan more
    # often, the tighter one holds less when it does.
    for factor in LEAN_TRY_FACTORS if best.seed % 2 == 0 else LEAN_TRY_FACTORS[::-1]:
        cap = factor * target_memory
        fits = [start for start in lean if start.peak <= cap * (1 + RELATIVE_EPS)]
        if cap >= best.peak or not fits or (user_cap is not None and cap > user_cap):
            continue
        start = min(fits, key=lambda s: s.makespan)
        now = time.perf_counter()
        sub = _Phase(
            now + (phase.deadline - now) * LEAN_TRY_SHARE, iterations + (phase.budget - iterations) * LEAN_TRY_SHARE
        )
        attempt = AnnealOutcome(best.seed, [list(o) for o in start.orders], start.makespan, start.peak, 0)
        walk = _Walk.of(inst, start.orders)
        iterations = _latency_phase(inst, sub, walk, attempt, rng, movable, iterations, best.makespan, cap, patience)
        if attempt.makespan <= best.makespan * (1 + RELATIVE_EPS) and attempt.peak < best.peak:
            best.orders, best.makespan, best.peak = attempt.orders, attempt.makespan, attempt.peak
            return _memory_phase(inst, phase, best, rng, movable, iterations, target_memory)
        if attempt.makespan < start.makespan * (1 - RELATIVE_EPS) and attempt.peak < best.peak:
            best.lean.append(LeanStart(cap, attempt.orders, attempt.makespan, attempt.peak))
    return iterations


#: Seeds anneal under this cap (x the memory bound) from the starts within it (`_run_seeds`).
#: Schedule benchmark, 65B/33B 16/16/64 (its fastest start is within it): seeds without the
#: cap reached 0.12% above the bound at 2.8x the reference; with it, 0.12% above at 1.4x.
CAPPED_SEED_FACTOR = 1.7
#: A capped seed's latency phase has this share of its budget. Schedule benchmark: from a
#: sequenced start 0.1% slower, 25 s capped annealing gets within 0.003-0.006% of the
#: bound on its two hardest cases, or to it.
CAPPED_LATENCY_SHARE = 0.7
#: Caps (x the memory bound) under which the lean phase looks for a schedule as fast as the best.
LEAN_TRY_FACTORS = (1.7, 1.3)
#: The lean phase's budget, as a share of the two phases' before it (it comes on top).
#: Schedule benchmark: from a lean start 0.03-0.1% slower, a try needs 2-10 s to reach the
#: makespan where it gets there at all.
LEAN_SHARE = 0.4
#: Share of the lean phase's remaining time (and iterations) each lean try may take ...
LEAN_TRY_SHARE = 0.6
#: ... and share of the lean phase after which a try stops when it has stopped gaining
#: (a try that cannot reach the makespan leaves the time to the next).
LEAN_PATIENCE = 0.15


@dataclass(frozen=True)
class _Phase:
    deadline: float
    """perf_counter time at which the phase stops."""
    budget: float
    """Iteration count at which the phase stops."""


@dataclass(frozen=True)
class _Patience:
    """How long a phase may go without progress before it stops."""

    seconds: float
    iterations: float


class _Clock:
    """A phase's cooling schedule: the temperature falls from `scale` by COOLING over the
    phase's time or iterations, whichever runs out first."""

    def __init__(self, phase: _Phase, scale: float, iterations: int, patience: _Patience | None = None) -> None:
        self.phase, self.scale, self.first = phase, scale, iterations
        self.began = time.perf_counter()
        self.length = max(phase.deadline - self.began, 1e-9)
        self.temperature = scale
        # With `patience` (seconds, iterations), the phase also ends once it has gone that
        # long without progress (`progressed`).
        self.patience = patience
        self.last = (self.began, iterations)

    def progressed(self, iterations: int) -> None:
        self.last = (time.perf_counter(), iterations)

    def tick(self, iterations: int) -> bool:
        """Update the temperature; False once the phase is over."""
        if iterations >= self.phase.budget:
            return False
        if self.patience is not None and iterations - self.last[1] > self.patience.iterations:
            return False
        if iterations % 32:
            return True
        now = time.perf_counter()
        if now >= self.phase.deadline:
            return False
        if self.patience is not None and now - self.last[0] > self.patience.seconds:
            return False
        done = (now - self.began) / self.length
        if self.phase.budget < math.inf:
            done = max(done, (iterations - self.first) / (self.phase.budget - self.first))
        self.temperature = self.scale * COOLING**done
        return True


def _try(inst: Instance, walk: _Walk, node: int, new_order: list[int], first: int) -> Evaluated | None:
    """Put `new_order` on `node` and re-time the walk from the first changed op: the new
    (makespan, start, end), or None (and the order restored) when it deadlocks."""
    old_order = walk.orders[node]
    walk.orders[node] = new_order
    simulated = resimulate(inst, walk.orders, walk.start, walk.end, walk.start[old_order[first]])
    if simulated is None:
        walk.orders[node] = old_order
    return simulated


Evaluated = tuple[float, list[float], list[float]]


def _latency_phase(
    inst: Instance,
    phase: _Phase,
    walk: _Walk,
    best: AnnealOutcome,
    rng: random.Random,
    movable: list[int],
    iterations: int,
    target_latency: float,
    cap: float | None,
    patience: _Patience | None = None,
) -> int:
    """Anneal the makespan plus the ops' lateness past `target_latency` with every node's
    activation within `cap`; `best` is updated in place (fastest, then least memory);
    returns the iteration count. With `patience` (seconds, iterations), stop early once the
    energy has gone that long without a new low."""
    _, tail = heads_and_tails(inst)
    follow = follow_tails(inst, walk.orders, tail)

    def energy(makespan: float, end: list[float], follow: list[float]) -> float:
        return makespan + LATENESS_WEIGHT * _lateness(end, follow, target_latency) / inst.problem.num_nodes

    # Schedules within RELATIVE_EPS of `reference` count as equally fast; it moves only on a
    # real improvement, so a chain of "equal" schedules cannot creep slower.
    reference = best.makespan
    clock = _Clock(phase, LATENCY_TEMPERATURE * walk.makespan, iterations, patience)
    current = energy(walk.makespan, walk.end, follow)
    lowest = current
    arcs: list[tuple[int, int]] | None = None
    while clock.tick(iterations):
        iterations += 1
        if best.makespan <= target_latency * (1 + RELATIVE_EPS):
            break  # latency optimal: go on to memory
        if rng.random() < CRITICAL_SHARE:
            arcs = arcs if arcs is not None else critical_node_arcs(inst, walk.orders, walk.start, walk.end)
            if not arcs:
                continue
            node, new_order, first = _critical_move(rng, walk.orders, arcs)
        else:
            node, new_order, first = _neighbour(rng, walk.orders, movable)
        new_peak_node = peak_memory(inst, [new_order])[0]
        if cap is not None and new_peak_node > cap * (1 + RELATIVE_EPS):
            continue
        old_order = walk.orders[node]
        simulated = _try(inst, walk, node, new_order, first)
        if simulated is None:
            continue
        new_peaks = list(walk.peaks)
        new_peaks[node] = new_peak_node
        new_follow = list(follow)
        node_tails(inst, new_order, tail, new_follow)
        candidate = energy(simulated[0], simulated[2], new_follow)
        if _accept(rng, clock.temperature, current, candidate, max(walk.peaks), max(new_peaks)):
            walk.makespan, walk.start, walk.end, walk.peaks = simulated[0], simulated[1], simulated[2], new_peaks
            current, arcs, follow = candidate, None, new_follow
            if current < lowest * (1 - RELATIVE_EPS):
                lowest = current
                clock.progressed(iterations)
            peak = max(new_peaks)
            faster = walk.makespan < reference * (1 - RELATIVE_EPS)
            if faster or (walk.makespan <= reference * (1 + RELATIVE_EPS) and peak < best.peak):
                best.orders, best.makespan, best.peak = [list(o) for o in walk.orders], walk.makespan, peak
                reference = walk.makespan if faster else reference
        else:
            walk.orders[node] = old_order
    return iterations


def _memory_phase(
    inst: Instance,
    phase: _Phase,
    best: AnnealOutcome,
    rng: random.Random,
    movable: list[int],
    iterations: int,
    target_memory: float,
    origin: Orders | None = None,
) -> int:
    """Lower the peak activation of `best` without making it slower than it was on entry;
    returns the iteration count. The walk starts from `origin` (default: `best`), which may
    be slower: the lateness term brings it back to `best`'s makespan.

    The walk anneals a penalty that is zero exactly when a schedule is as fast as `best` and
    holds less than its peak: the lateness past `best`'s makespan (in mean op durations) plus
    every node's excess over a level one activation step under the best peak (in mean
    activations). Slower or higher schedules may be crossed; only ones as fast and lower are
    kept, and each lowers the level. Half the moves target a high moment of a node above the
    level, a share of the rest (while the walk is late) a critical node arc.
    """
    makespan = best.makespan
    floor = max(target_memory, memory_bound_at(inst, makespan))
    if best.peak <= floor * (1 + RELATIVE_EPS):
        return iterations
    cap = inst.problem.activation_cap
    _, tail = heads_and_tails(inst)
    delta = inst.memory_delta
    grows = [d for d in delta if d > 0]
    step = min(grows) * MEMORY_STEP
    time_unit = sum(inst.duration) / max(inst.num_ops, 1)
    memory_unit = sum(grows) / len(grows)
    walk = _Walk.of(inst, origin or best.orders)
    level = min(best.peak, max(walk.peaks)) - step
    excess = [memory_profile(delta, order, level)[1] for order in walk.orders]

    target = makespan * (1 + RELATIVE_EPS)
    follow = follow_tails(inst, walk.orders, tail)

    def energy(end: list[float], follow: list[float], node_excess: list[float]) -> float:
        late = _lateness(end, follow, target) / time_unit
        return MEMORY_LATENESS_WEIGHT * late + sum(node_excess) / memory_unit

    clock = _Clock(phase, MEMORY_TEMPERATURE, iterations)
    current = energy(walk.end, follow, excess)
    late = walk.makespan > makespan * (1 + RELATIVE_EPS)
    arcs: list[tuple[int, int]] | None = None
    while clock.tick(iterations):
        iterations += 1
        if best.peak <= floor * (1 + RELATIVE_EPS):
            break
        draw = rng.random()
        if draw < PEAK_SHARE:
            node, new_order, first = _peak_move(inst, rng, walk.orders, excess, level)
        elif late and draw < PEAK_SHARE + CRITICAL_SHARE * (1 - PEAK_SHARE):
            arcs = arcs if arcs is not None else critical_node_arcs(inst, walk.orders, walk.start, walk.end)
            if not arcs:
                continue
            node, new_order, first = _critical_move(rng, walk.orders, arcs)
        else:
            node, new_order, first = _neighbour(rng, walk.orders, movable)
        if new_order == walk.orders[node]:
            continue
        peak_node, excess_node = memory_profile(delta, new_order, level)
        if cap is not None and peak_node > cap * (1 + RELATIVE_EPS):
            continue
        old_order = walk.orders[node]
        simulated = _try(inst, walk, node, new_order, first)
        if simulated is None:
            continue
        new_excess = list(excess)
        new_excess[node] = excess_node
        new_follow = list(follow)
        node_tails(inst, new_order, tail, new_follow)
        candidate = energy(simulated[2], new_follow, new_excess)
        if not _accept(rng, clock.temperature, current, candidate, 0.0, 0.0):
            walk.orders[node] = old_order
            continue
        walk.makespan, walk.start, walk.end = simulated
        walk.peaks[node] = peak_node
        excess, current, arcs, follow = new_excess, candidate, None, new_follow
        late = walk.makespan > makespan * (1 + RELATIVE_EPS)
        peak = max(walk.peaks)
        if not late and peak < best.peak * (1 - RELATIVE_EPS):
            best.orders, best.peak, best.makespan = [list(o) for o in walk.orders], peak, walk.makespan
            level = peak - step
            excess = [memory_profile(delta, order, level)[1] for order in walk.orders]
            current = energy(walk.end, follow, excess)
    return iterations


#: Latency phase: weight of the summed lateness of ops (per node) against the makespan.
LATENESS_WEIGHT = 3.0
#: Memory phase: weight of the lateness (in mean op durations) against the excess (in mean activations).
MEMORY_LATENESS_WEIGHT = 3.0
#: Latency phase: share of moves that reorder a critical node arc (the rest are random).
CRITICAL_SHARE = 0.5
#: Memory phase: share of moves aimed at a high moment (the rest are random or critical).
PEAK_SHARE = 0.5
#: Memory phase: the level sits this many of the smallest activations under the best peak.
MEMORY_STEP = 1.0
#: Memory phase: forwards (backwards) this near a high moment are the ones a peak move shifts.
NEAREST_OPS = 4


def _accept(
    rng: random.Random, temperature: float, current: float, candidate: float, peak: float, new_peak: float
) -> bool:
    """Metropolis on the energy; among equal energies prefer less memory (then a coin flip)."""
    delta = candidate - current
    if abs(delta) <= RELATIVE_EPS * max(abs(current), 1e-12):
        return new_peak <= peak or rng.random() < 0.5
    if delta < 0:
        return True
    return temperature > 0 and rng.random() < math.exp(-delta / temperature)


def _run_seeds(
    inst: Instance,
    starts: list[Start],
    lean: list[LeanStart],
    config: SearchConfig,
    bounds: LowerBounds,
    progress: Progress | None,
    window_s: float = 0.0,
    at_bound: bool = False,
    fat: bool = False,
) -> list[AnnealOutcome]:
    """Where some start holds at most CAPPED_SEED_FACTOR x the memory bound, the seeds
    anneal under that cap, unless the fastest start is within it and meets the lower bound
    (no walk then looks for a faster schedule, so none drifts to one that runs every
    forward early). Where the fastest start holds more (`fat`, `_fastest_is_fat`), seed k
    catches up from the k-th fastest start within the cap (`_lean_fits`), with
    CAPPED_LATENCY_SHARE of its budget for the latency phase; the fat start still competes
    as it is. Otherwise seeds cycle over the starts within RESTART_SLACK of the fastest
    (and within the cap, where capped), even seeds fastest first, odd seeds leanest first:
    restarts from constructions about as fast that differ in memory and in where they get
    stuck."""
    workers = parallel_workers(config.seeds)
    rounds = math.ceil(config.seeds / workers)
    # Each seed's lean phase comes on top of its budget: scale the budget to keep the total.
    per_seed = config.time_limit_s / rounds / (1 + LEAN_SHARE)
    budget = None if config.max_iterations is None else max(1, round(config.max_iterations / (1 + LEAN_SHARE)))
    # The peak windows take their time from the memory phase: the latency phase keeps its share.
    whole = config.time_limit_s + window_s
    latency_share = min(1.0, whole * (1 - MEMORY_PHASE_SHARE) / config.time_limit_s)
    args = (per_seed, bounds.latency, bounds.memory, budget, starts[0][1], lean)
    fastest = starts[0][2].makespan
    seed_cap = CAPPED_SEED_FACTOR * bounds.memory
    lean_fits = _lean_fits(starts, bounds)
    # An uncapped walk for a faster schedule drifts to one that runs every forward early,
    # and the moves from there rarely interleave the backwards again.
    walk_cap = seed_cap if lean_fits and not fat and not at_bound else None
    close = [
        (orders, ev)
        for _, orders, ev in starts
        if ev.makespan <= fastest * (1 + RESTART_SLACK)
        and (walk_cap is None or ev.max_peak_memory <= walk_cap * (1 + RELATIVE_EPS))
    ]
    leanest = sorted(close, key=lambda c: (c[1].max_peak_memory, c[1].makespan))
    jobs = []
    for seed in range(config.seeds):
        if fat:
            start = lean_fits[seed % len(lean_fits)]
            # Its lower peak counts only at the best makespan: most of the budget goes there.
            jobs.append((start, seed, CAPPED_LATENCY_SHARE, seed_cap))
        else:
            start = (close if seed % 2 == 0 else leanest)[(seed // 2) % len(close)][0]
            jobs.append((start, seed, latency_share, walk_cap))
    if workers == 1:
        outcomes = []
        for done, (start, seed, share, cap) in enumerate(jobs, 1):
            outcomes.append(anneal(inst, start, seed, *args, share, cap))
            if progress:
                progress(done, config.seeds)
        return outcomes
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(anneal, inst, start, seed, *args, share, cap) for start, seed, share, cap in jobs]
        outcomes = []
        for done, future in enumerate(as_completed(futures), 1):
            outcomes.append(future.result())
            if progress:
                progress(done, config.seeds)
    return sorted(outcomes, key=lambda o: o.seed)


def _lean_fits(starts: list[Start], bounds: LowerBounds) -> list[Orders]:
    """The starts that hold at most CAPPED_SEED_FACTOR x the memory bound, fastest first."""
    seed_cap = CAPPED_SEED_FACTOR * bounds.memory
    return [orders for _, orders, ev in starts if ev.max_peak_memory <= seed_cap * (1 + RELATIVE_EPS)]


def _fastest_is_fat(starts: list[Start], bounds: LowerBounds) -> bool:
    """The fastest start holds more than CAPPED_SEED_FACTOR x the memory bound and another
    start holds less: the seeds that anneal under that cap have somewhere to start."""
    seed_cap = CAPPED_SEED_FACTOR * bounds.memory
    return starts[0][2].max_peak_memory > seed_cap and bool(_lean_fits(starts, bounds))


def _window_seconds(config: SearchConfig) -> float:
    """The peak windows' seconds: their share of the time limit in a time-limited run with
    OR-Tools installed, else 0."""
    if config.max_iterations is not None or config.window_share == 0:
        return 0.0
    import importlib.util

    if importlib.util.find_spec("ortools") is None:
        return 0.0
    return config.time_limit_s * config.window_share


#: The peak windows' share shrinks by this factor when a start already meets the lower bound
#: and holds at most CAPPED_SEED_FACTOR x the memory bound (the seeds' peak descent has the
#: time then). Where the fastest start holds more, the endgame, which brings the capped
#: seeds' near misses and the sequenced starts to the bound, keeps its whole share.
AT_BOUND_WINDOW_FACTOR = 0.5
#: Share of the peak windows' time that first shortens the fastest schedule towards the
#: lower bound (`window.shorten`), where it is above it. Schedule benchmark, from the
#: recorded schedules: 33B/13B 8/8/16 from 0.076% above the bound to the bound and 65B/33B
#: 8/8/32 from 0.0065% above, each with a 240-op window in at most 1.2 s.
SHORTEN_SHARE = 0.2
#: Share of the peak windows' time kept, where the schedule is still above the lower bound,
#: for shortening it once more after the peak windows: they re-sequence it, and the result
#: is a new start for the suffix windows. Schedule benchmark, 33B/13B 8/8/16: the first
#: shortening left a seed's schedule 0.076% above the bound; from the peak windows' result
#: the suffix windows reached it in 0.5-1.2 s (4 of 4 tries).
SHORTEN_AGAIN_SHARE = 0.1
#: Share of what is left of the peak windows' time that then tries to bring lean starts to
#: the best makespan (the peak windows keep the rest, also on a schedule above 1.7x the
#: reference).
ENDGAME_SHARE = 0.8
#: Lean starts at most this much slower (relative) than the best makespan are tried ...
ENDGAME_SLACK = 0.005
#: ... this many of them at most, in turn. Each try has half of what is left (the last one
#: all of it); a try that CP-SAT proves unable to end by the makespan passes the rest of its
#: time on. Schedule benchmark, 65B/33B 16/8/64: of 16 near starts (0.03-0.08% slower) three
#: reach the bound, each in under 1.1 s, and the first of them is the fifth in the endgame's
#: order; most of the others are proved unable in under a second.
ENDGAME_TRIES = 32
#: Relative makespan gaps within one step count as alike when the starts are ordered.
#: Schedule benchmark, 65B/33B 16/8/64: of near starts 0.06-0.09% above the bound, the one
#: that reaches it is the nearest; in steps of 0.1%, which put the leanest first, it was
#: tried tenth with 2.9 s left; in 0.01% steps it is tried first.
ENDGAME_STEP = 0.0001


def _lean_endgame(
    inst: Instance, orders: Orders, makespan: float, lean: Sequence[LeanStart], seconds: float
) -> tuple[Orders, tuple[int, float] | None]:
    """The best schedule, or the leanest of the lean starts brought to its makespan by
    re-sequencing their last ops with CP-SAT (`window.meet_makespan`): up to ENDGAME_TRIES
    starts within ENDGAME_SLACK of `makespan` are tried in turn, each with half of what is
    left of `seconds` (the last one all of it), each only while it holds less than the best
    so far. Also returns (the winning try, the peak before) when a start won."""
    from nereus.solver.pipeline.window import meet_makespan

    began = time.perf_counter()
    before = best_peak = peak_memory_max(inst, orders)
    near = [s for s in lean if s.peak < before * (1 - RELATIVE_EPS) and s.makespan <= makespan * (1 + ENDGAME_SLACK)]
    # Nearest the makespan first (in steps of ENDGAME_STEP), then least memory: CP-SAT closes
    # a small gap far more often than a large one.
    tries = sorted(near, key=lambda s: (round((s.makespan / makespan - 1) / ENDGAME_STEP), s.peak))[:ENDGAME_TRIES]
    won: tuple[int, float] | None = None
    for n, start in enumerate(tries):
        left = seconds - (time.perf_counter() - began)
        if left <= 0.1:
            break
        if start.peak >= best_peak * (1 - RELATIVE_EPS):
            continue
        share = left / min(2, len(tries) - n)
        found = meet_makespan(inst, start.orders, makespan, share, workers=parallel_workers(2))
        if found is None:
            continue
        peak = peak_memory_max(inst, found)
        if peak < best_peak * (1 - RELATIVE_EPS):
            orders, best_peak, won = found, peak, (n + 1, before)
    return orders, won


def parallel_workers(most: int) -> int:
    """Processes (or CP-SAT workers) for `most` parallel tasks: one per CPU, at least one."""
    return max(1, min(most, os.cpu_count() or 1))


def peak_memory_max(inst: Instance, orders: Orders) -> float:
    return max(peak_memory(inst, orders), default=0.0)


def search_fused(
    actor: ModelTimes,
    critic: ModelTimes,
    config: SearchConfig | None = None,
    p2p_latency: float = 0.0,
    activation_cap: float | None = None,
    progress: Progress | None = None,
) -> FusedResult:
    """The fused actor-critic schedule: list schedules, forward-backward improvement, then
    annealing over `config.seeds` seeds from the best few starts."""
    config = config or SearchConfig()
    if actor.name == critic.name:
        raise NereusError(f"the two models need different names, both are {actor.name!r}")
    problem = fused_problem(actor, critic, p2p_latency, activation_cap)
    started = time.perf_counter()
    inst = build_instance(problem)
    bounds = lower_bounds(inst)
    (rule, _, greedy_eval), starts = starting_schedules(inst, (actor.name, critic.name))
    lean = lean_starts(inst, (actor.name, critic.name))
    sequence_s = 0.0 if config.max_iterations is not None else config.time_limit_s * SEQUENCE_SHARE
    sequenced = parallel_sequenced_starts(inst, (actor.name, critic.name), sequence_s)
    lean += sequenced
    # Under a cap the lean starts are often the fastest ones; sequenced starts sometimes are.
    extra = lean if activation_cap is not None else sequenced
    starts += [(f"lean, cap {start.cap:g}", start.orders, evaluate(inst, start.orders)) for start in extra]
    starts.sort(key=lambda s: (s[2].makespan, s[2].max_peak_memory))
    window_s = _window_seconds(config)
    at_bound = starts[0][2].makespan <= bounds.latency * (1 + RELATIVE_EPS)
    fat = _fastest_is_fat(starts, bounds)
    if at_bound and not fat:
        # No seed looks for a faster schedule: the time goes to the seeds' peak descent.
        window_s *= AT_BOUND_WINDOW_FACTOR
    # The time limit covers the whole search: the annealing has what the bounds, the starts
    # (the sequenced ones belong to the memory phase's share) and the windows leave.
    spent = time.perf_counter() - started
    anneal_s = max(config.time_limit_s * MIN_ANNEAL_SHARE, config.time_limit_s - window_s - spent)
    annealing = replace(config, time_limit_s=anneal_s)
    outcomes = _run_seeds(inst, starts, lean, annealing, bounds, progress, window_s, at_bound, fat)
    # The annealing keeps a start unless it improves it; makespans within RELATIVE_EPS tie
    # (float sums in another order), and ties go to the least memory.
    candidates = [(o.makespan, o.peak, o.orders) for o in outcomes]
    candidates += [(ev.makespan, ev.max_peak_memory, orders) for _, orders, ev in starts]
    candidates += [(start.makespan, start.peak, start.orders) for start in lean]
    fastest = min(makespan for makespan, _, _ in candidates)
    # Every seed's result and its lean tries may be near starts for the endgame.
    lean += [start for o in outcomes for start in o.lean]
    lean += [LeanStart(o.peak, o.orders, o.makespan, o.peak) for o in outcomes if o.makespan > fastest]
    _, _, orders = min((c for c in candidates if c[0] <= fastest * (1 + RELATIVE_EPS)), key=lambda c: c[1])
    windows = (0, 0, peak_memory_max(inst, orders))
    endgame: tuple[int, float] | None = None
    if window_s > 0:
        from nereus.solver.pipeline.window import lower_peak, shorten

        began = time.perf_counter()
        if fastest > bounds.latency * (1 + RELATIVE_EPS):
            orders = shorten(inst, orders, bounds.latency, window_s * SHORTEN_SHARE, parallel_workers(2))
            fastest = _makespan(inst, orders)
        floor = max(bounds.memory, memory_bound_at(inst, fastest))
        left = window_s - (time.perf_counter() - began)
        orders, endgame = _lean_endgame(inst, orders, fastest, lean, left * ENDGAME_SHARE)
        above = fastest > bounds.latency * (1 + RELATIVE_EPS)
        again = window_s * SHORTEN_AGAIN_SHARE if above else 0.0
        left = window_s - (time.perf_counter() - began) - again
        lowered = lower_peak(inst, orders, left, target=floor, workers=parallel_workers(2))
        orders, windows = lowered.orders, (lowered.windows, lowered.kept, windows[2])
        if above:
            orders = shorten(inst, orders, bounds.latency, again, parallel_workers(2))
    final = evaluate(inst, orders)
    assert final.ok, (final.violations, final.deadlocked)
    return FusedResult(
        problem=problem,
        instance=inst,
        orders=orders,
        evaluation=final,
        bounds=bounds,
        greedy=greedy_eval,
        greedy_rule=rule,
        baselines=pair_baselines(actor, critic, p2p_latency),
        search_s=time.perf_counter() - started,
        seeds=config.seeds,
        iterations=sum(o.iterations for o in outcomes),
        memory_lower_bound=memory_bound_at(inst, final.makespan),
        per_seed=[(o.seed, o.makespan, o.peak) for o in outcomes],
        lean=lean,
        windows=windows,
        endgame=endgame,
    )

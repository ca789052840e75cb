"""The fused schedule: list schedules, forward-backward improvement, then simulated annealing.

Starts: list schedules under several priority rules and activation caps; the best few are
re-justified right and left (`improve.forward_backward`) while that shortens them.
The search then minimises latency first and peak activation memory second
(lexicographically). Phase one anneals the makespan plus the summed lateness of ops past
the lower bound (zero exactly when the bound is met, so the walk is guided across makespan
plateaus), with half of its moves breaking an arc of the critical path (an op that waits
for its node predecessor moves ahead of it, or that predecessor behind it). Phase two
anneals the peak memory plus a penalty for latency lost (so the walk can cross slightly
slower schedules), half of its moves taking a forward past the highest peak or a backward
ahead of it, keeping only schedules no slower than the best found. Other neighbours swap
two nearby ops on one node or move one op a few places; neighbours that deadlock or break
the activation cap are rejected. Independent seeds run in parallel processes and the best
schedule wins.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field

from nereus.errors import ArgumentError, NereusError
from nereus.solver.pipeline.baselines import BaselineResult, pair_baselines
from nereus.solver.pipeline.bounds import LowerBounds, heads_and_tails, lower_bounds, memory_bound
from nereus.solver.pipeline.evaluate import Evaluation, evaluate, peak_memory, resimulate, simulate
from nereus.solver.pipeline.greedy import GreedyRule, list_schedule, rule_key, window_limits
from nereus.solver.pipeline.improve import forward_backward
from nereus.solver.pipeline.model import Instance, ModelTimes, Problem, build_instance, fused_problem

Progress = Callable[[int, int], None]
Orders = list[list[int]]

#: How far (in positions on a node) a move or swap reaches.
MOVE_SPAN = 8
#: Share of each seed's time spent on the memory phase.
MEMORY_PHASE_SHARE = 0.3
#: Initial temperature as a fraction of the starting makespan (latency phase) ...
LATENCY_TEMPERATURE = 0.01
#: ... or of the starting peak memory (memory phase).
MEMORY_TEMPERATURE = 0.02
#: The temperature falls by this factor over a phase.
COOLING = 1e-3
RELATIVE_EPS = 1e-9


@dataclass(frozen=True)
class SearchConfig:
    """How long and how widely the fused search looks."""

    time_limit_s: float = 10.0
    """Wall-clock seconds for the annealing (the greedy start and bounds come on top)."""
    seeds: int = 2
    """Independent annealing runs; they run in parallel processes, one per CPU at most."""
    max_iterations: int | None = None
    """Also stop each seed after this many neighbours (a run that does not depend on CPU speed)."""

    def __post_init__(self) -> None:
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
    per_seed: list[tuple[int, float, float]] = field(default_factory=list)
    """(seed, makespan, peak memory) of every annealing run."""


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


def greedy_schedule(inst: Instance, names: tuple[str, str]) -> Start:
    """The best list schedule (latency, then memory) within the activation cap."""
    return list_schedules(inst, names)[0]


#: Forward-backward improvement runs on this many of the best distinct list schedules.
IMPROVED_STARTS = 4
#: Seeds also start from starts at most this much slower (relative) than the fastest.
RESTART_SLACK = 0.01


def starting_schedules(inst: Instance, names: tuple[str, str]) -> tuple[Start, list[Start]]:
    """The best list schedule, and the annealing starts: the best few list schedules after
    forward-backward improvement (kept only within the activation cap), fastest first."""
    schedules = list_schedules(inst, names)
    cap = inst.problem.activation_cap
    starts: list[Start] = []
    seen: set[float] = set()
    for name, orders, ev in schedules:
        if len(starts) == IMPROVED_STARTS:
            break
        if ev.makespan in seen:
            continue  # the same makespan usually means the same schedule: improve distinct ones
        seen.add(ev.makespan)
        improved, makespan = forward_backward(inst, orders)
        better = evaluate(inst, improved)
        fits = cap is None or better.max_peak_memory <= cap * (1 + RELATIVE_EPS)
        if fits and makespan < ev.makespan * (1 - RELATIVE_EPS):
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


def _peak_move(inst: Instance, rng: random.Random, orders: Orders, peaks: list[float]) -> tuple[int, list[int], int]:
    """Lower the highest peak: on a node at the peak, move a forward that runs before the
    peak to a few places after it, or a backward that runs after it to a few places before."""
    top = max(peaks)
    node = rng.choice([n for n, p in enumerate(peaks) if p >= top * (1 - RELATIVE_EPS)])
    order = list(orders[node])
    delta = inst.memory_delta
    held, at = 0.0, 0
    for i, op in enumerate(order):
        held += delta[op]
        if held >= top * (1 - RELATIVE_EPS):
            at = i
            break
    if rng.random() < 0.5:
        forwards = [i for i in range(at + 1) if delta[order[i]] > 0]
        i = forwards[rng.randrange(len(forwards))]
        j = min(len(order) - 1, at + rng.randint(1, MOVE_SPAN))
        order.insert(j, order.pop(i))
        return node, order, i
    backwards = [i for i in range(at + 1, len(order)) if delta[order[i]] < 0]
    if not backwards:
        return node, order, len(order) - 1  # nothing to move: an unchanged order
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


def _lateness(end: list[float], tail: list[float], target: float) -> float:
    """How far ops end past the latest time that still lets the schedule meet `target`:
    zero exactly when the makespan is at most the target; it shrinks with every op that
    stops being late, so it guides the walk across makespan plateaus."""
    return sum(max(0.0, e + t - target) for e, t in zip(end, tail, strict=True))


def anneal(
    inst: Instance,
    start: Orders,
    seed: int,
    time_limit_s: float,
    target_latency: float,
    target_memory: float,
    max_iterations: int | None = None,
) -> AnnealOutcome:
    """Two-phase simulated annealing from `start` (latency, then memory at no latency cost)."""
    rng = random.Random(seed)
    walk = _Walk.of(inst, start)
    best = AnnealOutcome(seed, [list(o) for o in walk.orders], walk.makespan, max(walk.peaks), 0)
    movable = [n for n, order in enumerate(start) if len(order) > 1]
    if not movable:
        return best
    began = time.perf_counter()
    budget = max_iterations if max_iterations is not None else math.inf
    latency_share = 1 - MEMORY_PHASE_SHARE
    phases = (
        _Phase("latency", began + time_limit_s * latency_share, budget * latency_share),
        _Phase("memory", began + time_limit_s, budget),
    )
    iterations = 0
    for phase in phases:
        if phase.name == "memory":
            walk = _Walk.of(inst, best.orders)
        iterations = _anneal_phase(inst, phase, walk, best, rng, movable, iterations, target_latency, target_memory)
    best.iterations = iterations
    return best


@dataclass(frozen=True)
class _Phase:
    name: str
    """latency or memory"""
    deadline: float
    """perf_counter time at which the phase stops."""
    budget: float
    """Iteration count at which the phase stops."""


def _anneal_phase(
    inst: Instance,
    phase: _Phase,
    walk: _Walk,
    best: AnnealOutcome,
    rng: random.Random,
    movable: list[int],
    iterations: int,
    target_latency: float,
    target_memory: float,
) -> int:
    """One annealing phase from `walk`, updating `best` in place; returns the iteration count."""
    cap = inst.problem.activation_cap
    _, tail = heads_and_tails(inst)
    latency_phase = phase.name == "latency"

    def energy(makespan: float, end: list[float], peaks: list[float]) -> float:
        if latency_phase:
            return makespan + LATENESS_WEIGHT * _lateness(end, tail, target_latency) / inst.problem.num_nodes
        return _memory_energy(makespan, max(peaks), reference, peak_scale)

    # Schedules within RELATIVE_EPS of `reference` count as equally fast; it moves only on a
    # real improvement, so a chain of "equal" schedules cannot creep slower.
    reference = best.makespan
    peak_scale = max(max(walk.peaks), 1e-12)
    scale = LATENCY_TEMPERATURE * walk.makespan if latency_phase else MEMORY_TEMPERATURE * peak_scale
    current = energy(walk.makespan, walk.end, walk.peaks)
    phase_start, phase_len = time.perf_counter(), max(phase.deadline - time.perf_counter(), 1e-9)
    temperature, first_iteration = scale, iterations
    arcs: list[tuple[int, int]] | None = None
    while iterations < phase.budget:
        iterations += 1
        if iterations % 32 == 0:
            now = time.perf_counter()
            if now >= phase.deadline:
                break
            done = (now - phase_start) / phase_len
            if phase.budget < math.inf:
                done = max(done, (iterations - first_iteration) / (phase.budget - first_iteration))
            temperature = scale * COOLING**done
        if latency_phase and best.makespan <= target_latency * (1 + RELATIVE_EPS):
            break  # latency optimal: go on to memory
        if not latency_phase and best.peak <= target_memory * (1 + RELATIVE_EPS):
            break
        if latency_phase and rng.random() < CRITICAL_SHARE:
            arcs = arcs if arcs is not None else critical_node_arcs(inst, walk.orders, walk.start, walk.end)
            if not arcs:
                continue
            node, new_order, first = _critical_move(rng, walk.orders, arcs)
        elif not latency_phase and rng.random() < PEAK_SHARE:
            node, new_order, first = _peak_move(inst, rng, walk.orders, walk.peaks)
        else:
            node, new_order, first = _neighbour(rng, walk.orders, movable)
        old_order = walk.orders[node]
        new_peak_node = peak_memory(inst, [new_order])[0]
        if cap is not None and new_peak_node > cap * (1 + RELATIVE_EPS):
            continue
        walk.orders[node] = new_order
        simulated = resimulate(inst, walk.orders, walk.start, walk.end, walk.start[old_order[first]])
        if simulated is None:
            walk.orders[node] = old_order
            continue
        new_peaks = list(walk.peaks)
        new_peaks[node] = new_peak_node
        candidate = energy(simulated[0], simulated[2], new_peaks)
        if _accept(rng, temperature, current, candidate, max(walk.peaks), max(new_peaks)):
            walk.makespan, walk.start, walk.end, walk.peaks = simulated[0], simulated[1], simulated[2], new_peaks
            current, arcs = candidate, None
            peak = max(new_peaks)
            faster = walk.makespan < reference * (1 - RELATIVE_EPS)
            if faster or (walk.makespan <= reference * (1 + RELATIVE_EPS) and peak < best.peak):
                best.orders, best.makespan, best.peak = [list(o) for o in walk.orders], walk.makespan, peak
                reference = walk.makespan if faster else reference
        else:
            walk.orders[node] = old_order
    return iterations


#: Memory phase: being 1% slower than the best makespan costs this many peak-scales / 100.
LATENCY_PENALTY = 20.0
#: Latency phase: weight of the summed lateness of ops (per node) against the makespan.
LATENESS_WEIGHT = 3.0
#: Latency phase: share of moves that reorder a critical node arc (the rest are random).
CRITICAL_SHARE = 0.5
#: Memory phase: share of moves aimed at the highest peak (the rest are random).
PEAK_SHARE = 0.5


def _memory_energy(makespan: float, peak: float, best_makespan: float, peak_scale: float) -> float:
    """Peak memory, plus a penalty for latency lost: the walk may cross slower schedules,
    but only schedules as fast as the best are kept."""
    return peak + LATENCY_PENALTY * peak_scale * max(0.0, makespan / best_makespan - 1.0)


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
    inst: Instance, starts: list[Start], config: SearchConfig, bounds: LowerBounds, progress: Progress | None
) -> list[AnnealOutcome]:
    """Seeds cycle over the starts within RESTART_SLACK of the fastest: restarts from several
    constructions that are about as fast (they differ in memory and in where they get stuck)."""
    workers = max(1, min(config.seeds, os.cpu_count() or 1))
    rounds = math.ceil(config.seeds / workers)
    per_seed = config.time_limit_s / rounds
    args = (per_seed, bounds.latency, bounds.memory, config.max_iterations)
    fastest = starts[0][2].makespan
    close = [orders for _, orders, ev in starts if ev.makespan <= fastest * (1 + RESTART_SLACK)]
    jobs = [(close[seed % len(close)], seed) for seed in range(config.seeds)]
    if workers == 1:
        outcomes = []
        for done, (start, seed) in enumerate(jobs, 1):
            outcomes.append(anneal(inst, start, seed, *args))
            if progress:
                progress(done, config.seeds)
        return outcomes
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(anneal, inst, start, seed, *args) for start, seed in jobs]
        outcomes = []
        for done, future in enumerate(as_completed(futures), 1):
            outcomes.append(future.result())
            if progress:
                progress(done, config.seeds)
    return sorted(outcomes, key=lambda o: o.seed)


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
    outcomes = _run_seeds(inst, starts, config, bounds, progress)
    # The annealing keeps a start unless it improves it; makespans within RELATIVE_EPS tie
    # (float sums in another order), and ties go to the least memory.
    candidates = [(o.makespan, o.peak, o.orders) for o in outcomes] + [
        (ev.makespan, ev.max_peak_memory, orders) for _, orders, ev in starts
    ]
    fastest = min(makespan for makespan, _, _ in candidates)
    _, _, orders = min((c for c in candidates if c[0] <= fastest * (1 + RELATIVE_EPS)), key=lambda c: c[1])
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
        per_seed=[(o.seed, o.makespan, o.peak) for o in outcomes],
    )

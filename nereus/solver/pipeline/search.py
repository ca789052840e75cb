"""The fused schedule: greedy list scheduling, then simulated annealing over node orders.

The search minimises latency first and peak activation memory second (lexicographically):
phase one anneals the makespan (ties broken by peak memory), phase two anneals the peak
memory plus a penalty for latency lost (so the walk can cross slightly slower schedules),
keeping only schedules no slower than the best found. A neighbour swaps two nearby ops on
one node or moves one op a few places; neighbours that deadlock or break the activation
cap are rejected. Independent seeds run in parallel processes and the best schedule wins.
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

from nereus.errors import NereusError
from nereus.solver.pipeline.baselines import BaselineResult, pair_baselines
from nereus.solver.pipeline.bounds import LowerBounds, heads_and_tails, lower_bounds
from nereus.solver.pipeline.evaluate import Evaluation, evaluate, peak_memory, resimulate, simulate
from nereus.solver.pipeline.greedy import GreedyRule, list_schedule, rule_key, window_limits
from nereus.solver.pipeline.model import Instance, ModelTimes, Problem, build_instance, fused_problem

Progress = Callable[[int, int], None]
Orders = list[list[int]]

#: How far (in positions on a node) a move or swap reaches.
MOVE_SPAN = 8
#: Share of each seed's time spent on the memory phase.
MEMORY_PHASE_SHARE = 0.5
#: Initial temperature as a fraction of the starting makespan (or peak memory).
START_TEMPERATURE = 0.02
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
            raise NereusError(f"--time-limit must be > 0 seconds, got {self.time_limit_s}")
        if self.seeds < 1:
            raise NereusError(f"--seeds must be at least 1, got {self.seeds}")
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


def greedy_schedule(inst: Instance, names: tuple[str, str]) -> tuple[str, Orders, Evaluation]:
    """The best list schedule (latency, then memory) within the activation cap.

    Rules: the longest remaining chain first or not, either model first on ties, with or
    without 1F1B in-flight windows; the longest-chain rules also run under tighter
    activation caps (multiples of the memory bound) to find the same latency with less memory.
    """
    best: tuple[str, Orders, Evaluation] | None = None
    user_cap = inst.problem.activation_cap
    _, tails = heads_and_tails(inst)
    memory = lower_bounds(inst).memory
    for by_tail, model_order, windows in itertools.product((True, False), (names, names[::-1]), (True, False)):
        name = ("longest tail, " if by_tail else "") + f"{model_order[0]} first" + (", 1F1B windows" if windows else "")
        rule = GreedyRule(name, model_order, windows, tuple(tails) if by_tail else None)
        caps = [user_cap] + ([memory * f for f in GREEDY_CAP_FACTORS] if by_tail else [])
        for cap in caps:
            if cap is not None and user_cap is not None and cap > user_cap:
                continue
            orders = list_schedule(inst, rule_key(inst, rule), window_limits(inst) if windows else None, cap)
            if orders is None:
                continue
            ev = evaluate(inst, orders)
            if best is None or (ev.makespan, ev.max_peak_memory) < (best[2].makespan, best[2].max_peak_memory):
                best = (rule.name + (f", cap {cap:g}" if cap is not None else ""), orders, ev)
    if best is None:
        raise NereusError(
            f"activation cap {user_cap:g} is too small: no list schedule fits (the serial 1F1B peak is "
            f"{memory:g}); raise --act-cap"
        )
    return best


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
    cap = inst.problem.activation_cap
    movable = [n for n, order in enumerate(start) if len(order) > 1]
    orders = [list(o) for o in start]
    state = simulate(inst, orders)
    assert state is not None, "the start schedule runs"
    makespan = state[0]
    peaks = peak_memory(inst, orders)
    best = AnnealOutcome(seed, [list(o) for o in orders], makespan, max(peaks), 0)
    if not movable:
        return best
    deadline_latency = time.perf_counter() + time_limit_s * (1 - MEMORY_PHASE_SHARE)
    deadline = time.perf_counter() + time_limit_s
    iterations = 0
    budget = max_iterations if max_iterations is not None else math.inf
    for phase in ("latency", "memory"):
        stop = deadline_latency if phase == "latency" else deadline
        phase_budget = budget * (1 - MEMORY_PHASE_SHARE) if phase == "latency" else budget
        if phase == "memory":
            orders, makespan, peaks = [list(o) for o in best.orders], best.makespan, peak_memory(inst, best.orders)
            state = simulate(inst, orders)
            assert state is not None, "the best schedule runs"
        peak_scale = max(max(peaks), 1e-12)
        scale = START_TEMPERATURE * (makespan if phase == "latency" else peak_scale)
        phase_start, phase_len = time.perf_counter(), max(stop - time.perf_counter(), 1e-9)
        temperature = scale
        phase_first = iterations
        while iterations < phase_budget:
            iterations += 1
            if iterations % 32 == 0:
                now = time.perf_counter()
                if now >= stop:
                    break
                done = (now - phase_start) / phase_len
                if phase_budget < math.inf:
                    done = max(done, (iterations - phase_first) / (phase_budget - phase_first))
                temperature = scale * COOLING**done
            if phase == "latency" and best.makespan <= target_latency * (1 + RELATIVE_EPS):
                break  # latency optimal: go on to memory
            if phase == "memory" and best.peak <= target_memory * (1 + RELATIVE_EPS):
                break
            node, new_order, first = _neighbour(rng, orders, movable)
            old_order = orders[node]
            orders[node] = new_order
            new_peak_node = peak_memory(inst, [new_order])[0]
            if cap is not None and new_peak_node > cap * (1 + RELATIVE_EPS):
                orders[node] = old_order
                continue
            simulated = resimulate(inst, orders, state[1], state[2], state[1][old_order[first]])
            if simulated is None:
                orders[node] = old_order
                continue
            new_makespan = simulated[0]
            new_peaks = list(peaks)
            new_peaks[node] = new_peak_node
            accepted = _accept(
                phase, rng, temperature, makespan, max(peaks), new_makespan, max(new_peaks), best.makespan, peak_scale
            )
            if accepted:
                makespan, peaks, state = new_makespan, new_peaks, simulated
                faster = makespan < best.makespan * (1 - RELATIVE_EPS)
                if faster or (makespan <= best.makespan * (1 + RELATIVE_EPS) and max(peaks) < best.peak):
                    best = AnnealOutcome(seed, [list(o) for o in orders], makespan, max(peaks), iterations)
            else:
                orders[node] = old_order
    best.iterations = iterations
    return best


#: Memory phase: being 1% slower than the best makespan costs this many peak-scales / 100.
LATENCY_PENALTY = 20.0


def _memory_energy(makespan: float, peak: float, best_makespan: float, peak_scale: float) -> float:
    """Peak memory, plus a penalty for latency lost: the walk may cross slower schedules,
    but only schedules as fast as the best are kept."""
    return peak + LATENCY_PENALTY * peak_scale * max(0.0, makespan / best_makespan - 1.0)


def _accept(
    phase: str,
    rng: random.Random,
    temperature: float,
    makespan: float,
    peak: float,
    new_makespan: float,
    new_peak: float,
    best_makespan: float,
    peak_scale: float,
) -> bool:
    if phase == "latency":
        delta = new_makespan - makespan
        if abs(delta) <= RELATIVE_EPS * makespan:
            return new_peak <= peak or rng.random() < 0.5
    else:
        delta = _memory_energy(new_makespan, new_peak, best_makespan, peak_scale) - _memory_energy(
            makespan, peak, best_makespan, peak_scale
        )
        if delta == 0:
            return True
    if delta < 0:
        return True
    return temperature > 0 and rng.random() < math.exp(-delta / temperature)


def _run_seeds(
    inst: Instance, start: Orders, config: SearchConfig, bounds: LowerBounds, progress: Progress | None
) -> list[AnnealOutcome]:
    workers = max(1, min(config.seeds, os.cpu_count() or 1))
    rounds = math.ceil(config.seeds / workers)
    per_seed = config.time_limit_s / rounds
    args = (per_seed, bounds.latency, bounds.memory, config.max_iterations)
    if workers == 1:
        outcomes = []
        for seed in range(config.seeds):
            outcomes.append(anneal(inst, start, seed, *args))
            if progress:
                progress(seed + 1, config.seeds)
        return outcomes
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(anneal, inst, start, seed, *args) for seed in range(config.seeds)]
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
    """The fused actor-critic schedule: greedy start, annealed over `config.seeds` seeds."""
    config = config or SearchConfig()
    if actor.name == critic.name:
        raise NereusError(f"the two models need different names, both are {actor.name!r}")
    problem = fused_problem(actor, critic, p2p_latency, activation_cap)
    started = time.perf_counter()
    inst = build_instance(problem)
    bounds = lower_bounds(inst)
    rule, greedy_orders, greedy_eval = greedy_schedule(inst, (actor.name, critic.name))
    outcomes = _run_seeds(inst, greedy_orders, config, bounds, progress)
    best = min(outcomes, key=lambda o: (o.makespan, o.peak, o.seed))
    final = evaluate(inst, best.orders)
    assert final.ok, (final.violations, final.deadlocked)
    if (greedy_eval.makespan, greedy_eval.max_peak_memory) < (final.makespan, final.max_peak_memory):
        best.orders, final = greedy_orders, greedy_eval  # annealing keeps the start unless it improves it
    return FusedResult(
        problem=problem,
        instance=inst,
        orders=best.orders,
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

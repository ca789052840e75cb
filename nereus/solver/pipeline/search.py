"""The fused schedule: starting schedules, simulated annealing over seeds, then CP-SAT windows.

Starts (`starts`): list schedules under several priority rules and activation caps, the best
few re-justified right and left (`improve.forward_backward`) while that shortens them, lean
starts under tight caps and sequenced (interleaved 1F1B) starts. The search then minimises
latency first and peak activation memory second (lexicographically): independent seeds
(`anneal.anneal`, each a latency phase, a memory phase and a lean phase) run in parallel
processes and the best schedule wins. Last, CP-SAT shortens the fastest schedule towards
the lower bound (`window.shorten`), brings lean starts to its makespan (`_lean_endgame`,
`window.meet_makespan`) and re-solves windows around the peak at that makespan
(`window.lower_peak`) for `SearchConfig.window_share` of the time limit, taken from the
memory phase. How the time is shared out, and every other tuning knob, is a `SearchPolicy`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from nereus.errors import ArgumentError, NereusError
from nereus.solver.pipeline.anneal import AnnealOutcome, SeedJob, anneal
from nereus.solver.pipeline.baselines import BaselineResult, pair_baselines
from nereus.solver.pipeline.bounds import LowerBounds, lower_bounds, memory_bound_at
from nereus.solver.pipeline.evaluate import Evaluation, evaluate
from nereus.solver.pipeline.model import Instance, ModelTimes, Problem, build_instance, fused_problem
from nereus.solver.pipeline.policy import DEFAULT_POLICY, RELATIVE_EPS, SearchPolicy
from nereus.solver.pipeline.starts import (
    LeanStart,
    Orders,
    Start,
    by_speed,
    lean_starts,
    makespan_of,
    parallel_sequenced_starts,
    parallel_workers,
    peak_memory_max,
    starting_schedules,
)

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class SearchConfig:
    """How long and how widely the fused search looks."""

    time_limit_s: float = 10.0
    """Wall-clock seconds for the whole search: bounds and starts, then the annealing gets
    what they and the CP-SAT windows leave (at least `SearchPolicy.min_anneal_share` of it)."""
    seeds: int = 2
    """Independent annealing runs; they run in parallel processes, one per CPU at most."""
    max_iterations: int | None = None
    """Also stop each seed after this many neighbours (a run that does not depend on CPU speed)."""
    window_share: float = 0.3
    """Share of `time_limit_s` that goes to CP-SAT after the annealing: shortening the fastest
    schedule (`window.shorten`), bringing lean starts to its makespan (`window.meet_makespan`)
    and peak windows (`window.lower_peak`), with OR-Tools installed; else the annealing keeps
    it. Not used with `max_iterations`: the windows' solves depend on time."""

    def __post_init__(self) -> None:
        if not 0 <= self.window_share < 1:
            raise ArgumentError(f"`window_share` must lie in [0, 1), got {self.window_share}", "window_share")
        if not self.time_limit_s > 0:
            raise ArgumentError(f"`time_limit_s` must be > 0 seconds, got {self.time_limit_s}", "time_limit_s")
        if self.seeds < 1:
            raise ArgumentError(f"`seeds` must be at least 1, got {self.seeds}", "seeds")
        if self.max_iterations is not None and self.max_iterations < 1:
            raise NereusError(f"max_iterations must be at least 1, got {self.max_iterations}")


class SeedRun(NamedTuple):
    """One annealing run's result."""

    seed: int
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
    per_seed: list[SeedRun] = field(default_factory=list)
    """(seed, makespan, peak memory) of every annealing run, by seed."""
    seed_caps: list[float | None] = field(default_factory=list)
    """By seed: the activation cap its latency walk kept to on top of the problem's own
    (`SearchPolicy.capped_seed_factor` x the memory bound), or None where it had none."""
    lean: list[LeanStart] = field(default_factory=list)
    """The lean starts (`starts.lean_starts`): what holding less costs in makespan."""
    windows: tuple[int, int, float] = (0, 0, 0.0)
    """Peak windows solved, kept, and the peak before them (`window.lower_peak`)."""
    endgame: tuple[int, float] | None = None
    """When a lean start brought to the makespan won (`_lean_endgame`): its try and the
    peak of the annealing's schedule it replaced."""


def run_seeds(
    inst: Instance,
    starts: list[Start],
    lean: list[LeanStart],
    config: SearchConfig,
    bounds: LowerBounds,
    progress: Progress | None,
    window_s: float = 0.0,
    at_bound: bool = False,
    fat: bool = False,
    policy: SearchPolicy = DEFAULT_POLICY,
) -> list[AnnealOutcome]:
    """Anneal `config.seeds` seeds, in parallel processes, and return their outcomes by seed.

    Where some start holds at most `policy.capped_seed_factor` x the memory bound, the seeds
    anneal under that cap, unless the fastest start is within it and meets the lower bound
    (no walk then looks for a faster schedule, so none drifts to one that runs every
    forward early). Where the fastest start holds more (`fat`, `_fastest_is_fat`), seed k
    catches up from the k-th fastest start within the cap (`_lean_fits`), with
    `policy.capped_latency_share` of its budget for the latency phase; the fat start still
    competes as it is. Otherwise seeds cycle over the starts within `policy.restart_slack`
    of the fastest (and within the cap, where capped), even seeds fastest first, odd seeds
    leanest first: restarts from constructions about as fast that differ in memory and in
    where they get stuck."""
    workers = parallel_workers(config.seeds)
    rounds = math.ceil(config.seeds / workers)
    # Each seed's lean phase comes on top of its budget: scale the budget to keep the total.
    per_seed = config.time_limit_s / rounds / (1 + policy.lean_share)
    budget = None if config.max_iterations is None else max(1, round(config.max_iterations / (1 + policy.lean_share)))
    # The peak windows take their time from the memory phase: the latency phase keeps its share.
    whole = config.time_limit_s + window_s
    latency_share = min(1.0, whole * (1 - policy.memory_phase_share) / config.time_limit_s)
    fastest = starts[0].evaluation.makespan
    seed_cap = policy.capped_seed_factor * bounds.memory
    lean_fits = _lean_fits(starts, bounds, policy)
    # An uncapped walk for a faster schedule drifts to one that runs every forward early,
    # and the moves from there rarely interleave the backwards again.
    walk_cap = seed_cap if lean_fits and not fat and not at_bound else None
    close = [
        start
        for start in starts
        if start.evaluation.makespan <= fastest * (1 + policy.restart_slack)
        and (walk_cap is None or start.evaluation.max_peak_memory <= walk_cap * (1 + RELATIVE_EPS))
    ]
    leanest = sorted(close, key=lambda s: (s.evaluation.max_peak_memory, s.evaluation.makespan))

    def job(seed: int, start: Orders, share: float, cap: float | None) -> SeedJob:
        return SeedJob(
            seed=seed,
            start=start,
            time_limit_s=per_seed,
            target_latency=bounds.latency,
            target_memory=bounds.memory,
            max_iterations=budget,
            fallback=starts[0].orders,
            lean=lean,
            latency_share=share,
            seed_cap=cap,
        )

    jobs = []
    for seed in range(config.seeds):
        if fat:
            # Its lower peak counts only at the best makespan: most of the budget goes there.
            jobs.append(job(seed, lean_fits[seed % len(lean_fits)], policy.capped_latency_share, seed_cap))
        else:
            start = (close if seed % 2 == 0 else leanest)[(seed // 2) % len(close)].orders
            jobs.append(job(seed, start, latency_share, walk_cap))
    if workers == 1:
        outcomes = []
        for done, seed_job in enumerate(jobs, 1):
            outcomes.append(anneal(inst, seed_job, policy))
            if progress:
                progress(done, config.seeds)
        return outcomes
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(anneal, inst, seed_job, policy) for seed_job in jobs]
        outcomes = []
        for done, future in enumerate(as_completed(futures), 1):
            outcomes.append(future.result())
            if progress:
                progress(done, config.seeds)
    return sorted(outcomes, key=lambda o: o.seed)


def _lean_fits(starts: list[Start], bounds: LowerBounds, policy: SearchPolicy) -> list[Orders]:
    """The starts that hold at most `policy.capped_seed_factor` x the memory bound, fastest first."""
    seed_cap = policy.capped_seed_factor * bounds.memory
    return [s.orders for s in starts if s.evaluation.max_peak_memory <= seed_cap * (1 + RELATIVE_EPS)]


def _fastest_is_fat(starts: list[Start], bounds: LowerBounds, policy: SearchPolicy) -> bool:
    """The fastest start holds more than `policy.capped_seed_factor` x the memory bound and
    another start holds less: the seeds that anneal under that cap have somewhere to start."""
    seed_cap = policy.capped_seed_factor * bounds.memory
    return starts[0].evaluation.max_peak_memory > seed_cap and bool(_lean_fits(starts, bounds, policy))


def _window_seconds(config: SearchConfig) -> float:
    """The peak windows' seconds: their share of the time limit in a time-limited run with
    OR-Tools installed, else 0."""
    if config.max_iterations is not None or config.window_share == 0:
        return 0.0
    import importlib.util

    if importlib.util.find_spec("ortools") is None:
        return 0.0
    return config.time_limit_s * config.window_share


def _lean_endgame(
    inst: Instance,
    orders: Orders,
    makespan: float,
    lean: Sequence[LeanStart],
    seconds: float,
    policy: SearchPolicy = DEFAULT_POLICY,
) -> tuple[Orders, tuple[int, float] | None]:
    """The best schedule, or the leanest of the lean starts brought to its makespan by
    re-sequencing their last ops with CP-SAT (`window.meet_makespan`): up to
    `policy.endgame_tries` starts within `policy.endgame_slack` of `makespan` are tried in
    turn, each with half of what is left of `seconds` (the last one all of it), each only
    while it holds less than the best so far. Also returns (the winning try, the peak
    before) when a start won."""
    from nereus.solver.pipeline.window import meet_makespan

    began = time.perf_counter()
    before = best_peak = peak_memory_max(inst, orders)
    near = [
        s for s in lean if s.peak < before * (1 - RELATIVE_EPS) and s.makespan <= makespan * (1 + policy.endgame_slack)
    ]
    # Nearest the makespan first (in steps of `policy.endgame_step`), then least memory:
    # CP-SAT closes a small gap far more often than a large one.
    step = policy.endgame_step
    tries = sorted(near, key=lambda s: (round((s.makespan / makespan - 1) / step), s.peak))[: policy.endgame_tries]
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


def search_fused(
    actor: ModelTimes,
    critic: ModelTimes,
    config: SearchConfig | None = None,
    p2p_latency: float = 0.0,
    activation_cap: float | None = None,
    progress: Progress | None = None,
    policy: SearchPolicy = DEFAULT_POLICY,
) -> FusedResult:
    """The fused actor-critic schedule: list schedules, forward-backward improvement, then
    annealing over `config.seeds` seeds from the best few starts, then CP-SAT windows; the
    same config, policy and (with `max_iterations`) seeds give the same schedule."""
    config = config or SearchConfig()
    if actor.name == critic.name:
        raise NereusError(f"the two models need different names, both are {actor.name!r}")
    names = (actor.name, critic.name)
    problem = fused_problem(actor, critic, p2p_latency, activation_cap)
    started = time.perf_counter()
    inst = build_instance(problem)
    bounds = lower_bounds(inst)
    greedy, starts = starting_schedules(inst, names, policy)
    lean = lean_starts(inst, names, policy)
    sequence_s = 0.0 if config.max_iterations is not None else config.time_limit_s * policy.sequence_share
    sequenced = parallel_sequenced_starts(inst, names, sequence_s, policy)
    lean += sequenced
    # Under a cap the lean starts are often the fastest ones; sequenced starts sometimes are.
    extra = lean if activation_cap is not None else sequenced
    starts += [Start(f"lean, cap {start.cap:g}", start.orders, evaluate(inst, start.orders)) for start in extra]
    starts.sort(key=by_speed)
    window_s = _window_seconds(config)
    at_bound = starts[0].evaluation.makespan <= bounds.latency * (1 + RELATIVE_EPS)
    fat = _fastest_is_fat(starts, bounds, policy)
    if at_bound and not fat:
        # No seed looks for a faster schedule: the time goes to the seeds' peak descent.
        window_s *= policy.at_bound_window_factor
    # The time limit covers the whole search: the annealing has what the bounds, the starts
    # (the sequenced ones belong to the memory phase's share) and the windows leave.
    spent = time.perf_counter() - started
    anneal_s = max(config.time_limit_s * policy.min_anneal_share, config.time_limit_s - window_s - spent)
    annealing = replace(config, time_limit_s=anneal_s)
    outcomes = run_seeds(inst, starts, lean, annealing, bounds, progress, window_s, at_bound, fat, policy)
    # The annealing keeps a start unless it improves it; makespans within RELATIVE_EPS tie
    # (float sums in another order), and ties go to the least memory.
    candidates = [(o.makespan, o.peak, o.orders) for o in outcomes]
    candidates += [(s.evaluation.makespan, s.evaluation.max_peak_memory, s.orders) for s in starts]
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
            orders = shorten(inst, orders, bounds.latency, window_s * policy.shorten_share, parallel_workers(2))
            fastest = makespan_of(inst, orders)
        floor = max(bounds.memory, memory_bound_at(inst, fastest))
        left = window_s - (time.perf_counter() - began)
        orders, endgame = _lean_endgame(inst, orders, fastest, lean, left * policy.endgame_share, policy)
        above = fastest > bounds.latency * (1 + RELATIVE_EPS)
        again = window_s * policy.shorten_again_share if above else 0.0
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
        greedy=greedy.evaluation,
        greedy_rule=greedy.name,
        baselines=pair_baselines(actor, critic, p2p_latency),
        search_s=time.perf_counter() - started,
        seeds=config.seeds,
        iterations=sum(o.iterations for o in outcomes),
        memory_lower_bound=memory_bound_at(inst, final.makespan),
        per_seed=[SeedRun(o.seed, o.makespan, o.peak) for o in outcomes],
        seed_caps=[o.seed_cap for o in outcomes],
        lean=lean,
        windows=windows,
        endgame=endgame,
    )

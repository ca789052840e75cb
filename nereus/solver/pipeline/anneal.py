"""One seed's simulated annealing: a latency phase, a memory phase, then a lean phase.

Phase one anneals the makespan plus the summed lateness of ops past the lower bound (zero
exactly when the bound is met, so the walk is guided across makespan plateaus), with
`SearchPolicy.critical_share` of its moves breaking an arc of the critical path (an op that
waits for its node predecessor moves ahead of it, or that predecessor behind it). Phase two
keeps that makespan and anneals a penalty that is zero exactly when a schedule is that fast
and holds less than the best peak: the lateness past the makespan plus each node's excess
over a level just under the peak, summed over the moments it stands above it.
`SearchPolicy.peak_share` of its moves shift one of the forwards nearest a high moment to
after it, or a backward to before it; only schedules no slower are kept, and each lowers the
level. It stops at the memory lower bound at that makespan. Other neighbours swap two nearby
ops on one node or move one op a few places (`moves`); neighbours that deadlock or break the
activation cap are rejected. The lean phase, on a budget of its own, looks for an as fast,
lower schedule from the lean starts.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from nereus.solver.pipeline.bounds import follow_tails, heads_and_tails, memory_bound_at, node_tails
from nereus.solver.pipeline.evaluate import peak_memory, resimulate, simulate
from nereus.solver.pipeline.model import Instance
from nereus.solver.pipeline.moves import critical_move, critical_node_arcs, memory_profile, neighbour, peak_move
from nereus.solver.pipeline.policy import DEFAULT_POLICY, RELATIVE_EPS, SearchPolicy
from nereus.solver.pipeline.starts import LeanStart, Orders


@dataclass(frozen=True)
class SeedJob:
    """What one annealing run starts from, aims at and may spend."""

    seed: int
    """Seeds the run's random numbers: the same job and policy give the same outcome."""
    start: Orders
    """The schedule the latency phase starts from (it must run)."""
    time_limit_s: float
    """Wall-clock seconds of the latency and memory phases; the lean phase gets
    `SearchPolicy.lean_share` of it on top."""
    target_latency: float
    """The latency lower bound: the latency phase stops there."""
    target_memory: float
    """The memory bound: the memory phase stops at it (or at the bound at the makespan),
    and the lean phase's caps are factors of it."""
    max_iterations: int | None = None
    """Also stop the latency and memory phases after this many neighbours in all (the lean
    phase gets `SearchPolicy.lean_share` of it on top)."""
    fallback: Orders | None = None
    """The fastest start: when it is faster than what the latency phase reached, the memory
    phase works on it instead (only the fastest schedules can win)."""
    lean: Sequence[LeanStart] = ()
    """The lean starts the lean phase tries."""
    latency_share: float | None = None
    """Share of the budget for the latency phase; None: 1 - `SearchPolicy.memory_phase_share`."""
    seed_cap: float | None = None
    """An activation cap the latency phase keeps to on top of the problem's own (None: none)."""


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
    seed_cap: float | None = None
    """The job's `seed_cap`: the activation cap its latency walk kept to (None: only the
    problem's own)."""


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
    """A phase's cooling schedule: the temperature falls from `scale` by `cooling` over the
    phase's time or iterations, whichever runs out first."""

    def __init__(
        self, phase: _Phase, scale: float, iterations: int, cooling: float, patience: _Patience | None = None
    ) -> None:
        self.phase, self.scale, self.first, self.cooling = phase, scale, iterations, cooling
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
        self.temperature = self.scale * self.cooling**done
        return True


Evaluated = tuple[float, list[float], list[float]]


def _try(inst: Instance, walk: _Walk, node: int, new_order: list[int], first: int) -> Evaluated | None:
    """Put `new_order` on `node` and re-time the walk from the first changed op: the new
    (makespan, start, end), or None (and the order restored) when it deadlocks."""
    old_order = walk.orders[node]
    walk.orders[node] = new_order
    simulated = resimulate(inst, walk.orders, walk.start, walk.end, walk.start[old_order[first]])
    if simulated is None:
        walk.orders[node] = old_order
    return simulated


def _lateness(end: list[float], follow: list[float], target: float) -> float:
    """How far ops end past the latest end that still lets the schedule meet `target` (the
    target less what must follow them, `node_tails`): zero exactly when the makespan is at
    most the target; it shrinks with every op that stops being late, so it guides the walk
    across makespan plateaus."""
    return sum([e + f - target for e, f in zip(end, follow, strict=True) if e + f > target])


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


def anneal(inst: Instance, job: SeedJob, policy: SearchPolicy = DEFAULT_POLICY) -> AnnealOutcome:
    """Two-phase simulated annealing from `job.start`: latency, then memory at the makespan found.

    With `job.seed_cap`, the latency phase never lets a node hold more than it (nor the
    problem's own cap): from a lean start the seed looks for a schedule as fast as
    `job.fallback` (with `policy.capped_latency_share` as `latency_share`,
    `search.run_seeds`); when it gets there the memory phase lowers it further, else its
    schedule is kept as a near miss (`AnnealOutcome.lean`) and the memory phase works on
    the fallback.

    Each phase owns its share of the time (and iteration) budget (`latency_share` for the
    latency phase, the rest for the memory phase); a latency phase that meets
    the lower bound early hands the rest of its share to the memory phase. When the fallback
    (the fastest start) is faster than what the latency phase reached, the memory phase
    works on it instead: only the fastest schedules can win. Then, for `policy.lean_share`
    more of the budget, the lean phase looks for an as fast, lower schedule among the lean
    starts' neighbours (`_lean_phase`). It runs after the descent, on its own budget, and
    replaces the descent's schedule only with a lower one: the two phases before it run
    exactly as without lean starts, so the result never holds more than theirs.
    """
    rng = random.Random(job.seed)
    walk = _Walk.of(inst, job.start)
    best = AnnealOutcome(job.seed, [list(o) for o in walk.orders], walk.makespan, max(walk.peaks), 0)
    best.seed_cap = job.seed_cap
    movable = [n for n, order in enumerate(job.start) if len(order) > 1]
    if not movable:
        return best
    latency_share = 1 - policy.memory_phase_share if job.latency_share is None else job.latency_share
    began = time.perf_counter()
    budget = job.max_iterations if job.max_iterations is not None else math.inf
    latency = _Phase(began + job.time_limit_s * latency_share, budget * latency_share)
    user_cap = inst.problem.activation_cap
    cap = user_cap if job.seed_cap is None else min(job.seed_cap, user_cap or math.inf)
    iterations = _latency_phase(inst, latency, walk, best, rng, movable, 0, job.target_latency, cap, None, policy)
    if job.fallback is not None:
        faster = _Walk.of(inst, job.fallback)
        if faster.makespan < best.makespan * (1 - RELATIVE_EPS):
            if job.seed_cap is not None:  # a near miss the endgame may bring the rest of the way
                assert cap is not None
                best.lean.append(LeanStart(cap, best.orders, best.makespan, best.peak))
            orders = [list(o) for o in job.fallback]
            best = AnnealOutcome(job.seed, orders, faster.makespan, max(faster.peaks), 0, best.lean, job.seed_cap)
    memory = _Phase(began + job.time_limit_s, budget)
    iterations = _memory_phase(inst, memory, best, rng, movable, iterations, job.target_memory, None, policy)
    if job.max_iterations is not None:
        budget = iterations + job.max_iterations * policy.lean_share
    now = time.perf_counter()
    lean = _Phase(now + job.time_limit_s * policy.lean_share, budget)
    best.iterations = _lean_phase(inst, lean, best, rng, movable, iterations, job.target_memory, job.lean, policy)
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
    policy: SearchPolicy = DEFAULT_POLICY,
) -> int:
    """Look for a schedule as fast as `best` under a tight activation cap: per cap of
    `policy.lean_try_factors` (x the memory bound) below `best`'s peak, anneal the latency
    from the fastest lean start within it towards `best`'s makespan, never above the cap, for
    `policy.lean_try_share` of the phase, or until it has gone `policy.lean_patience` of the
    phase without gaining. The first that gets there replaces `best`, and the peak descent
    works on it for the rest of the phase. A fast schedule found without a cap tends to run
    every forward early, and no short move leads from there to one that interleaves the
    backwards; a lean start already does."""
    user_cap = inst.problem.activation_cap
    now = time.perf_counter()
    patience = _Patience(
        (phase.deadline - now) * policy.lean_patience, (phase.budget - iterations) * policy.lean_patience
    )
    # Seeds alternate which cap they try first: the looser one reaches the makespan more
    # often, the tighter one holds less when it does.
    factors = policy.lean_try_factors
    for factor in factors if best.seed % 2 == 0 else factors[::-1]:
        cap = factor * target_memory
        fits = [start for start in lean if start.peak <= cap * (1 + RELATIVE_EPS)]
        if cap >= best.peak or not fits or (user_cap is not None and cap > user_cap):
            continue
        start = min(fits, key=lambda s: s.makespan)
        now = time.perf_counter()
        share = policy.lean_try_share
        sub = _Phase(now + (phase.deadline - now) * share, iterations + (phase.budget - iterations) * share)
        attempt = AnnealOutcome(best.seed, [list(o) for o in start.orders], start.makespan, start.peak, 0)
        walk = _Walk.of(inst, start.orders)
        iterations = _latency_phase(
            inst, sub, walk, attempt, rng, movable, iterations, best.makespan, cap, patience, policy
        )
        if attempt.makespan <= best.makespan * (1 + RELATIVE_EPS) and attempt.peak < best.peak:
            best.orders, best.makespan, best.peak = attempt.orders, attempt.makespan, attempt.peak
            return _memory_phase(inst, phase, best, rng, movable, iterations, target_memory, None, policy)
        if attempt.makespan < start.makespan * (1 - RELATIVE_EPS) and attempt.peak < best.peak:
            best.lean.append(LeanStart(cap, attempt.orders, attempt.makespan, attempt.peak))
    return iterations


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
    policy: SearchPolicy = DEFAULT_POLICY,
) -> int:
    """Anneal the makespan plus the ops' lateness past `target_latency` with every node's
    activation within `cap`; `best` is updated in place (fastest, then least memory);
    returns the iteration count. With `patience` (seconds, iterations), stop early once the
    energy has gone that long without a new low."""
    _, tail = heads_and_tails(inst)
    follow = follow_tails(inst, walk.orders, tail)
    weight, span = policy.lateness_weight, policy.move_span

    def energy(makespan: float, end: list[float], follow: list[float]) -> float:
        return makespan + weight * _lateness(end, follow, target_latency) / inst.problem.num_nodes

    # Schedules within RELATIVE_EPS of `reference` count as equally fast; it moves only on a
    # real improvement, so a chain of "equal" schedules cannot creep slower.
    reference = best.makespan
    clock = _Clock(phase, policy.latency_temperature * walk.makespan, iterations, policy.cooling, patience)
    current = energy(walk.makespan, walk.end, follow)
    lowest = current
    arcs: list[tuple[int, int]] | None = None
    while clock.tick(iterations):
        iterations += 1
        if best.makespan <= target_latency * (1 + RELATIVE_EPS):
            break  # latency optimal: go on to memory
        if rng.random() < policy.critical_share:
            arcs = arcs if arcs is not None else critical_node_arcs(inst, walk.orders, walk.start, walk.end)
            if not arcs:
                continue
            node, new_order, first = critical_move(rng, walk.orders, arcs, span)
        else:
            node, new_order, first = neighbour(rng, walk.orders, movable, span)
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
    policy: SearchPolicy = DEFAULT_POLICY,
) -> int:
    """Lower the peak activation of `best` without making it slower than it was on entry;
    returns the iteration count. The walk starts from `origin` (default: `best`), which may
    be slower: the lateness term brings it back to `best`'s makespan.

    The walk anneals a penalty that is zero exactly when a schedule is as fast as `best` and
    holds less than its peak: the lateness past `best`'s makespan (in mean op durations) plus
    every node's excess over a level `policy.memory_step` activations under the best peak (in
    mean activations). Slower or higher schedules may be crossed; only ones as fast and lower
    are kept, and each lowers the level. `policy.peak_share` of the moves target a high moment
    of a node above the level, `policy.critical_share` of the rest (while the walk is late) a
    critical node arc.
    """
    makespan = best.makespan
    floor = max(target_memory, memory_bound_at(inst, makespan))
    if best.peak <= floor * (1 + RELATIVE_EPS):
        return iterations
    cap = inst.problem.activation_cap
    _, tail = heads_and_tails(inst)
    delta = inst.memory_delta
    grows = [d for d in delta if d > 0]
    step = min(grows) * policy.memory_step
    time_unit = sum(inst.duration) / max(inst.num_ops, 1)
    memory_unit = sum(grows) / len(grows)
    walk = _Walk.of(inst, origin or best.orders)
    level = min(best.peak, max(walk.peaks)) - step
    excess = [memory_profile(delta, order, level)[1] for order in walk.orders]
    span, peak_share = policy.move_span, policy.peak_share
    critical = peak_share + policy.critical_share * (1 - peak_share)

    target = makespan * (1 + RELATIVE_EPS)
    follow = follow_tails(inst, walk.orders, tail)

    def energy(end: list[float], follow: list[float], node_excess: list[float]) -> float:
        late = _lateness(end, follow, target) / time_unit
        return policy.memory_lateness_weight * late + sum(node_excess) / memory_unit

    clock = _Clock(phase, policy.memory_temperature, iterations, policy.cooling)
    current = energy(walk.end, follow, excess)
    late = walk.makespan > makespan * (1 + RELATIVE_EPS)
    arcs: list[tuple[int, int]] | None = None
    while clock.tick(iterations):
        iterations += 1
        if best.peak <= floor * (1 + RELATIVE_EPS):
            break
        draw = rng.random()
        if draw < peak_share:
            node, new_order, first = peak_move(inst, rng, walk.orders, excess, level, span, policy.nearest_ops)
        elif late and draw < critical:
            arcs = arcs if arcs is not None else critical_node_arcs(inst, walk.orders, walk.start, walk.end)
            if not arcs:
                continue
            node, new_order, first = critical_move(rng, walk.orders, arcs, span)
        else:
            node, new_order, first = neighbour(rng, walk.orders, movable, span)
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

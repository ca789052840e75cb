"""Serial schedule generation: place primitives one by one at their earliest safe time.

The list scheduler in `schedule.py` advances a clock and starts whatever fits now
(non-delay schedules). Some optimal transitions keep a GPU idle for a moment so that a
more urgent primitive can start there; non-delay schedules never do. This scheduler
takes primitives in priority order (a ready one at a time) and puts each at the
earliest time where its data dependencies are done, its GPUs are free for its whole run
(gaps between earlier placements count) and its allocations fit under capacity at every
later moment of the memory profile built so far. Such schedules include an optimal one
for some priority order, so restarts over orders can close gaps the list scheduler
leaves. It is quadratic in the primitives: used on small and medium DAGs.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Callable

from nereus.solver.transition.primitives import Primitive, Schedule

EPS = 1e-9


class _Profile:
    """Per GPU: busy intervals and memory events (time, free-before-alloc, bytes delta).

    Beside them, per GPU and kept sorted as placements come: the ends of its runs and the
    times of its releases, so that `candidates` takes the later ones by bisection and
    `_first_fit` sees at once when a time is past every run on a GPU.
    """

    def __init__(self, initial: dict[int, float], capacity: float) -> None:
        self.initial, self.capacity = initial, capacity
        self.busy: dict[int, list[tuple[float, float]]] = {}
        self.events: dict[int, list[tuple[float, int, float]]] = {}
        self.ends: dict[int, list[float]] = {}
        """GPU -> the ends of its runs, sorted."""
        self.release_times: dict[int, list[float]] = {}
        """GPU -> the times of its releases (memory events that free), sorted."""

    def gpu_free(self, gpu: int, start: float, end: float) -> bool:
        """No placed run on `gpu` overlaps [start, end) (a zero-length run is the point `start`)."""
        return self.blocker(gpu, start, end) is None

    def blocker(self, gpu: int, start: float, end: float) -> float | None:
        """The end of a placed run on `gpu` that overlaps [start, end) (a zero-length run is
        the point `start`), or None when none does (`gpu_free`)."""
        runs = self.busy.get(gpu)
        if not runs:
            return None
        # Placed runs longer than EPS overlap by EPS at most (each was placed where this test
        # held), so of those starting before `start` only the last can reach past it.
        first = bisect.bisect_left(runs, (start,))
        while first > 0:
            first -= 1
            if runs[first][1] - runs[first][0] > EPS:
                break
        point = end - start <= EPS
        for index in range(first, len(runs)):
            busy_start, busy_end = runs[index]
            if busy_start >= (start - EPS if point else end + EPS):
                break  # this run and every later one start too late to overlap
            if busy_end - busy_start <= EPS:
                continue  # zero-length runs never conflict
            if point:
                if busy_start + EPS < start < busy_end - EPS:
                    return busy_end
            elif busy_start < end - EPS and start < busy_end - EPS:
                return busy_end
        return None

    def fits(self, gpu: int, start: float, nbytes: float) -> bool:
        """`nbytes` allocated at `start` stay under capacity at every later moment."""
        usage = self.initial.get(gpu, 0.0)
        worst = -float("inf")
        for time, _, delta in self.events.get(gpu, ()):
            if time > start + EPS and usage > worst:
                worst = usage
            usage += delta
        worst = max(worst, usage)
        return worst + nbytes <= self.capacity + EPS

    def place(self, primitive: Primitive, start: float) -> None:
        end = start + primitive.duration_s
        busy, ends, events = self.busy, self.ends, self.events
        for gpu in primitive.gpus:
            bisect.insort(busy.setdefault(gpu, []), (start, end))
            bisect.insort(ends.setdefault(gpu, []), end)
        for gpu, nbytes in primitive.alloc.items():
            bisect.insort(events.setdefault(gpu, []), (start, 1, nbytes))
        released = end - EPS if end > start else start
        for gpu, nbytes in primitive.free.items():
            bisect.insort(events.setdefault(gpu, []), (released, 0, -nbytes))
            bisect.insort(self.release_times.setdefault(gpu, []), released)

    def candidates(self, primitive: Primitive, earliest: float) -> list[float]:
        """Times worth trying: the earliest, and every later end of a run or a free on its GPUs."""
        times = {earliest}
        for gpu in primitive.gpus:
            ends = self.ends.get(gpu)
            if ends:
                times.update(ends[bisect.bisect_right(ends, earliest) :])
        for gpu in primitive.alloc:
            released = self.release_times.get(gpu)
            if released:
                times.update(t + EPS for t in released[bisect.bisect_right(released, earliest) :])
        return sorted(times)

    def copy(self) -> _Profile:
        """An independent profile with the same placements (a branch of a search)."""
        twin = _Profile(self.initial, self.capacity)
        for name in ("busy", "events", "ends", "release_times"):
            setattr(twin, name, {gpu: list(values) for gpu, values in getattr(self, name).items()})
        return twin

    def peak(self) -> dict[int, float]:
        out = {}
        for gpu, events in self.events.items():
            usage = self.initial.get(gpu, 0.0)
            out[gpu] = usage
            for _, _, delta in events:
                usage += delta
                out[gpu] = max(out[gpu], usage)
        return out


def serial_schedule(
    primitives: list[Primitive],
    initial: dict[int, float],
    capacity: float,
    priority: Callable[[Primitive], tuple[float, ...]],
    stop_above: float = math.inf,
    ownership: bool = True,
) -> tuple[Schedule, dict[int, float]] | None:
    """Place every primitive (ready ones in `priority` order); return the schedule and peak
    bytes per GPU, or None when some primitive never fits or would end after `stop_above`
    (a caller that only wants a schedule up to that long stops early).

    Without `ownership` the schedule has no GPU-ownership dependencies yet: for a caller
    that often discards it, `with_ownership` adds them to the one it keeps.
    """
    profile = _Profile(initial, capacity)
    starts: dict[int, float] = {}
    if _complete(_Dag(primitives), profile, starts, priority, stop_above) is None:
        return None
    start = {p.id: starts[p.id] for p in primitives}
    end = {p.id: starts[p.id] + p.duration_s for p in primitives}
    schedule = Schedule(start, end)
    if ownership:
        schedule = with_ownership(schedule, primitives, initial, capacity)
    return schedule, profile.peak()


def with_ownership(
    schedule: Schedule, primitives: list[Primitive], initial: dict[int, float], capacity: float
) -> Schedule:
    """A serial schedule built without `ownership`, with its GPU-ownership dependencies."""
    start, end = schedule.start, schedule.end
    return Schedule(start, end, _ownership_edges(primitives, start, end, initial, capacity))


class _Dag:
    """The primitives by id and each one's dependents."""

    def __init__(self, primitives: list[Primitive]) -> None:
        self.by_id = {p.id: p for p in primitives}
        self.dependents: dict[int, list[int]] = {}
        for p in primitives:
            for dep in p.deps:
                self.dependents.setdefault(dep, []).append(p.id)


def _complete(
    dag: _Dag,
    profile: _Profile,
    starts: dict[int, float],
    priority: Callable[[Primitive], tuple[float, ...]],
    stop_above: float = math.inf,
) -> list[int] | None:
    """Place every primitive not in `starts` yet (ready ones in `priority` order) on
    `profile`, recording their starts; the order placed, or None when one never fits or
    would end after `stop_above` (then the makespan would exceed it: the caller has no use
    for the rest)."""
    by_id = dag.by_id
    waiting = {pid: sum(d not in starts for d in p.deps) for pid, p in by_id.items() if pid not in starts}
    ready = [(priority(by_id[pid]), pid) for pid, count in waiting.items() if not count]
    heapq.heapify(ready)
    placed = []
    while ready:
        primitive = by_id[heapq.heappop(ready)[1]]
        start = _first_fit(profile, primitive, _earliest(primitive, by_id, starts))
        if start is None or start + primitive.duration_s > stop_above:
            return None
        profile.place(primitive, start)
        starts[primitive.id] = start
        placed.append(primitive.id)
        for child in dag.dependents.get(primitive.id, []):
            waiting[child] -= 1
            if not waiting[child]:
                heapq.heappush(ready, (priority(by_id[child]), child))
    return placed


def _earliest(primitive: Primitive, by_id: dict[int, Primitive], starts: dict[int, float]) -> float:
    """When `primitive`'s data dependencies (placed at `starts`) are all done."""
    return max((starts[d] + by_id[d].duration_s for d in primitive.deps), default=0.0)


def pilot_order(
    primitives: list[Primitive],
    initial: dict[int, float],
    capacity: float,
    priority: Callable[[Primitive], tuple[float, ...]],
) -> tuple[float, list[int]] | None:
    """The pilot method over the serial generator: the best order it finds and its makespan.

    Step by step, every primitive that may be placed next is tried: placed at its earliest
    safe time, the rest completed by the serial generator in `priority` order (the pilot
    run). The primitive whose pilot run ends first is kept and the next step begins; the
    best complete schedule of any pilot run is returned (None if every one got stuck). A
    memory-tight transition often needs a releasing chain to go before the primitive the
    priority would pick; one pilot run per candidate sees that where one order cannot.
    Quadratic in the primitives times the candidates per step: for small DAGs.
    """
    dag = _Dag(primitives)
    profile = _Profile(initial, capacity)
    starts: dict[int, float] = {}
    prefix: list[int] = []
    best: tuple[float, list[int]] | None = None
    # The kept pilot run's own continuation: the primitive it placed next, where, its makespan
    # and what it placed after. The next step's pilot run for that primitive starts from the
    # same placements, so it would place the same way: it is not run again.
    carried: tuple[int, float, list[int], dict[int, float]] | None = None
    while len(starts) < len(primitives):
        candidates = [p for pid, p in dag.by_id.items() if pid not in starts and all(d in starts for d in p.deps)]
        step: tuple[float, Primitive, float, list[int], dict[int, float]] | None = None  # ties: priority
        for primitive in sorted(candidates, key=priority):  # (pilot makespan, primitive, start, rest, starts)
            if carried is not None and carried[0] == primitive.id:
                _, span, rest, trial_starts = carried
                start = trial_starts[primitive.id]
            else:
                found = _first_fit(profile, primitive, _earliest(primitive, dag.by_id, starts))
                if found is None:
                    continue
                start = found
                trial, trial_starts = profile.copy(), {**starts, primitive.id: start}
                trial.place(primitive, start)
                # A pilot run no shorter than this step's best and the best so far (by EPS)
                # changes neither: it stops as soon as it must end later.
                useless = math.inf if step is None or best is None else max(step[0], best[0]) - EPS
                completed = _complete(dag, trial, trial_starts, priority, useless)
                if completed is None:
                    continue
                rest = completed
                span = max((t + dag.by_id[pid].duration_s for pid, t in trial_starts.items()), default=0.0)
            if best is None or span < best[0] - EPS:
                best = (span, [*prefix, primitive.id, *rest])
            if step is None or span < step[0] - EPS:
                step = (span, primitive, start, rest, trial_starts)
        if step is None:
            return best
        span, primitive, start, rest, trial_starts = step
        profile.place(primitive, start)
        starts[primitive.id] = start
        prefix.append(primitive.id)
        carried = (rest[0], span, rest[1:], trial_starts) if rest else None
    return best


def _first_fit(profile: _Profile, primitive: Primitive, earliest: float) -> float | None:
    """The first candidate time where `primitive`'s GPUs are free for its run and its
    allocations fit (None if none).

    A run that overlaps a candidate's run also overlaps that of every later candidate
    (with the same point-or-not test, see `_Profile.gpu_free`) that starts more than EPS
    before the run ends: those fail the same test, so they are passed over unchecked.
    """
    duration, gpus, alloc = primitive.duration_s, primitive.gpus, primitive.alloc.items()
    blocker, fits, ends = profile.blocker, profile.fits, profile.ends
    blocked_before, blocked_point = -math.inf, False  # later candidates before this time fail
    for start in profile.candidates(primitive, earliest):
        end = start + duration
        point = end - start <= EPS
        if point != blocked_point:
            blocked_before, blocked_point = -math.inf, point
        if start < blocked_before:
            continue
        for gpu in gpus:
            gpu_ends = ends.get(gpu)
            if not gpu_ends or start >= gpu_ends[-1] - EPS:
                continue  # every run there ends by then: none overlaps
            until = blocker(gpu, start, end)
            if until is not None:
                blocked_before = max(blocked_before, until - EPS)
                break
        else:
            for gpu, nbytes in alloc:
                if not fits(gpu, start, nbytes):
                    break
            else:
                return start
    return None


def _ownership_edges(
    primitives: list[Primitive],
    start: dict[int, float],
    end: dict[int, float],
    initial: dict[int, float],
    capacity: float,
) -> dict[int, list[int]]:
    """For each allocation that only fits thanks to another model-stage's earlier release on
    that GPU, the latest such release, as GPU-ownership dependencies by primitive id."""
    frees: dict[int, list[tuple[float, float, Primitive]]] = {}
    allocs: dict[int, list[tuple[float, float]]] = {}
    for p in primitives:
        for gpu, nbytes in p.free.items():
            frees.setdefault(gpu, []).append((end[p.id], nbytes, p))
        for gpu, nbytes in p.alloc.items():
            allocs.setdefault(gpu, []).append((start[p.id], nbytes))
    ownership: dict[int, list[int]] = {}
    for p in primitives:
        at = start[p.id]
        for gpu in p.alloc:
            freed_before = [(t, b, q) for t, b, q in frees.get(gpu, []) if t <= at + EPS and q is not p]
            held = initial.get(gpu, 0.0) + sum(b for t, b in allocs[gpu] if t <= at + EPS)
            held -= sum(b for _, b, _ in freed_before)
            foreign = [(t, b, q) for t, b, q in freed_before if q.model_stage != p.model_stage]
            if foreign and held + max(b for _, b, _ in foreign) > capacity + EPS:
                latest = max(foreign, key=lambda item: item[0])[2]
                deps = ownership.setdefault(p.id, [])
                if latest.id not in deps:
                    deps.append(latest.id)
    return ownership


def improve_order(
    primitives: list[Primitive],
    evaluate: Callable[[list[int]], Schedule | None],
    order: list[int],
    makespan_s: float,
    iterations: int,
    seed: int,
    target_s: float,
) -> tuple[list[int], float] | None:
    """Local search over priority orders; the best order and makespan if it beats `makespan_s`.

    `evaluate(order)` schedules the primitives in that priority order and returns the
    schedule, or None on a deadlock. A move takes a primitive that
    started later than its data allowed and puts it just before one of the primitives that
    held its GPUs then (or, one time in four, moves a random primitive earlier). Moves
    that do not lengthen the schedule are kept, so the search crosses plateaus.
    Deterministic for a given seed.
    """
    rng = random.Random(seed)
    by_id = {p.id: p for p in primitives}
    current, best = list(order), None
    schedule = evaluate(current)
    if schedule is None:
        return None
    current_s = schedule.makespan_s
    if current_s < makespan_s - EPS:
        best = (list(current), current_s)
    for _ in range(iterations):
        candidate = _neighbour(current, schedule, by_id, rng)
        tried = evaluate(candidate)
        if tried is None or tried.makespan_s > current_s + EPS:
            continue  # the neighbourhood reads the current schedule's times
        span = tried.makespan_s
        if span < current_s - EPS and (best is None or span < best[1] - EPS):
            best = (list(candidate), span)
        current, current_s, schedule = candidate, span, tried
        if span <= target_s:
            break
    return best


def schedule_in_order(
    primitives: list[Primitive],
    initial: dict[int, float],
    capacity: float,
    order: list[int],
    stop_above: float = math.inf,
    ownership: bool = True,
) -> tuple[Schedule, dict[int, float]] | None:
    """`serial_schedule` with the priority given as a list of primitive ids."""
    rank = {pid: k for k, pid in enumerate(order)}
    return serial_schedule(primitives, initial, capacity, lambda p: (rank[p.id],), stop_above, ownership)


def _neighbour(order: list[int], schedule: Schedule, by_id: dict[int, Primitive], rng: random.Random) -> list[int]:
    """`order` with one primitive moved earlier (`schedule`: the schedule of `order`)."""
    position = {pid: k for k, pid in enumerate(order)}
    start, end = schedule.start, schedule.end
    delayed = [p for p in by_id.values() if start[p.id] > max((end[d] for d in p.deps), default=0.0) + EPS]
    moves = []
    if delayed and rng.random() < 0.75:
        p = rng.choice(delayed)
        gpus, p_start = set(p.gpus), start[p.id]
        moves = [
            position[q.id]
            for q in by_id.values()
            if q is not p
            and start[q.id] < p_start - EPS
            and end[q.id] >= p_start - EPS
            and gpus & set(q.gpus)
            and position[q.id] < position[p.id]
        ]
        if not moves:  # waited for memory: anything that started before it may be the holder
            moves = [k for k in range(position[p.id]) if start[order[k]] <= p_start]
    if moves:
        i, j = position[p.id], rng.choice(moves)
    else:
        i = rng.randrange(1, len(order))
        j = rng.randrange(0, i)
    out = list(order)
    out.insert(j, out.pop(i))
    return out

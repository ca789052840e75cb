"""The list scheduler: replay primitives in time on per-GPU memory and busy times.

A primitive starts when its data dependencies are done, its GPUs are idle and its
allocations fit in memory. When it had to wait for memory another model-stage released
on a GPU, the release becomes its GPU-ownership dependency. If nothing can start and
nothing runs, the model-stages waiting on each other's memory are reported.

Per-GPU state lives in lists indexed by GPU id (reading one costs a third of a dict
look-up): at 1024 GPUs one primitive copies or releases replicas on hundreds of GPUs.
Its checks are plain loops over them: on Python 3.11 a loop of list reads and stores
costs about half a C-level `map` of `list.__getitem__`/`__setitem__`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from nereus.solver.transition.primitives import Primitive, Schedule
from nereus.spec.stages import stage_order
from nereus.units import format_bytes

EPS = 1e-9

PriorityKey = Callable[[Primitive], tuple[float, ...]]


class Replay:
    """Mutable state of the list scheduler: bytes held, busy-until time and peak bytes per
    GPU id (lists sized by `bind`), the releases so far, and each started primitive's
    times and ownership dependencies (`schedule` returns them as a value).

    `usage` is what each GPU holds at the start (read, never changed: replays may share
    it); `peak` (when given) is a finished schedule's peak bytes per GPU, for a replay
    restored from a snapshot.
    """

    def __init__(self, usage: dict[int, float], capacity: float, peak: dict[int, float] | None = None) -> None:
        self.initial = usage
        self.capacity = capacity
        self.blocked_since: dict[int, float] = {}
        """Primitive id -> when it first waited for memory."""
        self.releases: list[Primitive] = []
        """Primitives that freed memory, in the order they finished (for ownership dependencies)."""
        self.start_s: dict[int, float] = {}
        """Primitive id -> when it started."""
        self.end_s: dict[int, float] = {}
        """Primitive id -> when it ends."""
        self.ownership: dict[int, list[int]] = {}
        """Primitive id -> its GPU-ownership dependencies (absent: none)."""
        self.held: list[float] = []
        self.busy_until: list[float] = []
        self.peak_held: list[float] = []  # -inf where nothing was ever allocated
        if peak:
            self.bind(max(peak) + 1)
            for gpu, nbytes in peak.items():
                self.peak_held[gpu] = nbytes

    def bind(self, num_gpus: int) -> None:
        """Make room for GPU ids below `num_gpus` (state so far is kept)."""
        start = len(self.held)
        size = max(num_gpus, max(self.initial, default=-1) + 1)
        more = size - start
        if more <= 0:
            return
        held = self.held
        held += [0.0] * more
        for gpu, nbytes in self.initial.items():  # a loop of list stores beats a C-level map of dict.get
            if gpu >= start:
                held[gpu] = nbytes
        self.busy_until += [0.0] * more
        self.peak_held += [-math.inf] * more

    def schedule(self) -> Schedule:
        """The times and ownership dependencies so far, as a value (later starts do not change it)."""
        return Schedule(dict(self.start_s), dict(self.end_s), dict(self.ownership))

    def usage(self, gpu: int) -> float:
        """Bytes `gpu` holds now."""
        return self.held[gpu] if gpu < len(self.held) else self.initial.get(gpu, 0.0)

    @property
    def peak(self) -> dict[int, float]:
        """Per GPU that ever allocated: the most bytes it held after an allocation."""
        return {gpu: nbytes for gpu, nbytes in enumerate(self.peak_held) if nbytes > -math.inf}

    def start(self, primitive: Primitive, now: float) -> None:
        end = now + primitive.duration_s
        self.start_s[primitive.id] = now
        self.end_s[primitive.id] = end
        busy, held, peak = self.busy_until, self.held, self.peak_held
        if primitive.duration_s > EPS:  # an instantaneous one leaves its (idle) GPUs idle
            for gpu in primitive.gpus:
                busy[gpu] = end
        for gpu, nbytes in primitive.alloc.items():
            now_held = held[gpu] = held[gpu] + nbytes
            if now_held > peak[gpu]:
                peak[gpu] = now_held
        waited = self.blocked_since.get(primitive.id)
        if waited is not None:
            self._add_ownership_deps(primitive, waited)

    def _add_ownership_deps(self, primitive: Primitive, waited: float) -> None:
        """Record, as ownership dependencies of `primitive`, the releases by other model-stages
        since it began to wait of the memory it allocates: per GPU, the last release there,
        in the order of the GPUs in its allocations. Looked up only for a primitive that
        waited, so releases (every Destroy and Merge) keep no per-GPU record."""
        unresolved = set(primitive.alloc)
        last_release: dict[int, Primitive] = {}  # GPU -> the last primitive that freed memory there
        for release in reversed(self.releases):
            found = unresolved.intersection(release.free)
            if found:
                last_release.update(dict.fromkeys(found, release))
                unresolved -= found
                if not unresolved:
                    break
        deps = self.ownership.get(primitive.id, [])
        ends = self.end_s
        for gpu in primitive.alloc:
            last = last_release.get(gpu)
            if last is None or last.model_stage == primitive.model_stage:
                continue
            if ends[last.id] >= waited and last.id not in deps:
                deps.append(last.id)
        if deps:
            self.ownership[primitive.id] = deps

    def finish(self, primitive: Primitive) -> None:
        if not primitive.free:
            return
        self.releases.append(primitive)
        held = self.held
        for gpu, nbytes in primitive.free.items():
            held[gpu] -= nbytes


def stage_index(primitive: Primitive) -> int:
    """Where the primitive's model-stage comes in a step (generation, inference, training)."""
    return stage_order(primitive.model_stage)


def release_first(primitive: Primitive) -> tuple[float, ...]:
    """The design's order: releases first, then generation -> inference -> training."""
    return (0 if primitive.releases else 1, stage_index(primitive), primitive.id)


def list_schedule(
    primitives: list[Primitive],
    replay: Replay,
    priority: PriorityKey = release_first,
    explain: bool = True,
    barriers: dict[int, list[int]] | None = None,
) -> list[str]:
    """Give every primitive a start and end in `replay` (`replay.schedule()`); return the
    blocking cycle if stuck (without `explain`, just a marker: naming the cycle costs more
    than scheduling).

    A ready primitive that cannot start waits on the GPUs that stop it (busy, or short of
    memory) and is looked at again only when something finishes there. `barriers` adds
    ordering edges (primitive id -> ids it must follow); they are recorded as ownership
    dependencies.
    """
    barriers = barriers or {}
    by_id = {p.id: p for p in primitives}
    for pid, parents in barriers.items():
        replay.ownership[pid] = sorted(set(replay.ownership.get(pid, ())) | set(parents))
    replay.bind(max((p.gpus[-1] for p in primitives if p.gpus), default=-1) + 1)
    key = {p.id: priority(p) for p in primitives}
    waiting = {p.id: len(p.deps) + len(barriers.get(p.id, ())) for p in primitives}
    dependents: dict[int, list[int]] = {}
    for p in primitives:
        for dep in (*p.deps, *barriers.get(p.id, ())) if barriers else p.deps:
            dependents.setdefault(dep, []).append(p.id)
    candidates = {p.id for p in primitives if not waiting[p.id]}
    state = _Waits(by_id, replay)
    now = 0.0
    while True:
        while candidates:
            candidates = state.try_start(sorted(candidates, key=key.__getitem__), now)
        if not state.running:
            if not state.blocked:
                return []
            stuck = [by_id[pid] for pid in sorted(state.blocked)]
            return blocking_cycle(stuck, primitives, replay) if explain else ["blocked"]
        now = state.running[0][0]
        while state.running and state.running[0][0] <= now + EPS:
            primitive = by_id[heapq.heappop(state.running)[1]]
            if primitive.duration_s > EPS:  # an instantaneous one freed (and woke) when it started
                replay.finish(primitive)
                candidates |= state.wake(primitive.gpus)
            for child in dependents.get(primitive.id, []):
                waiting[child] -= 1
                if not waiting[child]:
                    candidates.add(child)


@dataclass
class _Waits:
    """Ready primitives that could not start, indexed by the GPUs that stopped them."""

    by_id: dict[int, Primitive]
    replay: Replay
    blocked: set[int] = field(default_factory=set)
    waiters: dict[int, set[int]] = field(default_factory=dict)
    running: list[tuple[float, int]] = field(default_factory=list)

    def wake(self, gpus: Iterable[int]) -> set[int]:
        if not self.waiters:
            return set()
        woken: set[int] = set()
        waiters = self.waiters
        for gpu in waiters.keys() & gpus:  # in C: a large release touches many GPUs, few with waiters
            woken |= waiters.pop(gpu)
        return woken & self.blocked

    def try_start(self, order: list[int], now: float) -> set[int]:
        """Start what can start, in priority order; return ids an instantaneous free woke.

        One that cannot start waits on the GPUs that stop it and is looked at again when
        something finishes there: on every GPU short of memory, and, of its busy GPUs, on
        one per distinct finish time (a wide primitive need not wait on hundreds of GPUs
        to be looked at at the same moments).
        """
        replay, woken = self.replay, set()
        for pid in order:
            primitive = self.by_id[pid]
            if pid in replay.start_s:
                continue
            busy, lacking = self._stoppers(primitive, now + EPS)
            if busy or lacking:
                if lacking:
                    replay.blocked_since.setdefault(pid, now)
                self.blocked.add(pid)
                for gpu in busy + lacking:
                    self.waiters.setdefault(gpu, set()).add(pid)
                continue
            self.blocked.discard(pid)
            replay.start(primitive, now)
            heapq.heappush(self.running, (replay.end_s[pid], pid))
            if primitive.duration_s <= EPS:  # instantaneous: its frees count for what starts next
                replay.finish(primitive)
                woken |= self.wake(primitive.free)
        return woken

    def _stoppers(self, primitive: Primitive, horizon: float) -> tuple[list[int], list[int]]:
        """(one busy GPU per distinct finish time after `horizon`, GPUs short of memory);
        the common case (idle, room everywhere) is checked first, without building lists."""
        busy_until, held, limit = self.replay.busy_until, self.replay.held, self.replay.capacity + EPS
        lacking: list[int] = []
        alloc = primitive.alloc
        for gpu, nbytes in alloc.items():  # list reads in a loop: cheaper than C-level maps of __getitem__
            if held[gpu] + nbytes > limit:
                lacking = [gpu for gpu, nbytes in alloc.items() if held[gpu] + nbytes > limit]
                break
        last_gpu_per_end: dict[float, int] = {}  # busy GPUs only, by when they finish
        for gpu in primitive.gpus:
            end = busy_until[gpu]
            if end > horizon:
                last_gpu_per_end[end] = gpu
        return list(last_gpu_per_end.values()), lacking


def blocking_cycle(blocked: list[Primitive], primitives: list[Primitive], replay: Replay) -> list[str]:
    """Model-stages that wait for memory other model-stages hold, as a cycle if any."""
    import networkx as nx

    unfinished = [p for p in primitives if p.id not in replay.start_s]
    graph = nx.DiGraph()
    reasons = []
    for primitive in blocked:
        for gpu, nbytes in primitive.alloc.items():
            if replay.usage(gpu) + nbytes <= replay.capacity + EPS:
                continue
            holders = {p.model_stage for p in unfinished if gpu in p.free and p.model_stage != primitive.model_stage}
            for holder in sorted(holders):  # sorted: the same report in every process
                graph.add_edge(primitive.model_stage, holder, gpu=gpu)
            reasons.append(
                f"{primitive.model_stage} needs {format_bytes(nbytes)} more on GPU {gpu} "
                f"({format_bytes(replay.capacity - replay.usage(gpu))} free)"
            )
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return reasons[:3] or ["no primitive can start"]
    return [f"{a} waits for GPU {graph.edges[a, b]['gpu']} held by {b}" for a, b, *_ in cycle]

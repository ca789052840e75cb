"""The global transition DAG: every model-stage's local DAG, ordered on shared GPUs.

A list scheduler replays the primitives in time: a primitive starts when its data
dependencies are done, its GPUs are idle and its allocations fit in memory. Releases
(Destroy, Merge) go first; ties run generation, then inference, then training. When a
primitive had to wait for memory another model-stage released on a GPU, the release
becomes its GPU-ownership dependency. If nothing can start and nothing runs, the pair of
plans has no safe order: the model-stages waiting on each other's memory are reported.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import repeat
from typing import Literal, NamedTuple

import numpy as np

from nereus.cost.calibration import DEFAULT_CALIBRATION, Calibration
from nereus.cost.plan_cost import replica_state_bytes, resident_share, stage_room
from nereus.cost.vllm_engine import Engine, engine_rebuild_seconds
from nereus.errors import NereusError
from nereus.solver.transition.local import STAR_ROUNDS, Replicas, replica_dag, stamp
from nereus.solver.transition.order_search import GREEDY_TRIES, SEARCH_BUDGET, OrderSearch
from nereus.solver.transition.pair import plan_pair
from nereus.solver.transition.primitives import Emu, Layout, Primitive, Schedule, priced
from nereus.solver.transition.replay import (
    EPS,
    PriorityKey,
    Replay,
    list_schedule,
    release_first,
    stage_index,
)
from nereus.solver.transition.serial import (
    improve_order,
    pilot_order,
    schedule_in_order,
    serial_schedule,
    with_ownership,
)
from nereus.spec.cluster import Cluster
from nereus.spec.plan import Plan, StagePlan
from nereus.spec.stages import ACTOR_GENERATION, head_of, split
from nereus.units import format_bytes


@dataclass
class TransitionResult:
    """A transition DAG, its schedule and what it costs."""

    primitives: list[Primitive]
    """The global DAG (priced: each primitive's `duration_s` is set)."""
    schedule: Schedule
    """When each primitive runs and its GPU-ownership dependencies (with a blocking cycle:
    the partial schedule of the design's order, some primitives left unrun)."""
    makespan_s: float
    bytes_moved: float
    bytes_by_link: dict[str, float]
    lower_bound_bytes: float
    peak_extra_bytes: dict[int, float]
    capacity_bytes: float
    initial_bytes: dict[int, float]
    blocking_cycle: list[str] = field(default_factory=list)
    priority_rule: str = ""
    """The list-scheduling order that gave this schedule (see `priority_rules`)."""
    engine_ready_s: float = 0.0
    """When the last new actor/generation engine is ready (vLLM: start-up and weight load after
    the primitive that completes its replica, engines on their own GPUs in parallel, beside the
    rest of the schedule); 0 when none starts. `makespan_s` covers it."""

    @property
    def feasible(self) -> bool:
        return not self.blocking_cycle


def columns(entry: StagePlan) -> int:
    """The tensor-dimension width of the model-stage's EMU grid: tp, times ep with expert
    parallelism (an ep EMU's GPU `(s * ep + e) * tp + r` is column `e * tp + r` of stage s)."""
    return entry.tp * entry.ep


def ep_intermediate(a: StagePlan, b: StagePlan) -> Layout | None:
    """The intermediate layout a model-stage passes through when its transition changes an
    expert-parallel layout: (gcd of the tp, gcd of the pp) without expert parallelism, so
    every replica in between is whole copies over tensor ranks (the runtime's `emu_layout`
    reads them with ep 1); None when neither side has ep > 1 or only the GPUs change."""
    if max(a.ep, b.ep) == 1 or (a.tp, a.ep, a.pp) == (b.tp, b.ep, b.pp):
        return None
    return (math.gcd(a.tp, b.tp), math.gcd(a.pp, b.pp))


def state_replicas(entry: StagePlan) -> list[list[int]]:
    """The model-stage's copies of its state as a transition moves them: its EMUs, each a
    (columns, pp) grid of boxes, GPU `s * columns + r` holding box (s, r). Context parallelism's
    cp ranks hold the same weights (only the tokens differ), so an EMU with cp > 1 is cp copies,
    like dp replicas: cp rank c's copy is its GPUs (s * cp + c) * tp + r (`StagePlan.emus`). An
    EMU with ep > 1 is one copy whose tp x ep columns split the state (its experts by blocks
    over the ep ranks, the rest replicated: the boxes price each GPU at 1 / (tp * ep * pp), the
    runtime moves the real shards, docs/moe.md); with cp > 1 too it is refused."""
    if entry.ep > 1 and entry.cp > 1:
        raise NereusError(
            f"{entry.model_stage}: transitions of model-stages with both ep={entry.ep} and cp={entry.cp} are not "
            "planned yet; plan both sides with `nereus plan --expert-parallel off` to move this state"
        )
    if entry.cp == 1:
        return entry.emus
    tp, cp = entry.tp, entry.cp
    positions = [[(s * cp + c) * tp + r for s in range(entry.pp) for r in range(tp)] for c in range(cp)]
    return [[emu[i] for i in rank] for emu in entry.emus for rank in positions]


def plan_emus(plan: Plan, model_stages: list[str] | None = None) -> dict[str, list[Emu]]:
    """The EMUs of every model-stage in a plan (or of the ones named): its state's copies
    (`state_replicas`)."""
    make = functools.partial(tuple.__new__, Emu)  # Emu's own constructor, without a Python-level call per EMU
    return {
        entry.model_stage: list(
            map(
                make,
                zip(
                    repeat(entry.model_stage),
                    repeat(columns(entry)),
                    repeat(entry.pp),
                    map(tuple, state_replicas(entry)),
                ),
            )
        )
        for entry in plan.stages
        if model_stages is None or entry.model_stage in model_stages
    }


def _layout_of(entry: StagePlan) -> tuple[int, int, int, list[list[int]]]:
    return entry.tp, entry.ep, entry.pp, state_replicas(entry)


def _side(entry: StagePlan) -> Replicas:
    """A model-stage's layout and EMU GPU tuples (no Emu objects: most replicas never need one)."""
    return (columns(entry), entry.pp), list(map(tuple, state_replicas(entry)))


def _twins(changed: list[str], gpus_a: _PlanGpus, gpus_b: _PlanGpus) -> dict[str, str]:
    """Model-stage -> the first earlier one (itself no twin) with the very same EMUs in both
    plans: its local DAG is the other's, renamed (colocated inference model-stages)."""
    twin_of: dict[str, str] = {}
    originals: dict[tuple[str, str], str] = {}  # (A's, B's representative) -> the first model-stage with them
    for name in changed:
        key = (gpus_a.representative(name), gpus_b.representative(name))
        if key in originals:
            twin_of[name] = originals[key]
        else:
            originals[key] = name
    return twin_of


def _same_emus(one: StagePlan, other: StagePlan) -> bool:
    return (
        one.tp == other.tp
        and one.pp == other.pp
        and one.cp == other.cp
        and one.ep == other.ep
        and one.emus == other.emus
    )


def _state_sizes(plan: Plan, model_stages: Iterable[str], calibration: Calibration) -> dict[str, float]:
    """`replica_state_bytes` of each model-stage, priced once per model, head and kind of state
    (generation and inference hold the same parameters; only training adds more)."""
    sizes: dict[str, float] = {}
    priced: dict[tuple[str, str, bool], float] = {}
    for name in model_stages:
        role, stage = split(name)
        key = (plan.workload.model_name(role), head_of(role), stage == "training")
        if key not in priced:
            priced[key] = replica_state_bytes(plan, name, calibration)  # type: ignore[arg-type]
        sizes[name] = priced[key]
    return sizes


def _resident_sizes(plan_a: Plan, plan_b: Plan, sizes: dict[str, float], calibration: Calibration) -> dict[str, float]:
    """State bytes each model-stage keeps on GPUs in either plan (the cost model's resident
    share: an offloaded state sleeps in host memory, so it neither occupies GPUs nor moves
    between them; it loads in its new layout when it next runs, which the step already pays)."""
    entries_b = {e.model_stage: e for e in plan_b.stages}
    return {
        e.model_stage: sizes[e.model_stage]
        * max(resident_share(plan_a, e, calibration), resident_share(plan_b, entries_b[e.model_stage], calibration))
        for e in plan_a.stages
    }


def held_bytes(plan: Plan, sizes: dict[str, float]) -> dict[int, float]:
    """Bytes of model state on each GPU under a plan (every model-stage's EMU boxes)."""
    held = _PlanGpus(plan).held(sizes)
    return {gpu: nbytes for gpu, nbytes in enumerate(held.tolist()) if nbytes}


class _PlanGpus:
    """Model-stages' GPU ids in one plan (every one, or those named), EMU after EMU,
    flattened once (in C) and shared by the held-bytes, over-capacity and lower-bound
    computations. Model-stages with the very same layout and EMUs (colocated inference
    model-stages) share one flattened copy: comparing the plan's lists costs a third of
    flattening them."""

    def __init__(self, plan: Plan, model_stages: list[str] | None = None) -> None:
        entries = [e for e in plan.stages if model_stages is None or e.model_stage in model_stages]
        self.num_gpus = plan.cluster.num_gpus
        self.layouts: dict[str, tuple[int, int]] = {entry.model_stage: (columns(entry), entry.pp) for entry in entries}
        self.same_as: dict[str, str] = {}
        """Model-stage -> the first one here with the very same layout and EMUs (absent: itself)."""
        own: list[StagePlan] = []
        for entry in entries:
            original = next((other for other in own if _same_emus(other, entry)), None)
            if original is None:
                own.append(entry)
            else:
                self.same_as[entry.model_stage] = original.model_stage
        counts = [entry.replica_size * len(entry.emus) for entry in own]  # every GPU of the state's copies
        every = itertools.chain.from_iterable(itertools.chain.from_iterable(entry.emus for entry in own))
        flat = np.fromiter(every, np.int64, count=sum(counts))
        bounds = itertools.pairwise(itertools.accumulate(counts, initial=0))
        self.gpus: dict[str, np.ndarray] = {
            entry.model_stage: flat[lo:hi] for entry, (lo, hi) in zip(own, bounds, strict=True)
        }
        for name, first in self.same_as.items():
            self.gpus[name] = self.gpus[first]
        self.counts = [self.gpus[entry.model_stage].size for entry in entries]
        self.flat = flat if not self.same_as else np.concatenate([self.gpus[entry.model_stage] for entry in entries])

    def representative(self, model_stage: str) -> str:
        return self.same_as.get(model_stage, model_stage)

    def held(self, sizes: dict[str, float], model_stages: list[str] | None = None) -> np.ndarray:
        """`held_bytes` as an array over GPU ids (one bincount over the model-stages' GPUs),
        counting every model-stage here or only those named."""
        names = list(self.layouts) if model_stages is None else [n for n in self.layouts if n in model_stages]
        gpus, counts = self.flat, self.counts
        if len(names) < len(self.layouts):
            gpus = np.concatenate([self.gpus[name] for name in names] or [np.zeros(0, np.int64)])
            counts = [self.gpus[name].size for name in names]
        boxes = [sizes[name] / (self.layouts[name][0] * self.layouts[name][1]) for name in names]
        return np.bincount(gpus, np.repeat(boxes, counts), minlength=self.num_gpus)


def primitive_duration(primitive: Primitive, cluster: Cluster, calibration: Calibration) -> float:
    """Communicator set-up plus the slowest destination's incoming transfers."""
    return primitive_durations([primitive], cluster, calibration)[0]


def primitive_durations(primitives: list[Primitive], cluster: Cluster, calibration: Calibration) -> list[float]:
    """`primitive_duration` of each primitive (the links are looked up once)."""
    return _price(primitives, cluster, calibration)[0]


def link_bytes(primitives: list[Primitive], cluster: Cluster) -> dict[str, float]:
    """Bytes the primitives move within nodes and across them."""
    return _price(primitives, cluster, DEFAULT_CALIBRATION)[1]  # bytes do not depend on the calibration


def _price(
    primitives: list[Primitive], cluster: Cluster, calibration: Calibration
) -> tuple[list[float], dict[str, float]]:
    """Each primitive's duration and the bytes moved within nodes and across them: one
    pass over the transfers (a 1024-GPU transition has about a thousand)."""
    per_node = cluster.gpus_per_node
    (intra_bandwidth, intra_latency), (inter_bandwidth, inter_latency) = (
        calibration.link(cluster, False),
        calibration.link(cluster, True),
    )
    setup = calibration.communicator_setup_s
    durations, intra, inter = [], 0.0, 0.0
    for primitive in primitives:
        incoming: dict[int, float] = {}
        for src, dst, nbytes in primitive.transfers:
            if src // per_node != dst // per_node:
                inter += nbytes
                incoming[dst] = incoming.get(dst, 0.0) + inter_latency + nbytes / inter_bandwidth
            else:
                intra += nbytes
                incoming[dst] = incoming.get(dst, 0.0) + intra_latency + nbytes / intra_bandwidth
        durations.append((setup if primitive.new_groups else 0.0) + max(incoming.values(), default=0.0))
    return durations, {"intra_node": intra, "inter_node": inter}


def lower_bound_bytes(plan_a: Plan, plan_b: Plan, changed: list[str], sizes: dict[str, float]) -> float:
    """Bytes every GPU must end up holding (in B) that it does not hold yet (in A)."""
    return _lower_bound(_PlanGpus(plan_a), _PlanGpus(plan_b), changed, sizes)


def _lower_bound(gpus_a: _PlanGpus, gpus_b: _PlanGpus, changed: list[str], sizes: dict[str, float]) -> float:
    """`lower_bound_bytes` from both plans' GPU arrays: per B GPU, its box less the part of
    it the GPU's A box (if any) covers. GPU `s * tp + r` of an EMU holds box (s, r).
    Model-stages with the very same EMUs in both plans share the covered fraction."""
    total = 0.0
    position_a = np.empty(gpus_a.num_gpus, np.int64)
    covered_of: dict[tuple[str, str], float] = {}  # (A's, B's representative) -> boxes B needs that A holds
    for name in changed:
        layout_a, layout_b = gpus_a.layouts[name], gpus_b.layouts[name]
        on_b, per_replica = gpus_b.gpus[name], layout_b[0] * layout_b[1]
        key = (gpus_a.representative(name), gpus_b.representative(name))
        if key not in covered_of:
            covered_of[key] = _covered_boxes(gpus_a.gpus[name], on_b, layout_a, layout_b, position_a)
        if layout_a == layout_b:  # whole boxes: count them, then size them
            total += sizes[name] / per_replica * (on_b.size - covered_of[key])
        else:
            total += sizes[name] * (on_b.size / per_replica - covered_of[key])
    return total


def _covered_boxes(
    on_a: np.ndarray, on_b: np.ndarray, layout_a: Layout, layout_b: Layout, position_a: np.ndarray
) -> float:
    """How much of B's boxes the GPUs already hold in A: in boxes of B's layout when the
    layouts are equal (then a box is covered only by the same box, whole), else in
    fractions of the whole state. `position_a` is scratch space, one entry per GPU id."""
    (tp_a, pp_a), (tp_b, pp_b) = layout_a, layout_b
    position_a.fill(-1)
    position_a[on_a] = np.arange(len(on_a)) % (tp_a * pp_a)
    index_a = position_a[on_b]
    if layout_a == layout_b:
        return int(np.count_nonzero(index_a == np.arange(len(on_b)) % (tp_b * pp_b)))
    stage_a, rank_a = np.divmod(index_a, tp_a)
    stage_b, rank_b = np.divmod(np.arange(len(on_b)) % (tp_b * pp_b), tp_b)
    rows = np.minimum((stage_a + 1) / pp_a, (stage_b + 1) / pp_b) - np.maximum(stage_a / pp_a, stage_b / pp_b)
    cols = np.minimum((rank_a + 1) / tp_a, (rank_b + 1) / tp_b) - np.maximum(rank_a / tp_a, rank_b / tp_b)
    covered = np.where(index_a >= 0, np.maximum(rows, 0.0) * np.maximum(cols, 0.0), 0.0)
    return float(covered.sum())


Effort = Literal["design-rule", "list", "full"]


def _tail_lengths(primitives: list[Primitive]) -> dict[int, float]:
    """Longest chain of durations from each primitive to the end of its local DAG."""
    tail: dict[int, float] = {}
    ordered = primitives
    if any(a.id > b.id for a, b in itertools.pairwise(primitives)):
        ordered = sorted(primitives, key=lambda q: q.id)
    for p in reversed(ordered):  # a dependency always has a smaller id: children come first
        tail[p.id] = tail.get(p.id, 0.0) + p.duration_s
        for dep in p.deps:
            if tail.get(dep, 0.0) < tail[p.id]:
                tail[dep] = tail[p.id]
    return tail


def priority_rules(primitives: list[Primitive], tail: dict[int, float] | None = None) -> dict[str, PriorityKey]:
    """The orders the list scheduler tries; the best schedule wins.

    `release-first` is the design's rule (releases first, then generation -> inference ->
    training); the critical-path rules start long chains early, which matters when
    model-stages share GPUs; `net-releasers-first` lets model-stages that shrink go
    before those that grow, which avoids many hold-and-wait deadlocks.
    """
    tail = tail if tail is not None else _tail_lengths(primitives)
    net: dict[str, float] = {}  # bytes a model-stage frees minus bytes it allocates
    for p in primitives:
        net[p.model_stage] = net.get(p.model_stage, 0.0) + sum(p.free.values()) - sum(p.alloc.values())
    return {
        "release-first": release_first,
        "release-then-critical-path": lambda p: (0 if p.releases else 1, -tail[p.id], p.id),
        "critical-path": lambda p: (-tail[p.id], p.id),
        "release-then-late-stages": lambda p: (0 if p.releases else 1, -stage_index(p), -tail[p.id], p.id),
        "net-releasers-first": lambda p: (-net[p.model_stage], 0 if p.releases else 1, p.id),
    }


#: Extra seeded runs with perturbed critical-path priorities (biased random sampling);
#: fewer on large DAGs, where each run costs more.
RANDOM_RESTARTS = 12
RANDOM_RESTARTS_LARGE = 2
LARGE_DAG = 300


def _perturbed_rules(
    primitives: list[Primitive], count: int, tail: dict[int, float]
) -> Iterator[tuple[str, PriorityKey]]:
    """Critical-path rules with seeded noise, built one at a time (most builds never need them)."""
    rng = random.Random(len(primitives))  # deterministic: the same DAG gets the same schedule
    for k in range(count):
        noise = {p.id: 1.0 + 0.5 * rng.random() for p in primitives}
        releases_first = k % 2 == 0

        def rule(p: Primitive, n: dict[int, float] = noise, r: bool = releases_first) -> tuple[float, ...]:
            return (0 if (r and p.releases) else 1, -tail[p.id] * n[p.id], p.id)

        yield f"perturbed-{k}", rule


def makespan_lower_bound(primitives: list[Primitive], tail: dict[int, float] | None = None) -> float:
    """No schedule is shorter than the longest dependency chain or the busiest GPU's work."""
    timed = [p for p in primitives if p.duration_s > 0.0]
    busiest = 0.0
    if timed:  # per-GPU sums in one bincount: large DAGs touch thousands of GPU slots
        gpus = np.fromiter(itertools.chain.from_iterable(p.gpus for p in timed), np.int64)
        work = np.repeat([p.duration_s for p in timed], [len(p.gpus) for p in timed])
        busiest = float(np.bincount(gpus, work).max()) if len(gpus) else 0.0
    chain = max((tail if tail is not None else _tail_lengths(primitives)).values(), default=0.0)
    return max(chain, busiest)


#: DAGs up to this size also get the serial schedule generator (it is quadratic) and,
#: when every order deadlocks, the exhaustive order search (exponential in the worst case).
SERIAL_LIMIT = 100
#: The local search over orders runs on DAGs up to IMPROVE_LIMIT primitives when the best
#: schedule is further than IMPROVE_ABOVE_BOUND above the makespan lower bound (closer than
#: that, it is that close to the optimum already): IMPROVE_RESTARTS searches of IMPROVE_STEPS moves.
IMPROVE_LIMIT = 60
IMPROVE_ABOVE_BOUND = 0.05
IMPROVE_RESTARTS = 3
IMPROVE_STEPS = 100
#: DAGs up to this size that are still that far above the bound after all of the above get
#: the pilot method (`serial.pilot_order`) under each of PILOT_RULES: memory-tight ones
#: whose order the local search does not reach (gap instances 25, 65, 77 and 79 went from
#: 7-29% above the CP-SAT optimum to within 0.1%; over 160 instances the heuristic took
#: about 45% longer in all, 0.4 s more on the slowest).
PILOT_LIMIT = 40
PILOT_RULES = ("release-first", "release-then-critical-path", "release-then-late-stages", "net-releasers-first")


@dataclass
class _Candidate:
    """One safe schedule, kept while other priority orders are tried."""

    rule: str
    schedule: Schedule
    peak: dict[int, float]
    order: list[int]
    """A priority order (primitive ids) that reproduces the schedule: by start, releases first."""

    @property
    def makespan_s(self) -> float:
        return self.schedule.makespan_s

    @classmethod
    def of(cls, rule: str, primitives: list[Primitive], schedule: Schedule, peak: dict[int, float]) -> _Candidate:
        start, end = schedule.start, schedule.end
        order = [p.id for p in sorted(primitives, key=lambda p: (start[p.id], 0 if p.releases else 1, end[p.id], p.id))]
        return cls(rule, schedule, dict(peak), order)

    def outcome(self, initial: dict[int, float], capacity: float) -> Scheduled:
        return Scheduled(self.schedule, Replay(initial, capacity, peak=dict(self.peak)), [], self.rule)


class Scheduled(NamedTuple):
    """What `schedule_best` found: the schedule, the replay that holds its peak bytes per
    GPU (and the capacity), the blocking cycle (empty when safe) and the rule that gave it."""

    schedule: Schedule
    replay: Replay
    cycle: list[str]
    rule: str


def _replayed(
    primitives: list[Primitive],
    initial: dict[int, float],
    capacity: float,
    priority: PriorityKey = release_first,
    explain: bool = False,
    barriers: dict[int, list[int]] | None = None,
) -> Scheduled:
    """`list_schedule` on a fresh replay, as a `Scheduled` (rule left empty)."""
    replay = Replay(initial, capacity)
    cycle = list_schedule(primitives, replay, priority, explain=explain, barriers=barriers)
    return Scheduled(replay.schedule(), replay, cycle, "")


def schedule_best(
    primitives: list[Primitive], initial: dict[int, float], capacity: float, effort: Effort = "full"
) -> Scheduled:
    """Run the list scheduler under each priority rule (and, on small DAGs, the serial
    generator too); keep the shortest safe schedule, stopping at the lower bound.

    The design's rule goes first and, when its schedule meets the lower bound (the common
    case), nothing else is built: no other rule, no candidate kept. `effort` says how far to
    go when schedules deadlock: the design's rule alone, every priority rule, or (full) the
    serial generator, whole model-stages in sequence and the exhaustive order search too.
    Each try builds its own schedule; the primitives are never changed.
    """
    restarts = RANDOM_RESTARTS if len(primitives) <= LARGE_DAG else RANDOM_RESTARTS_LARGE
    tail = _tail_lengths(primitives)
    chain = max(tail.values(), default=0.0) * (1 + 1e-9)  # the bound's cheap half
    tried = _replayed(primitives, initial, capacity)
    best: _Candidate | None = None
    lower = chain
    if not tried.cycle:
        makespan = tried.schedule.makespan_s
        if makespan > chain:  # only then are the per-GPU sums worth computing
            lower = makespan_lower_bound(primitives, tail) * (1 + 1e-9)
        if makespan <= lower:
            return tried._replace(rule="release-first")
        best = _Candidate.of("release-first", primitives, tried.schedule, tried.replay.peak)
    elif effort == "design-rule":
        return tried._replace(cycle=["the design's priority order deadlocks"], rule="release-first")
    else:
        lower = makespan_lower_bound(primitives, tail) * (1 + 1e-9)
    rules = priority_rules(primitives, tail)
    for name, rule in itertools.chain(list(rules.items())[1:], _perturbed_rules(primitives, restarts, tail)):
        rules[name] = rule
        tried = _replayed(primitives, initial, capacity, rule)
        if tried.cycle:
            continue
        if best is None or tried.schedule.makespan_s < best.makespan_s - EPS:
            best = _Candidate.of(name, primitives, tried.schedule, tried.replay.peak)
            if best.makespan_s <= lower:
                return best.outcome(initial, capacity)
    if best is None and effort != "full":
        return tried._replace(cycle=["every priority order deadlocks"], rule="release-first")
    if len(primitives) <= SERIAL_LIMIT:
        best = _serial_best(primitives, initial, capacity, rules, best, lower)
    if best is not None:
        return best.outcome(initial, capacity)
    sequential = _one_model_stage_at_a_time(primitives, initial, capacity)
    if sequential is not None:  # a safe but serial schedule: improve it like any other
        candidate = _Candidate.of(sequential.rule, primitives, sequential.schedule, sequential.replay.peak)
        return _polished(primitives, initial, capacity, candidate, lower).outcome(initial, capacity)
    found: list[int] | str = "too large"
    if len(primitives) <= SERIAL_LIMIT:
        found = OrderSearch(primitives, initial, capacity).run(GREEDY_TRIES, SEARCH_BUDGET)
    if not isinstance(found, str):  # an order fits one at a time: pack it, then improve it
        packed = schedule_in_order(primitives, initial, capacity, found)
        assert packed is not None  # placing an order that fits one at a time never deadlocks
        candidate = _Candidate.of("order search", primitives, *packed)
        return _polished(primitives, initial, capacity, candidate, lower).outcome(initial, capacity)
    tried = _replayed(primitives, initial, capacity, explain=True)
    verdict = {
        "infeasible": "no order of these primitives fits in memory (exhaustive search)",
        "undecided": f"no order found that fits in memory (search stopped after {SEARCH_BUDGET} states)",
        "too large": f"no order found that fits in memory (no exhaustive search above {SERIAL_LIMIT} primitives)",
    }[found]
    return tried._replace(cycle=[*tried.cycle, verdict], rule="release-first")


def _serial_best(
    primitives: list[Primitive],
    initial: dict[int, float],
    capacity: float,
    rules: dict[str, PriorityKey],
    best: _Candidate | None,
    lower: float,
) -> _Candidate | None:
    """The serial generator under every rule, and in the best schedule's start order."""
    if best is not None:
        rank = {pid: k for k, pid in enumerate(best.order)}
        rules = {"left-shifted": lambda p: (rank[p.id],), **rules}
    for name, rule in rules.items():
        placed = serial_schedule(primitives, initial, capacity, rule)
        if placed is None:
            continue
        makespan = placed[0].makespan_s
        if best is None or makespan < best.makespan_s - EPS:
            best = _Candidate.of(f"serial: {name}", primitives, *placed)
            if makespan <= lower:
                return best
    return best if best is None else _polished(primitives, initial, capacity, best, lower)


def _polished(
    primitives: list[Primitive], initial: dict[int, float], capacity: float, best: _Candidate, lower: float
) -> _Candidate:
    """`best` after the local search over orders and then, if still far from the bound, the pilot method."""
    return _with_pilot(primitives, initial, capacity, _improve(primitives, initial, capacity, best, lower), lower)


def _with_pilot(
    primitives: list[Primitive], initial: dict[int, float], capacity: float, best: _Candidate, lower: float
) -> _Candidate:
    """`best`, or a shorter schedule from pilot runs under each of `PILOT_RULES` (then
    improved by the local search), on DAGs up to `PILOT_LIMIT` primitives still more than
    `IMPROVE_ABOVE_BOUND` above the bound."""
    if len(primitives) > PILOT_LIMIT or best.makespan_s <= lower * (1 + IMPROVE_ABOVE_BOUND):
        return best
    rules = priority_rules(primitives)
    pilot: tuple[float, list[int], str] | None = None
    for name in PILOT_RULES:  # which rule completes a prefix well differs from DAG to DAG
        found = pilot_order(primitives, initial, capacity, rules[name])
        if found is not None and found[0] < (pilot[0] if pilot else best.makespan_s) - EPS:
            pilot = (*found, name)
    if pilot is None:
        return best
    placed = schedule_in_order(primitives, initial, capacity, pilot[1])
    assert placed is not None  # the order a pilot run placed, placed again
    candidate = _Candidate.of(f"pilot: {pilot[2]}", primitives, *placed)
    return _improve(primitives, initial, capacity, candidate, lower)


def _improve(
    primitives: list[Primitive], initial: dict[int, float], capacity: float, best: _Candidate, lower: float
) -> _Candidate:
    """Local search over orders from the best schedule's start order, when it is far from the bound.

    Each order is scheduled by both generators (the list scheduler and the serial one)
    and scored by the shorter safe schedule: on memory-tight DAGs many orders deadlock
    in one of them but not in the other.
    """
    if len(primitives) > IMPROVE_LIMIT or best.makespan_s <= lower * (1 + IMPROVE_ABOVE_BOUND):
        return best

    seen: dict[tuple[int, ...], _Both | None] = {}

    def scheduled(order: list[int]) -> _Both | None:
        """`_schedule_both`, once per distinct order (the searches revisit orders often)."""
        key = tuple(order)
        if key not in seen:
            seen[key] = _schedule_both(primitives, initial, capacity, order)
        return seen[key]

    def evaluate(order: list[int]) -> Schedule | None:
        both = scheduled(order)
        return None if both is None else both.schedule

    order = best.order
    for seed in range(IMPROVE_RESTARTS):
        found = improve_order(primitives, evaluate, order, best.makespan_s, IMPROVE_STEPS, seed, lower)
        if found is not None:
            order = found[0]
            both = scheduled(order)
            assert both is not None  # the same order scheduled before
            schedule = with_ownership(both.schedule, primitives, initial, capacity) if both.serial else both.schedule
            best = _Candidate.of(f"local search {seed}", primitives, schedule, both.peak)
    return best


class _Both(NamedTuple):
    """What `_schedule_both` keeps: the shorter schedule, its peak bytes per GPU, and whether
    the serial generator made it (then its GPU-ownership dependencies are not added yet:
    `serial.with_ownership`; the local search reads only times and discards most orders)."""

    schedule: Schedule
    peak: dict[int, float]
    serial: bool


def _schedule_both(
    primitives: list[Primitive], initial: dict[int, float], capacity: float, order: list[int]
) -> _Both | None:
    """Schedule `order` with the list scheduler and the serial generator; the shorter safe
    schedule (the serial one on a tie) and its peak bytes per GPU (None when both deadlock).
    The serial generator stops once it must end more than EPS after the list scheduler's
    safe schedule: it would lose."""
    rank = {pid: k for k, pid in enumerate(order)}

    def key(p: Primitive) -> tuple[float, ...]:
        return (rank[p.id],)

    listed = _replayed(primitives, initial, capacity, key)
    loses_above = math.inf if listed.cycle else listed.schedule.makespan_s + EPS
    serial = schedule_in_order(primitives, initial, capacity, order, loses_above, ownership=False)
    if serial is not None and (listed.cycle or serial[0].makespan_s <= listed.schedule.makespan_s + EPS):
        return _Both(*serial, serial=True)
    if listed.cycle:
        return None
    return _Both(listed.schedule, listed.replay.peak, serial=False)


def _one_model_stage_at_a_time(
    primitives: list[Primitive], initial: dict[int, float], capacity: float
) -> Scheduled | None:
    """Fallback: whole model-stages one after another, joined by barrier edges.

    The memory a set of finished model-stages leaves does not depend on their order, so
    a depth-first search over sets (at most 2^7) finds a sequence whenever one exists in
    which each model-stage, scheduled alone, fits. None if there is none.
    """
    by_stage: dict[str, list[Primitive]] = {}
    for p in primitives:
        by_stage.setdefault(p.model_stage, []).append(p)
    delta: dict[str, dict[int, float]] = {}  # per model-stage: bytes it leaves on each GPU
    for name, group in by_stage.items():
        change = delta.setdefault(name, {})
        for p in group:
            for gpu, nbytes in p.alloc.items():
                change[gpu] = change.get(gpu, 0.0) + nbytes
            for gpu, nbytes in p.free.items():
                change[gpu] = change.get(gpu, 0.0) - nbytes
    order = _stage_order(by_stage, delta, initial, capacity, frozenset(), set())
    if order is None:
        return None
    barriers = {
        p.id: [q.id for q in by_stage[before]]
        for before, after in itertools.pairwise(order)
        for p in by_stage[after]
        if not p.deps
    }
    tried = _replayed(primitives, initial, capacity, barriers=barriers)
    if tried.cycle:
        return None
    return tried._replace(rule="one-model-stage-at-a-time: " + " > ".join(order))


def _stage_order(
    by_stage: dict[str, list[Primitive]],
    delta: dict[str, dict[int, float]],
    initial: dict[int, float],
    capacity: float,
    done: frozenset[str],
    dead_ends: set[frozenset[str]],
) -> list[str] | None:
    if len(done) == len(by_stage):
        return []
    if done in dead_ends:
        return None
    usage = dict(initial)
    for name in done:
        for gpu, change in delta[name].items():
            usage[gpu] = usage.get(gpu, 0.0) + change
    for name in sorted(set(by_stage) - done, key=lambda n: (sum(delta[n].values()), n)):  # shrinking first
        if list_schedule(by_stage[name], Replay(usage, capacity), explain=False):
            continue
        rest = _stage_order(by_stage, delta, initial, capacity, done | {name}, dead_ends)
        if rest is not None:
            return [name, *rest]
    dead_ends.add(done)
    return None


def _extra(replay: Replay, held_a: np.ndarray) -> dict[int, float]:
    """Per GPU that allocated (sorted), how far its peak rises above what it held at the
    start (over the replay's per-GPU list in one array pass)."""
    peak = np.array(replay.peak_held)
    allocated = np.flatnonzero(peak > -np.inf)
    rise = np.maximum(0.0, peak[allocated] - held_a[allocated])
    return dict(zip(allocated.tolist(), rise.tolist(), strict=True))


def _over_capacity(before: np.ndarray, after: np.ndarray, capacity: float) -> list[str]:
    """Plans whose model states alone overflow a GPU (bytes per GPU id): no order can help."""
    problems = []
    for label, held in (("plan A", before), ("plan B", after)):
        problems += [
            f"{label} holds {format_bytes(held[gpu])} of model state on GPU {gpu} "
            f"(room for model state: {format_bytes(capacity)}, the usable capacity less the workspace)"
            for gpu in np.flatnonzero(held > capacity * (1 + 1e-9))[:3].tolist()
        ]
    return problems


def _shape(primitives: list[Primitive]) -> list[tuple[object, ...]]:
    return [(p.kind, p.reads, p.writes, tuple(p.deps)) for p in primitives]


def _copies_a_new_replica(primitives: list[Primitive]) -> bool:
    """Some Extend copies from a replica another Extend made: the copies grew as a doubling
    tree (without `unswap`, the only way a copy reads a replica that is new)."""
    new = {emu for p in primitives if p.kind == "extend" for emu in p.adds}
    return any(emu in new for p in primitives if p.kind == "extend" for emu in p.copies_from)


#: Local-DAG variants (star_rounds, unswap, batched copies) in the order tried; see `local_dag`.
DAG_SHAPES: tuple[tuple[int | None, bool, bool], ...] = (
    (STAR_ROUNDS, False, True),
    (None, False, True),
    (STAR_ROUNDS, True, True),
    (None, True, True),
    (STAR_ROUNDS, False, False),
    (None, False, False),
    (STAR_ROUNDS, True, False),
    (None, True, False),
)


def _schedule_shapes(
    shapes: Iterable[list[Primitive]], initial: dict[int, float], capacity: float
) -> tuple[Scheduled, list[Primitive]]:
    """The first DAG shape that schedules, trying every shape at one effort before any gets
    the next; when none does, the first shape's full failure report."""
    tried: list[list[Primitive]] = []
    for primitives in shapes:  # built one by one: the first usually schedules at once
        if any(_shape(primitives) == _shape(other) for other in tried):
            continue
        tried.append(primitives)
        found = schedule_best(primitives, initial, capacity, "design-rule")
        if not found.cycle:
            return found, primitives
    failure: Scheduled | None = None
    for effort in ("list", "full"):
        for primitives in tried:
            found = schedule_best(primitives, initial, capacity, effort)
            if not found.cycle:
                return found, primitives
            if effort == "full" and failure is None:
                failure = found
    assert failure is not None
    return failure, tried[0]


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector, and resume it if it was running.

    A build allocates tens of thousands of short-lived objects with no reference cycles
    among them (primitives refer to each other by id), so each collection the allocations
    trigger frees nothing, yet walks the young objects and, now and then, every object of
    the caller's heap (in `nereus run`, the controller's and torch's): about a tenth of
    the build at 1024 GPUs. Reference counting still frees everything as usual.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def build_transition(
    plan_a: Plan, plan_b: Plan, calibration: Calibration | None = None, engine: Engine = "nereus"
) -> TransitionResult:
    """The scheduled global transition DAG from plan A to plan B. Plans on clusters that
    differ only in node count run on the larger one (`pair.plan_pair`, which refuses any
    other pair of clusters, and plans that run other model-stages). `engine`: the generation
    engine of actor/generation; under vLLM every new replica also starts an engine and loads
    its weights (`engine_rebuilds`)."""
    pair = plan_pair(plan_a, plan_b)
    plan_a, plan_b = pair.source, pair.target
    with _cyclic_gc_paused():
        return _build_transition(plan_a, plan_b, calibration, engine)


def engine_rebuilds(primitives: list[Primitive], plan: Plan, calibration: Calibration, engine: Engine) -> list[float]:
    """Seconds after each primitive ends until the actor/generation replicas it completes are ready
    to generate (`nereus.cost.vllm_engine.engine_rebuild_seconds`: engine start-up plus weight
    load under vLLM, nothing under nereus's own engine); several replicas start their engines in
    parallel. Only `plan`'s own replicas count: the intermediate ones a split makes on the way
    run no engine."""
    if engine == "nereus":
        return [0.0] * len(primitives)  # no engine to start (and large transitions skip the loop)
    final = set(plan_emus(plan, [ACTOR_GENERATION]).get(ACTOR_GENERATION, []))
    out = []
    for primitive in primitives:
        layouts = {emu.layout for emu in primitive.adds if emu in final}
        out.append(max((engine_rebuild_seconds(plan, calibration, tp, pp, engine) for tp, pp in layouts), default=0.0))
    return out


def _build_transition(
    plan_a: Plan, plan_b: Plan, calibration: Calibration | None, engine: Engine = "nereus"
) -> TransitionResult:
    calibration = DEFAULT_CALIBRATION if calibration is None else calibration  # building one costs ~0.1 ms
    entries_a: dict[str, StagePlan] = {entry.model_stage: entry for entry in plan_a.stages}
    changed_b = [e for e in plan_b.stages if _layout_of(e) != _layout_of(entries_a[e.model_stage])]
    changed: list[str] = [entry.model_stage for entry in changed_b]
    sizes = _resident_sizes(plan_a, plan_b, _state_sizes(plan_b, entries_a, calibration), calibration)
    gpus_a, gpus_b = _PlanGpus(plan_a), _PlanGpus(plan_b, changed)  # B's unchanged model-stages are A's
    held_a = gpus_a.held(sizes)
    on_gpus = np.flatnonzero(held_a)
    initial = dict(zip(on_gpus.tolist(), held_a[on_gpus].tolist(), strict=True))
    capacity = stage_room(plan_b.cluster, calibration)
    twin_of = _twins(changed, gpus_a, gpus_b)
    sides: dict[str, tuple[Replicas, Replicas]] = {
        e.model_stage: (_side(entries_a[e.model_stage]), _side(e)) for e in changed_b if e.model_stage not in twin_of
    }
    through: dict[str, Layout | None] = {e.model_stage: ep_intermediate(entries_a[e.model_stage], e) for e in changed_b}
    node_size = plan_b.cluster.gpus_per_node
    moved_by_shape: dict[int, dict[str, float]] = {}  # id of a shape's primitive list -> bytes by link class

    def dag(star_rounds: int | None, unswap: bool, batch: bool) -> list[Primitive]:
        primitives: list[Primitive] = []
        built: dict[str, list[Primitive]] = {}  # local DAGs of the model-stages that are no twins
        for name in changed:
            if name in twin_of:  # the same EMUs as a model-stage done already: its DAG, renamed
                local = stamp(built[twin_of[name]], name, sizes[name], len(primitives))
            else:
                batch_nodes = node_size if batch else None
                local = replica_dag(
                    name, sizes[name], *sides[name], len(primitives), star_rounds, unswap, batch_nodes, through[name]
                )
                built[name] = local
            primitives += local
        durations, moved = _price(primitives, plan_b.cluster, calibration)
        primitives = priced(primitives, durations)
        moved_by_shape[id(primitives)] = moved
        return primitives

    def shapes() -> Iterator[list[Primitive]]:
        """When a DAG deadlocks, other shapes: tree-shaped copies hold intermediate replicas
        longer (copy from the sources only), replicas trading GPUs need two boxes at once
        (copy those afresh), single copies wait for fewer GPUs than batched ones (only
        tried when some copies were batched). Built lazily: the first shape usually
        schedules at once."""
        batched = False
        treeless: set[bool] = set()  # `batch` values whose star-shaped DAG (no unswap) grew no copy tree
        for star_rounds, unswap, batch in DAG_SHAPES:
            if not (batch or batched) or (star_rounds is None and not unswap and batch in treeless):
                continue  # (a star shape without a tree is the very DAG star_rounds=None builds)
            primitives = dag(star_rounds, unswap, batch)
            batched |= batch and any(len(p.adds) > 1 for p in primitives if p.kind == "extend")
            yield primitives
            if star_rounds is not None and not unswap and not _copies_a_new_replica(primitives):
                treeless.add(batch)  # checked only when a next shape is wanted

    (schedule, replay, cycle, rule), primitives = _schedule_shapes(shapes(), initial, capacity)
    held_b = held_a - gpus_a.held(sizes, changed) + gpus_b.held(sizes)
    cycle = _over_capacity(held_a, held_b, capacity) + cycle
    moved = moved_by_shape[id(primitives)]
    rebuilds = engine_rebuilds(primitives, plan_b, calibration, engine)
    ready = max(
        (schedule.end_s(p) + r for p, r in zip(primitives, rebuilds, strict=True) if r > 0 and schedule.scheduled(p)),
        default=0.0,
    )
    return TransitionResult(
        primitives=primitives,
        schedule=schedule,
        makespan_s=max(schedule.makespan_s, ready),
        engine_ready_s=ready,
        bytes_moved=sum(moved.values()),
        bytes_by_link=moved,
        lower_bound_bytes=_lower_bound(gpus_a, gpus_b, changed, sizes),
        peak_extra_bytes=_extra(replay, held_a),
        capacity_bytes=replay.capacity,
        initial_bytes=initial,
        blocking_cycle=cycle,
        priority_rule=rule,
    )

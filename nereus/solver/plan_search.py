"""Global plan search: the fastest memory-feasible layout of every model-stage.

The space: per model-stage a power-of-two tp inside a node, a pp dividing the layers,
(training and inference) a context-parallel cp, dp from the pool's GPUs and (training) a
micro-batch count; and a placement of the
model-stages on GPU pools: fully colocated, or split in two pools at node granularity (GPU
granularity inside one node; actor vs. the other models, or generation vs. the rest). The
search is exact branch and bound over the same option tables that `reference_search`
enumerates in full.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from nereus.cost.calibration import Calibration
from nereus.cost.plan_cost import (
    GIB,
    RESIDENT_TERMS,
    stage_room,
    usable_capacity,
    weight_sync_time,
    workspace_bytes,
)
from nereus.cost.stage import TRAIN_OFFLOADS, StageCostModel, expert_params
from nereus.solver.layouts import (
    CP,
    CP_METHOD,
    CP_METHODS,
    EP,
    Choice,
    LayoutGrid,
    MemoryChoices,
    Option,
    OptionTable,
    layout_grid,
    price_layouts,
)
from nereus.spec.cluster import Cluster
from nereus.spec.model import Model
from nereus.spec.plan import RECOMPUTE_LEVELS, CpMethod
from nereus.spec.stages import (
    ACTOR_GENERATION,
    ACTOR_SYNC_TARGETS,
    ACTOR_TRAINING,
    CRITIC_TRAINING,
    STAGES,
    head_of,
    model_stage,
    role_of,
    stage_order,
)
from nereus.spec.workload import Workload, model_stages


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for: the cluster, the models by name, the workload, the GPUs to use."""

    cluster: Cluster
    models: tuple[Model, ...]
    workload: Workload
    num_gpus: int
    calibration: Calibration = field(default_factory=Calibration)
    choices: MemoryChoices = field(default_factory=MemoryChoices)
    """The memory-saving choices the search may use (RUNTIME_CHOICES: what `nereus run` executes)."""

    def model(self, name: str) -> Model:
        return next(m for m in self.models if m.name == name)


@dataclass(frozen=True)
class Placement:
    """Pools as (name, first GPU, size, model-stages)."""

    name: str
    pools: tuple[tuple[str, int, int, tuple[str, ...]], ...]


@dataclass(frozen=True)
class Candidate:
    """One complete assignment: a placement and one option per model-stage."""

    step_time_s: float
    placement: Placement
    choices: tuple[tuple[str, Option], ...]


@dataclass(frozen=True)
class Rejection:
    """A layout that cannot fit even alone on its GPUs: what it needs per GPU, its workspace
    included, against the usable capacity (`usable_capacity`), and the term that overflows."""

    model_stage: str
    tp: int
    pp: int
    dp: int
    micro_batches: int
    choice: str
    needed_bytes: float
    """Its memory terms per GPU, the workspace included."""
    usable_bytes: float
    largest_term: str
    largest_bytes: float
    workspace_bytes: float
    cp: int = 1
    ep: int = 1
    cp_method: CpMethod = "ulysses"

    def describe(self) -> str:
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        cp += f" {self.cp_method}" if self.cp > 1 and self.cp_method != "ulysses" else ""
        cp += f" ep={self.ep}" if self.ep > 1 else ""
        layout = f"tp={self.tp}{cp} pp={self.pp} dp={self.dp} micro_batches={self.micro_batches}{self.choice}"
        largest = f"{self.largest_term} {self.largest_bytes / GIB:.1f} GiB"
        return (
            f"{self.model_stage} {layout}: needs {self.needed_bytes / GIB:.1f} GiB > {self.usable_bytes / GIB:.1f} GiB "
            f"usable (largest term: {largest}; workspace {self.workspace_bytes / GIB:.1f} GiB)"
        )


@dataclass
class SearchOutcome:
    """The best candidates (ascending step time) and the layouts rejected for memory."""

    candidates: list[Candidate]
    num_placements: int = 0
    num_leaves: int = 0
    search_time_s: float = 0.0
    report: Callable[[], list[Rejection]] | None = field(default=None, repr=False)

    def rejections(self) -> list[Rejection]:
        """Layouts that overflow memory alone (a diagnostic, built on demand)."""
        return self.report() if self.report else []


def split_sizes(num_gpus: int, gpus_per_node: int) -> list[int]:
    """First-pool sizes of the two-pool splits: node-granular, or every GPU count when the
    GPUs fit in one node (a split inside a node shares no inter-node link)."""
    if num_gpus <= gpus_per_node:
        return list(range(1, num_gpus))
    return [k * gpus_per_node for k in range(1, -(-num_gpus // gpus_per_node))]


def placements(request: PlanRequest) -> list[Placement]:
    """Colocated, and every two-pool split (`split_sizes`) of the two templates.

    A split puts generation's pool on the last GPUs: GPU 0 (rank 0, which also runs the
    run's controller) then has no part in generation and does its control work meanwhile.
    The first pool starts on a node boundary and takes whole nodes (`split_sizes`); the
    last takes the rest.
    """
    n, per_node = request.num_gpus, request.cluster.gpus_per_node
    names = [model_stage(r, s) for r, s in model_stages(request.workload)]
    out = [Placement("colocated", (("shared", 0, n, tuple(names)),))]
    actor = tuple(x for x in names if role_of(x) == "actor")
    others = tuple(x for x in names if role_of(x) != "actor")
    rest = tuple(x for x in names if x != ACTOR_GENERATION)
    for first in split_sizes(n, per_node):
        a = n - first
        if others:
            out.append(Placement(f"split-actor-{a}", (("others", 0, first, others), ("actor", first, a, actor))))
        generation = ("generation", first, a, (ACTOR_GENERATION,))
        out.append(Placement(f"split-generation-{a}", (("rest", 0, first, rest), generation)))
    return out


def _cost_models(request: PlanRequest) -> dict[str, StageCostModel]:
    w = request.workload
    return {
        model_stage(role, stage): StageCostModel(
            request.model(w.model_name(role)), head_of(role), stage, w, request.cluster, request.calibration
        )
        for role, stage in model_stages(w)
    }


def price_all(request: PlanRequest, layouts: list[Placement]) -> dict[tuple[str, int], OptionTable]:
    """Option tables for every (model-stage, pool size) the placements need."""
    sizes: dict[str, set[int]] = {}
    for placement in layouts:
        for _, _, size, stages in placement.pools:
            for name in stages:
                sizes.setdefault(name, set()).add(size)
    return price_pool_sizes(request, sizes)


def price_pool_sizes(request: PlanRequest, sizes: dict[str, set[int]]) -> dict[tuple[str, int], OptionTable]:
    """Option tables for every model-stage on each of its pool sizes (`sizes`: by model-stage)."""
    # Model-stages with the same model, head and stage (reference and actor inference,
    # often) price identically: group them and price each group once.
    groups: dict[tuple[str, str, str], list[str]] = {}
    models = _cost_models(request)
    for name, cost in models.items():
        groups.setdefault((cost.model.name, cost.head, cost.stage), []).append(name)
    tables: dict[tuple[str, int], OptionTable] = {}
    grids: dict[tuple[str, str, tuple[int, ...]], LayoutGrid] = {}
    for names in groups.values():
        cost, needed = models[names[0]], sorted(set().union(*(sizes[name] for name in names)))
        key = (cost.model.name, cost.stage, tuple(needed))
        grid = grids.setdefault(key, layout_grid(cost, needed, request.choices))
        for size, table in price_layouts(cost, needed, request.choices, grid).items():
            for name in names:
                tables[name, size] = table
    return tables


@dataclass
class _Problem:
    """One placement compiled to plain lists for the hot loops."""

    placement: Placement
    names: list[str]  # in search order (see `_order`)
    pool_of: list[int]
    phase_of: list[int]
    options: list[list[Option]]
    budget: float
    pool_start: list[int]  # first GPU of each model-stage's pool
    sync: Callable[[Option, Option, int, int], float]
    concurrent_pools: bool = True
    """Pools of a phase overlap (the phase takes its slowest pool) or run one after another."""
    step_overhead_s: float = 0.0
    """Fixed seconds every step adds (the calibration's)."""
    host_budget: float = math.inf
    """Host-memory bytes per GPU a pool's model-stages may keep there together (the node's host
    memory over its GPUs: a sufficient condition for every node's host memory to fit)."""
    host_binds: bool = False
    """Whether some pool's model-stages at their largest host options overflow `host_budget`
    (else the search need not bound by host memory)."""

    sync_pairs: list[tuple[int, int]] = field(init=False, repr=False)
    """(actor/training, weight-sync target) positions in `names` (none without actor/training)."""

    def phase_time(self, per_pool: list[float]) -> float:
        return max(per_pool) if self.concurrent_pools else sum(per_pool)

    def __post_init__(self) -> None:
        index = {name: i for i, name in enumerate(self.names)}
        train = index.get(ACTOR_TRAINING)
        self.sync_pairs = [] if train is None else [(train, index[d]) for d in ACTOR_SYNC_TARGETS if d in index]

    def objective(self, chosen: Sequence[Option]) -> float | None:
        """Step time of a full assignment, or None if some pool overflows memory."""
        num_pools = len(self.placement.pools)
        resident, transient, host = [0.0] * num_pools, [0.0] * num_pools, [0.0] * num_pools
        sums = [[0.0] * num_pools for _ in STAGES]
        pool_of, phase_of = self.pool_of, self.phase_of
        for i, option in enumerate(chosen):
            p = pool_of[i]
            resident[p] += option[1]
            if option[2] > transient[p]:
                transient[p] = option[2]
            host[p] += option[8]
            sums[phase_of[i]][p] += option[0]
        budget, host_budget = self.budget, self.host_budget
        for p in range(num_pools):
            if resident[p] + transient[p] > budget or host[p] > host_budget:
                return None
        return sum(map(self.phase_time, sums)) + self.sync_time(chosen) + self.step_overhead_s

    def sync_time(self, chosen: Sequence[Option]) -> float:
        """Weight-sync time; `chosen` must cover actor/training and the sync targets."""
        assert ACTOR_TRAINING in self.names, "the weight sync needs actor/training"
        starts, sync = self.pool_start, self.sync
        slowest: float | None = None
        for train, dest in self.sync_pairs:
            seconds = sync(chosen[train], chosen[dest], starts[train], starts[dest])
            if slowest is None or seconds > slowest:
                slowest = seconds
        return 0.0 if slowest is None else slowest


def _sync_function(request: PlanRequest) -> Callable[[Option, Option, int, int], float]:
    actor = request.model(request.workload.actor)
    actor_params, actor_experts = actor.num_params("lm"), expert_params(actor)
    per_node = request.cluster.gpus_per_node

    def nodes(layout: tuple[int, ...], start: int) -> tuple[int, int]:
        """First and last node of the contiguous GPUs a (tp, pp, dp, cp, ep) layout takes from its pool's first GPU."""
        size = layout[0] * layout[1] * layout[2] * layout[3] * layout[4]
        return start // per_node, (start + size - 1) // per_node

    @functools.cache
    def priced(train: tuple[int, ...], dest: tuple[int, ...], train_start: int, dest_start: int) -> float:
        """The sync time by (tp, pp, dp, cp, ep) of both sides: options differing only in memory
        choices share it, so the search asks for the same few values many times."""
        same_layout = train_start == dest_start and train == dest  # equal tp, pp, dp, cp, ep: identical EMUs
        train_first, train_last = nodes(train, train_start)
        dest_first, dest_last = nodes(dest, dest_start)
        return weight_sync_time(
            request.cluster,
            request.workload,
            actor_params,
            request.calibration,
            same_layout=same_layout,
            tp=dest[0],
            pp=dest[1],
            inter=dest_first < train_first or dest_last > train_last,
            ep=dest[4],
            expert_params=actor_experts,
        )

    def sync(train: Option, dest: Option, train_start: int, dest_start: int) -> float:
        return priced((*train[3:6], train[CP], train[EP]), (*dest[3:6], dest[CP], dest[EP]), train_start, dest_start)

    return sync


def _order(names: list[str]) -> list[str]:
    """Search order: training first (large, memory-hungry: it prunes most), then the
    weight-sync targets (so the sync cost is known early), then the rest."""
    first = [n for n in (ACTOR_TRAINING, CRITIC_TRAINING, *ACTOR_SYNC_TARGETS) if n in names]
    return first + [n for n in names if n not in first]


def compile_problem(
    request: PlanRequest,
    placement: Placement,
    tables: dict[tuple[str, int], OptionTable],
    *,
    prune: bool,
    cache: dict[tuple[str, int, bool], list[Option]] | None = None,
) -> _Problem:
    """Per-stage option lists; with `prune`, drop lone-infeasible and dominated options (in host
    memory too where the pools' host memory may not hold every model-stage's largest option)."""
    budget = stage_room(request.cluster, request.calibration)
    host_budget = host_budget_per_gpu(request.cluster)
    pool_index = {name: (p, size) for p, (_, _, size, stages) in enumerate(placement.pools) for name in stages}
    start_of = {name: start for _, start, _, stages in placement.pools for name in stages}
    names = _order(list(pool_index))
    cache = {} if cache is None else cache
    by_host = host_may_bind(request, placement, tables)
    options = []
    for name in names:
        key = (name, pool_index[name][1])
        if not prune:
            options.append(sorted(tables[key].options))
            continue
        pruned = (*key, by_host)
        if pruned not in cache:
            actor = role_of(name) == "actor"
            cache[pruned] = _pareto(tables[key].options, budget, by_layout=actor, by_host=by_host)
        options.append(cache[pruned])
    return _Problem(
        placement,
        names,
        [pool_index[n][0] for n in names],
        [stage_order(n) for n in names],
        options,
        budget,
        [start_of[n] for n in names],
        _sync_function(request),
        request.calibration.concurrent_pools,
        request.calibration.step_overhead_s,
        host_budget,
        by_host,
    )


def host_may_bind(request: PlanRequest, placement: Placement, tables: dict[tuple[str, int], OptionTable]) -> bool:
    """Whether some pool's model-stages at their largest host options overflow its host memory
    per GPU (else the search need not look at host memory)."""
    budget = host_budget_per_gpu(request.cluster)
    return any(
        sum(float(tables[name, size].host.max(initial=0.0)) for name in stages) > budget
        for _, _, size, stages in placement.pools
    )


def host_budget_per_gpu(cluster: Cluster) -> float:
    """Host-memory bytes per GPU: one node's host memory shared evenly by its GPUs."""
    return cluster.host_memory_bytes / cluster.gpus_per_node


def _pareto(options: list[Option], budget: float, *, by_layout: bool, by_host: bool = False) -> list[Option]:
    """Options sorted by time, without any that a faster-or-equal one dominates in memory.

    Actor options are compared only within one (tp, pp, cp, ep): their layout decides the
    weight-sync cost, so a slower layout may still win. With `by_host` (host memory may bind),
    options are compared only with others keeping the same host bytes. The kept options' memory frontier
    per key is a staircase (resident ascending, transient descending), so a dominance test
    is one bisection.
    """
    kept: list[Option] = []
    stairs: dict[tuple[float, ...], tuple[list[float], list[float]]] = {}
    for option in sorted(o for o in options if o[1] + o[2] <= budget):
        layout = (option[3], option[4], option[CP], option[EP])
        key = (*(layout if by_layout else ()), *((option[8],) if by_host else ()))
        if _climb(stairs.setdefault(key, ([], [])), option[1], option[2]):
            kept.append(option)
    return kept


def _climb(stairs: tuple[list[float], list[float]], x: float, y: float) -> bool:
    """Add (x, y) to a staircase of points none of which another covers (x ascending, y
    descending), unless one of them covers it (no larger in both): whether it was added. The
    points it covers leave the staircase; a test is one bisection."""
    xs, ys = stairs
    below = bisect.bisect_right(xs, x)
    if below and ys[below - 1] <= y:
        return False  # the least y among no-larger x's is no larger
    start = end = bisect.bisect_left(xs, x)
    while end < len(xs) and ys[end] >= y:
        end += 1  # points (x, y) covers
    xs[start:end], ys[start:end] = [x], [y]
    return True


class _TopK:
    """The k best (step time, candidate) found so far; `bound` prunes the search."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.heap: list[tuple[float, int, Candidate]] = []  # max-heap on step time
        self.counter = itertools.count()
        self.bound = math.inf  # the k-th best step time once k are known
        self.capped = False  # whether a search pruned by `bound` before k candidates were known

    def cut(self) -> None:
        """Note a branch pruned by `bound`; before k candidates, that bound is a pass's cap."""
        if len(self.heap) < self.k:
            self.capped = True

    def offer(self, candidate: Candidate) -> None:
        item = (-candidate.step_time_s, -next(self.counter), candidate)
        if len(self.heap) < self.k:
            heapq.heappush(self.heap, item)
        elif candidate.step_time_s < self.bound:
            heapq.heapreplace(self.heap, item)
        if len(self.heap) == self.k:
            self.bound = -self.heap[0][0]

    def sorted(self) -> list[Candidate]:
        return [c for _, _, c in sorted(self.heap, key=lambda item: (-item[0], -item[1]))]


def _placement_bound(placement: Placement, fastest: dict[tuple[str, int], float]) -> float:
    """Step time with every model-stage at its fastest lone-feasible option."""
    phases = [[0.0] * len(placement.pools) for _ in STAGES]
    for p, (_, _, size, stages) in enumerate(placement.pools):
        for name in stages:
            phases[stage_order(name)][p] += fastest[name, size]
    return sum(max(row) for row in phases)


def _root_bound(problem: _Problem) -> float:
    """Step time with every model-stage at its fastest option, ignoring memory and sync."""
    if any(not opts for opts in problem.options):
        return math.inf
    num_pools = len(problem.placement.pools)
    sums = [[0.0] * num_pools for _ in STAGES]
    for i, opts in enumerate(problem.options):
        sums[problem.phase_of[i]][problem.pool_of[i]] += opts[0][0]
    return sum(max(row) for row in sums)


def branch_and_bound(problem: _Problem, best: _TopK) -> int:
    """Exact DFS over the option lists; returns the number of full assignments scored.

    The bound is the step time with unassigned model-stages at their fastest option
    (plus the weight sync once its three actor model-stages are chosen); the memory
    test charges unassigned model-stages their smallest footprint, on the GPUs and in host
    memory.
    """
    n, num_pools = len(problem.names), len(problem.placement.pools)
    # Every leaf's step time adds the calibration's fixed step overhead: so do its bounds (without
    # it, a bound is short by the overhead, which on a small model is larger than the spread of
    # the candidates, and the search scores millions of leaves that cannot win).
    overhead = problem.step_overhead_s
    if _root_bound(problem) + overhead >= best.bound:
        best.cut()
        return 0
    min_time = [opts[0][0] for opts in problem.options]
    min_res = [min(o[1] for o in opts) for opts in problem.options]
    tail_trans = _tail_transients(problem)
    sums = [[0.0] * num_pools for _ in STAGES]
    resident = [0.0] * num_pools
    for i in range(n):
        sums[problem.phase_of[i]][problem.pool_of[i]] += min_time[i]
        resident[problem.pool_of[i]] += min_res[i]
    phase_max = [problem.phase_time(row) for row in sums]  # with serial pools: the phase's sum
    transient = [0.0] * num_pools
    host = [0.0] * num_pools  # host bytes per GPU of the assigned model-stages
    tail_host = _tail_host(problem)
    host_tails = _host_tails(problem, min_time) if problem.host_binds else []
    mixes = _tail_mixes(problem) if problem.host_binds else []
    mix_budgets = [problem.budget + w * problem.host_budget for w in HOST_WEIGHTS]
    tail_min_res = [[0.0] * num_pools for _ in range(n + 1)]
    for j in range(n - 1, -1, -1):
        tail_min_res[j] = list(tail_min_res[j + 1])
        tail_min_res[j][problem.pool_of[j]] += min_res[j]

    def mixes_fit(i: int, p: int, res: float, host_p: float) -> bool:
        """Whether pool p's GPU and host budgets can both hold its model-stages, with those up
        to depth i assigned (`res` its resident bytes then, counting the unassigned at their
        least), by every weighted sum of the two (`_tail_mixes`)."""
        assigned = res - tail_min_res[i][p]
        return all(
            assigned + w * host_p + tail[i][p] <= budget
            for w, tail, budget in zip(HOST_WEIGHTS, mixes, mix_budgets, strict=True)
        )

    def host_bound(i: int) -> float:
        """Step-time bound from host memory: the step is at least one pool's model-stages' times
        added up, and the unassigned ones of a pool together take the least extra time whose host
        bytes fit what the pool has left (`_host_tails`)."""
        bound = 0.0
        for p in range(num_pools):
            hosts, extra = host_tails[i][p]
            k = bisect.bisect_right(hosts, problem.host_budget - host[p]) - 1
            own = sum(row[p] for row in sums)
            bound = max(bound, own + (extra[k] if k >= 0 else math.inf))
        return bound

    last_sync = max(i for i, name in enumerate(problem.names) if name == ACTOR_TRAINING or name in ACTOR_SYNC_TARGETS)
    chosen: list[Option] = []
    leaves = 0
    by_growth = [_fastest_by_growth(opts, min_res[j]) for j, opts in enumerate(problem.options)]
    run_start, tail_joint = _joint_tail(problem, by_growth, min_time)
    # Per depth and pool: the most resident growth an unassigned model-stage needs for its fastest option.
    tail_fastest_growth = [[0.0] * num_pools for _ in range(n + 1)]
    for j in range(n - 1, -1, -1):
        growth, fastest = by_growth[j]
        row = tail_fastest_growth[j] = list(tail_fastest_growth[j + 1])
        row[problem.pool_of[j]] = max(row[problem.pool_of[j]], growth[fastest.index(fastest[-1])])

    def memory_bound(i: int) -> float:
        """Step-time bound where each unassigned model-stage takes its fastest option that
        fits the memory its pool has left (each alone: a relaxation)."""
        slack = [problem.budget - resident[q] - max(transient[q], tail_trans[i][q]) for q in range(num_pools)]
        if all(slack[q] >= need for q, need in enumerate(tail_fastest_growth[i])):
            return sum(max(row) for row in sums)  # every unassigned model-stage can take its fastest option
        rows = [list(row) for row in sums]
        joint = max(i, run_start)  # the trailing model-stages of one (phase, pool): priced together
        for j in range(i, joint):
            growth, fastest = by_growth[j]
            k = bisect.bisect_right(growth, slack[problem.pool_of[j]]) - 1
            rows[problem.phase_of[j]][problem.pool_of[j]] += (fastest[k] if k >= 0 else math.inf) - min_time[j]
        if joint < n:
            growth, extra = tail_joint[joint - run_start]
            k = bisect.bisect_right(growth, slack[problem.pool_of[joint]]) - 1
            rows[problem.phase_of[joint]][problem.pool_of[joint]] += extra[k] if k >= 0 else math.inf
        return sum(max(row) for row in rows)

    def visit(i: int, sync: float) -> None:
        nonlocal leaves
        if i == n:
            leaves += 1
            best.offer(
                Candidate(
                    sum(phase_max) + sync + overhead,
                    problem.placement,
                    tuple(zip(problem.names, chosen, strict=True)),
                )
            )
            return
        if i and memory_bound(i) + sync + overhead >= best.bound:
            best.cut()
            return
        if problem.host_binds and host_bound(i) + sync + overhead >= best.bound:
            best.cut()
            return
        p, phase = problem.pool_of[i], problem.phase_of[i]
        base = sum(phase_max) + sync + overhead - phase_max[phase]
        for option in problem.options[i]:
            extra = option[0] - min_time[i]
            if base + max(phase_max[phase], sums[phase][p] + extra) >= best.bound:
                best.cut()
                break  # options are sorted by time: the rest are no better
            res = resident[p] + option[1] - min_res[i]
            trans = max(transient[p], option[2])
            if res + max(trans, tail_trans[i + 1][p]) > problem.budget:
                continue
            if host[p] + option[8] + tail_host[i + 1][p] > problem.host_budget:
                continue
            if mixes and not mixes_fit(i + 1, p, res, host[p] + option[8]):
                continue
            saved = resident[p], transient[p], phase_max[phase], host[p]
            sums[phase][p] += extra
            resident[p], transient[p], phase_max[phase] = res, trans, problem.phase_time(sums[phase])
            host[p] += option[8]
            chosen.append(option)
            visit(i + 1, problem.sync_time(chosen) if i == last_sync else sync)
            chosen.pop()
            sums[phase][p] -= extra
            resident[p], transient[p], phase_max[phase], host[p] = saved

    visit(0, 0.0)
    return leaves


def _joint_tail(
    problem: _Problem, by_growth: list[tuple[list[float], list[float]]], min_time: list[float]
) -> tuple[int, list[tuple[list[float], list[float]]]]:
    """The trailing model-stages that share one (phase, pool) add their times to one sum and
    their residents to one pool, so they are bounded together: for each suffix of that run,
    the least time over the sum of their fastest-by-growth options, by their total growth.

    Returns the run's first depth and, per suffix start, (growth ascending, least extra time
    over their fastest options). The extra times are shaved by a relative 1e-12 so float
    summation order can never make the bound exceed a leaf it covers.
    """
    n = len(problem.names)
    cell = problem.phase_of[n - 1], problem.pool_of[n - 1]
    start = n - 1
    while start > 0 and (problem.phase_of[start - 1], problem.pool_of[start - 1]) == cell:
        start -= 1
    stairs: list[tuple[list[float], list[float]]] = []
    growth_now, time_now = np.zeros(1), np.zeros(1)
    for j in range(n - 1, start - 1, -1):
        growth, fastest = (np.asarray(a) for a in by_growth[j])
        growth_now = (growth[:, None] + growth_now[None, :]).ravel()
        time_now = (fastest[:, None] - min_time[j] + time_now[None, :]).ravel()
        order = np.argsort(growth_now, kind="stable")
        growth_now, time_now = growth_now[order], np.minimum.accumulate(time_now[order])
        keep = np.concatenate([[True], time_now[1:] < time_now[:-1]])  # the staircase's corners
        growth_now, time_now = growth_now[keep], time_now[keep]
        stairs.append((growth_now.tolist(), (time_now * (1 - 1e-12)).tolist()))
    return start, stairs[::-1]


def _fastest_by_growth(options: list[Option], min_res: float) -> tuple[list[float], list[float]]:
    """Resident growth over the smallest option, ascending, and the fastest time up to it."""
    growth, fastest = [], []
    best = math.inf
    for option in sorted(options, key=lambda o: o[1]):
        best = min(best, option[0])
        growth.append(option[1] - min_res)
        fastest.append(best)
    return growth, fastest


def _host_tails(problem: _Problem, min_time: list[float]) -> list[list[tuple[list[float], list[float]]]]:
    """Per depth and pool: the unassigned model-stages of the pool together, as a staircase of
    (host bytes per GPU ascending, the least extra time over their fastest options with at most
    that many host bytes). The extra times are shaved by a relative 1e-12 so float summation
    order can never make the bound exceed a leaf it covers."""
    n, num_pools = len(problem.names), len(problem.placement.pools)
    current = [(np.zeros(1), np.zeros(1)) for _ in range(num_pools)]
    tails: list[list[tuple[list[float], list[float]]]] = [[([0.0], [0.0])] * num_pools for _ in range(n + 1)]
    for j in range(n - 1, -1, -1):
        p = problem.pool_of[j]
        hosts = np.array([o[8] for o in problem.options[j]])
        times = np.array([o[0] for o in problem.options[j]]) - min_time[j]
        hosts_now, times_now = current[p]
        combined = (hosts[:, None] + hosts_now[None, :]).ravel()
        extra = (times[:, None] + times_now[None, :]).ravel()
        order = np.argsort(combined, kind="stable")
        combined, extra = combined[order], np.minimum.accumulate(extra[order])
        keep = np.concatenate([[True], extra[1:] < extra[:-1]])  # the staircase's corners
        current[p] = (combined[keep], extra[keep])
        tails[j] = [(h.tolist(), (t * (1 - 1e-12)).tolist()) for h, t in current]
    return tails


def _tail_host(problem: _Problem) -> list[list[float]]:
    """Per depth and pool: the least host bytes per GPU the unassigned model-stages add."""
    n, num_pools = len(problem.names), len(problem.placement.pools)
    tail = [[0.0] * num_pools for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        tail[i] = list(tail[i + 1])
        tail[i][problem.pool_of[i]] += min(o[8] for o in problem.options[i])
    return tail


#: Weights of host bytes against GPU bytes in `_tail_mixes`' combined memory tests.
HOST_WEIGHTS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0)


def _tail_mixes(problem: _Problem) -> list[list[list[float]]]:
    """Per host weight w (`HOST_WEIGHTS`), depth and pool: the least `resident + w * host` bytes
    per GPU the unassigned model-stages add. A pool's model-stages must fit its GPUs and its host
    memory at once, so their resident plus w times their host bytes stays within the GPU budget
    plus w times the host budget, for every w >= 0: this couples the two budgets, which a search
    that bounds each alone cannot (each model-stage can save GPU memory only by taking host
    memory, so apart both bounds are loose)."""
    n, num_pools = len(problem.names), len(problem.placement.pools)
    mixes = []
    for w in HOST_WEIGHTS:
        tail = [[0.0] * num_pools for _ in range(n + 1)]
        for i in range(n - 1, -1, -1):
            tail[i] = list(tail[i + 1])
            tail[i][problem.pool_of[i]] += min(o[1] + w * o[8] for o in problem.options[i])
        mixes.append(tail)
    return mixes


def _tail_transients(problem: _Problem) -> list[list[float]]:
    """Per depth and pool: the largest smallest-transient among unassigned model-stages."""
    n, num_pools = len(problem.names), len(problem.placement.pools)
    tail = [[0.0] * num_pools for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        tail[i] = list(tail[i + 1])
        smallest = min(o[2] for o in problem.options[i])
        tail[i][problem.pool_of[i]] = max(tail[i][problem.pool_of[i]], smallest)
    return tail


def _check_request(request: PlanRequest) -> None:
    if request.num_gpus < 1:
        raise ValueError("num_gpus must be at least 1")
    if request.num_gpus > request.cluster.num_gpus:
        raise ValueError(
            f"{request.num_gpus} GPUs requested but cluster {request.cluster.name} has {request.cluster.num_gpus}"
        )


def search(request: PlanRequest, top_k: int = 1, progress: Callable[[int, int], None] | None = None) -> SearchOutcome:
    """Exact branch-and-bound search; returns up to `top_k` best feasible candidates."""
    _check_request(request)
    started = time.perf_counter()
    layouts = placements(request)
    tables = price_all(request, layouts)
    fastest = {key: table.fastest for key, table in tables.items()}
    ordered = sorted((_placement_bound(p, fastest), i, p) for i, p in enumerate(layouts))
    # A placement with a pool that holds no plan (memory only, `CountProbe`) has no leaf that
    # fits: a search of it could only exhaust its tree, which host memory makes vast. Decided
    # only for the placements the step-time bound leaves open.
    probe = CountProbe(request, tables)

    @functools.cache
    def holds(index: int) -> bool:
        return all(probe.holds(stages, size) for _, _, size, stages in layouts[index].pools)

    first = next((bound for bound, index, _ in ordered if holds(index)), math.inf)
    cache: dict[tuple[str, int, bool], list[Option]] = {}
    leaves = 0
    for cap in _caps(request, ordered, tables, first):
        best = _TopK(top_k)
        best.bound = cap  # only steps faster than the cap are looked for in this pass
        for done, (bound, index, placement) in enumerate(ordered, 1):
            if bound < best.bound:
                if holds(index):
                    # Dominance pruning keeps the optimum but may drop runners-up: only for top-1.
                    problem = compile_problem(request, placement, tables, prune=top_k == 1, cache=cache)
                    leaves += branch_and_bound(problem, best)
            elif len(best.heap) < top_k and holds(index):
                best.cut()  # a feasible placement the cap ruled out: a larger cap may find more
            if progress:
                progress(done, len(ordered))
        if len(best.heap) == top_k or not best.capped:
            break  # found, or nothing was cut for the cap: a larger one finds no more
    found = best.sorted()
    shown = found[0].placement if found else layouts[0]
    return SearchOutcome(
        found, len(layouts), leaves, time.perf_counter() - started, report=lambda: rejections(request, tables, shown)
    )


def resized(request: PlanRequest, num_gpus: int) -> PlanRequest:
    """The request on `num_gpus` GPUs of a cluster of the same nodes, as many as they need."""
    cluster = request.cluster.model_copy(update={"num_nodes": -(-num_gpus // request.cluster.gpus_per_node)})
    return dataclasses.replace(request, cluster=cluster, num_gpus=num_gpus)


def fits(request: PlanRequest) -> bool:
    """Whether some plan of the request fits memory: whether `search` finds one (`CountProbe`)."""
    return CountProbe(request, price_all(request, placements(request))).fits(request.num_gpus)


class CountProbe:
    """Whether some plan of a request fits memory on n GPUs (on as many of the request's nodes
    as n needs), for the counts whose pool sizes `tables` prices: whether `search` would find a
    plan, without its optimum.

    Only memory decides it, pool by pool: a placement holds a plan when every pool holds one
    option per model-stage whose resident bytes plus the largest transient fit the GPU budget
    and whose host bytes fit the host budget (`_Problem.objective`'s test); the step time and the
    weight sync (finite) rule nothing out. A pool's answer depends only on its model-stages and
    size, so each is decided once (`pool_fits`, on each model-stage's `memory_front`) for every
    placement and count that has it.
    """

    def __init__(self, request: PlanRequest, tables: dict[tuple[str, int], OptionTable]) -> None:
        self.request = request
        self.tables = tables
        self.budget = stage_room(request.cluster, request.calibration)
        self.host_budget = host_budget_per_gpu(request.cluster)
        self.names = [model_stage(r, s) for r, s in model_stages(request.workload)]
        self.fronts: dict[tuple[str, int], np.ndarray] = {}
        self.pools: dict[tuple[tuple[str, ...], int], bool] = {}

    @classmethod
    def up_to(cls, request: PlanRequest, largest: int) -> CountProbe:
        """A probe for every count up to `largest`: each model-stage priced once on every pool
        size up to it (a layout's time and memory do not depend on the cluster's node count)."""
        big = resized(request, largest)
        names = [model_stage(r, s) for r, s in model_stages(request.workload)]
        return cls(big, price_pool_sizes(big, {name: set(range(1, largest + 1)) for name in names}))

    def lower_bound(self, largest: int) -> int:
        """The fewest GPUs on which every model-stage fits alone (on some pool size up to
        `largest`): no smaller count holds a plan. `largest + 1` if one fits on none."""
        sizes = range(1, largest + 1)
        return max(
            min((n for n in sizes if math.isfinite(self.tables[name, n].fastest)), default=largest + 1)
            for name in self.names
        )

    def holds(self, stages: tuple[str, ...], size: int) -> bool:
        """Whether the model-stages `stages` fit together on a pool of `size` GPUs."""
        key = (stages, size)
        if any(math.isinf(self.tables[name, size].fastest) for name in stages):
            return False  # a model-stage that fits in no layout alone (known without listing options)
        if key not in self.pools and self._witness(stages, size):
            self.pools[key] = True
        if key not in self.pools:
            fronts = []
            for name in stages:
                if (name, size) not in self.fronts:
                    self.fronts[name, size] = memory_front(self.tables[name, size], self.budget)
                fronts.append(self.fronts[name, size])
            self.pools[key] = pool_fits(fronts, self.budget, self.host_budget)
        return self.pools[key]

    def _witness(self, stages: tuple[str, ...], size: int) -> bool:
        """Whether each model-stage's option least in `resident + transient + w * host` (host
        weight w: 0 or 1), all taken together, fit the pool: a quick proof that it holds a plan,
        before the exact test builds the memory fronts."""
        for weight in (0.0, 1.0):
            resident = host = transient = 0.0
            for name in stages:
                table = self.tables[name, size]
                time, res, trans = table.columns[:3]
                need = np.where(
                    np.isfinite(time) & (res + trans <= self.budget), res + trans + weight * table.host, np.inf
                )
                i = int(np.argmin(need))
                resident, host = resident + float(res[i]), host + float(table.host[i])
                transient = max(transient, float(trans[i]))
            if resident + transient <= self.budget and host <= self.host_budget:
                return True
        return False

    def fits(self, num_gpus: int) -> bool:
        """Whether some plan fits on `num_gpus` GPUs (whose pool sizes the tables price)."""
        return any(
            all(self.holds(stages, size) for _, _, size, stages in placement.pools)
            for placement in placements(resized(self.request, num_gpus))
        )


def memory_front(table: OptionTable, budget: float) -> np.ndarray:
    """A model-stage's options that fit `budget` alone with a finite time, as `front_rows`."""
    time, resident, transient = table.columns[:3]
    keep = np.isfinite(time) & (resident + transient <= budget)
    return front_rows(np.stack([transient[keep], resident[keep], table.host[keep]], axis=1))


def front_rows(rows: np.ndarray) -> np.ndarray:
    """Rows (transient, resident, host bytes per GPU) by transient ascending, without any that
    another covers (no larger in all three; one of equal rows): all a pool's memory test can
    tell apart."""
    rows = np.unique(rows, axis=0)
    stairs: tuple[list[float], list[float]] = ([], [])
    # In this order only an earlier row can cover a row: one staircase of (resident, host) serves.
    return rows[[i for i, (_, res, host) in enumerate(rows.tolist()) if _climb(stairs, res, host)]]


#: Relative slack of the necessary memory tests in `pool_fits` and `_sums_fit`: float sums in
#: another order must never rule out an assignment that fits (the final tests have none).
MEMORY_SLACK = 1e-9


def pool_fits(fronts: Sequence[np.ndarray], budget: float, host_budget: float) -> bool:
    """Whether one row of each model-stage's `memory_front` fits a pool together: resident bytes
    summed plus the largest transient within `budget`, host bytes summed within `host_budget`.
    Exact.

    With the largest transient fixed at T, each model-stage may take any of its rows of transient
    <= T, and what is left is a choice under two sums (`_sums_fit`). T need be tried only at the
    fronts' transients, from the largest least one up: between two of them the rows allowed stay
    the same and the room shrinks. Most T are settled at once, vectorised over all of them, by
    weighted sums (host weight w >= 0: 0 and `HOST_WEIGHTS`): nothing fits where the least
    `resident + w * host` summed over the model-stages exceeds `budget - T + w * host_budget`, and
    the rows with the least `resident + w * host` fit where their two sums do.
    """
    if not all(len(front) for front in fronts):
        return False
    floor = max(float(front[0, 0]) for front in fronts)
    thresholds = np.unique(np.concatenate([front[:, 0] for front in fronts]))
    thresholds = thresholds[thresholds >= floor]
    last = [np.searchsorted(front[:, 0], thresholds, side="right") - 1 for front in fronts]
    least_host = np.zeros(thresholds.size)
    for front, k in zip(fronts, last, strict=True):
        least_host += np.minimum.accumulate(front[:, 2])[k]
    open_ = least_host <= host_budget * (1 + MEMORY_SLACK)  # the limit of large w
    for w in (0.0, *HOST_WEIGHTS):
        least, resident, host = (np.zeros(thresholds.size) for _ in range(3))
        for front, k in zip(fronts, last, strict=True):
            mix = front[:, 1] + w * front[:, 2]
            low = np.minimum.accumulate(mix)
            at = np.maximum.accumulate(np.where(mix == low, np.arange(mix.size), 0))[k]  # where low[k] is
            least += low[k]
            resident += front[at, 1]
            host += front[at, 2]
        if np.any((resident + thresholds <= budget) & (host <= host_budget)):
            return True
        open_ &= least + thresholds <= (budget + w * host_budget) * (1 + MEMORY_SLACK)
    return any(
        _sums_fit(
            [front[: k[t] + 1, 1:] for front, k in zip(fronts, last, strict=True)], thresholds[t], budget, host_budget
        )
        for t in np.nonzero(open_)[0].tolist()
    )


def _sums_fit(rows: list[np.ndarray], transient: float, budget: float, host_budget: float) -> bool:
    """Whether one (resident, host) row per model-stage has its resident sum plus `transient`
    within `budget` and its host sum within `host_budget`. Exact: the staircase of the partial
    sums, model-stage by model-stage, without those the rest's least (weighted) bytes cannot
    complete."""
    weights = np.array((0.0, *HOST_WEIGHTS))
    fronts = [_lowest(r) for r in rows]
    rest_mix, rest_host = np.zeros((len(fronts) + 1, weights.size)), np.zeros(len(fronts) + 1)
    for j in range(len(fronts) - 1, -1, -1):
        rest_mix[j] = rest_mix[j + 1] + (fronts[j][:, :1] + weights * fronts[j][:, 1:]).min(axis=0)
        rest_host[j] = rest_host[j + 1] + fronts[j][:, 1].min()
    room = (budget - transient + weights * host_budget) * (1 + MEMORY_SLACK)
    sums = np.zeros((1, 2))
    for j, front in enumerate(fronts):
        sums = (sums[:, None, :] + front[None, :, :]).reshape(-1, 2)
        keep = sums[:, 1] + rest_host[j + 1] <= host_budget * (1 + MEMORY_SLACK)
        keep &= np.all(sums[:, :1] + weights * sums[:, 1:] + rest_mix[j + 1] <= room, axis=1)
        sums = _lowest(sums[keep])
        if not len(sums):
            return False
    return bool(np.any((sums[:, 0] + transient <= budget) & (sums[:, 1] <= host_budget)))


def _lowest(points: np.ndarray) -> np.ndarray:
    """The (x, y) rows no other row covers (no larger in both; one of equal rows), by x ascending."""
    points = points[np.lexsort((points[:, 1], points[:, 0]))]
    keep = np.ones(len(points), dtype=bool)
    keep[1:] = points[1:, 1] < np.minimum.accumulate(points[:, 1])[:-1]
    return points[keep]


#: Growth of the step-time cap between passes of a search whose host memory may bind.
CAP_GROWTH = 1.1
#: Capped passes before the last, uncapped one (the cap then exceeds 45x the first).
MAX_CAPPED_PASSES = 40


def _caps(
    request: PlanRequest,
    ordered: list[tuple[float, int, Placement]],
    tables: dict[tuple[str, int], OptionTable],
    first: float,
) -> list[float]:
    """The step-time caps of the search's passes. Host memory binds the model-stages of a pool
    together, so a depth-first search without an incumbent can wander long before its first
    leaf that fits: where host memory may bind, passes look only for steps under a cap growing
    from the best placement's lower bound, and stop at the first that finds the best candidates
    (each pass is exact below its cap); otherwise one uncapped pass. `first`: the least lower
    bound of a placement that holds a plan (inf: none does)."""
    if not math.isfinite(first) or not any(host_may_bind(request, p, tables) for _, _, p in ordered):
        return [math.inf]
    return [first * CAP_GROWTH**k for k in range(1, MAX_CAPPED_PASSES + 1)] + [math.inf]


def reference_search(request: PlanRequest, top_k: int = 1) -> SearchOutcome:
    """Exhaustive enumeration of every assignment of every placement (small cases only)."""
    _check_request(request)
    layouts = placements(request)
    tables = price_all(request, layouts)
    best = _TopK(top_k)
    leaves = 0
    for placement in layouts:
        problem = compile_problem(request, placement, tables, prune=False)
        for chosen in itertools.product(*problem.options):
            leaves += 1
            step = problem.objective(chosen)
            if step is not None:
                best.offer(Candidate(step, placement, tuple(zip(problem.names, chosen, strict=True))))
    return SearchOutcome(best.sorted(), num_placements=len(layouts), num_leaves=leaves)


def rejections(
    request: PlanRequest, tables: dict[tuple[str, int], OptionTable], placement: Placement
) -> list[Rejection]:
    """Layouts of `placement` that overflow memory even alone, with the largest term."""
    budget = stage_room(request.cluster, request.calibration)
    usable, workspace = (
        usable_capacity(request.cluster, request.calibration),
        workspace_bytes(request.cluster, request.calibration),
    )
    out = []
    for _, _, size, stages in placement.pools:
        for name in stages:
            table = tables[name, size]
            needed = table.columns[1] + table.columns[2]
            terms = list(table.memory)
            stacked = np.stack([table.memory[k] for k in terms])
            for i in np.nonzero(needed > budget)[0].tolist():
                largest = int(stacked[:, i].argmax())
                tp, pp, dp, micro_batches = (int(c[i]) for c in table.columns[3:])
                cp, ep, method = int(table.cp[i]), int(table.ep[i]), CP_METHODS[int(table.cp_method[i])]
                out.append(
                    Rejection(
                        name,
                        tp,
                        pp,
                        dp,
                        micro_batches,
                        describe_choice(table.options[i][7]),
                        float(needed[i]) + workspace,
                        usable,
                        terms[largest],
                        float(stacked[largest, i]),
                        workspace,
                        cp,
                        ep,
                        method,
                    )
                )
    return out


def describe_choice(choice: Choice) -> str:
    """` recompute=full token_budget=... ` for the choices an option makes (empty: none)."""
    kv, recompute, token_budget, zero1, offload, full_shard, train_offload = choice
    parts = [f"kv_budget={kv / GIB:.1f}GiB" if kv else ""]
    parts += [f"recompute={RECOMPUTE_LEVELS[recompute]}" if recompute else ""]
    parts += [f"token_budget={token_budget}" if token_budget else ""]
    parts += ["full_shard" if full_shard else "zero1" if zero1 and not train_offload else ""]  # implied by it
    parts += [f"train_offload={TRAIN_OFFLOADS[train_offload]}" if train_offload else "", "offload" if offload else ""]
    return "".join(f" {p}" for p in parts if p)


def iter_assignments(
    candidate: Candidate,
) -> Iterator[tuple[str, str, int, int, int, int, int, Choice, int, int, CpMethod]]:
    """(model-stage, pool, first GPU of pool, tp, pp, dp, micro-batches, choice, cp, ep, cp method)
    per model-stage."""
    pool_of = {name: (pool, start) for pool, start, _, stages in candidate.placement.pools for name in stages}
    for name, option in candidate.choices:
        pool, start = pool_of[name]
        yield name, pool, start, *option[3:8], option[CP], option[EP], CP_METHODS[option[CP_METHOD]]


@dataclass(frozen=True)
class PoolShortfall:
    """Why a pool's model-stages cannot have its GPUs, per GPU, against the usable capacity.

    Either one model-stage fits in no layout even alone (`alone`): of those, the one that
    exceeds the usable capacity by the most, at its smallest footprint; or each fits alone but
    not together: every model-stage's least resident states plus the largest running need."""

    placement: str
    pool: str
    states: tuple[tuple[str, float], ...]
    """Resident bytes per GPU: by term (alone), or by model-stage with its layout (together)."""
    running: str
    """The model-stage (with its layout and choices) whose running need counts; `X alone [...]`
    when it fits in no layout alone."""
    transient: tuple[tuple[str, float], ...]
    """(term, bytes per GPU) of what `running` needs while it runs, the workspace last."""
    usable_bytes: float
    alone: bool

    @property
    def needed_bytes(self) -> float:
        return sum(b for _, b in self.states) + sum(b for _, b in self.transient)

    @property
    def largest(self) -> tuple[str, float]:
        """The largest term of the need (a model-stage's states count as one term together)."""
        named = [(name if self.alone else f"{name} states", b) for name, b in self.states]
        return max([*named, *self.transient], key=lambda term: term[1])

    def describe(self) -> str:
        states = sum(b for _, b in self.states)
        parts = ", ".join(f"{name} {b / GIB:.1f}" for name, b in self.states if b > 0)
        transient = " + ".join(f"{term} {b / GIB:.1f} GiB" for term, b in self.transient if b > 0)
        term, size = self.largest
        need = f"{self.running} needs " if self.alone else ""
        running = "it" if self.alone else self.running
        over = self.needed_bytes - self.usable_bytes
        return (
            f"{self.placement} placement, pool {self.pool}: {need}{self.needed_bytes / GIB:.1f} GiB > "
            f"{self.usable_bytes / GIB:.1f} GiB usable per GPU ({over / GIB:.1f} GiB over; largest term: {term} "
            f"{size / GIB:.1f} GiB) = states {states / GIB:.1f} GiB ({parts}) + while {running} runs {transient}"
        )


def closest_shortfall(
    request: PlanRequest, priced: tuple[list[Placement], dict[tuple[str, int], OptionTable]] | None = None
) -> PoolShortfall | None:
    """The placement that misses memory by the least and the terms of its fullest pool, per
    GPU (see `_pool_shortfall` for the options it takes). `priced`: the request's placements
    and `price_all` tables, when the caller has them."""
    if priced is None:
        layouts = placements(request)
        priced = (layouts, price_all(request, layouts))
    layouts, tables = priced
    usable = usable_capacity(request.cluster, request.calibration)
    workspace = workspace_bytes(request.cluster, request.calibration)
    misses = []
    for placement in layouts:
        pool_tables = [(pool, {n: tables[n, size] for n in stages}) for pool, _, size, stages in placement.pools]
        if any(not table.options for _, by_stage in pool_tables for table in by_stage.values()):
            continue  # a model-stage with no candidate layout at all: no memory shortfall to explain
        pools = [_pool_shortfall(placement.name, pool, by_stage, usable, workspace) for pool, by_stage in pool_tables]
        worst = max(pools, key=lambda p: p.needed_bytes)
        if worst.needed_bytes > usable:
            misses.append(worst)
    return min(misses, key=lambda p: p.needed_bytes, default=None)


def _pool_shortfall(
    placement: str, pool: str, tables: dict[str, OptionTable], usable: float, workspace: float
) -> PoolShortfall:
    """The model-stage that exceeds the usable capacity by the most even alone, at its smallest
    footprint, if any does; else every model-stage at its least resident option (offloaded
    where allowed) on the shared GPUs, and the largest running need."""
    alone = {name: min(t.options, key=lambda o: o[1] + o[2]) for name, t in tables.items()}
    worst = max(alone, key=lambda name: alone[name][1] + alone[name][2])
    option = alone[worst]
    if option[1] + option[2] + workspace > usable:
        terms = tables[worst].terms(tables[worst].options.index(option))
        states = tuple((k, v) for k, v in terms.items() if k in RESIDENT_TERMS)
        label = f"{worst} alone [{_layout_text(option)}]"
        return PoolShortfall(placement, pool, states, label, _transient(terms, False, workspace), usable, True)
    picked = {name: min(t.options, key=lambda o: (o[1], o[2])) for name, t in tables.items()}
    states = tuple((f"{name} [{_layout_text(o)}]", o[1]) for name, o in picked.items())
    running = max(picked, key=lambda name: picked[name][2])
    terms = tables[running].terms(tables[running].options.index(picked[running]))
    label = f"{running} [{_layout_text(picked[running])}]"
    transient = _transient(terms, bool(picked[running][7][4]), workspace)
    return PoolShortfall(placement, pool, states, label, transient, usable, False)


def _transient(terms: dict[str, float], offloaded: bool, workspace: float) -> tuple[tuple[str, float], ...]:
    """A running model-stage's transient terms (with its states when they sleep between runs),
    and the workspace."""
    out = [(k, v) for k, v in terms.items() if k not in RESIDENT_TERMS]
    if offloaded:
        out.append(("its states", sum(v for k, v in terms.items() if k in RESIDENT_TERMS)))
    return (*out, ("workspace", workspace))


def _layout_text(option: Option) -> str:
    cp = f" cp={option[CP]}" if option[CP] > 1 else ""
    cp += f" {CP_METHODS[option[CP_METHOD]]}" if option[CP_METHOD] else ""
    cp += f" ep={option[EP]}" if option[EP] > 1 else ""
    return f"tp={option[3]}{cp} pp={option[4]} dp={option[5]}{describe_choice(option[7])}"

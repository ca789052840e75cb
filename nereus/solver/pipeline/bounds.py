"""Lower bounds on a schedule's makespan, and the memory reference bound.

Latency (each a valid lower bound on every schedule of the problem):
* critical path: the longest dependency chain (one micro-batch through every stage and back);
* node work: the busiest node's total op time;
* average work: all op time spread evenly over the nodes;
* arrival + work + tail: on each node, the earliest any of its ops can start, plus its work,
  plus the shortest chain that must follow its last op;
* one machine by rank: each node alone as a one-machine problem with release times and
  tails, solved exactly with preemption (Jackson's preemptive schedule). The release and
  tail of an op come from its *rank* within its group (the ops of one pipeline stage and
  kind, which differ only in their micro-batch): see `rank_tables`.

Memory: the serial 1F1B peak, max over models of the first stage's in-flight activations
(min(S, m) micro-batches). RLHFuse reports it as the fused schedule's memory lower bound; it
is a reference (a slow schedule holding one micro-batch at a time goes below it), and
the search's memory phase stops once it is reached. `memory_bound_at` is a true lower
bound on the peak of every schedule no slower than a given makespan (see there); on the
schedule benchmark it stays below the serial 1F1B reference wherever a node runs more than
one 1F1B fill of micro-batches, so that reference remains the figure the peak is judged by.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass

from nereus.solver.pipeline.model import Instance, ModelTimes, Pipeline, Problem


@dataclass(frozen=True)
class LowerBounds:
    """Each latency bound and the memory reference bound."""

    critical_path: float
    node_work: float
    average_work: float
    arrival_work_tail: float
    one_machine: float
    """Max over nodes of the preemptive one-machine optimum with rank releases and tails."""
    memory: float

    @property
    def latency(self) -> float:
        return max(self.critical_path, self.node_work, self.average_work, self.arrival_work_tail, self.one_machine)


def topological_order(inst: Instance) -> list[int]:
    """Op ids, every op after its dependencies."""
    remaining = [len(p) for p in inst.preds]
    order = [op for op in range(inst.num_ops) if not remaining[op]]
    for op in order:  # the list grows while we walk it
        for succ, _ in inst.succs[op]:
            remaining[succ] -= 1
            if not remaining[succ]:
                order.append(succ)
    assert len(order) == inst.num_ops, "the dependency graph is acyclic by construction"
    return order


def heads_and_tails(inst: Instance) -> tuple[list[float], list[float]]:
    """Earliest start of each op and the longest chain after it ends (resources ignored)."""
    order = topological_order(inst)
    head = [0.0] * inst.num_ops
    for op in order:
        for succ, lat in inst.succs[op]:
            head[succ] = max(head[succ], head[op] + inst.duration[op] + lat)
    tail = [0.0] * inst.num_ops
    for op in reversed(order):
        for succ, lat in inst.succs[op]:
            tail[op] = max(tail[op], lat + inst.duration[succ] + tail[succ])
    return head, tail


def node_tails(inst: Instance, order: list[int], tail: list[float], out: list[float]) -> None:
    """Write into `out`, for each op of one node's `order`, what must still run after it ends:
    its own tail (the longest dependent chain), or the node's ops after it plus the tail of
    one of them, whichever is longer.

    With only the chain tails, a node that must stay busy to the end (the one that sets the
    lower bound) sees a gap early in its order only at its last op; with the node's later
    work counted, every op after the gap is late by it, so the walk is led to close it.
    Zero lateness still means exactly "ends by the target": each op after it on the node
    ends at least that work later and is followed by its own tail."""
    after = -math.inf
    for op in reversed(order):
        out[op] = max(tail[op], after)
        after = inst.duration[op] + out[op]


def follow_tails(inst: Instance, orders: list[list[int]], tail: list[float]) -> list[float]:
    """`node_tails` of every node's order."""
    follow = [0.0] * inst.num_ops
    for order in orders:
        node_tails(inst, order, tail, follow)
    return follow


#: A group of interchangeable ops: (pipeline index, stage, kind).
Group = tuple[int, int, str]


@dataclass(frozen=True)
class RankTables:
    """Per group, release[k] and tail[k] of the group's k-th op in time order (0 = first).

    In every schedule the group's ops run on one node one at a time, so their k-th start is
    at least release[k], and the op started k-th (which also ends k-th) leaves at least
    tail[k] of dependent work after its end.
    """

    release: dict[Group, list[float]]
    tail: dict[Group, list[float]]


def _chain(first: list[float], step: float, previous: list[float] | None, hop: float) -> list[float]:
    """Rank values of a group: value[k] >= value[k-1] + step (one node, one op at a time) and
    value[k] >= previous[k] + hop (the k-th of this group needs k+1 distinct predecessors done,
    so it waits for the k-th of the predecessor group); `first` seeds every rank."""
    out = list(first)
    for k in range(len(out)):
        if previous is not None:
            out[k] = max(out[k], previous[k] + hop)
        if k:
            out[k] = max(out[k], out[k - 1] + step)
    return out


def _pipeline_ranks(
    problem: Problem, p_index: int, pipeline: Pipeline
) -> tuple[dict[Group, list[float]], dict[Group, list[float]]]:
    """Release and tail rank tables of one pipeline's groups.

    Releases run down the dependency chain F(0) .. F(S-1), B(S-1) .. B(0), W(s) after B(s);
    tails run up it in reverse (tail[j] counted from the last op of the group, then flipped).
    """
    model, nodes = pipeline.model, pipeline.stage_nodes
    m, last = len(pipeline.microbatches), model.num_stages - 1
    f, b, w = model.forward, model.backward, model.weight_grad

    def lat(a: int, c: int) -> float:
        return problem.p2p_latency if nodes[a] != nodes[c] else 0.0

    zeros = [0.0] * m
    rel: dict[Group, list[float]] = {}
    for s in range(last + 1):
        prev = rel[(p_index, s - 1, "F")] if s else None
        rel[(p_index, s, "F")] = _chain(zeros, f[s], prev, f[s - 1] + lat(s - 1, s) if s else 0.0)
    for s in range(last, -1, -1):
        if s == last:
            rel[(p_index, s, "B")] = _chain(zeros, b[s], rel[(p_index, s, "F")], f[s])
        else:
            rel[(p_index, s, "B")] = _chain(zeros, b[s], rel[(p_index, s + 1, "B")], b[s + 1] + lat(s + 1, s))
        if w is not None:
            rel[(p_index, s, "W")] = _chain(zeros, w[s], rel[(p_index, s, "B")], b[s])
    # Tails counted from the end: rest[j] belongs to the group's j-th op from the last.
    rest: dict[Group, list[float]] = {}
    for s in range(last + 1):
        if w is not None:
            rest[(p_index, s, "W")] = _chain(zeros, w[s], None, 0.0)
        own = _chain(zeros, b[s], rest[(p_index, s, "W")], w[s]) if w is not None else zeros
        below = rest[(p_index, s - 1, "B")] if s else None
        rest[(p_index, s, "B")] = _chain(own, b[s], below, b[s - 1] + lat(s, s - 1) if s else 0.0)
    for s in range(last, -1, -1):
        after = rest[(p_index, s, "B")] if s == last else rest[(p_index, s + 1, "F")]
        hop = b[s] if s == last else f[s + 1] + lat(s, s + 1)
        rest[(p_index, s, "F")] = _chain(zeros, f[s], after, hop)
    return rel, {group: values[::-1] for group, values in rest.items()}


def rank_tables(problem: Problem) -> RankTables:
    """Rank releases and tails of every group of every pipeline."""
    release: dict[Group, list[float]] = {}
    tail: dict[Group, list[float]] = {}
    for p_index, pipeline in enumerate(problem.pipelines):
        rel, rest = _pipeline_ranks(problem, p_index, pipeline)
        release.update(rel)
        tail.update(rest)
    return RankTables(release, tail)


def jackson_preemptive(jobs: list[tuple[float, float, float]]) -> float:
    """Optimal max(end + tail) of (release, duration, tail) jobs on one machine with preemption:
    always run the released job with the longest tail (Jackson's preemptive schedule)."""
    jobs = sorted(jobs)
    ready: list[tuple[float, float]] = []  # (-tail, remaining duration)
    now, i, best = 0.0, 0, 0.0
    while i < len(jobs) or ready:
        if not ready and now < jobs[i][0]:
            now = jobs[i][0]
        while i < len(jobs) and jobs[i][0] <= now:
            _, duration, tail = jobs[i]
            heapq.heappush(ready, (-tail, duration))
            i += 1
        neg_tail, duration = heapq.heappop(ready)
        next_release = jobs[i][0] if i < len(jobs) else float("inf")
        if now + duration <= next_release:
            now += duration
            best = max(best, now - neg_tail)
        else:  # preempted by the next release: run until it, then choose again
            heapq.heappush(ready, (neg_tail, duration - (next_release - now)))
            now = next_release
    return best


def one_machine_bound(problem: Problem) -> float:
    """Max over nodes of the one-machine relaxation with rank releases and tails.

    A real schedule restricted to one node, with each group's ops labelled by their start
    order, is a feasible (non-preemptive) schedule of that node's relaxation, so the
    relaxation's preemptive optimum is a lower bound on the makespan.
    """
    tables = rank_tables(problem)
    jobs: list[list[tuple[float, float, float]]] = [[] for _ in range(problem.num_nodes)]
    for p_index, pipeline in enumerate(problem.pipelines):
        model = pipeline.model
        times = {"F": model.forward, "B": model.backward, "W": model.weight_grad}
        for (p, stage, kind), releases in tables.release.items():
            if p != p_index:
                continue
            duration = times[kind]
            assert duration is not None, "W groups exist only with split backwards"
            tails = tables.tail[(p, stage, kind)]
            for release, tail in zip(releases, tails, strict=True):
                jobs[pipeline.stage_nodes[stage]].append((release, duration[stage], tail))
    return max((jackson_preemptive(node_jobs) for node_jobs in jobs), default=0.0)


def memory_bound(problem: Problem) -> float:
    """Serial 1F1B peak: the most any model's stage holds in flight under 1F1B."""
    peak = 0.0
    for pipeline in problem.pipelines:
        stages, m = pipeline.model.num_stages, len(pipeline.microbatches)
        for stage, activation in enumerate(pipeline.model.activation):
            peak = max(peak, min(stages - stage, m) * activation)
    return peak


def lower_bounds(inst: Instance) -> LowerBounds:
    head, tail = heads_and_tails(inst)
    num_nodes = inst.problem.num_nodes
    work = [0.0] * num_nodes
    first = [float("inf")] * num_nodes
    last = [float("inf")] * num_nodes
    for op in range(inst.num_ops):
        node = inst.node[op]
        work[node] += inst.duration[op]
        first[node] = min(first[node], head[op])
        last[node] = min(last[node], tail[op])
    critical = max((head[op] + inst.duration[op] + tail[op] for op in range(inst.num_ops)), default=0.0)
    arrival = max((first[n] + work[n] + last[n] for n in range(num_nodes) if work[n] > 0), default=0.0)
    return LowerBounds(
        critical_path=critical,
        node_work=max(work, default=0.0),
        average_work=sum(work) / num_nodes,
        arrival_work_tail=arrival,
        one_machine=one_machine_bound(inst.problem),
        memory=memory_bound(inst.problem),
    )


@dataclass(frozen=True)
class _NodeGroup:
    """One (pipeline, stage) on a node, for the memory bound: rank releases and start deadlines."""

    activation: float
    forward: float
    backward: float
    weight_grad: float
    f_release: list[float]
    f_deadline: list[float]
    """Latest start of the k-th forward that still lets the schedule end by the makespan."""
    b_release: list[float]
    w_release: list[float]


def _stage_chains(problem: Problem, pipeline: Pipeline) -> tuple[list[float], list[float]]:
    """Per stage s: the shortest forward chain from the end of F(s) to the start of
    F(S-1)'s successor B(S-1) (f[s+1..S-1] plus latencies), and the shortest backward chain
    after the end of B(s) (b[s-1..0] plus latencies)."""
    model, nodes = pipeline.model, pipeline.stage_nodes
    last = model.num_stages - 1

    def lat(a: int, c: int) -> float:
        return problem.p2p_latency if nodes[a] != nodes[c] else 0.0

    up = [0.0] * (last + 1)
    for s in range(last - 1, -1, -1):
        up[s] = up[s + 1] + lat(s, s + 1) + model.forward[s + 1]
    down = [0.0] * (last + 1)
    for s in range(1, last + 1):
        down[s] = down[s - 1] + model.backward[s - 1] + lat(s, s - 1)
    return up, down


#: A pipeline's model, micro-batch count and its stage chains (`_stage_chains`).
_Chains = tuple[ModelTimes, int, list[float], list[float]]


def _b_release(chains: _Chains, head: float, s: int, s2: int, k: int) -> float:
    """Earliest start of stage s's k-th backward from the work on stage s2 >= s before it,
    where no op of the pipeline starts before `head`."""
    model, _, _, down = chains
    if s2 == s:
        return head + (k + 1) * model.forward[s] + k * model.backward[s]
    work = (k + 1) * (model.forward[s2] + model.backward[s2])
    return head + work + down[s2] - down[s] - model.backward[s]


def _f_tail(chains: _Chains, s: int, s2: int, k: int) -> float:
    """Least time after stage s's k-th forward ends that the work of ranks k.. on s2 needs."""
    model, m, up, down = chains
    f, b, last = model.forward, model.backward, model.num_stages - 1
    if s2 == s:
        reach, work = 0.0, (m - k - 1) * f[s] + (m - k) * b[s]
    elif s2 > s:  # the forward chain up to s2
        reach, work = up[s] - up[s2] - f[s2], (m - k) * (f[s2] + b[s2])
    else:  # only backwards: up through the last stage and back down to s2
        reach, work = up[s] + b[last] + down[last] - down[s2] - b[s2], (m - k) * b[s2]
    weight_grads = (m - k) * model.weight_grad[s2] if model.weight_grad else 0.0
    # The last of those ops is a backward (then the chain down follows) or a weight gradient.
    return reach + work + max(down[s2], weight_grads)


def memory_rank_tables(problem: Problem) -> RankTables:
    """`rank_tables` with the backward releases and forward tails raised by each stage's
    node work (the one-machine argument per stage, which the rank chains leave out).

    Backward release, rank k of stage s: the k+1 micro-batches of B(s)'s ranks 0..k have each
    run F(s') and B(s') on the node of every later stage s' before; that node starts no op of
    the pipeline before its first forward's release, so the last of those 2(k+1) ops ends at
    least that release plus their work, and its micro-batch's B(s) starts at least the
    backward chain from s' to s after it. On stage s itself k+1 forwards and k backwards come
    first.

    Forward tail, rank k of stage s: the m-k micro-batches of ranks k..m-1 still run, after
    the k-th forward ends, every op of theirs on every stage s' (the forward of s itself only
    for ranks above k): on stage s' they start no earlier than the chain from s to s' after
    it, take their work on that node, and the last of them is followed by the backward chain
    down to stage 0 (or nothing, when it may be a weight gradient).
    """
    tables = rank_tables(problem)
    release, tail = dict(tables.release), dict(tables.tail)
    for p, pipeline in enumerate(problem.pipelines):
        m, stages = len(pipeline.microbatches), pipeline.model.num_stages
        chains = (pipeline.model, m, *_stage_chains(problem, pipeline))
        heads = [release[(p, s2, "F")][0] for s2 in range(stages)]
        for s in range(stages):
            release[(p, s, "B")] = [
                max([release[(p, s, "B")][k]] + [_b_release(chains, heads[s2], s, s2, k) for s2 in range(s, stages)])
                for k in range(m)
            ]
            tail[(p, s, "F")] = [
                max([tail[(p, s, "F")][k]] + [_f_tail(chains, s, s2, k) for s2 in range(stages)]) for k in range(m)
            ]
    return RankTables(release, tail)


def _node_groups(problem: Problem, makespan: float) -> list[list[_NodeGroup]]:
    tables = memory_rank_tables(problem)
    groups: list[list[_NodeGroup]] = [[] for _ in range(problem.num_nodes)]
    for p, pipeline in enumerate(problem.pipelines):
        model = pipeline.model
        for s in range(model.num_stages):
            f, w = model.forward[s], (model.weight_grad or (0.0,) * model.num_stages)[s]
            deadlines = [makespan - f - tail for tail in tables.tail[(p, s, "F")]]
            w_release = tables.release.get((p, s, "W"), [])
            releases = (tables.release[(p, s, "F")], deadlines, tables.release[(p, s, "B")], w_release)
            groups[pipeline.stage_nodes[s]].append(_NodeGroup(model.activation[s], f, model.backward[s], w, *releases))
    return groups


def _count(values: list[float], t: float, *, strict: bool) -> int:
    """How many of the sorted `values` are below `t` (at most `t` unless `strict`)."""
    return bisect.bisect_left(values, t) if strict else bisect.bisect_right(values, t)


def _held_at(groups: list[_NodeGroup], need: float, t: float, strict: bool) -> float:
    """Least activation a node can hold at time t when its ops started by t must add up to
    `need` of work: a fractional knapsack over the forwards it may still have started.

    Per group: backwards started by t are at most those released by t (and at most the
    forwards started); forwards started are at least those past their deadline. Backwards
    (and weight gradients) as early as they can be only lower the memory and add work, so
    they are taken in full; the missing work comes from extra forwards, cheapest activation
    per unit of work first.
    """
    held, work, extras = 0.0, 0.0, []
    for g in groups:
        f_max = _count(g.f_release, t, strict=strict)
        f_min = _count(g.f_deadline, t, strict=strict)
        b = min(_count(g.b_release, t, strict=strict), f_max)
        f = max(f_min, b)
        w = min(_count(g.w_release, t, strict=strict), b)
        held += g.activation * (f - b)
        work += g.forward * f + g.backward * b + g.weight_grad * w
        if f_max > f:
            extras.append((g.activation / g.forward, g.forward, f_max - f))
    for ratio, duration, count in sorted(extras):
        if work >= need:
            break
        used = min(count, (need - work) / duration)
        work += used * duration
        held += used * duration * ratio
    return held


def memory_bound_at(inst: Instance, makespan: float) -> float:
    """A lower bound on the peak activation per node of every schedule that ends by `makespan`.

    At any time t, a node's ops that have not started must still fit in (t, makespan], so
    the ops started by t carry at least its work less (makespan - t). Rank releases bound how
    many forwards, backwards and weight gradients of each stage can have started by t; rank
    tails give each forward a latest start (both with each stage's node work counted,
    `memory_rank_tables`: a backward waits for the forwards and backwards that must run
    before it on every later stage's node, and a forward is followed by the work of the
    micro-batches after it on every stage's node). The activation the node holds at t is at least
    the least a fractional knapsack of those counts allows (`_held_at`); the bound is its
    largest value over nodes and over the times where a count changes (both sides of each).
    It is not below the largest single activation: every forward holds its own.
    """
    problem = inst.problem
    work = [0.0] * problem.num_nodes
    for op in range(inst.num_ops):
        work[inst.node[op]] += inst.duration[op]
    tolerance = 1e-9 * max(1.0, makespan)
    best = max((d for d in inst.memory_delta if d > 0), default=0.0)
    for node, groups in enumerate(_node_groups(problem, makespan)):
        times = sorted({t for g in groups for t in (*g.f_release, *g.f_deadline, *g.b_release, *g.w_release)})
        for t in [*times, makespan]:
            if not 0 <= t <= makespan:
                continue
            need = work[node] - (makespan - t) - tolerance
            for strict in (True, False):
                best = max(best, _held_at(groups, need, t, strict))
    return best

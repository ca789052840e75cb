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
the search's memory phase stops once it is reached.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from nereus.solver.pipeline.model import Instance, Pipeline, Problem


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

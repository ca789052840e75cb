"""Lower bounds on a schedule's makespan, and the memory reference bound.

Latency (each a valid lower bound on every schedule of the problem):
* critical path: the longest dependency chain (one micro-batch through every stage and back);
* node work: the busiest node's total op time;
* average work: all op time spread evenly over the nodes;
* arrival + work + tail: on each node, the earliest any of its ops can start, plus its work,
  plus the shortest chain that must follow its last op.

Memory: the serial 1F1B peak, max over models of the first stage's in-flight activations
(min(S, m) micro-batches). RLHFuse reports it as the fused schedule's memory lower bound; it
is a reference (a slow schedule holding one micro-batch at a time goes below it), and
the search's memory phase stops once it is reached.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.solver.pipeline.model import Instance, Problem


@dataclass(frozen=True)
class LowerBounds:
    """Each latency bound and the memory reference bound."""

    critical_path: float
    node_work: float
    average_work: float
    arrival_work_tail: float
    memory: float

    @property
    def latency(self) -> float:
        return max(self.critical_path, self.node_work, self.average_work, self.arrival_work_tail)


def _topological(inst: Instance) -> list[int]:
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
    order = _topological(inst)
    head = [0.0] * inst.num_ops
    for op in order:
        for succ, lat in inst.succs[op]:
            head[succ] = max(head[succ], head[op] + inst.duration[op] + lat)
    tail = [0.0] * inst.num_ops
    for op in reversed(order):
        for succ, lat in inst.succs[op]:
            tail[op] = max(tail[op], lat + inst.duration[succ] + tail[succ])
    return head, tail


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
        memory=memory_bound(inst.problem),
    )

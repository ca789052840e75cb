"""Event-driven list scheduling: whenever a node is idle, it starts its best ready op.

"Ready" means every dependency has ended (plus latency), the node's activation memory
stays within the cap, and the op's pipeline stage has fewer in-flight micro-batches than
its window (1F1B keeps at most S - s micro-batches in flight on stage s). With
`sequences`, each (pipeline, stage) also runs its ops in a fixed order (`stage_sequences`:
1F1B with a chosen warm-up), and the scheduler only decides how a node interleaves its
stages' sequences. Ties between ready ops go to the lowest priority key. The result is a per-node order that the
evaluator reproduces exactly (the list schedule never delays an op it could start).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from nereus.solver.pipeline.model import Instance, OpKey, OpKind, Pipeline

PriorityKey = Callable[[int], tuple[float, ...]]

#: Kind order inside a pipeline: backward first (frees memory), then forward, then weight grads.
KIND_RANK = {"B": 0, "F": 1, "W": 2}


@dataclass(frozen=True)
class GreedyRule:
    """One list-scheduling rule: who goes first and whether 1F1B windows apply."""

    name: str
    model_order: tuple[str, ...]
    """Models earlier in this tuple win ties (the fused greedy puts the actor first)."""
    windows: bool
    """Limit stage s of an S-stage pipeline to S - s in-flight micro-batches (1F1B memory)."""
    tails: tuple[float, ...] | None = None
    """When given, the op with the longest chain still to follow (its tail) goes first."""


def window_limits(inst: Instance) -> list[int]:
    """Per op: the in-flight limit of its (pipeline, stage)."""
    pipelines = inst.problem.pipelines
    return [pipelines[inst.pipeline_of[op]].model.num_stages - inst.keys[op].stage for op in range(inst.num_ops)]


def rule_key(inst: Instance, rule: GreedyRule) -> PriorityKey:
    rank = {name: i for i, name in enumerate(rule.model_order)}

    tails = rule.tails

    def key(op: int) -> tuple[float, ...]:
        k = inst.keys[op]
        tie = (rank.get(k.model, len(rank)), KIND_RANK[k.kind], k.microbatch, k.replica, -k.stage)
        return tie if tails is None else (-tails[op], *tie)

    return key


def stage_sequences(inst: Instance, extra: Mapping[str, int]) -> list[list[int]]:
    """Per (pipeline, stage): its forwards and backwards in 1F1B order with a warm-up of
    min(m, S - s + extra[model]) forwards (then one backward, one forward, ...), and its
    weight gradients (split backwards) in micro-batch order as a sequence of their own.

    The warm-ups do not grow with the stage, so the sequences of one pipeline never wait on
    each other in a cycle: list scheduling under them cannot deadlock. Stage s then holds at
    most its warm-up in flight, so `extra` is the memory a model may spend beyond 1F1B.
    """
    sequences = []
    for pipeline in inst.problem.pipelines:
        model, m = pipeline.model, len(pipeline.microbatches)
        for stage in range(model.num_stages):
            warmup = max(1, min(m, model.num_stages - stage + extra.get(model.name, 0)))
            forwards, backwards = _stage_ops(inst, pipeline, stage, "F"), _stage_ops(inst, pipeline, stage, "B")
            sequence = forwards[:warmup]
            for i, backward in enumerate(backwards):
                sequence += [backward, *forwards[i + warmup : i + warmup + 1]]
            sequences.append(sequence)
            if model.weight_grad:
                sequences.append(_stage_ops(inst, pipeline, stage, "W"))
    return sequences


def _stage_ops(inst: Instance, pipeline: Pipeline, stage: int, kind: OpKind) -> list[int]:
    """The ops of one kind of a pipeline's stage, in micro-batch order."""
    model, replica = pipeline.model.name, pipeline.replica
    return [inst.index[OpKey(model, replica, mb, stage, kind)] for mb in pipeline.microbatches]


def list_schedule(
    inst: Instance,
    key: PriorityKey,
    limits: Sequence[int] | None = None,
    cap: float | None = None,
    sequences: Sequence[Sequence[int]] | None = None,
) -> list[list[int]] | None:
    """Per-node orders from list scheduling, or None when the cap or windows block every node.

    With `sequences` (every op in exactly one), an op is ready only once the ops before it
    in its sequence have started.
    """
    n_nodes = inst.problem.num_nodes
    gate = None if sequences is None else _Sequences(inst.num_ops, sequences)
    remaining = [len(p) for p in inst.preds]
    ready_at = [0.0] * inst.num_ops
    pending: list[list[int]] = [[] for _ in range(n_nodes)]
    for op in range(inst.num_ops):
        if not remaining[op]:
            pending[inst.node[op]].append(op)
    in_flight: dict[tuple[int, int], int] = {}
    held = [0.0] * n_nodes
    free_at = [0.0] * n_nodes
    orders: list[list[int]] = [[] for _ in range(n_nodes)]
    events: list[tuple[float, int]] = []  # (time, op that ends then; -1 for a wake-up)
    keys = [key(op) for op in range(inst.num_ops)]
    now, scheduled = 0.0, 0
    while scheduled < inst.num_ops:
        for node in range(n_nodes):
            if free_at[node] > now:
                continue
            op = _pick(inst, pending[node], keys, ready_at, now, limits, in_flight, held[node], cap, gate)
            if op < 0:
                continue
            if gate is not None:
                gate.started(op)
            pending[node].remove(op)
            orders[node].append(op)
            scheduled += 1
            free_at[node] = now + inst.duration[op]
            if inst.memory_delta[op] > 0:
                held[node] += inst.memory_delta[op]
                slot = (inst.pipeline_of[op], inst.keys[op].stage)
                in_flight[slot] = in_flight.get(slot, 0) + 1
            heapq.heappush(events, (free_at[node], op))
        if not events:
            return None if scheduled < inst.num_ops else orders
        now = events[0][0]
        while events and events[0][0] <= now:
            time, op = heapq.heappop(events)
            if op >= 0:
                _finish(inst, op, time, remaining, ready_at, pending, events, held, in_flight)
    return orders


def _pick(
    inst: Instance,
    candidates: list[int],
    keys: list[tuple[float, ...]],
    ready_at: list[float],
    now: float,
    limits: Sequence[int] | None,
    in_flight: dict[tuple[int, int], int],
    held: float,
    cap: float | None,
    gate: _Sequences | None = None,
) -> int:
    best, best_key = -1, None
    for op in candidates:
        if ready_at[op] > now or (gate is not None and not gate.is_next(op)):
            continue
        grow = inst.memory_delta[op]
        if grow > 0:
            if cap is not None and held + grow > cap * (1 + 1e-12):
                continue
            if limits is not None and in_flight.get((inst.pipeline_of[op], inst.keys[op].stage), 0) >= limits[op]:
                continue
        if best_key is None or keys[op] < best_key:
            best, best_key = op, keys[op]
    return best


def _finish(
    inst: Instance,
    op: int,
    time: float,
    remaining: list[int],
    ready_at: list[float],
    pending: list[list[int]],
    events: list[tuple[float, int]],
    held: list[float],
    in_flight: dict[tuple[int, int], int],
) -> None:
    """`op` ended at `time`: release its memory, wake its successors."""
    node = inst.node[op]
    if inst.memory_delta[op] < 0:
        held[node] += inst.memory_delta[op]
        slot = (inst.pipeline_of[op], inst.keys[op].stage)
        in_flight[slot] -= 1
    for succ, lat in inst.succs[op]:
        remaining[succ] -= 1
        ready_at[succ] = max(ready_at[succ], time + lat)
        if not remaining[succ]:
            pending[inst.node[succ]].append(succ)
            if lat > 0:
                heapq.heappush(events, (ready_at[succ], -1))


class _Sequences:
    """Which op of each sequence may start next."""

    def __init__(self, num_ops: int, sequences: Sequence[Sequence[int]]) -> None:
        self.sequence_of, self.position = [0] * num_ops, [0] * num_ops
        for q, sequence in enumerate(sequences):
            for i, op in enumerate(sequence):
                self.sequence_of[op], self.position[op] = q, i
        self.head = [0] * len(sequences)

    def is_next(self, op: int) -> bool:
        return self.head[self.sequence_of[op]] == self.position[op]

    def started(self, op: int) -> None:
        self.head[self.sequence_of[op]] += 1

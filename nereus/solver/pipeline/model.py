"""The pipeline-schedule problem: models, their replicas on nodes, and the ops they run.

A problem has `num_nodes` pipeline nodes (a node is one pipeline position's GPU group)
and one or more *pipelines*: a replica of a model whose stage `s` runs on node
`stage_nodes[s]` and which processes a subset of the model's micro-batches. Every
micro-batch `mb` of a pipeline with `S` stages yields the ops

    F(mb, s) for s = 0..S-1, B(mb, s) for s = S-1..0 and, when the backward is split,
    W(mb, s) (weight gradient) after B(mb, s).

Dependencies: F(mb, s) after F(mb, s-1); B(mb, S-1) after F(mb, S-1); B(mb, s) after
B(mb, s+1); W(mb, s) after B(mb, s). An edge between different nodes adds the p2p
latency. Memory: F(mb, s) allocates the stage's activation when it starts and B(mb, s)
(the input-gradient pass, which consumes the stored activations) releases it when it ends.

The hot loops work on `Instance`, the problem flattened into plain lists indexed by op id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from nereus.errors import NereusError

OpKind = Literal["F", "B", "W"]
KINDS: tuple[OpKind, ...] = ("F", "B", "W")


@dataclass(frozen=True)
class ModelTimes:
    """One model's training pipeline: stages, micro-batches, per-stage times and memory."""

    name: str
    """Model name as it appears in schedules, e.g. `actor`."""
    num_microbatches: int
    """Micro-batches of one training step, over all replicas of this model."""
    forward: tuple[float, ...]
    """Forward time of one micro-batch, per pipeline stage."""
    backward: tuple[float, ...]
    """Backward time per stage: the whole backward, or its input-gradient part with `weight_grad`."""
    activation: tuple[float, ...]
    """Activation memory one in-flight micro-batch holds, per stage."""
    weight_grad: tuple[float, ...] | None = None
    """Weight-gradient time per stage when the backward is split (zero-bubble schedules)."""

    def __post_init__(self) -> None:
        num_stages = len(self.forward)
        lengths = {len(self.backward), len(self.activation), len(self.weight_grad or self.forward)}
        if num_stages < 1 or lengths != {num_stages}:
            raise NereusError(f"model {self.name}: forward, backward and activation need one value per stage")
        if self.num_microbatches < 1:
            raise NereusError(f"model {self.name}: needs at least one micro-batch, got {self.num_microbatches}")
        values = [*self.forward, *self.backward, *self.activation, *(self.weight_grad or ())]
        if any(not v >= 0 for v in values) or any(not t > 0 for t in (*self.forward, *self.backward)):
            raise NereusError(f"model {self.name}: times must be positive and activations non-negative")

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @classmethod
    def uniform(
        cls,
        name: str,
        num_stages: int,
        num_microbatches: int,
        forward: float,
        backward: float,
        activation: float = 1.0,
        weight_grad: float | None = None,
    ) -> ModelTimes:
        """Every stage alike (the explicit command-line form)."""
        if num_stages < 1:
            raise NereusError(f"model {name}: needs at least one stage, got {num_stages}")
        return cls(
            name,
            num_microbatches,
            (forward,) * num_stages,
            (backward,) * num_stages,
            (activation,) * num_stages,
            None if weight_grad is None else (weight_grad,) * num_stages,
        )


@dataclass(frozen=True)
class Pipeline:
    """One replica of a model placed on nodes, with the micro-batches it processes."""

    model: ModelTimes
    replica: int
    """Replica index within its model (0 when the model runs once)."""
    stage_nodes: tuple[int, ...]
    """Node of each pipeline stage."""
    microbatches: tuple[int, ...]
    """The model's micro-batch ids this replica processes, in index order."""


@dataclass(frozen=True)
class Problem:
    """Pipelines on `num_nodes` nodes, a p2p latency and an optional per-node activation cap."""

    num_nodes: int
    pipelines: tuple[Pipeline, ...]
    p2p_latency: float = 0.0
    """Added to every dependency edge between two different nodes."""
    activation_cap: float | None = None
    """Activation memory a node may hold at once; None for no limit."""

    def __post_init__(self) -> None:
        for pipeline in self.pipelines:
            if len(pipeline.stage_nodes) != pipeline.model.num_stages:
                raise NereusError(f"model {pipeline.model.name}: one node per stage needed")
            if any(not 0 <= n < self.num_nodes for n in pipeline.stage_nodes):
                raise NereusError(f"model {pipeline.model.name}: stage nodes must lie in 0..{self.num_nodes - 1}")
        if self.p2p_latency < 0:
            raise NereusError(f"p2p latency must be >= 0, got {self.p2p_latency}")

    @property
    def models(self) -> tuple[ModelTimes, ...]:
        """Distinct models, in order of first appearance."""
        return tuple(dict.fromkeys(p.model for p in self.pipelines))


@dataclass(frozen=True)
class OpKey:
    """What an op is: model, replica, micro-batch, stage and kind."""

    model: str
    replica: int
    microbatch: int
    stage: int
    kind: OpKind


@dataclass
class Instance:
    """A problem flattened for the hot loops: op id -> node, duration, memory, edges."""

    problem: Problem
    keys: list[OpKey]
    pipeline_of: list[int]
    node: list[int]
    duration: list[float]
    memory_delta: list[float]
    """+activation for F (at its start), -activation for the releasing B (at its end), else 0."""
    preds: list[list[tuple[int, float]]]
    """(predecessor op, edge latency) per op."""
    succs: list[list[tuple[int, float]]] = field(default_factory=list)
    index: dict[OpKey, int] = field(default_factory=dict)

    @property
    def num_ops(self) -> int:
        return len(self.keys)

    def ops_on(self, node: int) -> list[int]:
        return [op for op in range(self.num_ops) if self.node[op] == node]


def _latency(problem: Problem, a: int, b: int) -> float:
    return problem.p2p_latency if a != b else 0.0


def build_instance(problem: Problem) -> Instance:
    """Enumerate every op of `problem` with its dependencies."""
    inst = Instance(problem, [], [], [], [], [], [])
    for p_index, pipeline in enumerate(problem.pipelines):
        model, nodes = pipeline.model, pipeline.stage_nodes
        last = model.num_stages - 1
        for mb in pipeline.microbatches:
            ids: dict[tuple[OpKind, int], int] = {}
            kinds: tuple[OpKind, ...] = ("F", "B", "W") if model.weight_grad else ("F", "B")
            for kind in kinds:
                for stage in range(model.num_stages):
                    times = {"F": model.forward, "B": model.backward, "W": model.weight_grad or ()}[kind]
                    delta = {"F": model.activation[stage], "B": -model.activation[stage], "W": 0.0}[kind]
                    key = OpKey(model.name, pipeline.replica, mb, stage, kind)
                    ids[(kind, stage)] = inst.num_ops
                    inst.index[key] = inst.num_ops
                    inst.keys.append(key)
                    inst.pipeline_of.append(p_index)
                    inst.node.append(nodes[stage])
                    inst.duration.append(float(times[stage]))
                    inst.memory_delta.append(float(delta))
                    inst.preds.append([])
            for stage in range(model.num_stages):
                if stage:
                    lat = _latency(problem, nodes[stage - 1], nodes[stage])
                    inst.preds[ids[("F", stage)]].append((ids[("F", stage - 1)], lat))
                if stage < last:
                    lat = _latency(problem, nodes[stage + 1], nodes[stage])
                    inst.preds[ids[("B", stage)]].append((ids[("B", stage + 1)], lat))
                if model.weight_grad:
                    inst.preds[ids[("W", stage)]].append((ids[("B", stage)], 0.0))
            inst.preds[ids[("B", last)]].append((ids[("F", last)], 0.0))
    inst.succs = [[] for _ in range(inst.num_ops)]
    for op, preds in enumerate(inst.preds):
        for pred, lat in preds:
            inst.succs[pred].append((op, lat))
    return inst


def split_evenly(num_items: int, num_parts: int) -> list[tuple[int, ...]]:
    """Consecutive ids 0..num_items-1 in `num_parts` parts whose sizes differ by at most one."""
    base, extra = divmod(num_items, num_parts)
    parts, start = [], 0
    for part in range(num_parts):
        size = base + (part < extra)
        parts.append(tuple(range(start, start + size)))
        start += size
    return parts


def replicas(model: ModelTimes, num_nodes: int, *, reverse: bool) -> list[Pipeline]:
    """The model as num_nodes / stages replicas side by side, micro-batches split evenly.

    Replica r's stage s runs on node r * S + s, or on node N - 1 - (r * S + s) when
    `reverse` (the second model of a bidirectional fused pipeline).
    """
    stages = model.num_stages
    if num_nodes % stages:
        raise NereusError(
            f"model {model.name} has {stages} pipeline stages, which do not divide the {num_nodes} nodes; "
            "pick stage counts where the smaller divides the larger"
        )
    count = num_nodes // stages
    if model.num_microbatches < count:
        raise NereusError(
            f"model {model.name} runs as {count} replicas but has only {model.num_microbatches} micro-batches; "
            f"give at least {count}"
        )
    out = []
    for r, mbs in enumerate(split_evenly(model.num_microbatches, count)):
        nodes = [r * stages + s for s in range(stages)]
        if reverse:
            nodes = [num_nodes - 1 - n for n in nodes]
        out.append(Pipeline(model, r, tuple(nodes), mbs))
    return out


def fused_problem(
    actor: ModelTimes, critic: ModelTimes, p2p_latency: float = 0.0, activation_cap: float | None = None
) -> Problem:
    """Actor stages on nodes 0..N-1, critic stages the other way round; N = the larger stage count.

    The model with fewer stages runs as N / S replicas that split its micro-batches.
    """
    num_nodes = max(actor.num_stages, critic.num_stages)
    pipelines = replicas(actor, num_nodes, reverse=False) + replicas(critic, num_nodes, reverse=True)
    return Problem(num_nodes, tuple(pipelines), p2p_latency, activation_cap)


def single_problem(model: ModelTimes, num_nodes: int, p2p_latency: float = 0.0, *, reverse: bool = False) -> Problem:
    """One model alone on the nodes (replicated when it has fewer stages)."""
    return Problem(num_nodes, tuple(replicas(model, num_nodes, reverse=reverse)), p2p_latency)

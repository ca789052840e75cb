"""Baseline schedules on the same evaluator: GPipe, 1F1B, interleaved 1F1B, ZB-H1, Chimera, serial.

Closed forms with uniform stage times F and B, p stages and m micro-batches (pinned by tests):
GPipe and 1F1B take (m + p - 1)(F + B); interleaved 1F1B with v chunks per node takes
m (F + B) + (p - 1)(F + B) / v; ZB-H1 (backward split into B and W) takes
m (F + B + W) + (p - 1)(F + B - W) when F = B = W.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nereus.errors import NereusError
from nereus.solver.pipeline.evaluate import evaluate
from nereus.solver.pipeline.greedy import KIND_RANK, list_schedule, window_limits
from nereus.solver.pipeline.model import (
    Instance,
    ModelTimes,
    OpKey,
    Pipeline,
    Problem,
    build_instance,
    replicas,
)


@dataclass(frozen=True)
class BaselineResult:
    """A baseline's makespan and peak activation memory (max over nodes)."""

    name: str
    makespan: float
    peak_memory: float
    bubble_ratio: float


def _per_stage_orders(inst: Instance, sequence: dict[tuple[int, int], list[tuple[str, int]]]) -> list[list[int]]:
    """Node orders from per-(pipeline, stage) sequences of (kind, micro-batch index within the pipeline)."""
    orders: list[list[int]] = [[] for _ in range(inst.problem.num_nodes)]
    for p_index, pipeline in enumerate(inst.problem.pipelines):
        for stage in range(pipeline.model.num_stages):
            for kind, k in sequence[(p_index, stage)]:
                key = (pipeline.model.name, pipeline.replica, pipeline.microbatches[k], stage, kind)
                op = inst.index[OpKey(*key)]  # type: ignore[arg-type]
                orders[pipeline.stage_nodes[stage]].append(op)
    return orders


def one_f_one_b(inst: Instance) -> list[list[int]]:
    """1F1B: stage s warms up with S - s - 1 forwards, then alternates, then drains backwards."""
    sequence = {}
    for p_index, pipeline in enumerate(inst.problem.pipelines):
        stages, m = pipeline.model.num_stages, len(pipeline.microbatches)
        for stage in range(stages):
            warmup = min(stages - stage - 1, m)
            seq = [("F", k) for k in range(warmup)]
            for k in range(m - warmup):
                seq += [("F", warmup + k), ("B", k)]
            seq += [("B", k) for k in range(m - warmup, m)]
            if pipeline.model.weight_grad:
                seq = [item for kind, k in seq for item in ([(kind, k)] + ([("W", k)] if kind == "B" else []))]
            sequence[(p_index, stage)] = seq
    return _per_stage_orders(inst, sequence)


def gpipe(inst: Instance) -> list[list[int]]:
    """GPipe: every forward, then every backward."""
    sequence = {}
    for p_index, pipeline in enumerate(inst.problem.pipelines):
        m = len(pipeline.microbatches)
        back = ["B", "W"] if pipeline.model.weight_grad else ["B"]
        for stage in range(pipeline.model.num_stages):
            seq = [("F", k) for k in range(m)] + [(kind, k) for k in range(m) for kind in back]
            sequence[(p_index, stage)] = seq
    return _per_stage_orders(inst, sequence)


def interleaved_problem(model: ModelTimes, num_nodes: int, chunks: int, p2p_latency: float = 0.0) -> Problem:
    """The model cut into num_nodes * chunks virtual stages; virtual stage s runs on node s % num_nodes.

    `model`'s per-stage times are per node; each chunk gets 1 / chunks of them.
    """
    if model.num_stages != num_nodes:
        raise NereusError("interleaved 1F1B needs one model stage per node")
    if model.num_microbatches % num_nodes:
        raise NereusError(
            f"interleaved 1F1B needs micro-batches ({model.num_microbatches}) divisible by the stages ({num_nodes})"
        )

    def cut(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(values[s % num_nodes] / chunks for s in range(num_nodes * chunks))

    virtual = replace(
        model,
        forward=cut(model.forward),
        backward=cut(model.backward),
        activation=cut(model.activation),
        weight_grad=None if model.weight_grad is None else cut(model.weight_grad),
    )
    nodes = tuple(s % num_nodes for s in range(num_nodes * chunks))
    return Problem(num_nodes, (Pipeline(virtual, 0, nodes, tuple(range(model.num_microbatches))),), p2p_latency)


def interleaved_one_f_one_b(inst: Instance, chunks: int) -> list[list[int]]:
    """Megatron's interleaved 1F1B order on an `interleaved_problem`."""
    (pipeline,) = inst.problem.pipelines
    p, m = inst.problem.num_nodes, len(pipeline.microbatches)
    orders: list[list[int]] = [[] for _ in range(p)]

    def op(node: int, k: int, kind: str) -> int:
        group, within = divmod(k, p * chunks)
        chunk = within // p if kind == "F" else chunks - 1 - within // p
        mb = pipeline.microbatches[group * p + within % p]
        return inst.index[OpKey(pipeline.model.name, 0, mb, chunk * p + node, kind)]  # type: ignore[arg-type]

    total = m * chunks
    for node in range(p):
        warmup = min((p - node - 1) * 2 + (chunks - 1) * p, total)
        seq = [op(node, k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            seq += [op(node, warmup + k, "F"), op(node, k, "B")]
        seq += [op(node, k, "B") for k in range(total - warmup, total)]
        orders[node] = seq
    return orders


def zero_bubble_h1(inst: Instance) -> list[list[int]]:
    """ZB-H1: 1F1B memory windows; an idle node runs a backward, else a forward, else a weight grad."""

    def key(op: int) -> tuple[float, ...]:
        k = inst.keys[op]
        return (KIND_RANK[k.kind], k.microbatch, -k.stage)

    orders = list_schedule(inst, key, window_limits(inst))
    assert orders is not None, "1F1B windows never block every node"
    return orders


def chimera_problem(model: ModelTimes, num_nodes: int, p2p_latency: float = 0.0) -> Problem:
    """Chimera-style bidirectional pipelines: each replica's micro-batches in two halves, the
    first down its nodes, the second up the mirrored nodes. Splitting per replica (not the
    model's micro-batches per direction) keeps every replica busy when it has a single
    micro-batch: that one runs down only."""
    pipelines: list[Pipeline] = []
    for direction in (0, 1):
        for replica in replicas(model, num_nodes, reverse=bool(direction)):
            down = (len(replica.microbatches) + 1) // 2
            half = replica.microbatches[:down] if direction == 0 else replica.microbatches[down:]
            if half:
                pipelines.append(Pipeline(model, len(pipelines), replica.stage_nodes, half))
    return Problem(num_nodes, tuple(pipelines), p2p_latency)


def chimera(inst: Instance) -> list[list[int]]:
    """Both directions list-scheduled: the best of backward-first / forward-first, with and without windows.

    Ties go to the older micro-batch; the lowest makespan wins, then the lower peak memory.
    """
    best: tuple[float, float, list[list[int]]] | None = None
    for forward_first in (False, True):
        for limits in (window_limits(inst), None):

            def key(op: int, forward_first: bool = forward_first) -> tuple[float, ...]:
                k = inst.keys[op]
                rank = KIND_RANK[k.kind] if not forward_first else (k.kind != "F")
                return (rank, k.microbatch, -k.stage)

            orders = list_schedule(inst, key, limits)
            assert orders is not None, "without a memory cap list scheduling never blocks"
            ev = evaluate(inst, orders)
            if best is None or (ev.makespan, ev.max_peak_memory) < best[:2]:
                best = (ev.makespan, ev.max_peak_memory, orders)
    assert best is not None
    return best[2]


def _result(name: str, inst: Instance, orders: list[list[int]]) -> BaselineResult:
    ev = evaluate(inst, orders)
    assert ev.ok, (name, ev.violations, ev.deadlocked)
    return BaselineResult(name, ev.makespan, ev.max_peak_memory, ev.bubble_ratio)


def _serial(name: str, parts: list[BaselineResult], num_nodes: int, busy: float) -> BaselineResult:
    makespan = sum(p.makespan for p in parts)
    return BaselineResult(name, makespan, max(p.peak_memory for p in parts), 1.0 - busy / (num_nodes * makespan))


def pair_baselines(actor: ModelTimes, critic: ModelTimes, p2p_latency: float = 0.0) -> dict[str, BaselineResult]:
    """Serial 1F1B (actor then critic) and serial Chimera-style, on the fused problem's nodes."""
    num_nodes = max(actor.num_stages, critic.num_stages)
    busy = 0.0
    ones, chimeras = [], []
    for index, model in enumerate((actor, critic)):
        inst = build_instance(Problem(num_nodes, tuple(replicas(model, num_nodes, reverse=bool(index))), p2p_latency))
        busy += sum(inst.duration)
        ones.append(_result(f"1f1b-{model.name}", inst, one_f_one_b(inst)))
        chimera_inst = build_instance(chimera_problem(model, num_nodes, p2p_latency))
        chimeras.append(_result(f"chimera-{model.name}", chimera_inst, chimera(chimera_inst)))
    return {
        "serial-1f1b": _serial("serial-1f1b", ones, num_nodes, busy),
        "serial-chimera": _serial("serial-chimera", chimeras, num_nodes, busy),
    }


__all__ = [
    "BaselineResult",
    "chimera",
    "chimera_problem",
    "gpipe",
    "interleaved_one_f_one_b",
    "interleaved_problem",
    "one_f_one_b",
    "pair_baselines",
    "zero_bubble_h1",
]

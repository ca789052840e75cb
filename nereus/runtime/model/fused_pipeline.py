"""The fused actor-critic pipeline executor: RLHFuse's intra-stage fusion on real ranks.

Actor and critic train with the same pp on the same ranks: actor stage s and critic stage
N-1-s share a rank, so the two pipelines run in opposite directions and each fills the
other's bubbles. Every rank runs its node's ops of a fused `Schedule` (`nereus schedule
fuse`, or `fused_schedule(plan)`) in the schedule's order, both models interleaved: sends
never block, receives wait for their data, and each model's messages carry their own tag
channel, so an actor activation and a critic gradient between the same two ranks never
match each other. Before anything runs, the whole schedule (every node, both models) is
checked to finish without all ranks waiting on each other. Each rank posts its sends to a
peer in the order the peer receives them (`OrderedSends`), so the messages also match where
the backend pairs them by order rather than by tag (NCCL).

The gradients are exactly those of separate actor and critic training: each model's
micro-batches, loss normalisation and gradient reduction are its engine's own
(`Engine.begin_forward_backward` / `finish_forward_backward`); only the op order differs.

The executor also measures what it holds: after every op, the micro-batches each model's
lane keeps for a backward (forwarded, not yet backwarded: the schedule's in-flight
activations) and the bytes of the tensors autograd saves for those backwards (`SavedBytes`,
parameters excluded). `activation_peak` folds them into the rank's peak, which the
schedule's evaluator predicts (`schedule_peaks`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nereus.runtime.model.engine import Engine, local
from nereus.runtime.model.losses import Objective
from nereus.runtime.model.pipeline import (
    Op,
    PipelineLane,
    Sends,
    StageOp,
    blocked_heads,
    check_stage_ops,
    op_lists_from_schedule,
    parse_op,
)
from nereus.runtime.model.transformer import Batch

if TYPE_CHECKING:
    from nereus.spec.schedule import Schedule


@dataclass(frozen=True)
class FusedPart:
    """One model of the fused pipeline on this rank and what it trains on."""

    name: str
    """The model's name in the schedule (`actor`, `critic`)."""
    engine: Engine
    batch: Batch
    """The global mini-batch (each replica takes its rows, as in `Engine.forward_backward`)."""
    objective: Objective


@dataclass(frozen=True)
class OpTiming:
    """When one op of the fused pipeline ran on one rank (`time.perf_counter` readings of
    that rank's process; subtract a reading taken on the same rank, e.g. the step's start)."""

    rank: int
    model: str
    """The schedule's model name (`actor`, `critic`)."""
    kind: str
    """F (forward) or B (backward)."""
    microbatch: int
    stage: int
    """The model's pipeline stage on this rank."""
    start: float
    """The rank began the op (from here to `ready` it waited for its input)."""
    ready: float
    """Its input had arrived and compute began."""
    end: float
    """Compute done and the output's send posted."""
    update: int = 0
    """Which optimizer update of the training phase the op belongs to (epoch-major, then
    mini-batch; set by the RL step, 0 for a lone `fused_train_step`)."""
    live: tuple[tuple[str, int], ...] = ()
    """After the op: per model (the schedule's name), the micro-batches its lane on this rank
    holds for a backward (forwarded, not yet backwarded), read from the lane itself."""
    saved_bytes: int = 0
    """After the op: bytes of the tensors autograd keeps for this rank's pending backwards
    (both models, each storage once, parameters excluded; `SavedBytes`)."""


def schedule_node_ops(schedule: Schedule) -> list[list[StageOp]]:
    """Every node's ops of a single-replica-per-model `Schedule`, as (model, stage, op) with
    the model's local micro-batch ids (see `op_lists_from_schedule`)."""
    local = {}
    for record in schedule.models:
        if len(record.replica_microbatches) != 1:
            raise ValueError(
                f"schedule model {record.name!r} runs as {len(record.replica_microbatches)} replicas; "
                "the fused executor runs models with the same pp (one replica each)"
            )
        local[record.name] = {mb: index for index, mb in enumerate(record.replica_microbatches[0])}
    node_ops: list[list[StageOp]] = [[] for _ in range(schedule.num_nodes)]
    for node in schedule.nodes:
        for op in node.ops:
            node_ops[node.node].append(
                (op.model, op.stage, parse_op({"kind": op.kind, "microbatch": local[op.model][op.microbatch]}))
            )
    return node_ops


def check_fused_schedule(schedule: Schedule) -> list[list[StageOp]]:
    """Every node's ops after checking that each model's stages run each of its micro-batches'
    F and B once (B after F) and that the nodes finish without all waiting on each other;
    ValueError otherwise."""
    node_ops = schedule_node_ops(schedule)
    num_stages = {record.name: len(record.forward) for record in schedule.models}
    for record in schedule.models:
        check_stage_ops(op_lists_from_schedule(schedule, record.name), record.microbatches, True, f"{record.name} ")
    stuck = blocked_heads(node_ops, num_stages)
    if stuck:
        heads = ", ".join(f"node {node} at {model} {op} of stage {stage}" for node, (model, stage, op) in stuck)
        raise ValueError(f"fused pipeline schedule deadlocks: {heads} wait on each other")
    return node_ops


#: A message between two nodes: (model, kind of the op that sends and receives it, micro-batch).
Message = tuple[str, str, int]


def message_orders(
    schedule: Schedule, node_ops: list[list[StageOp]]
) -> tuple[dict[tuple[int, int], list[Message]], dict[tuple[int, int], list[Message]]]:
    """Per (source node, destination node): the messages in the order the source's ops
    produce them, and in the order the destination's ops receive them."""
    nodes = {record.name: record.replica_nodes[0] for record in schedule.models}
    produced: dict[tuple[int, int], list[Message]] = {}
    received: dict[tuple[int, int], list[Message]] = {}
    for node, ops in enumerate(node_ops):
        for model, stage, op in ops:
            last = len(nodes[model]) - 1
            # F receives from stage - 1 and sends to stage + 1; B the other way round.
            step = 1 if op.kind == "F" else -1
            message = (model, op.kind, op.microbatch)
            if 0 <= stage - step <= last:
                received.setdefault((nodes[model][stage - step], node), []).append(message)
            if 0 <= stage + step <= last:
                produced.setdefault((node, nodes[model][stage + step]), []).append(message)
    assert {pair: sorted(m) for pair, m in produced.items()} == {pair: sorted(m) for pair, m in received.items()}
    return produced, received


class OrderedSends(Sends):
    """Sends to each peer posted in the order the peer receives them (NCCL matches a pair's
    messages in posting order, not by tag). A message produced early is held (the rank goes
    on: posting never blocks) until those the peer receives before it are posted. A peer
    waiting for message k has received every message before it, so those were posted and k
    is posted the moment it is produced: holding adds no wait the deadlock check missed."""

    def __init__(self, node: int, received: dict[tuple[int, int], list[Message]]):
        super().__init__()
        self.queues = {dst: deque(messages) for (src, dst), messages in received.items() if src == node}
        self.queue_of = {message: dst for dst, queue in self.queues.items() for message in queue}
        self.held: dict[Message, tuple[torch.Tensor, int, int, Any]] = {}

    def post(self, lane: str, op: Op, tensor: torch.Tensor, dst: int, tag: int, group: Any) -> None:
        message = (lane, op.kind, op.microbatch)
        self.held[message] = (tensor, dst, tag, group)
        queue = self.queues[self.queue_of[message]]
        while queue and queue[0] in self.held:
            first = queue.popleft()
            super().post(first[0], Op(first[1], first[2]), *self.held.pop(first))  # type: ignore[arg-type]

    def wait(self) -> None:
        assert not self.held, f"messages never posted: {sorted(self.held)}"
        super().wait()


def node_of(schedule: Schedule, part: FusedPart) -> int:
    """The schedule node this rank is, from where `part`'s stage runs."""
    record = next((r for r in schedule.models if r.name == part.name), None)
    if record is None:
        raise ValueError(f"schedule has no model {part.name!r}")
    groups = part.engine.groups
    if len(record.forward) != groups.layout.pp:
        raise ValueError(
            f"schedule model {part.name!r} has {len(record.forward)} stages, its engine pp={groups.layout.pp}"
        )
    return record.replica_nodes[0][groups.pp_rank]


class SavedBytes:
    """The bytes of the tensors autograd saves for backward while `hooks()` is active, live
    now: each storage counted once while some saved tensor still refers to it, and released
    when autograd drops the last one (after the backward that uses it). Weights saved by
    matmuls are left out, they are not activations: the storages of `parameters` (a DTensor's
    local rows) and any `nn.Parameter` or view of one (FSDP2's gathered weights, which exist
    only between its all-gather and its reshard)."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self.excluded = {local(param).untyped_storage().data_ptr() for param in parameters}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.bytes = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context under which forwards' saved tensors are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        root = tensor if tensor._base is None else tensor._base
        if key in self.excluded or storage.nbytes() == 0 or isinstance(root, torch.nn.Parameter):
            return tensor
        if key not in self.refs:
            self.refs[key], self.sizes[key] = 0, storage.nbytes()
            self.bytes += storage.nbytes()
        self.refs[key] += 1
        return _Saved(tensor, self, key)

    def release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.bytes -= self.sizes.pop(key)


class _Saved:
    """A tensor autograd saved, as packed by `SavedBytes` (its release is counted when autograd drops it)."""

    __slots__ = ("key", "owner", "tensor")

    def __init__(self, tensor: torch.Tensor, owner: SavedBytes, key: int):
        self.tensor, self.owner, self.key = tensor, owner, key

    def __del__(self) -> None:
        self.owner.release(self.key)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed


def run_node(ops: Sequence[StageOp], lanes: dict[str, PipelineLane], sends: Sends, saved: SavedBytes) -> list[OpTiming]:
    """Run one rank's interleaved `ops` of several pipelines (one `PipelineLane` per model) in
    order, then wait for every send; each op's timing and what the rank holds after it."""
    rank = dist.get_rank()
    timings = []
    with saved.hooks():
        for model, stage, op in ops:
            lane = lanes[model]
            assert lane.link.pp_rank == stage, (model, stage, lane.link.pp_rank)
            start = time.perf_counter()
            ready = lane.run_op(op, sends)
            end = time.perf_counter()
            live = tuple((name, len(other.saved)) for name, other in lanes.items())
            timings.append(
                OpTiming(rank, model, op.kind, op.microbatch, stage, start, ready, end, 0, live, saved.bytes)
            )
    sends.wait()
    return timings


def fused_forward_backward(parts: Sequence[FusedPart], schedule: Schedule) -> tuple[list[float], list[OpTiming]]:
    """Every part's `forward_backward` on its mini-batch, run together as `schedule` interleaves
    them on this rank (collective over the parts' ranks); each part's loss and the op timings.

    Every part's engine must sit on this rank, at the stage the schedule places on this
    rank's node; each model's micro-batch count is the schedule's.
    """
    node_ops = check_fused_schedule(schedule)
    nodes = {node_of(schedule, part) for part in parts}
    if len(nodes) != 1:
        placed = ", ".join(f"{part.name} stage {part.engine.groups.pp_rank}" for part in parts)
        raise ValueError(f"this rank holds {placed}, which the schedule puts on different nodes {sorted(nodes)}")
    node = nodes.pop()
    microbatches = {record.name: record.microbatches for record in schedule.models}
    if sorted(part.name for part in parts) != sorted(microbatches):
        raise ValueError(f"the schedule fuses {', '.join(microbatches)}; give one part for each")
    lanes, jobs = {}, []
    for channel, part in enumerate(parts):
        engine = part.engine
        op_lists = op_lists_from_schedule(schedule, part.name)
        job = engine.begin_forward_backward(part.batch, part.objective, microbatches[part.name], op_lists)
        mine = [op for model, _, op in node_ops[node] if model == part.name]
        assert mine == job.ops, (part.name, mine, job.ops)
        executor = engine.executor
        lanes[part.name] = PipelineLane(
            engine.groups.link, job.forward_step, job.input_shape, True, executor.dtype, executor.device,
            part.name, channel, len(parts),
        )  # fmt: skip
        jobs.append(job)
    _, received = message_orders(schedule, node_ops)
    saved = SavedBytes(param for part in parts for param in part.engine.params.values())
    timings = run_node(node_ops[node], lanes, OrderedSends(node, received), saved)
    losses = [
        part.engine.finish_forward_backward(job, lanes[part.name].outputs)
        for part, job in zip(parts, jobs, strict=True)
    ]
    return losses, timings


def fused_train_step(parts: Sequence[FusedPart], schedule: Schedule) -> tuple[list[float], list[OpTiming]]:
    """Every part's `train_step` (zero_grad, forward_backward, update), fused by `schedule`."""
    for part in parts:
        part.engine.zero_grad()
    losses, timings = fused_forward_backward(parts, schedule)
    for part in parts:
        part.engine.update()
    return losses, timings


def schedule_peaks(schedule: Schedule) -> list[float]:
    """Per node of `schedule`, the peak activation its order holds (in the schedule's memory
    unit), as the solver's evaluator replays the node orders: what `activation_peak`
    measures on the node's rank."""
    from nereus.solver.pipeline.document import orders_of, problem_of
    from nereus.solver.pipeline.evaluate import peak_memory
    from nereus.solver.pipeline.model import build_instance

    inst = build_instance(problem_of(schedule))
    orders, _, _, unknown = orders_of(inst, schedule)
    if unknown:
        raise ValueError(f"the schedule does not match its own models: {unknown[0]}")
    return peak_memory(inst, orders)


@dataclass(frozen=True)
class ActivationPeak:
    """What one rank held at its fullest during a run of a fused schedule (from its `OpTiming`s)."""

    microbatches: int
    """The most micro-batches (both models) held for a backward after any op."""
    activation: float
    """The most activation held, in the schedule's memory unit: each held micro-batch
    weighted by its model's activation on this rank's stage (what the schedule's peak counts)."""
    saved_bytes: int
    """The most bytes autograd kept saved for pending backwards."""


def activation_peak(timings: Sequence[OpTiming], schedule: Schedule, node: int) -> ActivationPeak:
    """The peak of one rank's `timings` (node `node` of `schedule`), weighted as the schedule counts memory."""
    weight = {
        record.name: record.activation[record.replica_nodes[0].index(node)]
        for record in schedule.models
        if node in record.replica_nodes[0]
    }
    counts = [sum(count for _, count in t.live) for t in timings]
    held = [sum(weight[name] * count for name, count in t.live) for t in timings]
    return ActivationPeak(
        max(counts, default=0), max(held, default=0.0), max((t.saved_bytes for t in timings), default=0)
    )

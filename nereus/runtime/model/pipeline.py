"""Pipeline parallelism: per-stage op lists, their deadlock check, and the send/recv executor.

A schedule is, per pipeline stage, an ordered list of ops `F(mb)` (forward of micro-batch
`mb`) and `B(mb)` (its backward). The executor runs any such list: a forward receives its
input from the previous stage and sends its output on; a backward receives the output's
gradient from the next stage and sends its input's gradient back. Sends are asynchronous
and receives block, so a stage waits only for data it needs; a list in which every stage
could end up waiting is refused before anything runs (`check_op_lists`).

Messages are tagged by micro-batch, direction and channel (one channel per pipeline when
several share the ranks, as in the fused actor-critic pipeline), so stages may order
micro-batches differently (gloo matches by tag; NCCL matches in order, which 1F1B satisfies).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from nereus.spec.schedule import Schedule

OpKind = Literal["F", "B"]


@dataclass(frozen=True, order=True)
class Op:
    """One op of a stage: the forward or backward of one micro-batch."""

    kind: OpKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def parse_op(item: Any) -> Op:
    """An op from `Op`, `("F", 3)`, `{"kind": "F", "microbatch": 3}` or an object with those attributes."""
    if isinstance(item, Op):
        return item
    if isinstance(item, Mapping):
        kind, microbatch = item.get("kind"), item.get("microbatch")
    elif isinstance(item, tuple) and len(item) == 2:
        kind, microbatch = item
    else:
        kind, microbatch = getattr(item, "kind", None), getattr(item, "microbatch", None)
    if kind not in ("F", "B") or not isinstance(microbatch, int) or microbatch < 0:
        raise ValueError(
            f"pipeline op {item!r}: needs kind F or B and a micro-batch index >= 0 "
            "(split backward W ops are not executable; use a schedule without weight-gradient ops)"
        )
    return Op(kind, microbatch)


def parse_op_lists(op_lists: Sequence[Sequence[Any]]) -> list[list[Op]]:
    return [[parse_op(item) for item in ops] for ops in op_lists]


def op_lists_from_schedule(schedule: Schedule, model: str, replica: int = 0) -> list[list[Op]]:
    """One model replica's per-stage op lists out of a `Schedule` document (`nereus schedule`).

    A fused schedule interleaves several models on each node; only the order of this
    replica's own ops on each stage matters to it. Micro-batch ids are renumbered to the
    replica's local 0..k-1 in the order of `replica_microbatches`.
    """
    records = {record.name: record for record in schedule.models}
    if model not in records:
        raise ValueError(f"schedule has no model {model!r} (it has {', '.join(sorted(records))})")
    record = records[model]
    if not 0 <= replica < len(record.replica_microbatches):
        raise ValueError(f"schedule model {model!r} has {len(record.replica_microbatches)} replicas, not {replica + 1}")
    local = {mb: index for index, mb in enumerate(record.replica_microbatches[replica])}
    op_lists: list[list[Op]] = [[] for _ in record.forward]
    for node in schedule.nodes:
        for op in node.ops:
            if op.model == model and op.replica == replica:
                op_lists[op.stage].append(parse_op({"kind": op.kind, "microbatch": local[op.microbatch]}))
    return op_lists


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Op]]:
    """The 1F1B schedule: warm-up forwards, alternating forward/backward, cool-down backwards."""
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        ops = [Op("F", mb) for mb in range(warmup)]
        for mb in range(num_microbatches - warmup):
            ops += [Op("F", warmup + mb), Op("B", mb)]
        ops += [Op("B", mb) for mb in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(ops)
    return schedule


def forward_only(num_stages: int, num_microbatches: int) -> list[list[Op]]:
    """Every stage runs the micro-batches' forwards in order (inference)."""
    return [[Op("F", mb) for mb in range(num_microbatches)] for _ in range(num_stages)]


def check_op_lists(op_lists: Sequence[Sequence[Op]], num_microbatches: int, backward: bool) -> None:
    """Raise ValueError unless every stage runs each micro-batch's F once (and B once, after it)
    and the stages can run their lists to the end without all waiting on each other."""
    check_stage_ops(op_lists, num_microbatches, backward)
    stuck = blocked_heads([[("", stage, op) for op in ops] for stage, ops in enumerate(op_lists)], {"": len(op_lists)})
    if stuck:
        heads = ", ".join(f"stage {stage} at {op}" for _, (_, stage, op) in stuck)
        raise ValueError(f"pipeline schedule deadlocks: {heads} wait on each other")


def check_stage_ops(op_lists: Sequence[Sequence[Op]], num_microbatches: int, backward: bool, what: str = "") -> None:
    """Raise ValueError unless every stage runs each micro-batch's F once (and B once, after it).
    `what` names the pipeline in the message (e.g. `actor `)."""
    kinds: tuple[OpKind, ...] = ("F", "B") if backward else ("F",)
    expected = sorted(Op(kind, mb) for kind in kinds for mb in range(num_microbatches))
    for stage, ops in enumerate(op_lists):
        if sorted(ops) != expected:
            want = "F and B" if backward else "F"
            raise ValueError(
                f"{what}pipeline stage {stage}: needs {want} of micro-batches 0..{num_microbatches - 1} once each"
            )
        for mb in range(num_microbatches):
            if backward and ops.index(Op("B", mb)) < ops.index(Op("F", mb)):
                raise ValueError(f"{what}pipeline stage {stage}: B{mb} comes before F{mb}")


#: An op of one of several pipelines that share ranks: (pipeline name, its stage, the op).
StageOp = tuple[str, int, Op]


def blocked_heads(node_ops: Sequence[Sequence[StageOp]], num_stages: Mapping[str, int]) -> list[tuple[int, StageOp]]:
    """Run every rank's list as far as it gets when sends never block and receives wait for
    their data; the (rank, op) every rank that cannot finish waits at (empty: no deadlock).

    Well-formed lists only (see `check_stage_ops`): each pipeline's stages run each op once.
    """
    done: set[StageOp] = set()
    cursor = [0] * len(node_ops)
    progress = True
    while progress:
        progress = False
        for node, ops in enumerate(node_ops):
            while cursor[node] < len(ops) and _ready(ops[cursor[node]], num_stages, done):
                done.add(ops[cursor[node]])
                cursor[node] += 1
                progress = True
    return [(node, ops[cursor[node]]) for node, ops in enumerate(node_ops) if cursor[node] < len(ops)]


def _ready(item: StageOp, num_stages: Mapping[str, int], done: set[StageOp]) -> bool:
    name, stage, op = item
    if op.kind == "F":
        return stage == 0 or (name, stage - 1, op) in done
    if stage == num_stages[name] - 1:
        return (name, stage, Op("F", op.microbatch)) in done
    return (name, stage + 1, op) in done


@dataclass(frozen=True)
class PipelineLink:
    """Where this rank's pipeline neighbours are (global ranks) and the group they share."""

    pp_rank: int
    """This rank's pipeline stage."""
    num_stages: int
    prev_rank: int | None
    next_rank: int | None
    group: Any

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.num_stages - 1


#: forward_step(microbatch, input or None on the first stage) -> output (on the last stage:
#: the scalar loss when training, the head output otherwise).
ForwardStep = Callable[[int, torch.Tensor | None], torch.Tensor]


class Sends:
    """Sends started as soon as they are posted; `wait` waits for all of them."""

    def __init__(self) -> None:
        self.pending: list[tuple[Any, torch.Tensor]] = []
        """Started sends and the buffers they read (kept alive until waited on)."""

    def post(self, lane: str, op: Op, tensor: torch.Tensor, dst: int, tag: int, group: Any) -> None:
        """Send `tensor`, the output of `op` of pipeline `lane`, to global rank `dst`."""
        buffer = tensor.contiguous()
        self.pending.append((dist.isend(buffer, dst=dst, group=group, tag=tag), buffer))

    def wait(self) -> None:
        for work, _buffer in self.pending:
            work.wait()


class PipelineLane:
    """One pipeline's stage on this rank during one run: runs its ops one at a time.

    A forward receives its input from the previous stage (blocking) and posts its output to
    the next; a backward receives the output's gradient from the next stage and posts its
    input's gradient to the previous one. Posting never blocks (see `Sends`).
    """

    def __init__(
        self,
        link: PipelineLink,
        forward_step: ForwardStep,
        input_shape: Callable[[int], tuple[int, ...]],
        train: bool,
        dtype: torch.dtype,
        device: torch.device,
        name: str = "",
        channel: int = 0,
        num_channels: int = 1,
    ):
        self.link = link
        self.forward_step = forward_step
        self.input_shape = input_shape
        self.train = train
        self.dtype = dtype
        self.device = device
        self.name = name
        """The pipeline's name among several sharing the ranks (the schedule's model name)."""
        self.channel = channel
        self.num_channels = num_channels
        self.saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        """The last stage's forward outputs by micro-batch (detached)."""

    def run_op(self, op: Op, sends: Sends) -> float:
        """Run `op`, posting its output to `sends`; returns the perf_counter time its input
        had arrived (compute began)."""
        link, mb = self.link, op.microbatch
        if op.kind == "F":
            stage_input = None
            if not link.is_first:
                stage_input = self._recv(self.input_shape(mb), link.prev_rank, self._tag(mb, False))
                stage_input.requires_grad_(self.train)
            ready = time.perf_counter()
            with torch.set_grad_enabled(self.train):
                output = self.forward_step(mb, stage_input)
            if link.is_last:
                self.outputs[mb] = output.detach()
            else:
                assert link.next_rank is not None
                sends.post(self.name, op, output.detach(), link.next_rank, self._tag(mb, False), link.group)
            if self.train:
                self.saved[mb] = (stage_input, output)
            return ready
        stage_input, output = self.saved.pop(mb)
        if link.is_last:
            ready = time.perf_counter()
            output.backward()
        else:
            grad = self._recv(tuple(output.shape), link.next_rank, self._tag(mb, True))
            ready = time.perf_counter()
            torch.autograd.backward(output, grad)
        if stage_input is not None:
            assert stage_input.grad is not None and link.prev_rank is not None
            sends.post(self.name, op, stage_input.grad, link.prev_rank, self._tag(mb, True), link.group)
        return ready

    def _tag(self, microbatch: int, is_grad: bool) -> int:
        """A message tag unique per micro-batch, direction and channel (one channel per pipeline
        sharing the ranks), so two pipelines' messages between the same ranks never match."""
        return 2 * (microbatch * self.num_channels + self.channel) + int(is_grad)

    def _recv(self, shape: tuple[int, ...], src: int | None, tag: int) -> torch.Tensor:
        assert src is not None
        tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        dist.recv(tensor, src=src, group=self.link.group, tag=tag)
        return tensor


class PipelineExecutor:
    """Runs one stage's op list with explicit send/recv to the neighbouring stages."""

    def __init__(self, link: PipelineLink, dtype: torch.dtype, device: torch.device):
        self.link = link
        self.dtype = dtype
        self.device = device

    def run(
        self,
        ops: Sequence[Op],
        forward_step: ForwardStep,
        input_shape: Callable[[int], tuple[int, ...]],
        train: bool,
    ) -> dict[int, torch.Tensor]:
        """Run `ops`; returns the last stage's forward outputs by micro-batch (detached)."""
        lane = PipelineLane(self.link, forward_step, input_shape, train, self.dtype, self.device)
        sends = Sends()
        for op in ops:
            lane.run_op(op, sends)
        sends.wait()
        return lane.outputs

"""The EMU executor: run a transition DAG's primitives on live sharded state.

Every rank walks the scheduled primitives in the same order (by predicted start, then id;
the schedule respects every data and GPU-ownership edge) and takes part in those that touch
it. It holds, per model-stage, the state of each replica (EMU) it is a GPU of:

    split    one replica -> its intermediate replicas on the same GPUs (reshard);
    merge    intermediate replicas -> one coarser replica on their GPUs (reshard);
    extend   a replica's boxes copied to a new replica's GPUs (reshard; the source stays);
    destroy  a replica's state dropped.

Each move is `nereus.runtime.state.reshard` between the primitive's source and target replica
layouts, so every byte is copied, never recomputed, and the logical state after the
transition equals the state before it bitwise. At the end every model-stage's replicas are
those of plan B, and each rank's state is returned in plan B's layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nereus.runtime.observe import timeline
from nereus.runtime.state.reshard import execute
from nereus.runtime.state.reshard_plan import plan_reshard
from nereus.runtime.state.shard_layout import RankLayout
from nereus.runtime.state.sharded_state import StateMeta, state_dtypes, state_meta
from nereus.solver.transition.primitives import Emu, Primitive, Schedule
from nereus.solver.transition.schedule import columns as plan_columns
from nereus.solver.transition.schedule import plan_emus
from nereus.spec.plan import Plan, StagePlan
from nereus.spec.stages import head_of

if TYPE_CHECKING:
    import torch

#: A rank's state of one replica: its tensors (keyed `family/name`) and optimizer step.
ReplicaState = tuple[dict[str, "torch.Tensor"], int | None]


@dataclass(frozen=True)
class ExecutedTransition:
    """What one rank did during a transition."""

    states: dict[str, ReplicaState]
    """This rank's state of every model-stage it holds in plan B, in plan B's layout."""
    bytes_sent: int
    bytes_received: int
    num_primitives: int
    """Primitives this rank took part in."""


def emu_layout(emus: Iterable[Emu], side: StagePlan) -> RankLayout:
    """Replicas of one layout as one RankLayout (replica-major, in the given order); an EMU's
    context-parallel degree is its GPUs over tp x pp (its cp ranks hold the same boxes).

    `side`: the plan entry the replicas may be EMUs of (plan A's for a move's sources, plan B's
    for its targets). The planner's grid is tp x ep columns wide (`schedule.columns`): replicas
    with the entry's grid have its expert parallelism; every other one (an intermediate
    replica, `schedule.ep_intermediate`) has none."""
    emus = list(emus)
    columns, pp = emus[0].layout
    ep = side.ep if (columns, pp) == (plan_columns(side), side.pp) else 1
    cp = len(emus[0].gpus) // (columns * pp)
    assert all(emu.layout == (columns, pp) and len(emu.gpus) == columns * cp * pp for emu in emus), emus
    return RankLayout(columns // ep, pp, len(emus), tuple(gpu for emu in emus for gpu in emu.gpus), cp, ep)


class _Executor:
    """One rank's replicas of every model-stage, updated primitive by primitive."""

    def __init__(self, plan_a: Plan, plan_b: Plan, rank: int, families: dict[str, tuple[str, ...]]) -> None:
        self.plan = plan_a
        self.plan_b = plan_b
        self.rank = rank
        self.families = families
        self.held: dict[Emu, ReplicaState] = {}
        self.sent = self.received = self.received_direct = self.count = 0

    def meta(self, model_stage: str, layout: RankLayout) -> StateMeta:
        entry = self.plan.stage_plan(model_stage)
        model = self.plan.model(self.plan.workload.model_name(entry.role))
        # Replicas move one by one, whole (ZeRO-1 and fully sharded state is assembled first,
        # in the state arena: `Engine.whole_state`); the target engines keep their rows.
        dtypes = state_dtypes(self.plan.workload, entry.stage)
        return state_meta(model, head_of(entry.role), layout, self.families[model_stage], dtypes)

    def load(self, model_stage: str, state: ReplicaState) -> None:
        """This rank's plan-A state of `model_stage` becomes the state of its replica."""
        for emu in plan_emus(self.plan, [model_stage])[model_stage]:
            if self.rank in emu.gpus:
                self.held[emu] = state

    def move(self, sources: list[Emu], targets: list[Emu]) -> None:
        """Reshard from the `sources` replicas to the `targets` replicas (collective over their GPUs)."""
        model_stage = sources[0].model_stage
        source_layout = emu_layout(sources, self.plan.stage_plan(model_stage))
        target_layout = emu_layout(targets, self.plan_b.stage_plan(model_stage))
        plan = plan_reshard(self.meta(model_stage, source_layout), self.meta(model_stage, target_layout))
        mine = next((emu for emu in sources if self.rank in emu.gpus), None)
        tensors, step = self.held[mine] if mine is not None else ({}, None)
        result = execute(plan, self.rank, tensors, step)
        self.sent += result.bytes_sent
        self.received += result.bytes_received
        self.received_direct += result.bytes_received_direct
        for emu in targets:
            if self.rank in emu.gpus:
                self.held[emu] = (result.tensors, result.step)

    def run(self, primitive: Primitive, schedule: Schedule) -> None:
        # A reshard is collective over the GPUs of its source and target replicas.
        involved = (*primitive.retires, *primitive.removes, *primitive.adds, *primitive.copies_from)
        if not any(self.rank in emu.gpus for emu in involved):
            return
        self.count += 1
        sent, received, direct = self.sent, self.received, self.received_direct
        with timeline.span(
            "primitive",
            f"{primitive.kind} {primitive.id}",
            id=str(primitive.id),
            kind=primitive.kind,
            model_stage=primitive.model_stage,
            predicted_start_s=schedule.start_s(primitive),
            predicted_end_s=schedule.end_s(primitive),
        ) as late:
            self._apply(primitive)
            late.update(
                bytes_sent=self.sent - sent,
                bytes_received=self.received - received,
                bytes_received_direct=self.received_direct - direct,  # read straight out of a peer's arena
            )

    def _apply(self, primitive: Primitive) -> None:
        if primitive.kind == "split" or primitive.kind == "merge":
            self.move(list(primitive.retires), list(primitive.adds))
        elif primitive.kind == "extend":
            self.move(list(primitive.copies_from), list(primitive.adds))
            return  # the source replica stays a replica
        # A retired or removed replica's state lives on (if at all) in the added ones.
        for emu in (*primitive.retires, *primitive.removes):
            self.held.pop(emu, None)

    def result(self, plan_b: Plan) -> dict[str, ReplicaState]:
        """Each moved model-stage's state in plan B's layout (the rank's replica of it)."""
        states: dict[str, ReplicaState] = {}
        for model_stage in self.families:
            for emu in plan_emus(plan_b, [model_stage])[model_stage]:
                if self.rank in emu.gpus:
                    states[model_stage] = self.held[emu]
        return states


def execute_transition(
    primitives: list[Primitive],
    schedule: Schedule,
    plan_a: Plan,
    plan_b: Plan,
    rank: int,
    states: dict[str, ReplicaState],
    families: dict[str, tuple[str, ...]],
) -> ExecutedTransition:
    """Move this rank's state from plan A's layouts to plan B's (collective over the world).

    `families` names the model-stages to move and their state families (e.g. parameters
    and AdamW moments for training); `states` holds this rank's plan-A state of each of them
    it is a GPU of. Primitives of other model-stages are skipped. Model-stages whose layout
    is the same in both plans have no primitives and keep their state.
    """
    executor = _Executor(plan_a, plan_b, rank, families)
    for model_stage, state in states.items():
        executor.load(model_stage, state)
    assert schedule.complete(primitives), "execute only a fully scheduled transition"
    # Every rank walks them by predicted start, then id (the schedule respects all edges).
    for primitive in sorted(primitives, key=lambda p: (schedule.start_s(p), p.id)):
        if primitive.model_stage in families:
            executor.run(primitive, schedule)
    return ExecutedTransition(executor.result(plan_b), executor.sent, executor.received, executor.count)

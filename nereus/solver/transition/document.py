"""Transition results as `Transition` documents and back, and their semantic check.

`to_document` turns a scheduled `TransitionResult` into the file `nereus dag build`
writes; `from_document` rebuilds the result (primitives, EMUs, memory) so the checker
can replay a file. `transition_problems` is the file's semantic check (named in
`nereus.spec.registry`): the
checker's violations are errors, a summary that no longer matches a rebuild is a
warning (stale).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from nereus.errors import NereusError
from nereus.solver.transition.primitives import Emu, Primitive, Schedule
from nereus.solver.transition.schedule import TransitionResult, build_transition, link_bytes
from nereus.spec.check import Problem
from nereus.spec.cluster import Cluster
from nereus.spec.plan import Plan
from nereus.spec.transition import (
    EmuRecord,
    ExactRecord,
    GpuBytes,
    LayoutRecord,
    LinkBytes,
    PrimitiveRecord,
    TransferRecord,
    Transition,
    TransitionSummary,
)


class ExactLike(Protocol):
    """What `to_document` reads from an exact solver's result."""

    solver: str
    status: Any
    makespan_s: float | None
    bound_s: float | None
    time_limit_s: float
    wall_s: float


def _gpu_bytes(values: dict[int, float]) -> list[GpuBytes]:
    return [GpuBytes(gpu=gpu, bytes=float(nbytes)) for gpu, nbytes in sorted(values.items())]


def _emus(emus: Sequence[Emu]) -> list[EmuRecord]:
    return [EmuRecord(tp=emu.tp, pp=emu.pp, gpus=list(emu.gpus)) for emu in emus]


def _record(primitive: Primitive, schedule: Schedule, cluster: Cluster) -> PrimitiveRecord:
    links = link_bytes([primitive], cluster)
    return PrimitiveRecord(
        id=primitive.id,
        kind=primitive.kind,
        model_stage=primitive.model_stage,  # type: ignore[arg-type]
        source_layout=LayoutRecord(tp=primitive.source_layout[0], pp=primitive.source_layout[1]),
        target_layout=LayoutRecord(tp=primitive.target_layout[0], pp=primitive.target_layout[1]),
        gpus_read=list(primitive.reads),
        gpus_written=list(primitive.writes),
        alloc_bytes=_gpu_bytes(primitive.alloc),
        free_bytes=_gpu_bytes(primitive.free),
        transfers=[TransferRecord(source=s, target=t, bytes=float(n)) for s, t, n in primitive.transfers],
        bytes_intra_node=links["intra_node"],
        bytes_inter_node=links["inter_node"],
        new_groups=primitive.new_groups,
        start_s=schedule.start_s(primitive),
        end_s=schedule.end_s(primitive),
        depends_on=list(primitive.deps),
        ownership_deps=list(schedule.ownership_deps(primitive)),
        removes=_emus(primitive.removes),
        retires=_emus(primitive.retires),
        adds=_emus(primitive.adds),
        copies_from=_emus(primitive.copies_from),
    )


def _optional(value: float | None) -> float | None:
    return None if value is None else float(value)


def exact_record(result: ExactLike) -> ExactRecord:
    """The file form of an exact solver's result (its per-primitive starts are dropped)."""
    status = getattr(result.status, "name", result.status)
    return ExactRecord(
        solver=str(result.solver),
        status=str(status),
        makespan_s=_optional(result.makespan_s),
        bound_s=_optional(result.bound_s),
        time_limit_s=float(result.time_limit_s),
        wall_s=float(result.wall_s),
        detail=str(getattr(result, "detail", "")) or None,
    )


def to_document(
    plan_a: Plan, plan_b: Plan, result: TransitionResult, exact: Sequence[ExactLike] | None = None
) -> Transition:
    """The `Transition` document of a scheduled transition from `plan_a` to `plan_b`."""
    cluster = plan_b.cluster
    summary = TransitionSummary(
        makespan_s=result.makespan_s,
        bytes_moved=result.bytes_moved,
        lower_bound_bytes=result.lower_bound_bytes,
        bytes_by_link=LinkBytes(
            intra_node=result.bytes_by_link.get("intra_node", 0.0),
            inter_node=result.bytes_by_link.get("inter_node", 0.0),
        ),
        initial_bytes=_gpu_bytes(result.initial_bytes),
        peak_extra_bytes=_gpu_bytes(result.peak_extra_bytes),
        capacity_bytes=result.capacity_bytes,
        feasible=result.feasible,
        blocking_cycle=list(result.blocking_cycle),
    )
    return Transition(
        source=plan_a,
        target=plan_b,
        primitives=[_record(p, result.schedule, cluster) for p in result.primitives],
        summary=summary,
        exact=[exact_record(e) for e in exact] if exact else None,
    )


def _emu_tuple(model_stage: str, records: list[EmuRecord]) -> tuple[Emu, ...]:
    return tuple(Emu(model_stage, r.tp, r.pp, tuple(r.gpus)) for r in records)


def _primitive(record: PrimitiveRecord) -> Primitive:
    stage = record.model_stage
    return Primitive(
        id=record.id,
        kind=record.kind,
        model_stage=stage,
        source_layout=(record.source_layout.tp, record.source_layout.pp),
        target_layout=(record.target_layout.tp, record.target_layout.pp),
        reads=tuple(record.gpus_read),
        writes=tuple(record.gpus_written),
        alloc={e.gpu: e.bytes for e in record.alloc_bytes},
        free={e.gpu: e.bytes for e in record.free_bytes},
        transfers=tuple((t.source, t.target, t.bytes) for t in record.transfers),
        removes=_emu_tuple(stage, record.removes),
        retires=_emu_tuple(stage, record.retires),
        adds=_emu_tuple(stage, record.adds),
        copies_from=_emu_tuple(stage, record.copies_from),
        deps=list(record.depends_on),
        new_groups=record.new_groups,
        duration_s=record.end_s - record.start_s,
    )


def _schedule(records: list[PrimitiveRecord]) -> Schedule:
    """The stored times and ownership dependencies (every primitive of a file has both times)."""
    return Schedule(
        start={r.id: r.start_s for r in records},
        end={r.id: r.end_s for r in records},
        ownership={r.id: list(r.ownership_deps) for r in records if r.ownership_deps},
    )


def from_document(transition: Transition) -> TransitionResult:
    """The scheduled result a `Transition` file describes, for the checker to replay.

    The plans are `transition.source` and `transition.target`; EMUs are rebuilt with the
    primitive's model-stage. Durations are `end_s - start_s` as stored.
    """
    summary = transition.summary
    return TransitionResult(
        primitives=[_primitive(record) for record in transition.primitives],
        schedule=_schedule(transition.primitives),
        makespan_s=summary.makespan_s,
        bytes_moved=summary.bytes_moved,
        bytes_by_link={"intra_node": summary.bytes_by_link.intra_node, "inter_node": summary.bytes_by_link.inter_node},
        lower_bound_bytes=summary.lower_bound_bytes,
        peak_extra_bytes={e.gpu: e.bytes for e in summary.peak_extra_bytes},
        capacity_bytes=summary.capacity_bytes,
        initial_bytes={e.gpu: e.bytes for e in summary.initial_bytes},
        blocking_cycle=list(summary.blocking_cycle),
    )


_PRIMITIVE_REF = re.compile(r"\bprimitive\s*#?\s*(\d+)|#(\d+)", re.IGNORECASE)


def _violation_path(message: str, count: int) -> str:
    """`primitives[i]` for the first primitive a checker message names, else `primitives`."""
    match = _PRIMITIVE_REF.search(message)
    if match:
        index = int(match.group(1) or match.group(2))
        if index < count:
            return f"primitives[{index}]"
    return "primitives"


def _first_difference(stored: Any, fresh: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first path where two dumped documents differ (floats to 1e-9 relative)."""
    if isinstance(stored, dict) and isinstance(fresh, dict):
        for key in [*stored, *(k for k in fresh if k not in stored)]:
            found = _first_difference(stored.get(key), fresh.get(key), f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if isinstance(stored, list) and isinstance(fresh, list):
        if len(stored) != len(fresh):
            return (f"{path} (number of entries)", len(stored), len(fresh))
        for i, (a, b) in enumerate(zip(stored, fresh, strict=True)):
            found = _first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(stored, float | int) and isinstance(fresh, float | int) and not isinstance(stored, bool):
        return None if math.isclose(stored, fresh, rel_tol=1e-9, abs_tol=1e-12) else (path, stored, fresh)
    return None if stored == fresh else (path, stored, fresh)


def transition_problems(transition: Transition) -> Iterator[Problem]:
    """Checker violations (errors), infeasibility (error) and a stale summary (warning)."""
    if not transition.summary.feasible:
        yield Problem(
            "summary.feasible",
            "the transition has no safe order: " + "; ".join(transition.summary.blocking_cycle),
        )
    try:
        from nereus.solver.transition import check as checker
    except ImportError:
        checker = None  # type: ignore[assignment]
    check_result = getattr(checker, "check_result", None)
    if check_result is not None and transition.summary.feasible:
        count = len(transition.primitives)
        for violation in check_result(from_document(transition), transition.source, transition.target):
            yield Problem(_violation_path(violation, count), violation)
    try:
        fresh = to_document(
            transition.source, transition.target, build_transition(transition.source, transition.target)
        )
    except NereusError as exc:
        yield Problem("target", str(exc))
        return
    stored = transition.model_dump(mode="json", include={"primitives", "summary"})
    difference = _first_difference(stored, fresh.model_dump(mode="json", include={"primitives", "summary"}), "")
    if difference:
        path, old, new = difference
        yield Problem(
            path,
            f"stale: stored {old!r}, rebuilding with the default calibration gives {new!r}; "
            "rerun `nereus dag build` (a custom --calibration also explains this)",
            "warning",
        )

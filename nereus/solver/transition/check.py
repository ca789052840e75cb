"""An independent check of a scheduled transition DAG.

The checker replays a schedule abstractly, using only the primitives' start and end,
memory (`alloc`, `free`), replica effects (`removes`, `retires`, `adds`), dependencies
and GPUs, and reports every broken rule as one line: a dependency that ends after its
dependent starts, two primitives on one GPU at once, a GPU over capacity, a model-stage
left without a complete replica, or a final replica set that is not plan B's. It shares
none of the scheduler's logic, so it catches the scheduler's mistakes as well as the
local DAGs'. Ends within `EPS_S` of a start count as before it, as in the scheduler,
and frees at one instant go before allocations.
"""

from __future__ import annotations

from collections.abc import Iterable

from nereus.solver.transition.primitives import Emu, Primitive, Schedule
from nereus.solver.transition.schedule import TransitionResult, plan_emus
from nereus.spec.plan import Plan

EPS_S = 1e-9  # seconds
REL_BYTES = 1e-9  # memory tolerance, relative to the capacity


def check_transition(
    primitives: list[Primitive],
    schedule: Schedule,
    emus_a: dict[str, list[Emu]],
    emus_b: dict[str, list[Emu]],
    initial_bytes: dict[int, float],
    capacity_bytes: float,
) -> list[str]:
    """Every rule the primitives break when run on `schedule`, one line each; empty when valid."""
    return [
        *dependency_violations(primitives, schedule),
        *gpu_overlap_violations(primitives, schedule),
        *memory_violations(primitives, schedule, initial_bytes, capacity_bytes),
        *replica_violations(primitives, schedule, emus_a, emus_b),
        *copy_source_violations(primitives, schedule, emus_a),
    ]


def check_result(result: TransitionResult, plan_a: Plan, plan_b: Plan) -> list[str]:
    """`check_transition` on a `build_transition` result."""
    return check_transition(
        result.primitives,
        result.schedule,
        plan_emus(plan_a),
        plan_emus(plan_b),
        result.initial_bytes,
        result.capacity_bytes,
    )


def dependency_violations(primitives: list[Primitive], schedule: Schedule) -> list[str]:
    """Data and ownership dependencies must end before their dependent starts."""
    by_id = {p.id: p for p in primitives}
    out = []
    for p in primitives:
        start = schedule.start_s(p)
        for kind, deps in (("dependency", p.deps), ("ownership dependency", schedule.ownership_deps(p))):
            for dep in deps:
                if dep not in by_id:
                    out.append(f"primitive {p.id} ({p.model_stage}) has unknown {kind} {dep}")
                elif schedule.end_s(by_id[dep]) > start + EPS_S:
                    out.append(
                        f"primitive {p.id} ({p.kind}, {p.model_stage}) starts at {start:.6g}s before its "
                        f"{kind} {dep} ends at {schedule.end_s(by_id[dep]):.6g}s"
                    )
    return out


def gpu_overlap_violations(primitives: list[Primitive], schedule: Schedule) -> list[str]:
    """No GPU runs two primitives at once (zero-length primitives never overlap)."""
    start, end = {p.id: schedule.start_s(p) for p in primitives}, {p.id: schedule.end_s(p) for p in primitives}
    on_gpu: dict[int, list[Primitive]] = {}
    for p in primitives:
        if end[p.id] < start[p.id] - EPS_S:
            continue  # reported below as a negative duration
        for gpu in p.gpus:
            on_gpu.setdefault(gpu, []).append(p)
    out = [
        f"primitive {p.id} ({p.model_stage}) ends before it starts"
        for p in primitives
        if end[p.id] < start[p.id] - EPS_S
    ]
    for gpu, runs in sorted(on_gpu.items()):
        last: Primitive | None = None  # the run that ends latest so far
        for p in sorted(runs, key=lambda q: (start[q.id], end[q.id], q.id)):
            if last is not None and end[p.id] > start[p.id] + EPS_S and start[p.id] < end[last.id] - EPS_S:
                out.append(
                    f"GPU {gpu} runs primitive {p.id} ({p.model_stage}) from {start[p.id]:.6g}s while primitive "
                    f"{last.id} ({last.model_stage}) runs until {end[last.id]:.6g}s"
                )
            if last is None or end[p.id] > end[last.id]:
                last = p
    return out


def memory_violations(
    primitives: list[Primitive], schedule: Schedule, initial_bytes: dict[int, float], capacity: float
) -> list[str]:
    """Per GPU, allocations (at start) never exceed capacity; frees (at end) go first at a tie."""
    events: dict[int, list[tuple[float, int, int, float]]] = {}  # GPU -> (time, 0 free / 1 alloc, id, bytes)
    for p in primitives:
        for gpu, nbytes in p.free.items():
            events.setdefault(gpu, []).append((schedule.end_s(p) - EPS_S, 0, p.id, nbytes))
        for gpu, nbytes in p.alloc.items():
            events.setdefault(gpu, []).append((schedule.start_s(p), 1, p.id, nbytes))
    tolerance = REL_BYTES * max(capacity, 1.0)
    out = [
        f"GPU {gpu} starts with {nbytes:.6g} B over the capacity of {capacity:.6g} B"
        for gpu, nbytes in sorted(initial_bytes.items())
        if nbytes > capacity + tolerance
    ]
    for gpu, gpu_events in sorted(events.items()):
        usage = initial_bytes.get(gpu, 0.0)
        for _, is_alloc, pid, nbytes in sorted(gpu_events):
            usage += nbytes if is_alloc else -nbytes
            if is_alloc and usage > capacity + tolerance:
                out.append(f"GPU {gpu} holds {usage:.6g} B > capacity {capacity:.6g} B when primitive {pid} starts")
            if not is_alloc and usage < -tolerance:
                out.append(f"GPU {gpu} frees more than it holds when primitive {pid} ends ({usage:.6g} B)")
    return out


_ReplicaEvent = tuple[float, int, int, tuple[Emu, ...], tuple[Emu, ...]]


def _replica_events(primitives: Iterable[Primitive], schedule: Schedule) -> list[_ReplicaEvent]:
    """(time, phase, id, leaving, joining), in replay order.

    Ends within `EPS_S` of a start go before it (a dependent may start the moment its
    input ends), except that a zero-length primitive's end follows its own start.
    """
    events: list[_ReplicaEvent] = []
    for p in primitives:
        start, end = schedule.start_s(p), schedule.end_s(p)
        zero = end <= start + EPS_S
        events.append((start, 1, p.id, p.removes, ()))
        events.append((start if zero else end - EPS_S, 2 if zero else 0, p.id, p.retires, p.adds))
    return sorted(events, key=lambda e: (e[0], e[1], e[2]))


def replica_violations(
    primitives: list[Primitive], schedule: Schedule, emus_a: dict[str, list[Emu]], emus_b: dict[str, list[Emu]]
) -> list[str]:
    """Every model-stage keeps a complete replica throughout and ends with exactly B's EMUs."""
    replicas = {name: set(emus) for name, emus in emus_a.items()}
    out = []
    for time, _, pid, leaving, joining in _replica_events(primitives, schedule):
        had = {e.model_stage: bool(replicas.get(e.model_stage)) for e in (*leaving, *joining)}
        for emu in leaving:
            if emu not in replicas.setdefault(emu.model_stage, set()):
                out.append(f"primitive {pid} drops {emu.model_stage} replica {_name(emu)}, which it does not hold")
            replicas[emu.model_stage].discard(emu)
        for emu in joining:
            replicas.setdefault(emu.model_stage, set()).add(emu)
        for name in sorted(n for n, before in had.items() if before and not replicas[n]):
            out.append(f"{name} has no complete replica from {time:.6g}s (after primitive {pid})")
    for name in sorted(set(replicas) | set(emus_b)):
        final, wanted = replicas.get(name, set()), set(emus_b.get(name, []))
        if final != wanted:
            extra = sorted(_name(e) for e in final - wanted)
            missing = sorted(_name(e) for e in wanted - final)
            out.append(f"{name} ends with replicas {extra} that B lacks and without B's {missing}")
    return out


def copy_source_violations(primitives: list[Primitive], schedule: Schedule, emus_a: dict[str, list[Emu]]) -> list[str]:
    """A primitive's `copies_from` replicas are complete from its start to its end."""
    alive: dict[Emu, list[list[float]]] = {e: [[-float("inf"), float("inf")]] for es in emus_a.values() for e in es}
    for time, _, _, leaving, joining in _replica_events(primitives, schedule):
        for emu in leaving:
            spans = alive.get(emu)
            if spans and spans[-1][1] == float("inf"):
                spans[-1][1] = time
        for emu in joining:
            alive.setdefault(emu, []).append([time, float("inf")])
    out = []
    for p in primitives:
        p_start, p_end = schedule.start_s(p), schedule.end_s(p)
        for emu in p.copies_from:
            spans = alive.get(emu, [])
            if not any(start <= p_start + EPS_S and end >= p_end - 2 * EPS_S for start, end in spans):
                out.append(
                    f"primitive {p.id} ({p.kind}, {p.model_stage}) copies from replica {_name(emu)}, "
                    f"which is not a complete copy from {p_start:.6g}s to {p_end:.6g}s"
                )
    return out


def _name(emu: Emu) -> str:
    return f"tp{emu.tp}pp{emu.pp}{list(emu.gpus)}"

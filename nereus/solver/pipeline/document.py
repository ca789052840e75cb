"""Fused schedules as `Schedule` documents and back, and their semantic check.

The check (named in `nereus.spec.registry`) says: ops must be well formed
(every op of the problem exactly once, on its stage's node), the evaluator must run the
node orders without deadlock, the stored times must respect durations, node order and
dependencies, and the peak memory must stay within the cap (errors); a summary that no
longer matches the re-evaluated schedule is a warning (stale).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from nereus.errors import NereusError
from nereus.solver.pipeline.evaluate import describe, evaluate, timing_violations
from nereus.solver.pipeline.exact import ExactMemory, ExactResult
from nereus.solver.pipeline.model import Instance, ModelTimes, OpKey, Pipeline, Problem, build_instance
from nereus.solver.pipeline.policy import RELATIVE_EPS
from nereus.solver.pipeline.search import FusedResult
from nereus.spec.check import Problem as CheckProblem
from nereus.spec.schedule import (
    ExactMemorySummary,
    ExactSummary,
    LeanAlternative,
    Schedule,
    ScheduleModel,
    ScheduleNode,
    ScheduleOp,
    ScheduleSummary,
)

#: The most ops `nereus check` replays (a guard against absurd files, far above real schedules).
MAX_CHECK_OPS = 2_000_000


def _model_record(problem: Problem, model: ModelTimes) -> ScheduleModel:
    pipelines = [p for p in problem.pipelines if p.model == model]
    return ScheduleModel(
        name=model.name,
        microbatches=model.num_microbatches,
        forward=list(model.forward),
        backward=list(model.backward),
        weight_grad=None if model.weight_grad is None else list(model.weight_grad),
        activation=list(model.activation),
        replica_nodes=[list(p.stage_nodes) for p in pipelines],
        replica_microbatches=[list(p.microbatches) for p in pipelines],
    )


def node_records(inst: Instance, orders: list[list[int]], start: list[float], end: list[float]) -> list[ScheduleNode]:
    """Each node's ops in order, as records."""
    records = []
    for node, order in enumerate(orders):
        ops = []
        for op in order:
            k = inst.keys[op]
            ops.append(ScheduleOp(model=k.model, replica=k.replica, microbatch=k.microbatch, stage=k.stage,
                                  kind=k.kind, start=float(start[op]), end=float(end[op])))  # fmt: skip
        records.append(ScheduleNode(node=node, ops=ops))
    return records


def exact_summary(result: ExactResult) -> ExactSummary:
    return ExactSummary(
        status=result.status,
        makespan=result.makespan,
        bound=result.bound,
        peak_memory=result.peak_memory,
        memory_optimal=result.memory_optimal,
        wall_s=result.wall_s,
    )


def exact_memory_summary(result: ExactMemory) -> ExactMemorySummary:
    return ExactMemorySummary(
        status=result.status,
        peak_memory=result.peak_memory,
        bound=result.bound,
        makespan=result.makespan,
        wall_s=result.wall_s,
    )


def lean_alternatives(result: FusedResult) -> list[LeanAlternative]:
    """The lean starts that hold less than the fused schedule, least memory first, each kept
    only when it is faster than every leaner one (the others cost memory for nothing)."""
    peak = result.evaluation.max_peak_memory
    kept: list[LeanAlternative] = []
    for start in sorted(result.lean, key=lambda s: (s.peak, s.makespan)):
        if start.peak >= peak * (1 - RELATIVE_EPS) or (kept and start.makespan >= kept[-1].makespan):
            continue
        kept.append(LeanAlternative(activation_cap=start.cap, makespan=start.makespan, peak_memory=start.peak))
    return kept


def to_document(
    result: FusedResult,
    exact: ExactResult | None = None,
    time_unit: str = "",
    memory_unit: str = "",
    exact_memory: ExactMemory | None = None,
) -> Schedule:
    """The `Schedule` document of a fused search (with the exact model's results, if run)."""
    ev, problem = result.evaluation, result.problem
    assert ev.start is not None and ev.end is not None, "the fused schedule runs"
    serial = result.baselines["serial-1f1b"].makespan
    summary = ScheduleSummary(
        makespan=ev.makespan,
        lower_bound=result.bounds.latency,
        gap=ev.makespan / result.bounds.latency - 1 if result.bounds.latency > 0 else 0.0,
        peak_memory=ev.max_peak_memory,
        memory_bound=result.bounds.memory,
        memory_lower_bound=result.memory_lower_bound,
        bubble_ratio=ev.bubble_ratio,
        serial_1f1b_makespan=serial,
        serial_chimera_makespan=result.baselines["serial-chimera"].makespan,
        speedup_vs_serial=serial / ev.makespan if ev.makespan > 0 else 1.0,
        greedy_makespan=result.greedy.makespan,
        search_s=result.search_s,
        seeds=result.seeds,
        exact=exact_summary(exact) if exact else None,
        exact_memory=exact_memory_summary(exact_memory) if exact_memory else None,
        lean_alternatives=lean_alternatives(result),
    )
    return Schedule(
        time_unit=time_unit,
        memory_unit=memory_unit,
        num_nodes=problem.num_nodes,
        p2p_latency=problem.p2p_latency,
        activation_cap=problem.activation_cap,
        models=[_model_record(problem, m) for m in problem.models],
        nodes=node_records(result.instance, result.orders, ev.start, ev.end),
        summary=summary,
    )


def problem_of(schedule: Schedule) -> Problem:
    """The problem a Schedule file describes; NereusError when its models are inconsistent."""
    pipelines = []
    for i, record in enumerate(schedule.models):
        try:
            model = ModelTimes(
                record.name,
                record.microbatches,
                tuple(record.forward),
                tuple(record.backward),
                tuple(record.activation),
                None if record.weight_grad is None else tuple(record.weight_grad),
            )
        except NereusError as exc:
            raise NereusError(f"models[{i}]: {exc}") from None
        if len(record.replica_nodes) != len(record.replica_microbatches):
            raise NereusError(f"models[{i}]: replica_nodes and replica_microbatches need one entry per replica")
        ids = sorted(mb for mbs in record.replica_microbatches for mb in mbs)
        if ids != list(range(record.microbatches)):
            raise NereusError(f"models[{i}]: replicas must split micro-batches 0..{record.microbatches - 1} once each")
        for r, (nodes, mbs) in enumerate(zip(record.replica_nodes, record.replica_microbatches, strict=True)):
            pipelines.append(Pipeline(model, r, tuple(nodes), tuple(mbs)))
    num_ops = sum(len(r.forward) * r.microbatches * (3 if r.weight_grad else 2) for r in schedule.models)
    if num_ops > MAX_CHECK_OPS:
        raise NereusError(f"models: {num_ops} ops is more than this checker replays ({MAX_CHECK_OPS})")
    if len({m.name for m in schedule.models}) != len(schedule.models):
        raise NereusError("models: two models share a name; give each its own")
    return Problem(schedule.num_nodes, tuple(pipelines), schedule.p2p_latency, schedule.activation_cap)


def orders_of(inst: Instance, schedule: Schedule) -> tuple[list[list[int]], list[float], list[float], list[str]]:
    """Node orders and stored times by op id; ops the problem lacks are reported, not indexed."""
    orders: list[list[int]] = [[] for _ in range(schedule.num_nodes)]
    start = [math.nan] * inst.num_ops
    end = [math.nan] * inst.num_ops
    unknown = []
    for i, record in enumerate(schedule.nodes):
        if record.node >= schedule.num_nodes:
            unknown.append(f"nodes[{i}].node: node {record.node} does not exist (num_nodes {schedule.num_nodes})")
            continue
        for j, op in enumerate(record.ops):
            key = OpKey(op.model, op.replica, op.microbatch, op.stage, op.kind)
            index = inst.index.get(key)
            if index is None:
                unknown.append(f"nodes[{i}].ops[{j}]: no such op in the models: {op.kind} of {op.model} "
                               f"replica {op.replica} micro-batch {op.microbatch} stage {op.stage}")  # fmt: skip
                continue
            orders[record.node].append(index)
            start[index], end[index] = op.start, op.end
    return orders, start, end, unknown


def schedule_problems(schedule: Schedule) -> Iterator[CheckProblem]:
    """Errors for malformed ops, deadlock, broken dependencies or cap; a stale summary warns."""
    try:
        inst = build_instance(problem_of(schedule))
    except NereusError as exc:
        yield CheckProblem("models", str(exc))
        return
    orders, start, end, unknown = orders_of(inst, schedule)
    for line in unknown:
        path, message = line.split(": ", 1)
        yield CheckProblem(path, message)
    if unknown:
        return
    ev = evaluate(inst, orders)
    for violation in ev.violations:
        yield CheckProblem("nodes", violation)
    if ev.violations:
        return
    if ev.deadlocked:
        waiting = ", ".join(describe(inst, op) for op in ev.deadlocked[:4])
        yield CheckProblem("nodes", f"the node orders deadlock: every node waits ({waiting})")
        return
    for violation in timing_violations(inst, orders, start, end)[:20]:
        yield CheckProblem("nodes", violation)
    cap = schedule.activation_cap
    for node, peak in enumerate(ev.peak_memory):
        if cap is not None and peak > cap * (1 + 1e-9):
            yield CheckProblem(f"nodes[{node}]", f"peak activation {peak:g} exceeds the cap {cap:g}")
    stored = schedule.summary
    for name, fresh in (("makespan", max(end, default=0.0)), ("peak_memory", ev.max_peak_memory)):
        old = getattr(stored, name)
        if not math.isclose(old, fresh, rel_tol=1e-9, abs_tol=1e-12):
            yield CheckProblem(f"summary.{name}", f"stale: stored {old!r}, the ops give {fresh!r}", "warning")

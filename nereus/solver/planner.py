"""The planner's public API: search, then turn candidates into Plan documents."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from nereus.cost.plan_cost import evaluate_plan, host_problems
from nereus.cost.stage import TRAIN_OFFLOADS
from nereus.errors import NereusError
from nereus.solver.async_search import async_placements, async_search, no_split_message
from nereus.solver.layouts import OptionTable
from nereus.solver.plan_search import (
    Candidate,
    CountProbe,
    PlanRequest,
    Rejection,
    closest_shortfall,
    fits,
    host_budget_per_gpu,
    iter_assignments,
    placements,
    price_all,
    resized,
    search,
)
from nereus.spec.plan import RECOMPUTE_LEVELS, Plan, Pool, StagePlan
from nereus.spec.stages import is_trained, model_stage
from nereus.spec.workload import model_stages
from nereus.units import format_bytes

#: The largest GPU count probed when looking for the smallest one that fits.
MAX_PROBE_GPUS = 65536


@dataclass
class PlanResult:
    """The best plan, its runners-up, and the layouts rejected for memory."""

    best: Plan
    alternatives: list[Plan]
    rejections: list[Rejection] = field(default_factory=list)
    search_time_s: float = 0.0
    num_placements: int = 0


def build_plan(request: PlanRequest, candidate: Candidate) -> Plan:
    """A Plan document for a candidate: contiguous EMUs from each pool's first GPU."""
    pools = [
        Pool(name=name, gpus=list(range(start, start + size))) for name, start, size, _ in candidate.placement.pools
    ]
    entries = {}
    for name, pool, start, tp, pp, dp, micro_batches, choice, cp, ep, cp_method in iter_assignments(candidate):
        emu_size = tp * cp * ep * pp
        kv, recompute, token_budget, zero1, offload, full_shard, train_offload = choice
        training = is_trained(name)
        emus = [list(range(start + k * emu_size, start + (k + 1) * emu_size)) for k in range(dp)]
        entries[name] = StagePlan(
            model_stage=name,  # type: ignore[arg-type]
            pool=pool,
            tp=tp,
            pp=pp,
            cp=cp,
            cp_method=cp_method,
            ep=ep,
            dp=dp,
            emus=emus,
            micro_batches=micro_batches,
            recompute=RECOMPUTE_LEVELS[recompute],
            token_budget=token_budget or None,
            zero1=bool(zero1) if training else None,
            offload=bool(offload),
            full_shard=bool(full_shard),
            train_offload=TRAIN_OFFLOADS[train_offload],  # type: ignore[arg-type]
            kv_budget_bytes=kv or None,
        )
    order = [model_stage(r, s) for r, s in model_stages(request.workload)]
    names = {request.workload.model_name(role) for role in request.workload.roles()}
    plan = Plan(
        cluster=request.cluster,
        models=[m for m in request.models if m.name in names],
        workload=request.workload,
        pools=pools,
        stages=[entries[n] for n in order],
    )
    evaluation = evaluate_plan(plan, request.calibration)
    assert evaluation.feasible, evaluation.memory_problems
    assert abs(evaluation.predictions.step_time_s - candidate.step_time_s) <= 1e-9 * max(1.0, candidate.step_time_s)
    return plan.model_copy(update={"predictions": evaluation.predictions})


def make_plan(request: PlanRequest, top_k: int = 1, progress: Callable[[int, int], None] | None = None) -> PlanResult:
    """Search and return Plan documents, or raise NereusError saying what would fit."""
    asynchronous = request.workload.execution == "async"
    if asynchronous and (unsplit := no_split_message(request)) is not None:
        raise NereusError(unsplit)
    try:
        outcome = (async_search if asynchronous else search)(request, top_k=top_k, progress=progress)
    except ValueError as exc:
        raise NereusError(str(exc)) from None
    if not outcome.candidates and asynchronous:
        raise NereusError(_async_infeasible_message(request))
    if not outcome.candidates:
        raise NereusError(_infeasible_message(request, outcome.rejections()))
    plans = [build_plan(request, c) for c in outcome.candidates]
    return PlanResult(plans[0], plans[1:], outcome.rejections(), outcome.search_time_s, outcome.num_placements)


def _async_infeasible_message(request: PlanRequest) -> str:
    layouts = async_placements(request)
    short = closest_shortfall(request, (layouts, price_all(request, layouts)))
    reason = f"; closest: {short.describe()}" if short is not None else ""
    return (
        f"no memory-feasible async plan for {request.workload.name} on {request.num_gpus} "
        f"{request.cluster.gpu.name} GPUs: no split into a generation pool and a training pool fits{reason}; "
        "plan for more GPUs or set execution: sync"
    )


def _infeasible_message(request: PlanRequest, rejected: list[Rejection]) -> str:
    layouts = placements(request)
    tables = price_all(request, layouts)
    unlisted = _stages_without_layouts(tables)
    if unlisted:
        return (
            f"no plan for {request.workload.name} on {request.num_gpus} {request.cluster.gpu.name} GPUs: "
            f"{', '.join(unlisted)} has no candidate layout under the allowed memory-saving choices "
            "(a pinned choice may not apply to it); allow more choices"
        )
    short = closest_shortfall(request, (layouts, tables))
    least = min(rejected, key=lambda r: r.needed_bytes, default=None)
    host = _host_shortfall(request)
    if host is not None:
        reason = f"; every plan that fits the GPUs overflows host memory: the fastest needs {host}"
    elif short is not None:
        reason = f"; closest: {short.describe()}"
    else:
        reason = f"; e.g. {least.describe()}" if least else " (model-stages do not fit together)"
    smallest = smallest_feasible_gpus(request)
    fix = smallest.describe() if smallest else f"nothing up to {MAX_PROBE_GPUS} GPUs fits"
    return (
        f"no memory-feasible plan for {request.workload.name} on {request.num_gpus} "
        f"{request.cluster.gpu.name} GPUs{reason}; {fix}"
    )


@dataclass(frozen=True)
class SmallestFit:
    """The fewest GPUs with a feasible plan, and the fewest whole nodes' GPUs."""

    gpus: int
    """The smallest GPU count the search finds a plan for (any count)."""
    whole_node_gpus: int
    """The smallest multiple of the node size the search finds a plan for."""
    gpus_per_node: int

    def describe(self) -> str:
        said = f"the smallest GPU count that fits is {self.gpus}"
        if self.whole_node_gpus == self.gpus:
            return said
        nodes = self.whole_node_gpus // self.gpus_per_node
        whole = f"{nodes} node{'s' if nodes > 1 else ''} of {self.gpus_per_node}"
        return f"{said}; the smallest whole-node count is {self.whole_node_gpus} ({whole})"


def _host_shortfall(request: PlanRequest) -> str | None:
    """What the fastest plan that fits the GPUs keeps in host memory beyond the nodes' (None:
    no plan fits the GPUs even with unbounded host memory)."""
    unbounded = dataclasses.replace(request, cluster=request.cluster.model_copy(update={"host_memory_bytes": 2**62}))
    found = search(unbounded).candidates
    if not found:
        return None
    plan = build_plan(unbounded, found[0])
    assert plan.predictions is not None
    host = {name: float(sum(p.host_memory_bytes.values())) for name, p in plan.predictions.model_stages.items()}
    problems = host_problems(plan.model_copy(update={"cluster": request.cluster}), host)
    per_gpu = host_budget_per_gpu(request.cluster)
    pools = {e.pool: 0.0 for e in plan.stages}
    for entry in plan.stages:
        pools[entry.pool] += host[entry.model_stage]
    fullest = max(pools, key=lambda name: pools[name])
    # The search bounds a pool's host bytes per GPU by the node's share (a sufficient condition).
    per_pool = f"{format_bytes(pools[fullest])} per GPU in pool {fullest} > {format_bytes(per_gpu)} (the node's share)"
    return problems[0] if problems else per_pool


def smallest_feasible_gpus(request: PlanRequest) -> SmallestFit | None:
    """The fewest GPUs, and the fewest whole nodes' GPUs, with a feasible plan (probing beyond the
    cluster, on nodes of its kind); None if nothing up to MAX_PROBE_GPUS fits.

    Doubling whole-node counts from the request's finds one that fits, `high`. Fitting need not
    be monotone in the GPU count (layouts fill their pool by whole EMUs; splits are node-granular
    beyond one node), so every count below `high` is then probed in order, from the fewest GPUs
    each model-stage fits on alone, with one pricing for all of them (`CountProbe`).
    """
    per_node = request.cluster.gpus_per_node
    high = max(per_node, -(-request.num_gpus // per_node) * per_node)
    while not fits(resized(request, high)):
        if high >= MAX_PROBE_GPUS:
            return None
        high *= 2
    probe = CountProbe.up_to(request, high)
    smallest = next((n for n in range(probe.lower_bound(high), high) if probe.fits(n)), high)
    whole = range(-(-smallest // per_node) * per_node, high, per_node)
    return SmallestFit(smallest, next((n for n in whole if probe.fits(n)), high), per_node)


def _stages_without_layouts(tables: dict[tuple[str, int], OptionTable]) -> list[str]:
    """Model-stages with no candidate layout on any pool size (every option ruled out by the
    allowed memory-saving choices, not by memory)."""
    listed = {name for (name, _), table in tables.items() if table.options}
    return sorted({name for name, _ in tables} - listed)

"""Plan search under async execution: the split of the GPUs between a generation pool and a
training pool, and each pool's layouts, for the fastest steady state that fits.

Async execution (`Workload.execution: async`) runs actor/generation alone on the last GPUs
(the generation pool) and every other model-stage on the first (the training pool); with
max_staleness k >= 1 generation runs up to k batches ahead, so a step in the steady state takes
max(G, T): G the generation pool's time, T the training pool's (inference, training, then the
weight sync to the generation pool). With k = 0 the pools take turns and the step is G + T, the
synchronous composition of the same layouts.

The search is exact. The two pools share no GPU, so their memory is apart and only the weight
sync ties their layouts: for each split and each generation layout (tp, pp, dp; its fastest
option that fits alone), the training pool's best T, the weight sync to that layout included,
is the synchronous branch and bound of the same placement with generation fixed to that option
(whose objective is G + T, G fixed). The step is max(G, T) at that T, as it grows with T. Layouts
whose G alone is no faster than the best step found are not searched; the training pool's search
is capped at the best step found.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence

from nereus.cost.plan_cost import TRAINING_POOL_PHASES
from nereus.solver.layouts import Option, OptionTable
from nereus.solver.plan_search import (
    Candidate,
    Placement,
    PlanRequest,
    SearchOutcome,
    _check_request,
    _Problem,
    _TopK,
    branch_and_bound,
    compile_problem,
    placements,
    price_all,
    rejections,
)
from nereus.spec.stages import ACTOR_GENERATION, STAGES, stage_order


def async_placements(request: PlanRequest) -> list[Placement]:
    """The placements async execution can run: actor/generation alone on a pool of its own
    (`placements`' generation splits), every split size."""
    return [p for p in placements(request) if any(stages == (ACTOR_GENERATION,) for *_, stages in p.pools)]


def no_split_message(request: PlanRequest) -> str | None:
    """One line when the request's GPUs cannot be split into two pools (None: they can)."""
    if async_placements(request):
        return None
    return (
        f"workload {request.workload.name!r}: execution: async runs generation and training on disjoint "
        f"GPU pools, which {request.num_gpus} GPU{'s' if request.num_gpus > 1 else ''} cannot split into; "
        "plan for at least 2 GPUs or set execution: sync"
    )


def async_step(problem: _Problem, chosen: Sequence[Option], overlap: bool) -> float | None:
    """An async placement's step time for a full assignment (None: some pool overflows memory):
    max(G, T) with overlap (max_staleness >= 1), else G + T (`nereus.cost.plan_cost.steady_state`)."""
    if problem.objective(chosen) is None:
        return None
    num_pools = len(problem.placement.pools)
    sums = [[0.0] * num_pools for _ in STAGES]
    for i, option in enumerate(chosen):
        sums[problem.phase_of[i]][problem.pool_of[i]] += option[0]
    phases: dict[str, float] = {stage: problem.phase_time(sums[stage_order(stage)]) for stage in STAGES}
    phases["weight_sync"] = problem.sync_time(chosen)
    generation = phases["generation"]
    training = sum(phases[name] for name in TRAINING_POOL_PHASES)
    pooled = max(generation, training) if overlap else generation + training
    return pooled + problem.step_overhead_s


def _generation_options(problem: _Problem, unpruned: list[Option]) -> list[Option]:
    """Generation's options that fit alone on their pool, the fastest per layout (tp, pp, dp: what
    the weight sync depends on), by time."""
    budget, host_budget = problem.budget, problem.host_budget
    fastest: dict[tuple[int, ...], Option] = {}
    for option in sorted(unpruned):
        if option[1] + option[2] <= budget and option[8] <= host_budget:
            fastest.setdefault(tuple(option[3:6]), option)
    return sorted(fastest.values())


def async_search(
    request: PlanRequest, top_k: int = 1, progress: Callable[[int, int], None] | None = None
) -> SearchOutcome:
    """The fastest async plans: up to `top_k` candidates, at most one per (split, generation
    layout) (the best training-pool layouts for each), ascending step time."""
    _check_request(request)
    started = time.perf_counter()
    layouts = async_placements(request)
    tables = price_all(request, layouts)
    overlap = request.workload.overlaps
    found: list[Candidate] = []
    cache: dict[tuple[str, int, bool], list[Option]] = {}
    leaves = 0

    def cutoff() -> float:
        return found[top_k - 1].step_time_s if len(found) >= top_k else math.inf

    for done, placement in enumerate(layouts, 1):
        problem = compile_problem(request, placement, tables, prune=True, cache=cache)
        index = problem.names.index(ACTOR_GENERATION)
        size = next(size for _, _, size, stages in placement.pools if ACTOR_GENERATION in stages)
        for option in _generation_options(problem, tables[ACTOR_GENERATION, size].options):
            generation = option[0]
            if generation + problem.step_overhead_s >= cutoff():
                break  # by time: no later layout's step is faster either (max(G, T) and G + T are >= G)
            fixed = [*problem.options[:index], [option], *problem.options[index + 1 :]]
            best = _TopK(1)
            # The synchronous objective is G + T + overhead: T below the cutoff's is what can win.
            best.bound = cutoff() + generation if overlap else cutoff()
            leaves += branch_and_bound(dataclasses.replace(problem, options=fixed), best)
            if not best.heap:
                continue
            candidate = best.sorted()[0]
            step = async_step(problem, [o for _, o in candidate.choices], overlap)
            assert step is not None
            found.append(Candidate(step, placement, candidate.choices))
            found.sort(key=lambda c: c.step_time_s)
            del found[top_k:]
        if progress:
            progress(done, len(layouts))
    shown = found[0].placement if found else (layouts[0] if layouts else None)
    return SearchOutcome(
        found,
        len(layouts),
        leaves,
        time.perf_counter() - started,
        report=(lambda: rejections(request, tables, shown)) if shown else None,
    )


def reference_async_search(request: PlanRequest) -> dict[str, Candidate | None]:
    """Exhaustive enumeration of every assignment of every async placement (small cases only):
    each split's best candidate by its name (None: nothing fits that split)."""
    _check_request(request)
    layouts = async_placements(request)
    tables: dict[tuple[str, int], OptionTable] = price_all(request, layouts)
    out: dict[str, Candidate | None] = {}
    for placement in layouts:
        problem = compile_problem(request, placement, tables, prune=False)
        best: Candidate | None = None
        for chosen in itertools.product(*problem.options):
            step = async_step(problem, chosen, request.workload.overlaps)
            if step is not None and (best is None or step < best.step_time_s):
                best = Candidate(step, placement, tuple(zip(problem.names, chosen, strict=True)))
        out[placement.name] = best
    return out

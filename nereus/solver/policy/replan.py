"""Replan and price: plan search under current conditions, step times, transition and restart costs.

Everything here is cached: plans by (GPUs, response lengths rounded up to a geometric
grid, efficiency rounded down), evaluations by (plan, exact conditions), transitions by
(plan A, plan B). A trace of a thousand steps then plans only a few dozen times.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from nereus.cost.calibration import Calibration
from nereus.cost.fit import with_engine_budget
from nereus.cost.plan_cost import (
    PlanEvaluation,
    evaluate_plan,
    one_sequence_bytes,
    replica_state_bytes,
    usable_capacity,
)
from nereus.cost.vllm_engine import Engine
from nereus.errors import NereusError
from nereus.solver.layouts import MemoryChoices
from nereus.solver.plan_search import PlanRequest
from nereus.solver.planner import make_plan
from nereus.solver.policy.types import PolicyConfig
from nereus.solver.transition import build_transition
from nereus.solver.transition.check import check_result
from nereus.solver.transition.schedule import held_bytes
from nereus.spec.check import plan_problems
from nereus.spec.plan import Plan, Pool, StagePlan
from nereus.spec.stages import label
from nereus.spec.workload import ResponseLengths, Workload

PlanKey = tuple[object, ...]
#: Share of a GPU's memory a refit's KV budget stays below the usable limit (rounding slack).
SMALLER_WAVES_MARGIN = 0.001


def plan_key(plan: Plan) -> PlanKey:
    """Identity of a plan's layout: pools, every model-stage's EMUs and its memory-saving
    choices (which change its time and memory as much as the layout does; not its workload)."""
    pools = tuple((p.name, tuple(p.gpus)) for p in plan.pools)
    stages = tuple(
        (
            s.model_stage,
            s.pool,
            s.tp,
            s.pp,
            s.micro_batches,
            tuple(tuple(e) for e in s.emus),
            (s.kv_budget_bytes, s.recompute, s.token_budget, s.zero1, s.offload, s.full_shard, s.train_offload),
        )
        for s in plan.stages
    )
    return (pools, stages)


def layout_summary(plan: Plan) -> str:
    """One short line: GPUs used and each model-stage's tp/pp/dp."""
    gpus = sum(len(p.gpus) for p in plan.pools)
    parts = [f"{label(s.model_stage)} {s.tp}/{s.pp}/{s.dp}" for s in plan.stages]
    return f"{gpus} GPUs: " + ", ".join(parts)


def max_gpu(plan: Plan) -> int:
    """The highest GPU id the plan uses."""
    return max(max(p.gpus) for p in plan.pools)


def survivors(plan: Plan, num_gpus: int) -> Plan | None:
    """`plan` without the EMUs that touch GPUs >= `num_gpus` (lost without notice).

    Their replicas are gone; the survivors hold complete copies of the state, so a DAG from
    here reads only live GPUs. None when some model-stage lost every replica.
    """
    stages = []
    for entry in plan.stages:
        alive = [emu for emu in entry.emus if max(emu) < num_gpus]
        if not alive:
            return None
        stages.append(entry.model_copy(update={"emus": alive, "dp": len(alive)}))
    return plan.model_copy(update={"stages": stages, "predictions": None})


@dataclass(frozen=True)
class TransitionVerdict:
    """Whether a transition DAG may run, and its cost (the DAG's critical path)."""

    cost_s: float
    problems: tuple[str, ...]
    """Why it may not run: no order exists, the independent checker's findings."""
    reads_gpus: frozenset[int] = frozenset()
    """GPUs whose state the DAG copies or reshards from (a lost GPU here means it cannot run)."""

    def passes(self, lost_gpus: frozenset[int] = frozenset()) -> bool:
        return not self.problems and not (self.reads_gpus & lost_gpus)


@dataclass
class Replanner:
    """The plan search and cost model under changing conditions, for one job (its base plan)."""

    base: Plan
    config: PolicyConfig = field(default_factory=PolicyConfig)
    calibration: Calibration = field(default_factory=Calibration)
    choices: MemoryChoices = field(default_factory=MemoryChoices)
    """The memory-saving choices replanned plans may use (RUNTIME_CHOICES inside `nereus run`)."""
    engineless: tuple[str, ...] | None = None
    """For plans nereus's runtime runs: its model-stages that run no engine (a rule-scored
    reward). Every plan is then priced and checked with actor/generation in the KV pool the
    engine will give it (`nereus.cost.fit.with_engine_budget`: in waves when that pool cannot
    hold the replica's batch), as `nereus fit`, the online calibration and the per-step
    prediction price it. None: as planned (unbounded unless the plan sets a KV budget)."""
    engine: Engine = "nereus"
    """The generation engine of actor/generation: under vLLM a transition that builds new
    actor/generation replicas also pays their engines' start-up and weight load
    (`build_transition`'s `engine`), so the payback admission weighs it."""
    refuses: Callable[[Plan], list[str]] | None = None
    """Why the runtime cannot run a plan (`nereus run`'s own check of a target plan). The policies
    move to plans it refuses only when no other plan fits (the runtime then keeps its plan), so
    the next best plan is taken rather than a refused move. None: no such check."""
    _runs: dict[PlanKey, bool] = field(default_factory=dict, repr=False)
    num_searches: int = 0
    _plans: dict[tuple[object, ...], list[Plan]] = field(default_factory=dict, repr=False)
    _times: dict[tuple[object, ...], float | None] = field(default_factory=dict, repr=False)
    _refits: dict[tuple[object, ...], Plan | None] = field(default_factory=dict, repr=False)
    _transitions: dict[tuple[PlanKey, PlanKey], TransitionVerdict] = field(default_factory=dict, repr=False)

    def recalibrate(self, calibration: Calibration) -> None:
        """Plan with `calibration` from now on; plans and times cached under the old one are dropped."""
        self.calibration = calibration
        self._plans.clear()
        self._times.clear()
        self._refits.clear()
        self._transitions.clear()

    def workload_for(self, lengths: ResponseLengths) -> Workload:
        return self.base.workload.model_copy(update={"response_len": lengths})

    def calibration_for(self, efficiency: float) -> Calibration:
        """The calibration with compute efficiencies scaled by the measured factor (capped at peak)."""
        c = self.calibration
        scaled = {name: min(1.0, getattr(c, name) * efficiency) for name in ("gemm", "attention", "decode_memory")}
        return c.model_copy(update=scaled)

    def rounded_lengths(self, lengths: ResponseLengths, margin: bool = True) -> ResponseLengths:
        """The lengths plans are sized for: measured plus the growth margin (`margin`), rounded up to the grid."""
        ratio = self.config.length_grid_ratio
        grow = 1.0 + self.config.growth_margin if margin else 1.0

        def up(tokens: int) -> int:
            grown = tokens * grow
            return max(tokens, math.ceil(ratio ** math.ceil(math.log(grown) / math.log(ratio) - 1e-9)))

        return ResponseLengths(median=up(lengths.median), p99=up(lengths.p99), max=up(lengths.max))

    def rounded_efficiency(self, efficiency: float) -> float:
        grid = self.config.efficiency_grid
        return max(grid, math.floor(efficiency / grid + 1e-9) * grid)

    def best_plan(self, gpus: int, lengths: ResponseLengths, efficiency: float) -> Plan | None:
        """The fastest memory-feasible plan on GPUs 0..gpus-1, or None when nothing fits."""
        plans = self.best_plans(gpus, lengths, efficiency)
        return plans[0] if plans else None

    def best_plans(self, gpus: int, lengths: ResponseLengths, efficiency: float) -> list[Plan]:
        """The `config.num_alternatives` fastest plans, fastest first (empty when nothing fits)."""
        rounded, eff = self.rounded_lengths(lengths), self.rounded_efficiency(efficiency)
        key = (gpus, rounded.median, rounded.p99, rounded.max, eff)
        if key not in self._plans:
            workload = self.workload_for(rounded)
            request = PlanRequest(
                self.base.cluster, tuple(self.base.models), workload, gpus, self.calibration_for(eff), self.choices
            )
            self.num_searches += 1
            try:
                result = make_plan(request, top_k=self.config.num_alternatives)
                # Plans the runtime runs first (fastest first among each): a move it would refuse
                # is proposed only when nothing else fits.
                plans = [result.best, *result.alternatives]
                self._plans[key] = sorted(plans, key=lambda p: not self.runs(p))
            except NereusError:
                self._plans[key] = []
        return self._plans[key]

    def runs(self, plan: Plan) -> bool:
        """Whether the runtime would run `plan` (always, without a `refuses` check; cached)."""
        if self.refuses is None:
            return True
        key = plan_key(plan)
        if key not in self._runs:
            self._runs[key] = not self.refuses(plan)
        return self._runs[key]

    def step_time(self, plan: Plan, lengths: ResponseLengths, efficiency: float) -> float | None:
        """Predicted step time of `plan` under these conditions; None when it overflows memory."""
        key = (plan_key(plan), lengths.median, lengths.p99, lengths.max, efficiency)
        if key not in self._times:
            self._times[key] = self.step_time_under(plan, lengths, self.calibration_for(efficiency))
        return self._times[key]

    def fill_time(self, plan: Plan, lengths: ResponseLengths, efficiency: float) -> float | None:
        """An async plan's first step after its pipeline starts empty (at the start, after a
        transition, restart or stall): generation has not run ahead, so the pools take turns:
        the synchronous composition of the same layouts. None when it overflows memory."""
        workload = self.workload_for(lengths).model_copy(
            update={"execution": "sync", "max_staleness": None, "partial_rollout": False}
        )
        evaluation = self.evaluate(plan.model_copy(update={"workload": workload}), self.calibration_for(efficiency))
        return evaluation.predictions.step_time_s if evaluation.feasible else None

    def step_time_under(self, plan: Plan, lengths: ResponseLengths, calibration: Calibration) -> float | None:
        """`step_time` under another calibration (not cached)."""
        evaluation = self.evaluate(plan.model_copy(update={"workload": self.workload_for(lengths)}), calibration)
        return evaluation.predictions.step_time_s if evaluation.feasible else None

    def evaluate(self, plan: Plan, calibration: Calibration) -> PlanEvaluation:
        """The cost model's evaluation of `plan` (sized), generation in the engine's pool when
        the plan is nereus's runtime's (`engineless` set). The memory rule stays the cost
        model's: states, the KV the engine will hold and activations within the usable memory."""
        if self.engineless is not None:
            plan = with_engine_budget(plan, self.engineless)
        return evaluate_plan(plan, calibration)

    def transition(self, plan_a: Plan, plan_b: Plan) -> TransitionVerdict:
        """Build, schedule and independently check the DAG from A to B (cached)."""
        key = (plan_key(plan_a), plan_key(plan_b))
        if key not in self._transitions:
            target = plan_b.model_copy(update={"workload": plan_a.workload})
            result = build_transition(plan_a, target, self.calibration, self.engine)
            problems: tuple[str, ...]
            if not result.feasible:
                problems = ("no order of the primitives fits memory: " + "; ".join(result.blocking_cycle[:2]),)
            else:
                problems = tuple(check_result(result, plan_a, target))
            reads = {src for p in result.primitives if p.kind != "destroy" for src, _, _ in p.transfers}
            reads |= {g for p in result.primitives if p.kind != "destroy" for g in p.reads}
            self._transitions[key] = TransitionVerdict(result.makespan_s, problems, frozenset(reads))
        return self._transitions[key]

    def restart_cost(self, plan: Plan) -> float:
        """Checkpoint-and-restart into `plan`: relaunch plus writing and reading the busiest GPU's state."""
        sizes: dict[str, float] = {
            s.model_stage: replica_state_bytes(plan, s.model_stage, self.calibration) for s in plan.stages
        }
        busiest = max(held_bytes(plan, sizes).values(), default=0.0)
        return self.config.restart_overhead_s + 2 * busiest / self.config.checkpoint_bytes_per_s

    def refit(self, plan: Plan, gpus: int, lengths: ResponseLengths, efficiency: float) -> Plan | None:
        """Keep every tp/pp: scale dp to `gpus`, then split overflowing model-stages into more micro-batches.

        What a runtime does without changing layouts: DP scaling and smaller micro-batches.
        Sized for the rounded-up lengths, like `best_plan`, or, when the layout cannot hold
        those, for the measured lengths (on the grid): the margin is a guess at the growth, and
        a layout that runs the lengths the steps have is kept. None when memory still overflows.
        """
        eff = self.rounded_efficiency(efficiency)
        for rounded in (self.rounded_lengths(lengths), self.rounded_lengths(lengths, margin=False)):
            key = (plan_key(plan), gpus, rounded.median, rounded.p99, rounded.max, eff)
            if key not in self._refits:
                self._refits[key] = self._refit(plan, gpus, self.workload_for(rounded), self.calibration_for(eff))
            if self._refits[key] is not None:
                return self._refits[key]
        return None

    def _refit(self, plan: Plan, gpus: int, workload: Workload, calibration: Calibration) -> Plan | None:
        candidate = self.dp_scaled(plan, gpus)
        while candidate is not None:
            sized = candidate.model_copy(update={"workload": workload})
            evaluation = self.evaluate(sized, calibration)
            if evaluation.feasible:
                return candidate
            over = {m.split(" ", 1)[0] for m in evaluation.memory_problems}
            stages = [
                _smaller_waves(sized, s, evaluation, calibration)
                if s.stage == "generation"
                else _more_micro_batches(s, workload, "full" in self.choices.recompute)
                for s in candidate.stages
                if s.model_stage in over
            ]
            if any(s is None for s in stages):
                return None  # not even one maximum-length sequence fits: only a new layout helps
            changed = {s.model_stage: s for s in stages if s is not None}
            updated = [changed.get(s.model_stage, s) for s in candidate.stages]
            if updated == candidate.stages:
                return None
            candidate = candidate.model_copy(update={"stages": updated})
        return None

    def dp_scaled(self, plan: Plan, gpus: int) -> Plan | None:
        """The same tp/pp per model-stage with dp scaled to `gpus` GPUs; None when it cannot be built."""
        sizes = _scaled_pool_sizes([len(p.gpus) for p in plan.pools], gpus, plan.cluster.gpus_per_node)
        if sizes is None:
            return None
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        pools = [
            Pool(name=p.name, gpus=list(range(s, s + n))) for p, s, n in zip(plan.pools, starts, sizes, strict=True)
        ]
        where = {p.name: (s, n) for p, s, n in zip(plan.pools, starts, sizes, strict=True)}
        stages = []
        for entry in plan.stages:
            start, size = where[entry.pool]
            scaled = _scaled_stage(entry, start, size, _samples(plan.workload, entry))
            if scaled is None:
                return None
            stages.append(scaled)
        candidate = plan.model_copy(update={"pools": pools, "stages": stages, "predictions": None})
        if any(p.severity == "error" for p in plan_problems(candidate)):
            return None
        return candidate


def _samples(workload: Workload, entry: StagePlan) -> int:
    per_step = workload.samples_per_step
    return per_step // workload.mini_batches if entry.stage == "training" else per_step


def _smaller_waves(
    plan: Plan, entry: StagePlan, evaluation: PlanEvaluation, calibration: Calibration
) -> StagePlan | None:
    """Generation batched continuously into the KV memory its GPUs have left (smaller waves:
    slower, priced by the cost model's continuous batching); None when not even one
    maximum-length sequence fits there."""
    prediction = evaluation.predictions.model_stages[entry.model_stage]
    limit = usable_capacity(plan.cluster, calibration)
    kv = prediction.memory_breakdown_bytes.get("kv_cache", 0)
    # Just below the limit (integer byte counts), by at most a MiB: a fixed MiB would take a
    # large share of a small GPU's pool (8% of a 12.8 MiB emulated rank).
    margin = min(2**20, math.ceil(plan.cluster.gpu.memory_bytes * SMALLER_WAVES_MARGIN))
    budget = math.floor(kv - (prediction.peak_memory_bytes - limit)) - margin
    if budget < one_sequence_bytes(plan, entry, calibration):
        return None
    return entry.model_copy(update={"kv_budget_bytes": budget})


def _more_micro_batches(entry: StagePlan, workload: Workload, recompute: bool) -> StagePlan:
    """Twice the micro-batches (half the activations), up to one sample each; then, in
    training and where the choices allow it (`recompute`), activation recomputation (the
    layout stays); generation has one. Unchanged when nothing is left to split."""
    if entry.stage == "generation":
        return entry
    share = _ceil_div(_samples(workload, entry), entry.dp)
    if entry.micro_batches >= share and entry.stage == "training" and entry.recompute == "none" and recompute:
        return entry.model_copy(update={"recompute": "full"})
    return entry.model_copy(update={"micro_batches": min(share, entry.micro_batches * 2)})


def _scaled_pool_sizes(sizes: list[int], gpus: int, per_node: int) -> list[int] | None:
    if len(sizes) == 1:
        return [gpus]
    total = sum(sizes)
    head = [max(per_node, round(n * gpus / total / per_node) * per_node) for n in sizes[:-1]]
    last = gpus - sum(head)
    return [*head, last] if last > 0 else None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _scaled_stage(entry: StagePlan, start: int, size: int, samples: int) -> StagePlan | None:
    emu_size = entry.replica_size
    dp = min(size // emu_size, samples)
    if dp == 0:
        return None
    micro_size = _ceil_div(_ceil_div(samples, entry.dp), entry.micro_batches)  # kept: samples per micro-batch
    micro = 1 if entry.stage == "generation" else _ceil_div(_ceil_div(samples, dp), micro_size)
    emus = [list(range(start + k * emu_size, start + (k + 1) * emu_size)) for k in range(dp)]
    return entry.model_copy(update={"dp": dp, "emus": emus, "micro_batches": micro})

"""Intra-stage fusion of a plan, without torch: whether the plan can run it, and its schedule.

Under `fusion.intra_stage` the actor and critic train in one bidirectional pipeline on the
same ranks (RLHFuse's intra-stage fusion): actor stage s and critic stage N-1-s share a rank,
so the critic's EMU lists the actor's GPUs stage by stage in reverse. The op order each rank
runs is the fused schedule `nereus schedule fuse --plan` searches, built here in-process
from the plan (same library, same cost-model times and activation cap: `fused_pipelines`, which
the command uses too). A run searches it once, when it is set up (`RunSetup.fused_schedule`, and
each plan change's `Move.fused_schedule`), and hands it to the ranks.

The search is the one `nereus schedule fuse --plan` runs (`search_fused`: list schedules,
latency annealing, then the memory phase and the lean phase that lower the peak at the
makespan found), under the same activation cap: the GiB per GPU left after both training
models' resident states (`plan_pipelines`). It runs one seed under a work budget that grows
with the problem's size (`search_iterations`), never a wall-clock limit, so every rank that
builds the schedule of a plan gets the very same op order, and a resumed run the same one
as before. The CP-SAT peak windows of a time-limited search are left out: their solves stop
on the clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nereus.errors import NereusError
from nereus.spec.plan import Plan, StagePlan
from nereus.spec.stages import ACTOR_TRAINING, CRITIC_TRAINING

if TYPE_CHECKING:
    from nereus.cost.calibration import Calibration
    from nereus.solver.pipeline.from_plan import PlanPipelines
    from nereus.spec.schedule import Schedule

#: Annealing neighbours per op of the fused problem in the run-time search (one seed): a
#: deterministic budget. The memory phase needs it: on 4 stages x 8 micro-batches per model
#: (128 ops) a flat 3000 neighbours leave the peak at 8 activations, 400 per op (about 2 s
#: on one core) reach the 6 of a 10 s `schedule fuse`, at the same makespan.
SEARCH_ITERATIONS_PER_OP = 400
#: The budget's floor (the small pipelines of tests still anneal) and ceiling (the search of
#: a large pipeline stays within seconds on every rank that builds it).
SEARCH_ITERATIONS = (3000, 100_000)
#: Only a guard: the iteration budget ends the search long before (a wall-clock end would
#: make ranks disagree on the schedule).
SEARCH_TIME_LIMIT_S = 3600.0


def reversed_stages(entry: StagePlan) -> list[list[int]]:
    """`entry`'s EMUs with their pipeline stages in reverse order (each stage's tp x cp ranks kept in order)."""
    width = entry.tp * entry.cp
    return [
        [gpu for stage in reversed(range(entry.pp)) for gpu in emu[stage * width : (stage + 1) * width]]
        for emu in entry.emus
    ]


def intra_stage_problems(plan: Plan) -> list[str]:
    """Why `plan` cannot run `fusion.intra_stage` (empty when it can, or when fusion is off).

    Call it on the plan a run uses, with the run config's `fusion:` block applied.
    """
    if not plan.fusion.intra_stage:
        return []
    field = "fusion.intra_stage"
    try:
        actor, critic = plan.stage_plan(ACTOR_TRAINING), plan.stage_plan(CRITIC_TRAINING)
    except KeyError as missing:
        return [f"{field}: the plan has no {missing.args[0]} stage; intra-stage fusion trains actor and critic "
                "together (PPO); set intra_stage: false"]  # fmt: skip
    if (actor.tp, actor.pp, actor.dp) != (critic.tp, critic.pp, critic.dp):
        return [
            f"{field}: actor/training is tp={actor.tp} pp={actor.pp} dp={actor.dp} but critic/training is "
            f"tp={critic.tp} pp={critic.pp} dp={critic.dp}; fusion needs both with the same layout on the "
            "same ranks, or intra_stage: false"
        ]
    expected = reversed_stages(actor)
    if critic.emus != expected:
        return [
            f"{field}: critic/training emus {critic.emus} must be actor/training's {actor.emus} with the "
            f"pipeline stages reversed, {expected} (critic stage 0 shares ranks with actor stage {actor.pp - 1}); "
            "fix critic/training emus or set intra_stage: false"
        ]
    try:
        # Whether a schedule exists is settled by the search's list schedules under the cap,
        # before any annealing: one neighbour tells (the run searches in full once, at set-up).
        fused_schedule(plan, max_iterations=1)
    except NereusError as error:
        return [f"{field}: no fused schedule for this plan: {error}"]
    return []


def fused_schedule(plan: Plan, max_iterations: int | None = None) -> Schedule:
    """The fused actor-critic `Schedule` of `plan`'s training stages, searched (seconds for a
    large pipeline: build it once and pass it on); NereusError when the plan has none (e.g.
    no memory left for activations). `max_iterations`: the annealing budget (default
    `search_iterations`)."""
    from nereus.solver.pipeline.document import to_document
    from nereus.solver.pipeline.search import SearchConfig, search_fused

    pipelines, cap = fused_pipelines(plan)
    budget = search_iterations(pipelines) if max_iterations is None else max_iterations
    config = SearchConfig(time_limit_s=SEARCH_TIME_LIMIT_S, seeds=1, max_iterations=budget)
    result = search_fused(pipelines.actor, pipelines.critic, config, activation_cap=cap)
    return to_document(result, time_unit="s", memory_unit="GiB")


def fused_pipelines(
    plan: Plan, calibration: Calibration | None = None, activation_cap: float | None = None, where: str | None = None
) -> tuple[PlanPipelines, float]:
    """`plan`'s fused actor-critic problem: both training models' pipelines (`plan_pipelines`
    under `calibration`, default the cost model's) and the activation cap (GiB per GPU) the
    search runs under: `activation_cap` when given, else what the plan's training states
    leave, a NereusError (prefixed by `where`) when they leave nothing."""
    from nereus.solver.pipeline.from_plan import plan_pipelines

    pipelines = plan_pipelines(plan) if calibration is None else plan_pipelines(plan, calibration)
    if activation_cap is not None:
        return pipelines, activation_cap
    if pipelines.activation_cap <= 0:
        prefix = "" if where is None else f"{where}: "
        raise NereusError(f"{prefix}the actor and critic training states leave no GPU memory for activations")
    return pipelines, pipelines.activation_cap


def search_iterations(pipelines: PlanPipelines) -> int:
    """The run-time search's budget of annealing neighbours: SEARCH_ITERATIONS_PER_OP per
    op (a forward and a backward per stage and micro-batch of each model), within
    SEARCH_ITERATIONS."""
    ops = sum(2 * len(times.forward) * times.num_microbatches for times in (pipelines.actor, pipelines.critic))
    low, high = SEARCH_ITERATIONS
    return min(high, max(low, SEARCH_ITERATIONS_PER_OP * ops))

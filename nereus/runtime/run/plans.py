"""The plans a run runs under: read as their kind, with the run config's fusion block in
force, the ranks each calls for, the planner's layout for another number of ranks, and the
fused schedule, searched once by the process that sets the run up and carried to the ranks.

It imports no torch, like everything the launcher runs before it spawns a rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from nereus.errors import NereusError
from nereus.spec.io import load_document
from nereus.spec.plan import Plan

if TYPE_CHECKING:
    from nereus.spec.schedule import Schedule


def load_as(path: Path, kind: type[Any]) -> Any:
    """The document at `path`, refused unless it is a `kind`."""
    document = load_document(path)
    if not isinstance(document, kind):
        raise NereusError(f"{path}: kind: expected {kind.__name__}, got {type(document).__name__}")
    return document


def plan_schedule(plan: Plan) -> Schedule | None:
    """The fused schedule the ranks train `plan` under (None without `fusion.intra_stage`):
    searched here, once, by the process that sets the run up or changes its plan, and
    carried to every rank (`RunSetup.fused_schedule`, `Move.fused_schedule`), which then runs the very
    same op order without searching it again."""
    from nereus.runtime.model.fused_schedule import fused_schedule

    return fused_schedule(plan) if plan.fusion.intra_stage else None


def check_same_work(plan: Plan, stored: Plan, where: Path) -> None:
    """A resumed run keeps its models and workload: only the layouts may change."""
    if plan.models != stored.models:
        raise NereusError(f"{where}: models: differ from the run's; a resume may change layouts, not models")
    if plan.workload != stored.workload:
        old, new = stored.workload, plan.workload
        changed = [name for name in type(new).model_fields if getattr(new, name) != getattr(old, name)]
        raise NereusError(
            f"{where}: workload.{changed[0]}: differs from the run's; a resume may change layouts, not the workload"
        )


def replan(stored: Plan, num_ranks: int) -> Plan:
    """The planner's best plan for the stored plan's models and workload on `num_ranks` ranks,
    searching every memory choice the runtime executes under the stored plan's fusion."""
    from nereus.solver.layouts import runtime_choices
    from nereus.solver.plan_search import PlanRequest
    from nereus.solver.planner import make_plan

    cluster = stored.cluster.model_copy(update={"num_nodes": 1, "gpus_per_node": num_ranks})
    request = PlanRequest(
        cluster, tuple(stored.models), stored.workload, num_ranks, choices=runtime_choices(stored.fusion)
    )
    return make_plan(request).best.model_copy(update={"fusion": stored.fusion, "weights": stored.weights})

"""What `nereus run` settles about a run whose models come from a Hugging Face folder,
before any rank exists (no torch): the folder's Model and weight check, the plan's agreement
with it, and a plan of its own when the config names none."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nereus.errors import NereusError
from nereus.runtime.hf.files import check_weights
from nereus.spec.cluster import Cluster
from nereus.spec.model import Model
from nereus.spec.plan import Plan
from nereus.spec.workload import Workload

#: Roles whose initial weights are read from the folder (a critic gets a new value head; a
#: fitted reward model starts from its own initialisation).
LOADED_ROLES = ("actor", "reference", "critic")
#: Plans the planner proposes for a run that plans itself; the first the runtime can run is used.
PLANS_TRIED = 8


@dataclass(frozen=True)
class HfWeights:
    """A checked Hugging Face folder: the model it describes and where it is."""

    folder: Path
    """Absolute path of the folder."""
    model: Model


def hf_weights(folder: Path) -> HfWeights:
    """The folder's Model with every weight it needs checked against its config.json."""
    from nereus.spec.hf_config import model_from_hf_config

    folder = folder.resolve()
    model = model_from_hf_config(folder, name=folder.name)
    check_weights(folder, model, "lm")
    return HfWeights(folder, model)


def every_role_is(workload: Workload, model_name: str) -> Workload:
    """`workload` with every role it has played by `model_name`."""
    roles: dict[str, str] = {role: model_name for role, name in workload.role_models().items() if name is not None}
    return workload.model_copy(update=roles)


def check_plan_models(plan: Plan, weights: HfWeights, where: str) -> None:
    """A given plan must run the folder's model in every role (as `nereus plan --model` makes it)."""
    for role, name in plan.workload.role_models().items():
        if name is not None and plan.model(name) != weights.model:
            raise NereusError(
                f"{where}: workload.{role}: plays {name}, not the model of {weights.folder}; "
                f"make the plan with `nereus plan --model {weights.folder}`"
            )


def plans_for_folder(weights: HfWeights, workload: Workload, cluster: Cluster, num_ranks: int) -> list[Plan]:
    """The planner's best plans (best first) running the folder's model in every role of
    `workload` on `num_ranks` local ranks (one node of `cluster`'s GPU kind); each records
    the folder as its weight source."""
    from nereus.solver.plan_search import PlanRequest
    from nereus.solver.planner import make_plan

    local = cluster.model_copy(update={"num_nodes": 1, "gpus_per_node": num_ranks})
    request = PlanRequest(local, (weights.model,), every_role_is(workload, weights.model.name), num_ranks)
    result = make_plan(request, top_k=PLANS_TRIED)
    return [plan.model_copy(update={"weights": str(weights.folder)}) for plan in (result.best, *result.alternatives)]

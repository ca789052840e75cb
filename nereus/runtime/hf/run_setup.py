"""What `nereus run` settles about a run whose models come from Hugging Face folders,
before any rank exists (no torch): each folder's Model and weight check, the plan's agreement
with them, and a plan of its own when the config names none."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nereus.errors import NereusError
from nereus.runtime.hf.files import check_weights
from nereus.spec.cluster import Cluster
from nereus.spec.model import Head, Model
from nereus.spec.plan import Fusion, Plan
from nereus.spec.stages import Role
from nereus.spec.workload import Workload

#: Plans the planner proposes for a run that plans itself; the first the runtime can run is used.
PLANS_TRIED = 8


@dataclass(frozen=True)
class HfWeights:
    """A checked Hugging Face folder: the model it describes and where it is."""

    folder: Path
    """Absolute path of the folder."""
    model: Model


@dataclass(frozen=True)
class HfSources:
    """Where every role's initial weights come from; the actor's folder gives the model."""

    model: Model
    """The actor folder's model: every role plays it."""
    folders: dict[Role, Path]
    """Folder of each role that starts from one (absolute paths)."""

    def for_plan(self, plan: Plan) -> Plan:
        """`plan` recording the folders of the roles its workload has."""
        roles = {role for role, name in plan.workload.role_models().items() if name is not None}
        weights = {role: str(folder) for role, folder in self.folders.items() if role in roles}
        return plan.model_copy(update={"weights": weights})


def hf_weights(folder: Path, head: Head = "lm", field: str = "model") -> HfWeights:
    """The folder's Model with every weight a `head` model needs checked against its config.json;
    a value head must be there when `field` is the reward model's."""
    from nereus.spec.hf_config import model_from_hf_config

    folder = folder.resolve()
    model = model_from_hf_config(folder, name=folder.name)
    found = check_weights(folder, model, head)
    if field == "reward_model" and "value_head.weight" not in found:
        raise NereusError(
            f"{field}: {folder} has no score.weight; a reward model folder holds a sequence-classification "
            "checkpoint with one label"
        )
    return HfWeights(folder, model)


def hf_sources(actor: Path, critic: Path | None, reward: Path | None) -> HfSources:
    """The checked folders of a run: the actor's (also the reference's, and the critic's with a
    new value head unless `critic` is given) and the optional critic and reward folders, which
    must hold the same architecture."""
    main = hf_weights(actor)
    folders: dict[Role, Path] = {"actor": main.folder, "reference": main.folder, "critic": main.folder}
    for role, folder, field in (("critic", critic, "critic_model"), ("reward", reward, "reward_model")):
        if folder is None:
            continue
        other = hf_weights(folder, "value", field)
        # The head is not the decoder: a value-head checkpoint may say nothing about tying.
        uncompared = {"name": main.model.name, "tied_embeddings": main.model.tied_embeddings}
        if other.model.model_copy(update=uncompared) != main.model:
            raise NereusError(
                f"{field}: {other.folder} holds another architecture than {main.folder}; "
                "every role of a run plays the same model"
            )
        folders[role] = other.folder  # type: ignore[index]
    return HfSources(main.model, folders)


def every_role_is(workload: Workload, model_name: str) -> Workload:
    """`workload` with every role it has played by `model_name`."""
    roles: dict[str, str] = {role: model_name for role, name in workload.role_models().items() if name is not None}
    return workload.model_copy(update=roles)


def check_plan_models(plan: Plan, sources: HfSources, where: str) -> None:
    """A given plan must run the folder's model in every role (as `nereus plan --model` makes it)."""
    for role, name in plan.workload.role_models().items():
        if name is not None and plan.model(name) != sources.model:
            raise NereusError(
                f"{where}: workload.{role}: plays {name}, not the model of {sources.folders['actor']}; "
                f"make the plan with `nereus plan --model {sources.folders['actor']}`"
            )


def plans_for_folder(
    sources: HfSources, workload: Workload, cluster: Cluster, num_ranks: int, fusion: Fusion | None = None
) -> list[Plan]:
    """The planner's best plans (best first) running the folder's model in every role of
    `workload` on `num_ranks` local ranks (one node of `cluster`'s GPU kind), searching every
    memory choice the runtime executes under `fusion` (the run's fusion block); each records
    the folder as its weight source."""
    from nereus.solver.layouts import runtime_choices
    from nereus.solver.plan_search import PlanRequest
    from nereus.solver.planner import make_plan

    local = cluster.model_copy(update={"num_nodes": 1, "gpus_per_node": num_ranks})
    request = PlanRequest(
        local, (sources.model,), every_role_is(workload, sources.model.name), num_ranks, choices=runtime_choices(fusion)
    )
    result = make_plan(request, top_k=PLANS_TRIED)
    return [sources.for_plan(plan) for plan in (result.best, *result.alternatives)]

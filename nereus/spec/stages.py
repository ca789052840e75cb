"""The model-stage table: the one place that names roles, stages and model-stages.

A *model-stage* is one model in one stage of an RL step, written `role/stage`
(`actor/generation`). Every layer keys its dictionaries by the names defined here and asks
this table for the facts about a role (its head, whether it is trained or checkpointed, which
RunConfig field holds its learning rate, its init-seed offset, its short label); no module
splits or builds a `role/stage` string by hand.

Phases are a different kind of thing: the parts of a step that are not one model-stage's work
(the row exchange between model-stages, weight syncs, live transitions). Step records keep the
two apart (`Phase` below).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, TypeGuard, TypeVar, get_args

Role = Literal["actor", "critic", "reference", "reward"]
"""A model's part in an RL step."""
Stage = Literal["generation", "inference", "training"]
"""What a model does in a step: sample responses, score them, or learn from them."""
Head = Literal["lm", "value"]
"""A model's output head: next-token logits, or one scalar per position."""

ModelStageName = Literal[
    "actor/generation",
    "actor/inference",
    "reference/inference",
    "reward/inference",
    "critic/inference",
    "actor/training",
    "critic/training",
]
"""A model-stage: `role/stage`, in the order a step runs them (see `workload.model_stages`)."""

Phase = Literal["advantages", "exchange", "weight_sync", "transition", "restart"]
"""A part of a step that is not one model-stage's work: computing advantages and returns
(`advantages`), rows moving between model-stages (`exchange`), trained weights reaching their
targets (`weight_sync`); and the plan changes before a step: a live layout change
(`transition`) or a restart under the new plan (`restart`)."""

ROLES: tuple[Role, ...] = get_args(Role)
STAGES: tuple[Stage, ...] = get_args(Stage)
MODEL_STAGES: tuple[ModelStageName, ...] = get_args(ModelStageName)
"""Every model-stage, in the order a step runs them."""
PHASES: tuple[Phase, ...] = get_args(Phase)
#: The phases that are plan changes before a step, not part of it.
PLAN_CHANGES: tuple[Phase, ...] = ("transition", "restart")

ACTOR_GENERATION: ModelStageName = "actor/generation"
ACTOR_INFERENCE: ModelStageName = "actor/inference"
REFERENCE_INFERENCE: ModelStageName = "reference/inference"
REWARD_INFERENCE: ModelStageName = "reward/inference"
CRITIC_INFERENCE: ModelStageName = "critic/inference"
ACTOR_TRAINING: ModelStageName = "actor/training"
CRITIC_TRAINING: ModelStageName = "critic/training"


@dataclass(frozen=True)
class RoleInfo:
    """What every layer needs to know about one role."""

    role: Role
    head: Head
    """Critic and reward models end in a scalar value head; the others in an LM head."""
    trained: bool
    """Whether the role has a training model-stage (its weights change during a run)."""
    checkpointed: bool
    """Whether a run checkpoint saves its weights (trained roles, and a reward model, whose
    weights may come from a folder the run does not own); the reference is saved only after a
    supervised warm-start changed it (see `checkpointed_stages`)."""
    lr_field: str
    """The RunConfig `rl:` field that holds its (peak) learning rate."""
    seed_offset: int
    """Added to the run's seed for its initial weights: the reward model starts from weights of
    its own, not the critic's."""
    label: str
    """Its short label in progress lines and tables."""


#: One record per role.
ROLE_INFO: dict[Role, RoleInfo] = {
    "actor": RoleInfo("actor", "lm", True, True, "actor_lr", 0, "act"),
    "critic": RoleInfo("critic", "value", True, True, "critic_lr", 0, "crit"),
    "reference": RoleInfo("reference", "lm", False, False, "actor_lr", 0, "ref"),
    "reward": RoleInfo("reward", "value", False, True, "reward_model_lr", 1, "rew"),
}

#: Short labels of the stages and of the phases.
STAGE_LABELS: dict[Stage, str] = {"generation": "gen", "inference": "inf", "training": "train"}
PHASE_LABELS: dict[Phase, str] = {
    "advantages": "adv",
    "exchange": "xchg",
    "weight_sync": "sync",
    "transition": "transition",
    "restart": "restart",
}

_STAGE_ORDER: dict[str, int] = {stage: number for number, stage in enumerate(STAGES)}
_PARTS: dict[str, tuple[Role, Stage]] = {name: tuple(name.split("/")) for name in MODEL_STAGES}  # type: ignore[misc]


def is_model_stage(name: str) -> TypeGuard[ModelStageName]:
    """Whether `name` is one of the seven model-stages (not a phase or anything else)."""
    return name in _PARTS


def is_phase(name: str) -> TypeGuard[Phase]:
    """Whether `name` is one of the phases."""
    return name in PHASES


V = TypeVar("V")


def model_stage_entries(values: Mapping[str, V]) -> dict[ModelStageName, V]:
    """The entries of `values` keyed by a model-stage (a step record's times mix model-stages
    and phases under one mapping), in `values`' order."""
    return {name: value for name, value in values.items() if is_model_stage(name)}


def phase_entries(values: Mapping[str, V]) -> dict[Phase, V]:
    """The entries of `values` keyed by a phase, in `values`' order."""
    return {name: value for name, value in values.items() if is_phase(name)}


def split(name: str) -> tuple[Role, Stage]:
    """`actor/generation` -> (`actor`, `generation`); a ValueError for any other string."""
    try:
        return _PARTS[name]
    except KeyError:
        raise ValueError(f"unknown model-stage {name!r}; expected one of {', '.join(MODEL_STAGES)}") from None


def role_of(name: str) -> Role:
    """The role of model-stage `name`."""
    return split(name)[0]


def stage_of(name: str) -> Stage:
    """The stage of model-stage `name`."""
    return split(name)[1]


def stage_order(name: str) -> int:
    """Where `name`'s stage comes in a step: its stage's index in `STAGES` (generation 0,
    inference 1, training 2). `name` is a model-stage or any `role/stage` name: the transition
    solver moves replicas of whatever model it is given (its tests name them `x/training`)."""
    return _STAGE_ORDER[name.rpartition("/")[2]]


def model_stage(role: str, stage: str) -> ModelStageName:
    """The model-stage of `role` in `stage`; a ValueError for a pair that is none."""
    for name, parts in _PARTS.items():
        if parts == (role, stage):
            return name  # type: ignore[return-value]
    raise ValueError(f"{role!r} has no {stage!r} model-stage; expected one of {', '.join(MODEL_STAGES)}")


def head_of(role: str) -> Head:
    """The output head of `role`'s model."""
    return ROLE_INFO[role].head  # type: ignore[index]


def is_trained(name: str) -> bool:
    """Whether model-stage `name` trains (its stage is `training`)."""
    return stage_of(name) == "training"


#: The model-stages that train, in step order (one per trained role).
TRAINED_STAGES: tuple[ModelStageName, ...] = tuple(
    model_stage(role, "training") for role, info in ROLE_INFO.items() if info.trained
)


def label(name: str) -> str:
    """The short label of a model-stage (`act-train`, `gen`, ...) or a phase (`sync`, ...)."""
    if name in PHASE_LABELS:
        return PHASE_LABELS[name]
    role, stage = split(name)
    if name == ACTOR_GENERATION:
        return STAGE_LABELS[stage]
    if role in ("reference", "reward"):
        return ROLE_INFO[role].label
    return f"{ROLE_INFO[role].label}-{STAGE_LABELS[stage]}"


#: The inference model-stages and what each computes for every token of a rollout: the
#: token-aligned log probability of each response token, the critic's value of emitting it, or
#: the value head's output at every position (a reward model's score is its value at the last
#: response token). In the order every rank runs them.
InferenceOutput = Literal["log_probs", "values", "position_values"]
INFERENCE_OUTPUTS: dict[ModelStageName, InferenceOutput] = {
    ACTOR_INFERENCE: "log_probs",
    REFERENCE_INFERENCE: "log_probs",
    CRITIC_INFERENCE: "values",
    REWARD_INFERENCE: "position_values",
}

#: The inference model-stages, in the order every rank runs them.
INFERENCE_STAGES: tuple[ModelStageName, ...] = tuple(INFERENCE_OUTPUTS)

#: The weight syncs after training: (source model-stage, target model-stage).
WEIGHT_SYNCS: tuple[tuple[ModelStageName, ModelStageName], ...] = (
    (ACTOR_TRAINING, ACTOR_GENERATION),
    (ACTOR_TRAINING, ACTOR_INFERENCE),
    (CRITIC_TRAINING, CRITIC_INFERENCE),
)

#: The model-stages that receive the trained actor's weights.
ACTOR_SYNC_TARGETS: tuple[ModelStageName, ...] = tuple(
    target for source, target in WEIGHT_SYNCS if source == ACTOR_TRAINING
)

#: The model-stages whose engines a run checkpoint saves: one per checkpointed role, the one
#: whose weights are current at the end of a step (its training stage if it trains).
SAVED_STAGES: tuple[ModelStageName, ...] = tuple(
    model_stage(role, "training" if info.trained else "inference")
    for role, info in ROLE_INFO.items()
    if info.checkpointed
)


def checkpointed_stages(warm_started: bool) -> tuple[ModelStageName, ...]:
    """`SAVED_STAGES`, and the reference after a supervised warm-start changed its weights."""
    return (*SAVED_STAGES, REFERENCE_INFERENCE) if warm_started else SAVED_STAGES

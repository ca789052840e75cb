"""Actor and critic training pipelines from a plan, timed by the cost model.

Per micro-batch and pipeline stage, the cost model's 1F1B training terms are
`rounds * m * slot_x` for x in compute, tp_comm, pp_comm and overhead, with
rounds = mini-batches x PPO epochs and m micro-batches; one slot is one forward plus one
backward on the busiest stage (the last, which carries the head), and the model counts a
backward as two forwards (3 passes per slot). So forward = slot / 3 and backward =
2 slot / 3, the same for every stage. Activation memory per in-flight micro-batch is the
cost model's activation term divided by the micro-batches 1F1B keeps in flight
(min(pp, m)). The schedule covers one mini-batch (one optimizer step).

When the tensor-parallel degrees differ by a factor s, s consecutive stages of the model
with the smaller tp form one group, so every node has tp_max GPUs for both models; a
group's times and memory are the sums over its stages (a micro-batch holds the group for
its whole pass: conservative); its activation stays the per-GPU value of one stage, as
each GPU of the group holds only its own stage's activations.

`activation_cap` is what a GPU has left for activations: the model-stages' room (the usable
capacity less the workspace, `stage_room`) less the resident model states (parameters, gradients, optimizer)
of both training model-stages, which share the GPUs in a fused schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nereus.cost.calibration import DEFAULT_CALIBRATION, Calibration
from nereus.cost.plan_cost import RESIDENT_TERMS, stage_cost_model, stage_room
from nereus.errors import NereusError
from nereus.solver.pipeline.model import ModelTimes
from nereus.spec.plan import Plan, StagePlan
from nereus.spec.stages import ACTOR_TRAINING, CRITIC_TRAINING

GIB = 2**30


@dataclass(frozen=True)
class PlanPipelines:
    """The two models' pipelines and how they were derived."""

    actor: ModelTimes
    critic: ModelTimes
    actor_group: int
    """Consecutive actor stages per node (1 unless its tp is the smaller)."""
    critic_group: int
    """Consecutive critic stages per node (1 unless its tp is the smaller)."""
    gpus_per_node: int
    """GPUs of one node: the larger tp."""
    activation_cap: float
    """GiB per GPU left for activations once both models' states are resident."""


def _spans_nodes(plan: Plan, gpus: list[int]) -> bool:
    return len({plan.cluster.node_of(g) for g in gpus}) > 1


def _resident_gib(plan: Plan, entry: StagePlan, calibration: Calibration) -> float:
    cost = stage_cost_model(plan, entry.role, "training", calibration)
    memory = cost.memory_terms(entry.tp, entry.pp, entry.dp, entry.micro_batches)
    return sum(float(memory[k]) for k in RESIDENT_TERMS if k in memory) / GIB


def _stage_times(plan: Plan, entry: StagePlan, calibration: Calibration) -> tuple[float, float, float]:
    """(forward s, backward s, activation GiB) of one micro-batch on one stage."""
    cost = stage_cost_model(plan, entry.role, "training", calibration)
    pp_inter = any(_spans_nodes(plan, emu) for emu in entry.emus)
    terms = cost.time_terms(entry.tp, entry.pp, entry.dp, entry.micro_batches, pp_inter, _spans_nodes(plan, entry.gpus))
    rounds = plan.workload.mini_batches * plan.workload.ppo_epochs
    slot = sum(float(terms[k]) for k in ("compute", "tp_comm", "pp_comm", "overhead")) / (rounds * entry.micro_batches)
    memory = cost.memory_terms(entry.tp, entry.pp, entry.dp, entry.micro_batches)
    activation = float(memory["activations"]) / min(entry.pp, entry.micro_batches) / GIB
    return slot / 3, 2 * slot / 3, activation


def _grouped(
    name: str, entry: StagePlan, group: int, microbatches: int, times: tuple[float, float, float]
) -> ModelTimes:
    if entry.pp % group:
        raise NereusError(
            f"{entry.model_stage}: tp differs from the other model's by a factor {group}, so {group} stages "
            f"share a node, but pp={entry.pp} is not a multiple of {group}; pick pp divisible by {group}"
        )
    forward, backward, activation = times[0] * group, times[1] * group, times[2]
    return ModelTimes.uniform(name, entry.pp // group, microbatches, forward, backward, activation)


def plan_pipelines(plan: Plan, calibration: Calibration = DEFAULT_CALIBRATION) -> PlanPipelines:
    """Actor and critic pipelines of one actor replica's share of a mini-batch."""
    try:
        actor, critic = plan.stage_plan(ACTOR_TRAINING), plan.stage_plan(CRITIC_TRAINING)
    except KeyError as exc:
        raise NereusError(
            f"the plan has no {exc.args[0]} entry; schedule fuse needs a PPO plan with a critic"
        ) from None
    small, large = sorted((actor.tp, critic.tp))
    if large % small:
        raise NereusError(
            f"actor tp={actor.tp} and critic tp={critic.tp}: one must divide the other so stages group evenly"
        )
    factor = large // small
    actor_group = factor if actor.tp < critic.tp else 1
    critic_group = factor if critic.tp < actor.tp else 1
    # The critic's micro-batches of the samples one actor replica trains on.
    critic_mbs = math.ceil(critic.dp * critic.micro_batches / actor.dp)
    return PlanPipelines(
        actor=_grouped("actor", actor, actor_group, actor.micro_batches, _stage_times(plan, actor, calibration)),
        critic=_grouped("critic", critic, critic_group, critic_mbs, _stage_times(plan, critic, calibration)),
        actor_group=actor_group,
        critic_group=critic_group,
        gpus_per_node=large,
        activation_cap=stage_room(plan.cluster, calibration) / GIB
        - _resident_gib(plan, actor, calibration)
        - _resident_gib(plan, critic, calibration),
    )

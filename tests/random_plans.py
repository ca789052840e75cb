"""Random plans for the transition tests: the 4-rank example relaid at random on random clusters and models.

Shared by the transition checker, the transition search and the EMU executor tests.
"""

from __future__ import annotations

import math
import random

from nereus.cost.calibration import Calibration
from nereus.spec.check import kv_heads_rule
from nereus.spec.io import load_document
from nereus.spec.model import Model
from nereus.spec.plan import Plan, Pool, StagePlan
from nereus.spec.presets import MODELS


def example_plan() -> Plan:
    plan = load_document("examples/plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan, Plan)
    return plan


BASE = example_plan()


Layouts = dict[str, tuple[int, int, list[list[int]]]]  # model-stage -> (tp, pp, EMUs)


def relayout_stages(plan: Plan, layouts: Layouts) -> Plan:
    stages = [
        StagePlan(
            model_stage=e.model_stage, pool=e.pool, tp=tp, pp=pp, dp=len(emus), emus=emus, micro_batches=e.micro_batches
        )
        if e.model_stage in layouts
        else e
        for e in plan.stages
        for tp, pp, emus in [layouts.get(e.model_stage, (0, 0, []))]
    ]
    return plan.model_copy(update={"stages": stages, "predictions": None})


CUSTOM = (
    Model(
        name="six", num_layers=6, hidden_dim=96, num_heads=6, num_kv_heads=2, head_dim=16, ffn_dim=256, vocab_size=64
    ),
    Model(
        name="odd", num_layers=3, hidden_dim=96, num_heads=12, num_kv_heads=4, head_dim=8, ffn_dim=200, vocab_size=80
    ),
)
ROLES = ("actor", "critic", "reference", "reward")


def _layouts(model: Model, num_gpus: int) -> list[tuple[int, int]]:
    return [
        (tp, pp)
        for tp in range(1, num_gpus + 1)
        for pp in range(1, num_gpus // tp + 1)
        if kv_heads_rule(model, tp) is None and model.num_layers % pp == 0
    ]


def random_setting(rng: random.Random) -> Plan:
    """The example plan on a random 1-2 node cluster with random models per role (stages not yet relaid)."""
    nodes, per_node = rng.choice((1, 2)), rng.choice((2, 4, 8))
    models = {role: rng.choice((MODELS["tiny"], MODELS["tiny-wide"], *CUSTOM)) for role in ROLES}
    cluster = BASE.cluster.model_copy(update={"num_nodes": nodes, "gpus_per_node": per_node})
    workload = BASE.workload.model_copy(update={role: m.name for role, m in models.items()})
    unique = list({m.name: m for m in models.values()}.values())
    pools = [Pool(name="all", gpus=list(range(nodes * per_node)))]
    return BASE.model_copy(update={"cluster": cluster, "models": unique, "workload": workload, "pools": pools})


def random_stages(rng: random.Random, setting: Plan) -> Plan:
    """Random layout and EMUs (disjoint random GPU subsets of the pool) for every model-stage."""
    gpus = setting.pools[0].gpus
    layouts: Layouts = {}
    for entry in setting.stages:
        model = setting.model(setting.workload.model_name(entry.role))
        tp, pp = rng.choice(_layouts(model, len(gpus)))
        dp = rng.randint(1, len(gpus) // (tp * pp))
        chosen = rng.sample(gpus, dp * tp * pp)
        layouts[entry.model_stage] = (tp, pp, [chosen[i : i + tp * pp] for i in range(0, len(chosen), tp * pp)])
    return relayout_stages(setting, layouts)


def with_capacity(plan: Plan, capacity: float) -> Plan:
    """The plan on GPUs whose usable memory (after headroom and workspace) is about `capacity` bytes."""
    calibration = Calibration()
    usable = 1 - calibration.memory_headroom - calibration.workspace_fraction
    gpu = plan.cluster.gpu.model_copy(update={"memory_bytes": math.ceil(capacity / usable)})
    return plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"gpu": gpu})})

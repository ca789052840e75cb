"""The EMU executor runs transition DAGs on live sharded state (tier: multi-process gloo):
through tp, pp, dp and placement changes, a pool shrink and a pool growth, and through
random sequences of mixed per-model-stage layouts, the gathered logical state after each
transition equals the state before it, bitwise."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import yaml
from random_plans import random_setting, random_stages, relayout_stages
from repo_paths import EXAMPLES

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.state.shard_layout import stage_layout
from nereus.runtime.state.sharded_state import gather, random_rank_state, state_meta
from nereus.runtime.state.transition_executor import execute_transition
from nereus.solver.transition.schedule import build_transition
from nereus.spec.check import layout_problem
from nereus.spec.plan import Plan
from nereus.spec.stages import head_of

pytestmark = pytest.mark.one_rank

EXAMPLES = EXAMPLES
TRAINING_FAMILIES = ("param", "exp_avg", "exp_avg_sq")
#: Layouts (tp, pp, emus) every model-stage takes in each plan of the sequence.
SEQUENCE: list[tuple[str, tuple[int, int, list[list[int]]]]] = [
    ("tp2-dp2", (2, 1, [[0, 1], [2, 3]])),
    ("pp4", (1, 4, [[3, 2, 1, 0]])),
    ("dp4", (1, 1, [[0], [1], [2], [3]])),
    ("shrink-tp2-on-0-1", (2, 1, [[0, 1]])),
    ("grow-pp2-dp2", (1, 2, [[2, 3], [0, 1]])),
]


def make_plan(tp: int, pp: int, emus: list[list[int]]) -> Plan:
    document = yaml.safe_load((EXAMPLES / "plan-tiny-ppo-4rank.yaml").read_text())
    gpus = sorted({gpu for emu in emus for gpu in emu})
    document["pools"] = [{"name": "all", "gpus": gpus}]
    layout = {"pool": "all", "tp": tp, "pp": pp, "dp": len(emus), "emus": emus, "micro_batches": 1}
    document["stages"] = [{**entry, **layout} for entry in document["stages"]]
    return Plan.model_validate(document)


def families(plan: Plan) -> dict[str, tuple[str, ...]]:
    return {e.model_stage: TRAINING_FAMILIES if e.stage == "training" else ("param",) for e in plan.stages}


def metas(plan: Plan) -> dict[str, Any]:
    found = {}
    for entry in plan.stages:
        model = plan.model(plan.workload.model_name(entry.role))
        found[entry.model_stage] = state_meta(
            model, head_of(entry.role), stage_layout(entry), families(plan)[entry.model_stage]
        )
    return found


def walk(rank: int, world_size: int, plans: list[Plan], transitions: list[Any]) -> list[dict[str, Any]]:
    """Start from random plan-0 state, run every transition; this rank's state after each."""
    states = {name: (random_rank_state(meta, rank, seed=11), 5) for name, meta in metas(plans[0]).items()}
    states = {name: state for name, state in states.items() if state[0]}
    snapshots = [states]
    for (plan_a, plan_b), (primitives, schedule) in zip(itertools.pairwise(plans), transitions, strict=True):
        done = execute_transition(primitives, schedule, plan_a, plan_b, rank, states, families(plan_a))
        states = done.states
        snapshot = {name: (dict(tensors), step) for name, (tensors, step) in states.items()}
        snapshots.append({**snapshot, "moved": (done.bytes_sent, done.num_primitives)})
    return snapshots


def assert_state_kept(plans: list[Plan], per_rank: list[list[dict[str, Any]]]) -> None:
    """Each plan's gathered logical state (and optimizer step) equals the previous plan's, bitwise."""
    before = None
    for index, plan in enumerate(plans):
        now = {}
        for name, meta in metas(plan).items():
            held = {rank: per_rank[rank][index][name][0] for rank in meta.boxes}
            assert all(per_rank[rank][index][name][1] == 5 for rank in meta.boxes), "optimizer steps kept"
            now[name] = gather(meta, held)
            if before is not None:
                assert now[name].keys() == before[name].keys()
                for key, tensor in now[name].items():
                    assert tensor.equal(before[name][key]), (index, name, key)
        before = now


@pytest.mark.multiprocess
@pytest.mark.slow
def test_state_survives_every_transition_bitwise() -> None:
    plans = [make_plan(*layout) for _, layout in SEQUENCE]
    # Built once here: every rank must walk the very same primitives in the same order.
    transitions = [build_transition(a, b) for a, b in itertools.pairwise(plans)]
    assert all(t.feasible for t in transitions), [t.blocking_cycle for t in transitions]
    assert_state_kept(plans, spawn(walk, 4, plans, [(t.primitives, t.schedule) for t in transitions]))


def runnable(plan: Plan) -> bool:
    """The runtime can shard every model-stage's layout (`nereus run` refuses other plans)."""
    return all(layout_problem(plan.model(plan.workload.model_name(e.role)), e.tp, e.pp) is None for e in plan.stages)


def random_sequence(seed: int, num_gpus: int, length: int) -> tuple[list[Plan], list[Any]]:
    """`length` runnable random plans on one random `num_gpus`-GPU setting (each model-stage its
    own layout and GPUs; a fifth of them kept from the plan before) and the feasible
    transitions between them."""
    rng = random.Random(seed)
    setting = random_setting(rng)
    while setting.cluster.num_gpus != num_gpus:
        setting = random_setting(rng)
    plans: list[Plan] = []
    transitions: list[Any] = []
    while len(plans) < length:
        plan = random_stages(rng, setting)
        if plans:
            kept = [e for e in plans[-1].stages if rng.random() < 0.2]
            plan = relayout_stages(plan, {e.model_stage: (e.tp, e.pp, e.emus) for e in kept})
        if not runnable(plan):
            continue
        if plans:
            transition = build_transition(plans[-1], plan)
            if not transition.feasible:
                continue
            transitions.append((transition.primitives, transition.schedule))
        plans.append(plan)
    return plans, transitions


@pytest.mark.multiprocess
@pytest.mark.slow
def test_random_layout_sequences_keep_state_bitwise() -> None:
    plans, transitions = random_sequence(seed=1, num_gpus=4, length=4)
    assert_state_kept(plans, spawn(walk, 4, plans, transitions))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_batched_extend_runs_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """dp2 -> dp4: the two new replicas are copied side by side. Batching is lowered to two
    copies a round here (large transitions batch rounds of 16 or more), so the executor
    runs one Extend with two sources and two targets; the state survives bitwise."""
    import nereus.solver.transition.local as local

    monkeypatch.setattr(local, "BATCH_MIN_COPIES", 2)
    plans = [make_plan(1, 1, [[0], [1]]), make_plan(1, 1, [[0], [1], [2], [3]])]
    transition = build_transition(plans[0], plans[1])
    assert transition.feasible
    extends = [p for p in transition.primitives if p.kind == "extend"]
    assert extends and all(len(p.adds) == 2 and len(p.copies_from) == 2 for p in extends)
    assert_state_kept(plans, spawn(walk, 4, plans, [(transition.primitives, transition.schedule)]))

"""The EMU executor runs transition DAGs on live sharded state (tier: multi-process gloo):
through tp, pp, dp and placement changes, a pool shrink and a pool growth, the gathered
logical state after each transition equals the state before it, bitwise."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml

from nereus.cost.plan_cost import head_of
from nereus.runtime.dist import spawn
from nereus.runtime.shard_layout import RankLayout
from nereus.runtime.sharded_state import gather, random_rank_state, state_meta
from nereus.runtime.transition_executor import execute_transition
from nereus.solver.transition.schedule import build_transition
from nereus.spec.plan import Plan

EXAMPLES = Path(__file__).parent.parent / "examples"
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
        layout = RankLayout(entry.tp, entry.pp, entry.dp, tuple(entry.gpus))
        found[entry.model_stage] = state_meta(model, head_of(entry.role), layout, families(plan)[entry.model_stage])
    return found


def walk(rank: int, world_size: int, plans: list[Plan], transitions: list[Any]) -> list[dict[str, Any]]:
    """Start from random plan-0 state, run every transition; this rank's state after each."""
    states = {name: (random_rank_state(meta, rank, seed=11), 5) for name, meta in metas(plans[0]).items()}
    states = {name: state for name, state in states.items() if state[0]}
    snapshots = [states]
    for (plan_a, plan_b), primitives in zip(itertools.pairwise(plans), transitions, strict=True):
        done = execute_transition(primitives, plan_a, plan_b, rank, states, families(plan_a))
        states = done.states
        snapshot = {name: (dict(tensors), step) for name, (tensors, step) in states.items()}
        snapshots.append({**snapshot, "moved": (done.bytes_sent, done.num_primitives)})
    return snapshots


@pytest.mark.slow
def test_state_survives_every_transition_bitwise() -> None:
    plans = [make_plan(*layout) for _, layout in SEQUENCE]
    # Built once here: every rank must walk the very same primitives in the same order.
    transitions = [build_transition(a, b) for a, b in itertools.pairwise(plans)]
    assert all(t.feasible for t in transitions), [t.blocking_cycle for t in transitions]
    per_rank = spawn(walk, 4, plans, [t.primitives for t in transitions])
    before = None
    for index, plan in enumerate(plans):
        for name, meta in metas(plan).items():
            held = {rank: per_rank[rank][index][name][0] for rank in meta.boxes}
            assert all(per_rank[rank][index][name][1] == 5 for rank in meta.boxes), "optimizer steps kept"
            logical = gather(meta, held)
            if before is not None:
                assert logical.keys() == before[name].keys()
                for key, tensor in logical.items():
                    assert tensor.equal(before[name][key]), (SEQUENCE[index][0], name, key)
        before = {
            name: gather(meta, {r: per_rank[r][index][name][0] for r in meta.boxes})
            for name, meta in metas(plan).items()
        }


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
    per_rank = spawn(walk, 4, plans, [transition.primitives])
    for name, meta in metas(plans[1]).items():
        after = gather(meta, {rank: per_rank[rank][1][name][0] for rank in meta.boxes})
        before_meta = metas(plans[0])[name]
        before = gather(before_meta, {rank: per_rank[rank][0][name][0] for rank in before_meta.boxes})
        assert after.keys() == before.keys()
        for key, tensor in after.items():
            assert tensor.equal(before[key]), (name, key)

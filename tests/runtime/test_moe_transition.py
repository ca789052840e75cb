"""Live transitions that change expert parallelism keep a mixture-of-experts model's state
exact (tier: multi-process gloo): on 2 ranks, every model-stage of a tiny Qwen3-MoE plan goes
ep2 -> ep1 (dp2) -> ep2 through the planner's DAG and the EMU executor, and the gathered
logical state (parameters and AdamW moments) after each transition equals the state before
it, bitwise."""

from __future__ import annotations

import itertools

import pytest
import yaml
from repo_paths import EXAMPLES
from test_transition_executor import assert_state_kept, walk

from nereus.runtime.comm.spawn import spawn
from nereus.solver.transition.schedule import build_transition
from nereus.spec.plan import Plan

pytestmark = [pytest.mark.one_rank, pytest.mark.multiprocess, pytest.mark.slow]

MOE = {"num_experts": 4, "experts_per_token": 2, "expert_ffn_dim": 32, "norm_topk_prob": True}


def moe_plan(ep: int, emus: list[list[int]], tp: int = 1, pp: int = 1) -> Plan:
    """The tiny PPO example on GPUs 0-1 with a Qwen3-MoE model, every model-stage at `tp`, `pp`,
    `ep` on `emus`."""
    document = yaml.safe_load((EXAMPLES / "plan-tiny-ppo-4rank.yaml").read_text())
    document.pop("predictions", None)
    document["models"][0]["moe"] = MOE
    document["pools"] = [{"name": "all", "gpus": [0, 1]}]
    layout = {"pool": "all", "tp": tp, "pp": pp, "ep": ep, "dp": len(emus), "emus": emus, "micro_batches": 1}
    document["stages"] = [{**entry, **layout} for entry in document["stages"]]
    return Plan.model_validate(document)


def test_ep2_to_dp2_and_back_keeps_moe_state_bitwise() -> None:
    plans = [moe_plan(2, [[0, 1]]), moe_plan(1, [[0], [1]]), moe_plan(2, [[0, 1]])]
    # Built once here: every rank must walk the very same primitives in the same order.
    transitions = [build_transition(a, b) for a, b in itertools.pairwise(plans)]
    assert all(t.feasible for t in transitions), [t.blocking_cycle for t in transitions]
    assert {p.kind for p in transitions[0].primitives} == {"split"}
    assert {p.kind for p in transitions[1].primitives} == {"merge"}
    per_rank = spawn(walk, 2, plans, [(t.primitives, t.schedule) for t in transitions])
    assert all(snapshots[index]["moved"][1] > 0 for snapshots in per_rank for index in (1, 2))
    assert_state_kept(plans, per_rank)


@pytest.mark.parametrize("other", ["tp2", "pp2-reversed"])
def test_ep2_to_tp2_or_pp2_on_the_same_gpus_and_back_keeps_moe_state_bitwise(other: str) -> None:
    """ep2 and tp2 on GPUs 0-1 are grids of the same width, ep2 and pp2 of the same size: the
    planner still passes through whole copies (split, then merge) and the executor reads each
    side's parallelism."""
    middle = moe_plan(1, [[0, 1]], tp=2) if other == "tp2" else moe_plan(1, [[1, 0]], pp=2)
    plans = [moe_plan(2, [[0, 1]]), middle, moe_plan(2, [[0, 1]])]
    transitions = [build_transition(a, b) for a, b in itertools.pairwise(plans)]
    assert all({p.kind for p in t.primitives} == {"split", "merge"} for t in transitions)
    assert_state_kept(plans, spawn(walk, 2, plans, [(t.primitives, t.schedule) for t in transitions]))

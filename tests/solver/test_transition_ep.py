"""Transitions of plans with expert parallelism: an ep > 1 replica is one copy whose tp x ep
columns split the state (experts by blocks, the rest replicated). A change of (tp, ep, pp)
passes through replicas without expert parallelism (`ep_intermediate`); a change of GPUs
alone moves whole ep replicas. Every primitive kind appears, and the replicas at the end
are plan B's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_helpers import invoke

from nereus.errors import NereusError
from nereus.solver.transition import build_transition
from nereus.solver.transition.schedule import ep_intermediate, plan_emus
from nereus.spec.io import document_from_data, load_document, save_document
from nereus.spec.plan import Plan
from nereus.spec.transition import Transition

pytestmark = pytest.mark.logic

ROOT = Path(__file__).resolve().parents[2]
TRAINING = 5  # actor/training in the example plan (tp=1, pp=2, dp=2 on GPUs 0-3)
NAME = "actor/training"


def _plan(**training: Any) -> Plan:
    data = yaml.safe_load((ROOT / "examples" / "plan-tiny-ppo-4rank.yaml").read_text())
    data.pop("predictions", None)
    data["models"][0]["moe"] = {"num_experts": 4, "experts_per_token": 2, "expert_ffn_dim": 32}
    data["stages"][TRAINING].update(training)
    plan = document_from_data(data, "plan.yaml")
    assert isinstance(plan, Plan)
    return plan


EP2_DP2 = {"tp": 1, "pp": 1, "ep": 2, "dp": 2, "emus": [[0, 1], [2, 3]], "micro_batches": 1}
EP2_DP1 = {"tp": 1, "pp": 1, "ep": 2, "dp": 1, "emus": [[0, 1]], "micro_batches": 1}
EP2_MOVED = {"tp": 1, "pp": 1, "ep": 2, "dp": 1, "emus": [[2, 3]], "micro_batches": 1}
EP4 = {"tp": 1, "pp": 1, "ep": 4, "dp": 1, "emus": [[0, 1, 2, 3]], "micro_batches": 1}
TP2_DP2 = {"tp": 2, "pp": 1, "dp": 2, "emus": [[0, 1], [2, 3]], "micro_batches": 1}
DP4 = {"tp": 1, "pp": 1, "dp": 4, "emus": [[0], [1], [2], [3]], "micro_batches": 1}
DP2 = {"tp": 1, "pp": 1, "dp": 2, "emus": [[0], [1]], "micro_batches": 1}


def _kinds(source: dict[str, Any], target: dict[str, Any]) -> tuple[set[str], Any]:
    result = build_transition(_plan(**source), _plan(**target))
    assert result.feasible
    mine = [p for p in result.primitives if p.model_stage == NAME]
    assert result.schedule.complete(result.primitives)
    return {p.kind for p in mine}, mine


def _final(primitives: list[Any], source: dict[str, Any], target: dict[str, Any]) -> None:
    """The replicas alive at the end are plan B's EMUs (tp x ep columns wide): each is added
    after any primitive that retired a replica on the same grid and GPUs (plan A's, where
    tp x ep alike on both sides makes the grids look alike), or is one of plan A's, kept."""
    kept = set(plan_emus(_plan(**source), [NAME])[NAME])
    alive = plan_emus(_plan(**target), [NAME])[NAME]
    assert all(emu.tp == target["tp"] * target.get("ep", 1) for emu in alive)
    for emu in alive:
        added = [p.id for p in primitives if emu in p.adds]
        gone = [p.id for p in primitives if emu in (*p.retires, *p.removes)]
        if not added:
            assert emu in kept and not gone
        else:
            assert max(added) > max(gone, default=-1)
    width = target["tp"] * target.get("ep", 1)
    assert all(p.adds[0].tp == width for p in primitives if p.kind == "merge")


@pytest.mark.parametrize(
    ("source", "target", "kinds"),
    [
        (EP2_DP2, DP4, {"split"}),  # each ep pair splits into two whole copies
        (DP4, EP2_DP2, {"merge"}),  # pairs of whole copies merge into ep replicas
        (EP2_DP2, TP2_DP2, {"split", "merge"}),  # same grid width, other parallelism: through tp 1
        (EP2_DP1, EP2_DP2, {"extend"}),  # one more ep replica: copied whole
        (EP2_DP2, EP2_DP1, {"destroy"}),  # one ep replica fewer
        (EP4, EP2_DP2, {"split", "merge"}),
        (EP2_DP1, EP2_MOVED, {"extend", "destroy"}),
    ],
)
def test_transitions_touching_ep_use_every_primitive_and_end_on_plan_b(
    source: dict[str, Any], target: dict[str, Any], kinds: set[str]
) -> None:
    found, primitives = _kinds(source, target)
    assert kinds <= found
    _final(primitives, source, target)


def test_a_change_of_ep_passes_through_replicas_without_it() -> None:
    a, b = _plan(**EP2_DP2).stage_plan(NAME), _plan(**TP2_DP2).stage_plan(NAME)
    assert ep_intermediate(a, b) == (1, 1)
    assert ep_intermediate(a, _plan(**EP2_DP1).stage_plan(NAME)) is None  # same shape, other GPUs
    assert ep_intermediate(_plan(**DP2).stage_plan(NAME), _plan(**DP4).stage_plan(NAME)) is None
    _, primitives = _kinds(EP2_DP2, TP2_DP2)
    middle = {emu for p in primitives if p.kind == "split" for emu in p.adds}
    assert middle and all(emu.layout == (1, 1) for emu in middle)


def test_ep_with_cp_is_refused_by_name() -> None:
    both = _plan(tp=1, pp=1, ep=2, cp=2, dp=1, emus=[[0, 1, 2, 3]], micro_batches=1)
    with pytest.raises(NereusError) as raised:
        build_transition(both, _plan(**DP4))
    message = str(raised.value)
    assert message.startswith("actor/training: transitions of model-stages with both ep=2 and cp=2 are not planned")
    assert "\n" not in message


def test_an_moe_plan_at_ep_1_transitions_as_before() -> None:
    result = build_transition(_plan(**DP2), _plan(**DP4))
    assert any(p.model_stage == NAME for p in result.primitives)


@pytest.mark.cli
def test_dag_build_on_two_ep_plans_writes_a_transition_check_accepts(tmp_path: Path) -> None:
    """`nereus dag build` from an ep2 plan to a dp4 one (and back) writes a Transition file that
    `nereus check` accepts."""
    paths = {}
    for name, layout in (("ep2.yaml", EP2_DP2), ("dp4.yaml", DP4)):
        paths[name] = tmp_path / name
        save_document(_plan(**layout), paths[name])
    for a, b in (("ep2.yaml", "dp4.yaml"), ("dp4.yaml", "ep2.yaml")):
        out = tmp_path / f"{a}-{b}"
        result = invoke("dag", "build", paths[a], paths[b], "-o", out)
        assert result.exit_code == 0, result.output
        assert "tp=1 ep=2 pp=1 dp=2" in result.output  # the summary names the ep side
        assert "actor/training" in out.read_text()
        assert isinstance(load_document(out), Transition)
        assert invoke("check", out).exit_code == 0

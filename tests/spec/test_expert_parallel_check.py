"""Bad expert parallelism in a plan: one line naming `stages[i].ep`, `nereus check` exits 1; a
plan without `ep` reads as ep = 1 and writes without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from test_context_parallel_check import PLAN, TRAINING, _errors, assert_check_refuses

from nereus.spec.check import ep_rule
from nereus.spec.io import document_from_data, to_data
from nereus.spec.model import MoE
from nereus.spec.presets import MODELS

#: The example's tiny model with 4 experts of width 32, 2 per token.
EXPERTS = {"num_experts": 4, "experts_per_token": 2, "expert_ffn_dim": 32}


def _plan_data(moe: dict[str, Any] | None = None, **training: Any) -> dict[str, Any]:
    data = yaml.safe_load(PLAN.read_text())
    data.pop("predictions", None)
    if moe is not None:
        data["models"][0]["moe"] = moe
    data["stages"][TRAINING].update(training)
    return data


@pytest.mark.logic
def test_ep_rule() -> None:
    qwen3 = MODELS["qwen3-30b-a3b"]  # 128 experts
    assert ep_rule(qwen3, 1) is None
    assert ep_rule(qwen3, 8) is None
    assert ep_rule(qwen3, 128) is None
    assert "does not divide the 128 experts" in (ep_rule(qwen3, 3) or "")
    assert "ep=2 with cp=2 is not supported" in (ep_rule(qwen3, 2, cp=2) or "")
    assert "dense model" in (ep_rule(MODELS["qwen3-8b"], 2) or "")


@pytest.mark.logic
def test_an_ep_plan_passes_the_checks() -> None:
    """tp=1 x ep=2 x pp=2 per EMU: GPU (s, e, r) of an EMU is entry (s * ep + e) * tp + r."""
    assert _errors(_plan_data(EXPERTS, tp=1, pp=2, ep=2, dp=1, emus=[[0, 1, 2, 3]], micro_batches=2)) == []


@pytest.mark.logic
def test_ep_on_a_dense_model_is_named() -> None:
    errors = _errors(_plan_data(tp=1, pp=2, ep=2, dp=1, emus=[[0, 1, 2, 3]], micro_batches=2))
    assert errors == [f"stages[{TRAINING}].ep: ep=2 but tiny is a dense model (no experts to split); set ep: 1"]


@pytest.mark.logic
def test_ep_not_dividing_the_experts_is_named() -> None:
    moe = {**EXPERTS, "num_experts": 6}
    errors = _errors(_plan_data(moe, tp=1, pp=1, ep=4, dp=1, emus=[[0, 1, 2, 3]], micro_batches=2))
    assert errors == [
        f"stages[{TRAINING}].ep: ep=4 does not divide the 6 experts of tiny; pick a divisor (each ep rank holds "
        "an equal block of experts)"
    ]


@pytest.mark.logic
def test_ep_with_cp_is_named() -> None:
    errors = _errors(_plan_data(EXPERTS, tp=1, pp=1, cp=2, ep=2, dp=1, emus=[[0, 1, 2, 3]], micro_batches=2))
    assert errors == [f"stages[{TRAINING}].ep: ep=2 with cp=2 is not supported; set ep: 1 or cp: 1"]


@pytest.mark.logic
def test_an_emu_of_the_wrong_size_names_ep() -> None:
    errors = _errors(_plan_data(EXPERTS, tp=1, pp=2, ep=2, dp=2, emus=[[0, 1], [2, 3]]))
    assert f"stages[{TRAINING}].emus[0]: an EMU with tp=1, ep=2, pp=2 needs 4 GPUs, got 2" in errors


@pytest.mark.logic
def test_plans_without_ep_read_as_ep_1_and_write_without_it() -> None:
    data = _plan_data()
    plan = document_from_data(data, "plan.yaml")
    assert all(entry.ep == 1 and entry.replica_size == entry.tp * entry.cp * entry.pp for entry in plan.stages)
    assert all("ep" not in stage for stage in to_data(plan)["stages"])
    moe = document_from_data(_plan_data(EXPERTS, tp=1, pp=2, ep=2, dp=1, emus=[[0, 1, 2, 3]]), "plan.yaml")
    assert moe.stage_plan("actor/training").replica_size == 4  # type: ignore[attr-defined]
    assert [stage.get("ep") for stage in to_data(moe)["stages"]] == [None] * 5 + [2] + [None]


@pytest.mark.cli
@pytest.mark.parametrize(
    ("moe", "fields", "expected"),
    [
        (None, {"tp": 1, "pp": 2, "ep": 2, "dp": 1}, "stages[5].ep: ep=2 but tiny is a dense model"),
        ({**EXPERTS, "num_experts": 6}, {"tp": 1, "pp": 1, "ep": 4, "dp": 1}, "stages[5].ep: ep=4 does not divide"),
        (EXPERTS, {"tp": 1, "pp": 1, "cp": 2, "ep": 2, "dp": 1}, "stages[5].ep: ep=2 with cp=2"),
    ],
)
def test_nereus_check_refuses_bad_ep_in_one_line(
    tmp_path: Path, moe: dict[str, Any] | None, fields: dict[str, Any], expected: str
) -> None:
    assert_check_refuses(tmp_path, _plan_data(moe, **fields, emus=[[0, 1, 2, 3]], micro_batches=1), expected)


@pytest.mark.logic
def test_the_runtime_takes_ep_without_the_choices_it_does_not_pair_with() -> None:
    """The runtime executes expert parallelism with ZeRO-1, but not
    beside full sharding, training-time offload or token budgets: such an entry is refused in one line
    naming the choice; a run planning for itself keeps ep = 1."""
    from nereus.solver.admission import expert_parallel_problems
    from nereus.solver.layouts import RUNTIME_CHOICES

    assert RUNTIME_CHOICES.expert_parallel == (False,)
    plan = document_from_data(_plan_data(EXPERTS, tp=1, pp=2, ep=2, dp=1, emus=[[0, 1, 2, 3]]), "plan.yaml")
    assert expert_parallel_problems(plan) == []  # type: ignore[arg-type]
    zero1 = document_from_data(
        _plan_data(EXPERTS, tp=1, pp=2, ep=2, dp=1, emus=[[0, 1, 2, 3]], zero1=True), "plan.yaml"
    )
    assert expert_parallel_problems(zero1) == []  # type: ignore[arg-type]
    full_shard = document_from_data(
        _plan_data(EXPERTS, tp=1, pp=2, ep=2, dp=1, emus=[[0, 1, 2, 3]], full_shard=True), "plan.yaml"
    )
    assert expert_parallel_problems(full_shard) == [  # type: ignore[arg-type]
        "actor/training: ep=2 with full_shard: the runtime's expert parallelism runs without full_shard for now; "
        "replan with `nereus plan --expert-parallel off` or drop full_shard"
    ]
    assert MoE(**EXPERTS).num_experts == 4


@pytest.mark.logic
def test_the_router_aux_loss_is_refused_on_a_dense_actor_and_with_pipeline_stages() -> None:
    from nereus.solver.admission import router_aux_problems
    from nereus.spec.run_config import RLConfig

    on, off = RLConfig(router_aux_loss_coef=0.01), RLConfig()
    moe = document_from_data(_plan_data(EXPERTS, tp=1, pp=1, ep=2, dp=1, emus=[[0, 1]]), "plan.yaml")
    dense = document_from_data(_plan_data(None, tp=1, pp=1, dp=1, emus=[[0]]), "plan.yaml")
    staged = document_from_data(_plan_data(EXPERTS, tp=1, pp=2, ep=2, dp=1, emus=[[0, 1, 2, 3]]), "plan.yaml")
    assert router_aux_problems(moe, on) == [] and router_aux_problems(dense, off) == []  # type: ignore[arg-type]
    assert router_aux_problems(dense, on) == [  # type: ignore[arg-type]
        "rl.router_aux_loss_coef: 0.01 needs a mixture-of-experts actor; model tiny is dense, set it to 0"
    ]
    assert router_aux_problems(staged, on) == [  # type: ignore[arg-type]
        "rl.router_aux_loss_coef: runs with actor/training pp=1 and cp=1, the plan has pp=2 cp=1; replan with pp "
        "and cp 1 or set it to 0"
    ]

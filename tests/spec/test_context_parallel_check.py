"""Bad context parallelism in a plan: one line naming the field, `nereus check` exits 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_helpers import invoke

from nereus.errors import SpecError
from nereus.spec.check import cp_rule, semantic_problems
from nereus.spec.io import document_from_data
from nereus.spec.long_response_setups import setup_model
from nereus.spec.presets import MODELS

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "examples" / "plan-tiny-ppo-4rank.yaml"
TRAINING = 5  # actor/training in the example (tp=1, pp=2, dp=2 on GPUs 0-3)


def _plan_data(**training: Any) -> dict[str, Any]:
    data = yaml.safe_load(PLAN.read_text())
    data.pop("predictions", None)
    data["stages"][TRAINING].update(training)
    return data


def _errors(data: dict[str, Any]) -> list[str]:
    plan = document_from_data(data, "plan.yaml")
    return [f"{p.path}: {p.message}" for p in semantic_problems(plan) if p.severity == "error"]


@pytest.mark.logic
def test_cp_rule_needs_whole_query_heads_per_rank() -> None:
    """cp divides a tensor rank's query heads; beyond its KV heads they are repeated (runtime)."""
    qwen3 = MODELS["qwen3-8b"]  # 32 query heads, 8 KV heads
    assert cp_rule(qwen3, 1, 8) is None
    assert cp_rule(qwen3, 2, 4) is None
    assert cp_rule(qwen3, 1, 1) is None
    assert cp_rule(qwen3, 2, 8) is None  # 16 query heads per tensor rank, 4 KV heads: repeated
    assert cp_rule(qwen3, 1, 32) is None
    assert cp_rule(qwen3, 8, 4) is None
    assert "cp=8 with tp=8 does not divide the 4 query heads" in (cp_rule(qwen3, 8, 8) or "")
    assert "cp=64 with tp=1" in (cp_rule(qwen3, 1, 64) or "")
    qwen25 = setup_model("qwen2.5-32b")  # 40 query heads, 8 KV heads: 5 per tensor rank at tp=8
    assert cp_rule(qwen25, 4, 2) is None
    assert "does not divide the 5 query heads" in (cp_rule(qwen25, 8, 2) or "")
    # All-gather KV splits no heads: any cp.
    assert cp_rule(qwen25, 8, 2, "allgather") is None and cp_rule(qwen3, 8, 8, "allgather") is None


@pytest.mark.logic
def test_a_cp_plan_passes_the_checks() -> None:
    """tp=1 x cp=2, dp=2 on the tiny model's 2 KV heads: GPU (c, r) of an EMU is entry c * tp + r."""
    assert _errors(_plan_data(tp=1, pp=1, cp=2, dp=2, emus=[[0, 1], [2, 3]])) == []


@pytest.mark.logic
def test_cp_beyond_the_kv_heads_passes_and_beyond_the_query_heads_is_named() -> None:
    """tiny: 4 query heads, 2 KV heads. tp=2 x cp=2 repeats the one KV head of a tensor rank;
    tp=2 x cp=4 has 2 query heads per tensor rank for 4 cp ranks."""
    assert _errors(_plan_data(tp=2, pp=1, cp=2, dp=1, emus=[[0, 1, 2, 3]], micro_batches=1)) == []
    errors = _errors(_plan_data(tp=2, pp=1, cp=4, dp=1, emus=[list(range(8))], micro_batches=1))
    assert (
        f"stages[{TRAINING}].cp: cp=4 with tp=2 does not divide the 2 query heads of a tensor rank of tiny "
        "(4 heads over tp=2; Ulysses gives each cp rank whole query heads)"
    ) in errors


@pytest.mark.logic
def test_allgather_cp_beyond_the_query_heads_passes() -> None:
    """tp=2 x cp=4 on tiny, which Ulysses refuses, by all-gather KV; cp_method without cp is named."""
    layout: dict[str, Any] = dict(tp=2, pp=1, cp=4, dp=1, emus=[list(range(8))], micro_batches=1)
    # The 4-GPU pool is too small for 8 (named elsewhere); the cp is named for Ulysses only.
    assert any(f"stages[{TRAINING}].cp:" in e for e in _errors(_plan_data(**layout)))
    assert not any(".cp:" in e for e in _errors(_plan_data(**layout, cp_method="allgather")))
    solo = _plan_data(tp=1, pp=1, cp=1, dp=2, emus=[[0], [1]], cp_method="allgather")
    with pytest.raises(SpecError, match=rf"stages\[{TRAINING}\]: cp_method allgather needs cp > 1; drop cp_method"):
        _errors(solo)


@pytest.mark.logic
def test_cp_with_pipeline_stages_is_named() -> None:
    errors = _errors(_plan_data(tp=1, pp=2, cp=2, dp=1, emus=[[0, 1, 2, 3]], micro_batches=1))
    assert errors == [f"stages[{TRAINING}].cp: cp=2 with pp=2 is not supported; set cp: 1 or pp: 1"]


@pytest.mark.logic
def test_an_emu_of_the_wrong_size_names_cp() -> None:
    errors = _errors(_plan_data(tp=1, pp=1, cp=2, dp=2, emus=[[0], [1]]))
    assert f"stages[{TRAINING}].emus[0]: an EMU with tp=1, cp=2, pp=1 needs 2 GPUs, got 1" in errors


@pytest.mark.cli
@pytest.mark.parametrize(
    ("stage", "fields", "expected"),
    [
        (TRAINING, {"tp": 1, "pp": 2, "cp": 2, "dp": 1, "emus": [[0, 1, 2, 3]]}, "stages[5].cp: cp=2 with pp=2"),
        (TRAINING, {"tp": 4, "pp": 1, "cp": 2, "dp": 1, "emus": [list(range(8))]}, "stages[5].cp: cp=2 with tp=4"),
        (0, {"cp": 2, "dp": 1, "emus": [[0, 1, 2, 3]]}, "cp applies to training and inference only"),
    ],
)
def test_nereus_check_refuses_bad_cp_in_one_line(
    tmp_path: Path, stage: int, fields: dict[str, Any], expected: str
) -> None:
    data = yaml.safe_load(PLAN.read_text())
    data.pop("predictions", None)
    data["stages"][stage].update(fields, micro_batches=1)
    assert_check_refuses(tmp_path, data, expected)


def assert_check_refuses(tmp_path: Path, data: dict[str, Any], expected: str) -> None:
    """`nereus check` on the plan `data` exits 1 printing `expected`, without a traceback."""
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = invoke("check", path)
    assert result.exit_code == 1
    assert expected in result.stdout
    assert "Traceback" not in result.output


@pytest.mark.logic
def test_the_runtime_plans_and_admits_cp() -> None:
    """`nereus run` executes context parallelism: it searches cp for itself and admits a cp plan."""
    from nereus.solver.admission import plan_problems
    from nereus.solver.layouts import RUNTIME_CHOICES
    from nereus.spec.run_config import RLConfig

    plan = document_from_data(_plan_data(tp=1, pp=1, cp=2, dp=2, emus=[[0, 1], [2, 3]]), "plan.yaml")
    assert True in RUNTIME_CHOICES.context_parallel
    assert plan_problems(plan, 4, RLConfig(task="sort")) == []  # type: ignore[arg-type]

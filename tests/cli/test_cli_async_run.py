"""`nereus run` refuses, in one line and before any rank starts, the async runs its loop cannot
run (docs/async.md, "The run loop"): a partial rollout with nereus's own engine (it cannot
pause a generation), async on one rank (no split into pools), vLLM generation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cli_helpers import invoke, one_error_line
from tests.run_helpers import DATA

pytestmark = pytest.mark.cli

PLAN = DATA / "plan-tiny-grpo-async-2rank.yaml"


def write_run(folder: Path, plan: dict[str, Any], **config: Any) -> Path:
    plan.pop("predictions", None)
    (folder / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    document = {"kind": "RunConfig", "version": 1, "plan": "plan.yaml", "num_steps": 2, **config}
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def async_plan() -> dict[str, Any]:
    plan: dict[str, Any] = yaml.safe_load(PLAN.read_text())
    return plan


def test_partial_rollout_with_nereus_engine_is_refused(tmp_path: Path) -> None:
    plan = async_plan()
    plan["workload"]["partial_rollout"] = True
    line = one_error_line(invoke("run", write_run(tmp_path, plan), "--out", tmp_path / "out"))
    assert "workload.partial_rollout" in line and "cannot pause" in line, line
    assert not (tmp_path / "out").exists()


def test_async_on_one_rank_is_refused(tmp_path: Path) -> None:
    plan = async_plan()
    plan["cluster"]["gpus_per_node"] = 1
    plan["pools"] = [{"name": "all", "gpus": [0]}]
    for stage in plan["stages"]:
        stage["pool"], stage["emus"] = "all", [[0]]
    line = one_error_line(invoke("run", write_run(tmp_path, plan), "--out", tmp_path / "out"))
    assert "execution: async" in line and "shares its GPUs" in line, line


def test_async_with_vllm_is_refused(tmp_path: Path) -> None:
    config = write_run(tmp_path, async_plan(), generation={"engine": "vllm"})
    line = one_error_line(invoke("run", config, "--out", tmp_path / "out"))
    assert "vllm" in line, line

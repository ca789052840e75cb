"""`nereus run` refuses, in one line and before any rank starts, the async runs its loop cannot
run (docs/async.md, "The run loop"): async on one rank (no split into pools), vLLM generation
without the actor's folder or on a generation pool vLLM's external launcher cannot group. (A
partial rollout runs with either engine: tests/runtime/test_async_partial.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from nereus.runtime.generation.engine_choice import vllm_layout_problem
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
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


def test_async_on_one_rank_is_refused(tmp_path: Path) -> None:
    plan = async_plan()
    plan["cluster"]["gpus_per_node"] = 1
    plan["pools"] = [{"name": "all", "gpus": [0]}]
    for stage in plan["stages"]:
        stage["pool"], stage["emus"] = "all", [[0]]
    line = one_error_line(invoke("run", write_run(tmp_path, plan), "--out", tmp_path / "out"))
    assert "execution: async" in line and "shares its GPUs" in line, line


def test_async_with_vllm_needs_the_actors_folder(tmp_path: Path) -> None:
    config = write_run(tmp_path, async_plan(), generation={"engine": "vllm"})
    line = one_error_line(invoke("run", config, "--out", tmp_path / "out"))
    assert "generation.engine: vllm" in line, line
    assert not (tmp_path / "out").exists()


def test_async_vllm_generation_must_be_whole_tp_blocks_of_the_world() -> None:
    """vLLM's external launcher groups the whole world in tp-sized blocks: the generation pool's
    replicas must be such blocks (the training pool's ranks stand by in the others)."""
    plan = load_document(PLAN)
    assert isinstance(plan, Plan)
    assert vllm_layout_problem(plan) is None  # rank 1 of 2 at tp = 1

    def generating(tp: int, emus: list[list[int]], training: list[int]) -> Plan:
        stages = [
            s.model_copy(update={"tp": tp, "emus": emus})
            if s.model_stage == "actor/generation"
            else s.model_copy(update={"emus": [[rank] for rank in training]})
            for s in plan.stages
        ]
        return plan.model_copy(update={"stages": stages})

    assert vllm_layout_problem(generating(2, [[2, 3]], [0, 1])) is None
    assert "tp-sized blocks" in str(vllm_layout_problem(generating(2, [[1, 2]], [0])))  # 3 ranks: no blocks of 2
    assert "tp-sized blocks" in str(vllm_layout_problem(generating(2, [[1, 2]], [0, 3])))  # not a block

"""`nereus run` under plans that recompute activations and pack micro-batches to a token budget
(2 CPU ranks, the 2-rank PPO plan: actor/training pp=2, critic/training dp=2).

Recompute reruns the same operations on the same inputs, so a run with it is the run without
it, bitwise (its metrics and every checkpoint's logical state): from the start, after a live
transition into and out of it, and after a resume under a plan that drops it. A token budget
sums the same token gradients in other micro-batches, so its first step differs by rounding
only.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from nereus.spec.run_folder import finished_checkpoints, read_metrics
from tests.cli_helpers import invoke
from tests.run_helpers import TIMING_FIELDS, write_config

pytestmark = [pytest.mark.cli, pytest.mark.multiprocess]

#: One row of the plan's maximum length (16 + 48 tokens): the least budget admitted.
TOKEN_BUDGET = 64


#: Fields that differ between the plans by design: the predicted peaks (recompute keeps less).
PLAN_FIELDS = ("plan_index", "predicted_memory_peak_bytes", "predicted_memory_peak_bytes_by_stage")


def training_records(out: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in {*TIMING_FIELDS, *PLAN_FIELDS}} for r in read_metrics(out)]


def assert_same_checkpoints(out: Path, other: Path) -> None:
    """Every checkpoint of `out` holds bitwise the logical state of `other`'s of the same step."""
    from nereus.runtime.state.checkpoint import load_checkpoint
    from nereus.runtime.state.shard_layout import RankLayout

    folders = finished_checkpoints(out)
    assert folders and [f.name for f in folders] == [f.name for f in finished_checkpoints(other)]
    whole = RankLayout(1, 1, 1, (0,))
    for folder in folders:
        for role in ("actor", "critic"):
            mine = load_checkpoint(folder / role, whole, 0).tensors
            theirs = load_checkpoint(other / "checkpoints" / folder.name / role, whole, 0).tensors
            assert mine.keys() == theirs.keys()
            assert all(torch.equal(mine[key], theirs[key]) for key in mine), (folder.name, role)


def write_plan(folder: Path, name: str, **training: dict[str, Any]) -> str:
    """The config's plan with `training[model_stage]` set on those training entries."""
    plan = yaml.safe_load((folder / "plan.yaml").read_text())
    plan.pop("predictions", None)
    for entry in plan["stages"]:
        entry.update(training.get(entry["model_stage"].replace("/", "_"), {}))
    (folder / name).write_text(yaml.safe_dump(plan))
    return name


def test_recompute_runs_bitwise_the_run_without_it_and_transitions_into_and_out_of_it(
    plain_three_step_run: Path, tmp_path: Path
) -> None:
    plain, recomputed, switched = (tmp_path / name for name in ("plain", "recomputed", "switched"))
    for folder in (plain, recomputed, switched):
        folder.mkdir()
    shutil.copytree(plain_three_step_run, plain / "out")  # resumed below

    config = write_config(recomputed, num_steps=3)
    changes = {"actor_training": {"recompute": "full"}, "critic_training": {"recompute": "selective"}}
    plan = write_plan(recomputed, "recompute.yaml", **changes)
    result = invoke("run", config, "--plan", recomputed / plan, "--out", recomputed / "out")
    assert result.exit_code == 0, result.output
    stored = yaml.safe_load((recomputed / "out" / "plan.yaml").read_text())
    assert {s["model_stage"]: s.get("recompute") for s in stored["stages"] if "training" in s["model_stage"]} == {
        "actor/training": "full",
        "critic/training": "selective",
    }
    assert training_records(recomputed / "out") == training_records(plain / "out")
    assert_same_checkpoints(recomputed / "out", plain / "out")

    # Live: into recompute at step 1, out of it at step 2.
    switches = [{"step": 1, "plan": "into.yaml"}, {"step": 2, "plan": "out-of.yaml"}]
    config = write_config(switched, num_steps=3, plan_switches=switches)
    write_plan(switched, "into.yaml", **changes)
    write_plan(switched, "out-of.yaml")
    result = invoke("run", config, "--out", switched / "out")
    assert result.exit_code == 0, result.output
    records = read_metrics(switched / "out")
    assert [r["plan_index"] for r in records] == [0, 1, 2]
    assert training_records(switched / "out") == training_records(plain / "out")
    assert_same_checkpoints(switched / "out", plain / "out")

    # Resume the recomputing run's checkpoint under the plan without recompute: the same steps.
    result = invoke("run", "--resume", recomputed / "out", "--plan", switched / "out-of.yaml", "--steps", "4")
    assert result.exit_code == 0, result.output
    result = invoke("run", "--resume", plain / "out", "--steps", "4")
    assert result.exit_code == 0, result.output
    assert training_records(recomputed / "out") == training_records(plain / "out")


def test_a_token_budget_run_trains_as_the_run_with_equal_rows(plain_three_step_run: Path, tmp_path: Path) -> None:
    packed = tmp_path / "packed"
    packed.mkdir()
    config = write_config(packed, num_steps=2)
    budget = {"token_budget": TOKEN_BUDGET, "recompute": "full"}
    plan = write_plan(packed, "packed.yaml", actor_training=budget, critic_training={"token_budget": TOKEN_BUDGET})
    result = invoke("run", config, "--plan", packed / plan, "--out", packed / "out")
    assert result.exit_code == 0, result.output
    ours, theirs = read_metrics(packed / "out"), read_metrics(plain_three_step_run)[:2]  # its first 2 of 3 steps
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [0, 1]
    # Step 0 samples from the same weights; its second mini-batch follows one AdamW update, which
    # turns rounding-level gradient differences into ~1e-4 relative ones (later steps sample anew).
    for key in ("actor_loss", "critic_loss"):
        assert ours[0][key] == pytest.approx(theirs[0][key], rel=1e-3), (key, ours[0][key], theirs[0][key])
        assert all(math.isfinite(r[key]) for r in ours)

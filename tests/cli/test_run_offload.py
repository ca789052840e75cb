"""`nereus run` under offload: a tiny model run with the memory choices `nereus plan` makes for
Llama-3.3-70B PPO on 16 H100s (training-time offload of the optimizer, idle model-stages
asleep in host memory, selective recompute), checkpointed and resumed bitwise, its host bytes
measured and predicted (tier: CLI e2e, multi-process gloo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from nereus.runtime.state.checkpoint import verify_checkpoint
from nereus.spec.run_folder import finished_checkpoints, read_metrics
from tests.cli_helpers import invoke
from tests.run_helpers import TIMING_FIELDS, write_config

pytestmark = pytest.mark.cli

#: The choices copied from the big plan onto the tiny one's model-stages of the same name.
CHOICES = ("recompute", "offload", "train_offload", "zero1", "full_shard")


def training_records(out: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in read_metrics(out)]


@pytest.fixture(scope="module")
def llama_70b_choices(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each model-stage's memory choices in the plan `nereus plan` finds for the issue's set-up."""
    path = tmp_path_factory.mktemp("plan") / "p.yaml"
    result = invoke(
        "plan", "--gpus", "16", "--cluster", "h100", "--model", "llama-3.3-70b", "--workload", "ppo", "-o", path
    )
    assert result.exit_code == 0, result.output
    stages = yaml.safe_load(path.read_text())["stages"]
    return {s["model_stage"]: {k: s[k] for k in CHOICES if k in s} for s in stages}


def offloaded_config(folder: Path, choices: dict[str, dict[str, Any]], **fields: Any) -> Path:
    """The 2-rank tiny PPO config, its plan given the big plan's choices (full sharding only
    where the tiny layout can shard: dp > 1 without pipeline stages)."""
    folder.mkdir()
    config = write_config(folder, **fields)
    plan = yaml.safe_load((folder / "plan.yaml").read_text())
    for entry in plan["stages"]:
        chosen = dict(choices[entry["model_stage"]])
        if entry["dp"] < 2 or entry["pp"] > 1:
            chosen["full_shard"] = False
        entry.update(chosen)
    plan.pop("predictions", None)
    (folder / "plan.yaml").write_text(yaml.safe_dump(plan))
    return config


def test_the_70b_plans_offload_choices_run_on_a_tiny_model_and_resume_bitwise(
    tmp_path: Path, llama_70b_choices: dict[str, dict[str, Any]]
) -> None:
    trained = {n: c for n, c in llama_70b_choices.items() if n.endswith("/training")}
    assert trained and all(c["train_offload"] != "none" for c in trained.values()), trained
    assert any(c.get("offload") for c in llama_70b_choices.values())
    whole = offloaded_config(tmp_path / "whole", llama_70b_choices)
    result = invoke("run", whole, "--out", tmp_path / "whole" / "out", "--json")
    assert result.exit_code == 0, result.output
    records = read_metrics(tmp_path / "whole" / "out")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    # every rank keeps state in host memory (the trainers' optimizer, the sleeping model-stages),
    # and the cost model puts host bytes on each
    assert all(min(r["host_memory_bytes"]) > 0 and min(r["predicted_host_memory_bytes"]) > 0 for r in records)
    checkpoints = finished_checkpoints(tmp_path / "whole" / "out")
    assert [p.name for p in checkpoints] == ["step-000002", "step-000004"]
    verify_checkpoint(checkpoints[-1] / "actor")  # safetensors with a sha256 per file
    assert verify_checkpoint(checkpoints[-1] / "critic").dp_sharded  # dp=2: each replica's optimizer rows

    split = offloaded_config(tmp_path / "split", llama_70b_choices)
    assert invoke("run", split, "--out", tmp_path / "split" / "out", "--steps", "2").exit_code == 0
    result = invoke("run", "--resume", tmp_path / "split" / "out", "--steps", "4", "--json")
    assert result.exit_code == 0, result.output
    assert training_records(tmp_path / "split" / "out") == training_records(tmp_path / "whole" / "out")

"""`benchmarks/gpu_check.py --device cpu` runs end to end on a tiny model (so the GPU check
cannot rot between GPU runs) and records every phase it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import BENCHMARKS

pytest.importorskip("transformers")
pytestmark = pytest.mark.multiprocess


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    output = tmp_path / "gpu_check.json"
    command = [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu", "--output", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["device"] == "cpu" and result["profile"]["profile"]
    generation = result["generation"]
    assert generation["nereus_tokens_per_s"] > 0 and generation["transformers_tokens_per_s"] > 0
    assert result["training"]["median_step_s"] > 0 and result["training"]["mfu"] is None
    memory = result["grpo_run"]["memory"]
    assert {row["model_stage"] for row in memory} >= {"actor/generation", "actor/training"}
    assert all(row["predicted_bytes"] > 0 and row["measured_bytes"] > 0 for row in memory)
    rows = {row["row"]: row for row in result["memory_rows"]}
    assert set(rows) == {
        "recompute-none",
        "recompute-full",
        "recompute-selective",
        "fsdp2-full-shard",
        "tp2",
        "train-offload",
    }
    for name, row in rows.items():
        if "skipped" in row:  # CPU ranks are never too few: only an unexecuted choice is skipped
            assert name == "train-offload" and row["skipped"] == "offload not executed by this build"
            continue
        assert row["stages"], name
        assert all(s["predicted_bytes"] > 0 and s["measured_bytes"] > 0 for s in row["stages"])
    tp_ranks = {s["rank"] for s in rows["tp2"]["stages"] if s["model_stage"] == "actor/training"}
    assert tp_ranks == {0, 1}

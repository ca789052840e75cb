"""`benchmarks/gpu_check.py --device cpu` runs end to end on a tiny model (so the GPU check
cannot rot between GPU runs) and records every phase it promises, its vLLM section included."""

from __future__ import annotations

import importlib.util
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
        assert "skipped" not in row and row["stages"], (name, row)  # CPU ranks are never too few
        assert all(s["predicted_bytes"] > 0 and s["measured_bytes"] > 0 for s in row["stages"])
    tp_ranks = {s["rank"] for s in rows["tp2"]["stages"] if s["model_stage"] == "actor/training"}
    assert tp_ranks == {0, 1}
    vllm = result["vllm"]
    if importlib.util.find_spec("vllm") is None:
        assert vllm == "skipped: vLLM is not installed"
        return
    assert vllm["size"] == "small" and vllm["engine_start_s"] > 0
    assert vllm["nereus_tokens_per_s"] > 0 and vllm["vllm_tokens_per_s"] > 0
    assert vllm["weight_bytes"] > 0 and len(vllm["weight_sync_s"]) == 3 and min(vllm["weight_sync_s"]) > 0
    assert vllm["median_weight_sync_s"] == sorted(vllm["weight_sync_s"])[1]

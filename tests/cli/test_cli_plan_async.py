"""`nereus plan` with an async workload: the pools, the steady-state step and its bound, in the
table and in --json; and the async inputs it refuses in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_helpers import invoke, one_error_line

pytestmark = pytest.mark.cli

ARGS = ("plan", "--gpus", "64", "--cluster", "h100", "--model", "llama-3.1-8b")

GRPO_ASYNC = """kind: Workload
version: 1
name: grpo-async
algorithm: grpo
actor: llama-3.1-8b
reference: llama-3.1-8b
prompts_per_step: 64
samples_per_prompt: 8
prompt_len: 1024
response_len: {median: 500, p99: 2500, max: 8192}
mini_batches: 4
micro_batch_size: 2
execution: async
"""


def test_plan_prints_the_pools_the_steady_state_and_its_bound(tmp_path: Path) -> None:
    workload = tmp_path / "w.yaml"
    workload.write_text(GRPO_ASYNC)
    result = invoke(*ARGS, "--workload", workload)
    assert result.exit_code == 0, result.output
    out = result.output
    pools = (
        r"async pools: generation on GPUs (\d+)-63 \((\d+), pool generation\), "
        r"training on GPUs 0-(\d+) \((\d+), pool rest\)"
    )
    found = re.search(pools, out)
    assert found is not None, out
    first, generation, last, training = (int(x) for x in found.groups())
    assert first == last + 1 and generation + training == 64
    assert "generation runs up to 1 batch ahead" in out
    assert "= max(generation " in out and "inference " in out and "weight_sync " in out
    assert "steady state bound by the " in out


def test_plan_json_carries_the_steady_state() -> None:
    result = invoke(*ARGS, "--workload", "grpo-async", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    steady = payload["steady_state"]
    assert steady == payload["plan"]["predictions"]["steady_state"]
    assert steady["max_staleness"] == 1 and steady["bound"] in ("generation", "training")
    step = payload["plan"]["predictions"]["step_time_s"]
    assert step == pytest.approx(max(steady["generation_s"], steady["training_s"]))
    gpus = {p["name"]: p["gpus"] for p in payload["plan"]["pools"]}
    assert len(gpus) == 2 and not set(gpus["generation"]) & set(gpus["rest"])


def test_async_on_one_gpu_is_one_line() -> None:
    result = invoke("plan", "--gpus", "1", "--workload", "grpo-async")
    assert result.exit_code == 1
    line = one_error_line(result)
    assert "execution: async" in line and "1 GPU cannot split" in line


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ("max_staleness: -1\n", "max_staleness: Input should be greater than or equal to 0"),
        ("execution: sync\npartial_rollout: true\n", "partial_rollout: a partial rollout continues"),
    ],
)
def test_bad_async_settings_are_one_line(tmp_path: Path, extra: str, fragment: str) -> None:
    workload = tmp_path / "w.yaml"
    workload.write_text(GRPO_ASYNC.replace("execution: async\n", "") + extra)
    result = invoke(*ARGS, "--workload", workload)
    assert result.exit_code == 1
    assert fragment in one_error_line(result)

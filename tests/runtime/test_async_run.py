"""`nereus run` of async plans (issue 49, item 4; docs/async.md, "The run loop"): generation on
rank 1, training on rank 0 (tests/data/plan-tiny-grpo-async-2rank.yaml, from `nereus plan`).

- k = 0 trains exactly as the synchronous run of the same plan: losses, rewards, gradient
  norms and the final weights, bitwise;
- k = 1: every trained batch's staleness is what the schedule says (0 for the first batch, 1
  after), generation of batch t + 1 happens during step t, and the samples trained are the
  stream's, in order;
- SIGKILL after the step-2 checkpoint (held before step 3 by the run's hook, so no race with
  the steps) and `--resume`: the samples trained are the stream's in order, none lost or
  repeated, and the run ends with the uninterrupted run's weights and records.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from nereus.spec.run_folder import read_metrics
from tests.cli_helpers import invoke, one_error_line
from tests.run_helpers import DATA, TIMING_FIELDS, kill_async_run_after_step_two_and_resume

pytestmark = pytest.mark.multiprocess

PLAN = DATA / "plan-tiny-grpo-async-2rank.yaml"
#: 8 samples a step (4 prompts x 2).
BATCH = 8
#: What a step trained on and what training gave: compared bitwise between k = 0 and sync
#: (beside the final weights; the rest of a record is times, memory and the async record).
TRAINING_FIELDS = (
    "step",
    "reward",
    "score",
    "kl",
    "response_len_mean",
    "response_len_min",
    "response_len_max",
    "prompt_len",
    "actor_loss",
    "grad_norm",
    "lr",
)


def write_run(folder: Path, num_steps: int, **workload: Any) -> Path:
    """A run config of the async plan with its workload's `workload` fields replaced (None: dropped)."""
    plan = yaml.safe_load(PLAN.read_text())
    for key, value in workload.items():
        if value is None:
            plan["workload"].pop(key, None)
        else:
            plan["workload"][key] = value
    plan.pop("predictions", None)
    (folder / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    config = {
        "kind": "RunConfig",
        "version": 1,
        "plan": "plan.yaml",
        "num_steps": num_steps,
        "checkpoint_every": 2,
        "rl": {"task": "sort", "seed": 3, "max_new_tokens": 6},
    }
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run(folder: Path, num_steps: int, **workload: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    result = invoke("run", write_run(folder, num_steps, **workload), "--out", folder / "out")
    assert result.exit_code == 0, result.output
    return folder / "out"


def records(out: Path, drop: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in (*TIMING_FIELDS, *drop)} for r in read_metrics(out)]


def training(out: Path) -> list[dict[str, Any]]:
    return [{key: record[key] for key in TRAINING_FIELDS} for record in read_metrics(out)]


def differences(left: list[dict[str, Any]], right: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(step, field) of every field two runs' records differ in (and the steps one lacks)."""
    found = [(index, "step missing") for index in range(min(len(left), len(right)), max(len(left), len(right)))]
    for a, b in zip(left, right, strict=False):
        found += [(a["step"], key) for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
    return found


def final_actor(out: Path, step: int) -> dict[str, bytes]:
    folder = out / "checkpoints" / f"step-{step:06d}" / "actor"
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def trained_samples(out: Path) -> list[int]:
    return [i for r in read_metrics(out) for start, stop in r["async_step"]["samples"] for i in range(start, stop)]


@pytest.fixture(scope="module")
def one_step_off(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 6-step run at k = 1 (checkpoints after steps 4 and 6)."""
    return run(tmp_path_factory.mktemp("k1"), 6, max_staleness=1)


def test_k0_equals_the_synchronous_run_bitwise(tmp_path: Path) -> None:
    turns = run(tmp_path / "k0", 3, max_staleness=0)
    sync = run(tmp_path / "sync", 3, execution=None, max_staleness=None)
    assert differences(training(turns), training(sync)) == []
    assert final_actor(turns, 3) == final_actor(sync, 3)
    assert [r["async_step"]["staleness"] for r in read_metrics(turns)] == [{"0": BATCH}] * 3
    # The behaviour log-probs are the trainer's old log-probs where the weights are the same.
    assert all(r["rollout_log_prob_diff_max"] < 1e-5 for r in read_metrics(turns))
    # k = 0 takes turns: by the timestamps, no step's training overlaps its generation.
    assert [r["async_step"]["overlap_s"] for r in read_metrics(turns)] == [0.0] * 3


def test_k1_trains_each_batch_one_version_behind_in_stream_order(one_step_off: Path) -> None:
    steps = read_metrics(one_step_off)
    assert [r["async_step"]["staleness"] for r in steps] == [{"0": BATCH}] + [{"1": BATCH}] * 5
    assert trained_samples(one_step_off) == list(range(6 * BATCH))
    for record in steps:
        busy = record["async_step"]
        assert 0 < busy["training_busy"] <= 1 and 0 <= busy["generation_busy"] <= 1
    # Generation runs one batch ahead: batch t + 1 is generated during step t (rank 1's timeline).
    spans = [json.loads(line) for line in (one_step_off / "timeline" / "rank-1.jsonl").read_text().splitlines()]
    generated = {(s["step"], s["name"]) for s in spans if s["cat"] == "async"}
    assert generated == {(0, "generate batch 0"), (0, "generate batch 1")} | {
        (t, f"generate batch {t + 1}") for t in range(1, 5)
    }
    assert not list((one_step_off / "async").glob("batch-*"))  # every handed-over batch was trained


def test_sigkill_mid_queue_and_resume_lose_and_repeat_no_sample(one_step_off: Path, tmp_path: Path) -> None:
    config = write_run(tmp_path, 6, max_staleness=1)
    out = kill_async_run_after_step_two_and_resume(config, tmp_path, BATCH, handed_over=True)
    assert trained_samples(out) == list(range(6 * BATCH))
    assert differences(records(out, ("async_step",)), records(one_step_off, ("async_step",))) == []
    assert final_actor(out, 6) == final_actor(one_step_off, 6)


def test_report_shows_each_steps_staleness_queue_and_busy_shares(one_step_off: Path, tmp_path: Path) -> None:
    shown = invoke("report", one_step_off)
    assert shown.exit_code == 0, shown.output
    assert "async: per step" in shown.output and "1: 8" in shown.output
    document = json.loads(invoke("report", one_step_off, "--json", "--from-step", "1").stdout)
    rows = document["async_steps"]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert all(row["staleness"] == {"1": BATCH} and row["queue_depth"] >= BATCH for row in rows)
    # A hand-damaged record is refused in one line naming the line.
    damaged = tmp_path / "out"
    shutil.copytree(one_step_off, damaged)
    lines = (damaged / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[2])
    record["async_step"]["staleness"] = [1]
    lines[2] = json.dumps(record)
    (damaged / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    line = one_error_line(invoke("report", damaged))
    assert "line 3" in line and "async_step" in line, line


def test_torchrun_runs_the_same_async_loop(one_step_off: Path, tmp_path: Path) -> None:
    """`torchrun --nnodes 1 --nproc-per-node 2 -m nereus run` of the same config trains what the
    spawned run trained, bitwise (the ranks run one loop, `rank_entry.rank_main`)."""
    from tests.runtime.test_run_torchrun import finish, start_agents

    finish(start_agents(1, 2, one_step_off.parent / "run.yaml", "--out", tmp_path / "out"), 400)
    assert differences(training(tmp_path / "out"), training(one_step_off)) == []
    assert trained_samples(tmp_path / "out") == list(range(6 * BATCH))
    assert final_actor(tmp_path / "out", 6) == final_actor(one_step_off, 6)

"""`nereus run` end to end: refusals before any rank exists, metrics and checkpoints, resume
bitwise, resume onto another number of ranks, and a run killed with SIGKILL (tier: CLI e2e,
multi-process gloo)."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from repo_paths import DATA, EXAMPLES

from nereus.runtime.run.run_state import read_run_state
from nereus.runtime.state.checkpoint import verify_checkpoint
from nereus.runtime.state.sharded_state import box_slices
from nereus.solver.admission import memory_problems, plan_problems, predicted_peaks, state_bytes_by_rank
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig
from nereus.spec.run_folder import finished_checkpoints, read_metrics
from tests.cli_helpers import invoke, one_error_line
from tests.run_helpers import (
    TIMING_FIELDS,
    alive,
    rank_pids,
    release,
    start_run,
    wait_for,
    wait_until_held,
    write_config,
)

pytestmark = pytest.mark.cli

DATA = DATA
PLAN_2RANK = DATA / "plan-tiny-ppo-2rank.yaml"
EXAMPLES = EXAMPLES


def training_records(out: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in read_metrics(out)]


def assert_checkpoints_whole(out: Path) -> None:
    for folder in finished_checkpoints(out):
        assert json.loads((folder / "state.json").read_text())["step"] >= 1
        for role in ("actor", "critic"):
            verify_checkpoint(folder / role)


# ---- refusals: one line, nothing spawned, nothing written ----


@pytest.mark.parametrize(
    ("fields", "args", "expected"),
    [
        ({"rl": {"task": "juggle"}}, [], "unknown task 'juggle'"),
        ({"num_steps": 0}, [], "num_steps"),
        ({"plan": "missing.yaml"}, [], "missing.yaml does not exist"),
        ({}, ["--nproc", "3"], "--nproc is 3; pass --nproc 2"),
        ({"plan": None}, [], "plan: not set"),
        ({"plan_switches": [{"step": 9, "plan": "plan.yaml"}]}, [], "plan_switches.0.step: 9 is not before"),
        ({"plan_switches": [{"step": 1, "plan": "nope.yaml"}]}, [], "plan_switches.0.plan:"),
        ({"lengths_from_trace": True}, [], "lengths_from_trace: needs a trace"),
        ({"calibration": "nope.yaml"}, [], "calibration: "),
        ({"fusion": {"intra_stage": True}}, [], "fusion.intra_stage: "),
        ({"fusion": {"inter_stage": True}}, [], "fusion.inter_stage: needs actor/generation dp >= 2"),
        ({"rl": {"sft_steps": 2, "sft_batch": 1}}, [], "rl.sft_batch: 1 demonstrations over actor/training's dp=1"),
    ],
)
def test_bad_config_or_plan_is_refused_before_spawning(
    tmp_path: Path, fields: dict[str, Any], args: list[str], expected: str
) -> None:
    config = write_config(tmp_path, **fields)
    out = tmp_path / "out"
    start = time.perf_counter()
    line = one_error_line(invoke("run", config, "--out", out, *args))
    assert expected in line
    assert time.perf_counter() - start < 5, "refusals must come before any rank is spawned"
    assert not out.exists()


def test_local_ranks_are_bounded(tmp_path: Path) -> None:
    """Found by the careless-input test: `--resume --nproc 3000` replanned for minutes."""
    from nereus.cli.inputs import MAX_LOCAL_RANKS

    config, too_many = write_config(tmp_path), str(MAX_LOCAL_RANKS + 1)
    for command in (["run", config, "--out", tmp_path / "out"], ["profile", "-o", tmp_path / "p.yaml"]):
        refused = invoke(*command, "--nproc", too_many)
        assert refused.exit_code == 2 and "'--nproc'" in refused.output, command  # a usage error
    assert not (tmp_path / "out").exists() and not (tmp_path / "p.yaml").exists()


def test_resume_refuses_a_plan_with_another_workload(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out).mkdir()
    shutil.copy(PLAN_2RANK, out / "plan.yaml")
    (out / "config.yaml").write_text(yaml.safe_dump({"kind": "RunConfig", "version": 1, "plan": "plan.yaml"}))
    other = yaml.safe_load(PLAN_2RANK.read_text())
    other["workload"]["prompts_per_step"] = 16
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    line = one_error_line(invoke("run", "--resume", out, "--plan", tmp_path / "other.yaml"))
    assert "workload.prompts_per_step: differs from the run's" in line


def test_a_plan_over_the_per_gpu_memory_is_refused(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    plan["cluster"]["gpu"]["memory_bytes"] = 4_000_000
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    result = invoke("run", config, "--out", tmp_path / "out")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert all(line.startswith("error: ") and "memory:" in line for line in result.stderr.strip().splitlines())
    assert not (tmp_path / "out").exists()
    # The runtime's own check, from the exact shard sizes (it also vets the controller's targets).
    problems = memory_problems(Plan.model_validate(plan), RLConfig())
    assert problems and problems[0].startswith("rank 0 would hold") and "per GPU of cluster" in problems[0]


def predicted_rank_peaks(plan: Plan, num_ranks: int, skip: list[str]) -> list[int]:
    """Per rank, the largest predicted peak of the model-stages it runs (0 for an idle rank)."""
    peaks = [0] * num_ranks
    for by_rank in predicted_peaks(plan, skip=skip).values():
        for rank, peak in by_rank.items():
            peaks[rank] = max(peaks[rank], peak)
    return peaks


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_rank_capacity_refuses_what_is_predicted_not_to_fit_and_admits_what_is(tmp_path: Path) -> None:
    """`rl.rank_memory_bytes` one byte under the plan's predicted peak is refused before any
    rank exists; at the predicted peak the run starts, and every step records each rank's
    measured and predicted peak, overall and per model-stage."""
    plan: Plan = load_document(PLAN_2RANK)  # type: ignore[assignment]
    rule = ["reward/inference"]  # a rule reward runs no model
    peak = max(predicted_rank_peaks(plan, 2, skip=rule))
    tight = write_config(
        tmp_path, num_steps=1, rl={"task": "sort", "seed": 3, "max_new_tokens": 4, "rank_memory_bytes": peak - 1}
    )
    line = one_error_line(invoke("run", tight, "--out", tmp_path / "refused"))
    assert "at its peak" in line and "rl.rank_memory_bytes" in line and not (tmp_path / "refused").exists()
    # The controller vets every target plan with the same check (plan_problems).
    vetted = plan_problems(plan, 2, RLConfig(rank_memory_bytes=peak - 1))
    assert any("at its peak" in problem for problem in vetted)
    assert not any("at its peak" in p for p in plan_problems(plan, 2, RLConfig(rank_memory_bytes=peak)))
    fits = write_config(
        tmp_path, num_steps=1, rl={"task": "sort", "seed": 3, "max_new_tokens": 4, "rank_memory_bytes": peak}
    )
    assert invoke("run", fits, "--out", tmp_path / "runs").exit_code == 0
    (record,) = read_metrics(tmp_path / "runs")
    assert record["predicted_memory_peak_bytes"] == predicted_rank_peaks(plan, 2, skip=rule)
    assert len(record["memory_peak_bytes"]) == 2 and min(record["memory_peak_bytes"]) > 0
    by_stage = record["memory_peak_bytes_by_stage"]
    assert set(by_stage) == {e.model_stage for e in plan.stages if e.role != "reward"}
    assert set(record["predicted_memory_peak_bytes_by_stage"]) == set(by_stage)
    report = invoke("report", tmp_path / "runs")
    assert report.exit_code == 0 and "peak memory" in report.output and "actor/training" in report.output


def test_existing_out_folder_is_refused(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "something").write_text("x")
    assert "already exists; resume it with" in one_error_line(invoke("run", config, "--out", tmp_path / "out"))


# ---- runs ----


@pytest.mark.multiprocess
def test_run_writes_metrics_and_checkpoints_and_resumes_bitwise(tmp_path: Path) -> None:
    """With the training basics on: a supervised warm-start, lr warm-up then cosine decay,
    gradient clipping, per-sequence loss aggregation and TensorBoard events."""
    rl = {"task": "sort", "seed": 3, "max_new_tokens": 6, "sft_steps": 2, "sft_batch": 4, "lr_warmup_steps": 1}
    rl.update(lr_schedule="cosine", min_lr_ratio=0.5, grad_clip=0.5, loss_agg_mode="seq-mean-token-sum")
    config = write_config(tmp_path, rl=rl, log={"tensorboard": True})
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert invoke("run", config, "--out", whole, "--json").exit_code == 0
    records = read_metrics(whole)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    actor_lrs = [r["lr"]["actor/training"] for r in records]
    cosine_end = 0.5e-2 * (1 + 0.5 * (1 + math.cos(2 * math.pi / 3)))  # warm-up 1, decay over steps 1..4
    assert actor_lrs[:2] == [1e-2, 1e-2] and actor_lrs[-1] == pytest.approx(cosine_end)
    assert all(set(r["grad_norm"]) == {"actor/training", "critic/training"} for r in records)
    assert all(norm > 0 for r in records for norm in r["grad_norm"].values())
    assert list((whole / "tensorboard").glob("events.out.tfevents.*"))
    first = records[0]
    assert set(first["stage_seconds"]) >= {"actor/generation", "critic/training", "weight_sync"}
    assert len(first["state_bytes_per_rank"]) == 2 and min(first["state_bytes_per_rank"]) > 0
    # The memory check before spawning predicts exactly what the ranks then hold.
    plan = load_document(whole / "plan.yaml")
    predicted = state_bytes_by_rank(plan, RLConfig())  # type: ignore[arg-type]
    assert [predicted[rank] for rank in (0, 1)] == first["state_bytes_per_rank"]
    assert [p.name for p in finished_checkpoints(whole)] == ["step-000002", "step-000004"]
    assert_checkpoints_whole(whole)
    verify_checkpoint(finished_checkpoints(whole)[-1] / "reference")  # the warmed-up actor

    assert invoke("run", config, "--out", split, "--steps", "2").exit_code == 0
    result = invoke("run", "--resume", split, "--steps", "4", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["first_step"] == 2 and summary["steps_run"] == 2
    assert training_records(split) == training_records(whole)


@pytest.mark.multiprocess
def test_resume_onto_other_ranks_continues_from_the_same_state(tmp_path: Path) -> None:
    """4 ranks -> checkpoint -> 2 ranks (replanned) and 1 rank: the weights loaded equal the saved ones."""
    from nereus.runtime.state.checkpoint import load_checkpoint
    from nereus.runtime.state.shard_layout import RankLayout

    config = write_config(tmp_path, checkpoint_every=2, num_steps=2)
    four = yaml.safe_load((EXAMPLES / "plan-tiny-ppo-4rank.yaml").read_text())
    four["workload"]["prompts_per_step"] = 8
    (tmp_path / "plan4.yaml").write_text(yaml.safe_dump(four))
    out = tmp_path / "out"
    assert invoke("run", config, "--plan", tmp_path / "plan4.yaml", "--out", out).exit_code == 0
    saved = load_checkpoint(out / "checkpoints" / "step-000002" / "actor", RankLayout(1, 1, 1, (0,)), 0).tensors
    result = invoke("run", "--resume", out, "--nproc", "2", "--steps", "3", "--json")
    assert result.exit_code == 0, result.output
    assert "planned a new layout for 2 ranks" in result.stderr
    plan = yaml.safe_load((out / "plan.yaml").read_text())
    assert {gpu for stage in plan["stages"] for emu in stage["emus"] for gpu in emu} == {0, 1}
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2]
    # Resuming restores exactly the saved logical state: check it through the library on 1 rank.
    from nereus.runtime.comm.spawn import spawn
    from nereus.runtime.run.resolve import resume_run

    setup = resume_run(out, num_ranks=1, num_steps=4)
    setup = type(setup)(**{**setup.__dict__, "checkpoint": out / "checkpoints" / "step-000002", "start_step": 2})
    restored = spawn(restored_actor_params, 1, setup)[0]
    for key, tensor in restored.items():
        assert (tensor == saved[key]).all(), key


def restored_actor_params(rank: int, world_size: int, setup: Any) -> dict[str, Any]:
    from nereus.runtime.rl.stages import build_stages
    from nereus.runtime.rl.update import sync_plans, sync_weights
    from nereus.runtime.run.checkpoints import restore

    stages = build_stages(setup.plan, setup.config.rl)
    restore(stages, setup.checkpoint, rank, setup.config.rl)
    sync_weights(sync_plans(stages))
    generation = stages["actor/generation"].engine
    training = stages["actor/training"].engine
    assert generation is not None and training is not None
    for key, tensor in training.local_state().items():
        if key.startswith("param/"):
            assert (generation.local_state()[key] == tensor).all(), key
    return {k: v.clone() for k, v in training.local_state().items()}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    ("choice", "split_families"),
    [("zero1", ["exp_avg", "exp_avg_sq"]), ("full_shard", ["exp_avg", "exp_avg_sq", "grad", "param"])],
)
def test_a_dp_sharded_checkpoint_resumes_exactly_onto_any_layout_and_exports(
    tmp_path: Path, choice: str, split_families: list[str]
) -> None:
    """critic/training runs ZeRO-1 (its AdamW moments split) or full sharding on FSDP2 (every
    family split) over dp=2: the split families are saved as each replica's rows and the index
    says so. The checkpoint resumes on the same layout (the run continues exactly as an
    uninterrupted one), restores bitwise onto the same ranks and onto 1 rank without the
    choice, and the export reads its weights whole."""
    from nereus.runtime.comm.spawn import spawn
    from nereus.runtime.hf.export import whole_params
    from nereus.runtime.run.resolve import resume_run
    from nereus.runtime.state.checkpoint import load_checkpoint
    from nereus.runtime.state.shard_layout import RankLayout
    from nereus.runtime.state.sharded_state import stage_dp_sharded
    from nereus.spec.stages import CRITIC_TRAINING

    def sharded_run(folder: Path, num_steps: int) -> Path:
        folder.mkdir()
        config = write_config(folder, checkpoint_every=1, num_steps=num_steps)
        plan = yaml.safe_load((folder / "plan.yaml").read_text())
        next(s for s in plan["stages"] if s["model_stage"] == CRITIC_TRAINING)[choice] = True
        (folder / "plan.yaml").write_text(yaml.safe_dump(plan))
        result = invoke("run", config, "--out", folder / "out")
        assert result.exit_code == 0, result.output
        return folder / "out"

    def whole(checkpoint: Path) -> dict[str, Any]:
        return load_checkpoint(checkpoint, RankLayout(1, 1, 1, (0,)), 0).tensors

    split, uninterrupted = sharded_run(tmp_path / "split", 1), sharded_run(tmp_path / "whole", 2)
    first = split / "checkpoints" / "step-000001"
    index = verify_checkpoint(first / "critic")
    saved_split = [family for family in split_families if family != "grad"]  # gradients are not saved
    assert index.dp == 2 and index.dp_sharded == saved_split
    saved = whole(first / "critic")
    assert {key.partition("/")[0] for key in saved} >= {"param", "exp_avg", "exp_avg_sq"}
    exported = whole_params(first / "critic")
    assert exported.keys() == {key.partition("/")[2] for key in saved if key.startswith("param/")}
    for name, tensor in exported.items():
        assert torch_equal(tensor, saved[f"param/{name}"]), name

    # (a) `run --resume` on the same layout: the checkpoint is accepted, the run goes on exactly.
    result = invoke("run", "--resume", split, "--steps", "2", "--json")
    assert result.exit_code == 0, result.output
    assert training_records(split) == training_records(uninterrupted)
    for role in ("actor", "critic"):
        ours, theirs = (whole(out / "checkpoints" / "step-000002" / role) for out in (split, uninterrupted))
        assert ours.keys() == theirs.keys() and all(torch_equal(ours[k], theirs[k]) for k in ours), role

    # (b) the step-1 state restored onto the sharded ranks and onto 1 rank: each rank's shard, bitwise.
    for ranks in (2, 1):
        setup = resume_run(split, num_ranks=ranks, num_steps=3)
        setup = type(setup)(**{**setup.__dict__, "checkpoint": first, "start_step": 1})
        # onto 1 rank the runtime replans (it may offload the critic's optimizer: its families are
        # then this one replica's rows, the whole tensors)
        critic = setup.plan.stage_plan(CRITIC_TRAINING)
        expected = split_families if ranks == 2 else sorted(stage_dp_sharded(setup.plan.workload, critic))
        for rank, (sharded, local, boxes) in enumerate(spawn(restored_critic_state, ranks, setup)):
            assert sharded == expected, sharded
            for key, tensor in local.items():
                if key in saved:
                    assert torch_equal(tensor, saved[key][box_slices(boxes[key])]), (ranks, rank, key)


def torch_equal(a: Any, b: Any) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())


def restored_critic_state(rank: int, world_size: int, setup: Any) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """critic/training after `restore`: its dp-sharded families, local state, and each key's box."""
    from nereus.runtime.rl.stages import build_stages
    from nereus.runtime.run.checkpoints import restore
    from nereus.spec.stages import CRITIC_TRAINING

    stages = build_stages(setup.plan, setup.config.rl)
    restore(stages, setup.checkpoint, rank, setup.config.rl)
    stage = stages[CRITIC_TRAINING]
    assert stage.engine is not None
    local = {k: v.clone() for k, v in stage.engine.local_state().items()}
    families = tuple(sorted({key.partition("/")[0] for key in local}))
    boxes = stage.meta(families).rank_boxes(rank)
    return sorted(stage.dp_sharded), local, dict(boxes)


# ---- killed runs (subprocesses) ----


@pytest.fixture(scope="module")
def plain_six(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """The 2-rank config's plain 6-step run (checkpoints every 2 steps) and its seconds: the
    reference of the SIGKILL test and of the plan-switch test's steps before its first switch."""
    folder = tmp_path_factory.mktemp("plain-six")
    config = write_config(folder, num_steps=6)
    start = time.monotonic()
    result = invoke("run", config, "--out", folder / "whole")
    assert result.exit_code == 0, result.output
    return folder / "whole", time.monotonic() - start


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_is_bitwise(plain_six: tuple[Path, float], tmp_path: Path) -> None:
    config = write_config(tmp_path, num_steps=6)
    whole, duration = plain_six
    chooser = random.Random(7)
    for attempt in range(2):
        out = tmp_path / f"killed-{attempt}"
        result = kill_then_resume(config, out, chooser.uniform(0.2, 0.8) * duration)
        if "already ran 6 of 6 steps" in result.output:  # the kill came after the end
            continue
        assert result.exit_code == 0, result.output
        assert_checkpoints_whole(out)
        assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
        assert training_records(out) == training_records(whole)


def kill_then_resume(config: Path, out: Path, delay_s: float) -> Any:
    """Start a run, SIGKILL its launcher after `delay_s`, check no rank outlives it and every
    finished checkpoint is whole, then resume it in-process; the resume's result."""
    process = start_run(config, "--out", out)
    wait_for(lambda: len(rank_pids(process.pid)) == 2, 60)
    ranks = rank_pids(process.pid)
    time.sleep(delay_s)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    # No orphaned ranks: a rank still importing torch when the launcher dies (a loaded CI
    # machine) sees it only when it reaches its start-up check, hence the margin.
    wait_for(lambda: not any(alive(pid) for pid in ranks), 30)
    assert_checkpoints_whole(out)
    return invoke("run", "--resume", out)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_dead_rank_takes_the_run_down_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    config = write_config(tmp_path, num_steps=4, checkpoint_every=1)
    out, hold = tmp_path / "out", tmp_path / "hold"
    process = start_run(config, "--out", out, hold=(2, hold))  # both ranks wait before step 2
    wait_until_held(hold, 2)
    ranks = rank_pids(process.pid)
    os.kill(ranks[1], signal.SIGKILL)
    release(hold)
    _, stderr = process.communicate(timeout=300)  # a hang guard: seconds on an idle machine
    assert process.returncode == 1
    error = stderr.decode().strip().splitlines()[-1]
    assert error.startswith("error: run failed: rank ") and "resume from step-000002" in error, error
    assert not any(alive(pid) for pid in ranks)
    assert (out / "failure.log").is_file()
    assert_checkpoints_whole(out)


@pytest.mark.multiprocess
def test_reward_model_option_runs_checkpoints_and_resumes_bitwise(tmp_path: Path) -> None:
    rl = {"task": "sort", "seed": 3, "max_new_tokens": 6, "reward": "model", "reward_model_steps": 4}
    config = write_config(tmp_path, rl=rl, num_steps=2, checkpoint_every=1)
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert invoke("run", config, "--out", whole).exit_code == 0
    records = read_metrics(whole)
    assert all(r["reward"] != r["score"] for r in records), "the reward comes from the model, not the rule"
    assert records[0]["stage_seconds"]["reward/inference"] > 0
    assert (whole / "checkpoints" / "step-000002" / "reward" / "index.json").is_file()
    assert invoke("run", config, "--out", split, "--steps", "1").exit_code == 0
    assert invoke("run", "--resume", split, "--steps", "2").exit_code == 0
    assert training_records(split) == training_records(whole)


@pytest.mark.multiprocess
def test_plan_switches_move_state_live_and_resume_under_the_plan_in_force(
    plain_six: tuple[Path, float], tmp_path: Path
) -> None:
    """2 ranks: tp/pp layouts -> colocated dp=2 at step 2 -> actor and critic on their own rank at step 3."""
    plan = yaml.safe_load(PLAN_2RANK.read_text())
    colocated = {**plan, "stages": [{**e, "tp": 1, "pp": 1, "dp": 2, "emus": [[0], [1]]} for e in plan["stages"]]}
    split = {
        **plan,
        "pools": [{"name": "actor", "gpus": [0]}, {"name": "critic", "gpus": [1]}],
        "stages": [
            {**e, "pool": p, "tp": 1, "pp": 1, "dp": 1, "emus": [[g]], "micro_batches": 1}
            for e in plan["stages"]
            for p, g in [("critic", 1) if e["model_stage"].startswith("critic") else ("actor", 0)]
        ],
    }
    (tmp_path / "colocated.yaml").write_text(yaml.safe_dump(colocated))
    (tmp_path / "split.yaml").write_text(yaml.safe_dump(split))
    switches = [{"step": 2, "plan": "colocated.yaml"}, {"step": 3, "plan": "split.yaml"}]
    config = write_config(tmp_path, num_steps=4, checkpoint_every=3, plan_switches=switches)
    switched = tmp_path / "switched"
    assert invoke("run", config, "--out", switched).exit_code == 0
    records = read_metrics(switched)
    assert ["transition" in r["stage_seconds"] for r in records] == [False, False, True, True]
    assert (switched / "plan-from-step-000003.yaml").is_file()
    decisions = [json.loads(line) for line in (switched / "decisions.jsonl").read_text().splitlines()]
    assert [(d["observation"]["event"], d["decision"]["step"], d["engine"]) for d in decisions] == [
        ("plan_switch", 2, "nereus"),
        ("plan_switch", 3, "nereus"),
    ]
    # into dp=2 copies state (priced); out to one replica per rank only destroys (a 0 s makespan)
    assert [d["decision"]["transition_cost_s"] > 0 for d in decisions] == [True, False]
    assert all(d["measured_cost_s"] > 0 for d in decisions)
    # Before the first switch the run is the plain run, bitwise; after, training goes on.
    plain, _ = plain_six
    assert training_records(switched)[:2] == training_records(plain)[:2]
    assert all(r["actor_loss"] == r["actor_loss"] and r["critic_loss"] is not None for r in records)  # finite
    # Resume after the checkpoint at step 3: under the plan in force then (split).
    shutil.rmtree(switched / "checkpoints" / "step-000004")
    result = invoke("run", "--resume", switched)
    assert result.exit_code == 0, result.output
    assert training_records(switched)[3] == {k: v for k, v in records[3].items() if k not in TIMING_FIELDS}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_after_a_live_transition_the_run_is_a_resume_into_the_target_plan_bitwise(tmp_path: Path) -> None:
    """A transition verifies the logical state it moves; this checks the rest (optimizer step,
    learning rate, clipping, data and sampling positions): from the switch on, the run repeats
    bitwise the plain run resumed from its checkpoint before the switch into the target plan."""
    plan = yaml.safe_load(PLAN_2RANK.read_text())
    colocated = {**plan, "stages": [{**e, "tp": 1, "pp": 1, "dp": 2, "emus": [[0], [1]]} for e in plan["stages"]]}
    (tmp_path / "colocated.yaml").write_text(yaml.safe_dump(colocated))
    switches = [{"step": 1, "plan": "colocated.yaml"}]
    switched, plain = tmp_path / "switched", tmp_path / "plain"
    assert invoke("run", write_config(tmp_path, num_steps=2, plan_switches=switches), "--out", switched).exit_code == 0
    assert invoke("run", write_config(tmp_path, num_steps=1, checkpoint_every=1), "--out", plain).exit_code == 0
    result = invoke("run", "--resume", plain, "--plan", tmp_path / "colocated.yaml", "--steps", "2")
    assert result.exit_code == 0, result.output
    moved, resumed = training_records(switched), training_records(plain)
    assert [r.pop("plan_index") for r in moved] == [0, 1]
    assert [{k: v for k, v in r.items() if k != "plan_index"} for r in resumed] == moved


@pytest.mark.multiprocess
def test_controller_moves_off_a_leaving_rank_and_logs_every_decision(tmp_path: Path) -> None:
    """Rank 1 leaves at step 2 with one step of notice: the urgent path moves every model-stage
    onto rank 0 before it goes; every decision is logged with its observation."""
    config = write_config(tmp_path, num_steps=6, checkpoint_every=3)
    out = tmp_path / "out"
    result = invoke("run", config, "--out", out, "--trace", DATA / "trace-spot-2rank.yaml", "--policy", "nereus")
    assert result.exit_code == 0, result.output
    decisions = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    assert [d["observation"]["step"] for d in decisions] == list(range(6))
    assert [d["observation"]["gpus"] for d in decisions] == [2, 2, 1, 1, 2, 2]
    moved = [d["decision"] for d in decisions if d["decision"]["action"] in ("transition", "restart")]
    assert moved and moved[0]["step"] == 1 and moved[0]["path"] == "urgent"
    records = read_metrics(out)
    assert any(moved[0]["action"] in r["stage_seconds"] for r in records[1:2])
    # From the move on, rank 1 holds no state: nothing runs on a GPU that has left.
    assert all(r["state_bytes_per_rank"][1] == 0 for r in records[1:4])
    assert (out / "trace.yaml").is_file()
    plan_at_3 = yaml.safe_load((out / "checkpoints" / "step-000003" / "plan.yaml").read_text())
    assert {gpu for stage in plan_at_3["stages"] for emu in stage["emus"] for gpu in emu} == {0}


@pytest.mark.multiprocess
def test_trace_lengths_timeline_and_controller_state_survive_a_resume(tmp_path: Path) -> None:
    """Responses follow the trace's lengths; every rank logs its spans; a resume goes on with the
    controller's decisions and the online calibration where the checkpoint left them."""
    trace = yaml.safe_load((DATA / "trace-spot-2rank.yaml").read_text())
    trace["response_len"] = {"median": 3, "p99": 3, "max": 3}
    trace["events"] = [{"step": 3, "response_len": {"median": 7, "p99": 7, "max": 7}}]
    (tmp_path / "trace.yaml").write_text(yaml.safe_dump(trace))
    config = write_config(tmp_path, num_steps=6, checkpoint_every=3, trace="trace.yaml", lengths_from_trace=True)
    out = tmp_path / "out"
    assert invoke("run", config, "--out", out).exit_code == 0
    records = read_metrics(out)
    assert [r["response_len_max"] <= (3 if r["step"] < 3 else 7) for r in records] == [True] * 6
    assert max(r["response_len_max"] for r in records[3:]) > 3
    assert all(r["predicted_step_seconds"] > 0 and r["plan_index"] >= 0 for r in records)
    shutil.rmtree(out / "checkpoints" / "step-000006")
    assert invoke("run", "--resume", out).exit_code == 0
    decisions = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    assert [d["observation"]["step"] for d in decisions] == list(range(6))
    for rank in (0, 1):
        spans = [json.loads(line) for line in (out / "timeline" / f"rank-{rank}.jsonl").read_text().splitlines()]
        generation = [s["step"] for s in spans if s["name"] == "actor/generation"]
        assert generation == list(range(6)), rank
        assert all(s["end"] >= s["start"] for s in spans)
    events = json.loads((out / "timeline.json").read_text())["traceEvents"]
    assert {e["name"] for e in events if e.get("ph") == "X"} >= {"actor/generation", "step-000006"}
    state = read_run_state(out / "checkpoints" / "step-000006" / "controller.json")
    # Steps 1, 2, 4, 5 calibrate (each process's first step is warm-up): 2 of them before the resume.
    # Under a plan that keeps rank 0 out of generation, step 5's update waits in the checkpoint.
    pending = state.predictor.pending
    assert state.predictor.calibrator is not None and state.controller is not None
    assert state.predictor.calibrator.num_updates + (pending is not None) == 4
    assert pending is None or pending.metrics["step"] == 5
    assert state.controller.plan == load_document(out / "checkpoints" / "step-000006" / "plan.yaml")


@pytest.mark.multiprocess
def test_with_generation_off_rank_0_each_online_update_runs_in_the_next_steps_generation(tmp_path: Path) -> None:
    """The actor's model-stages on rank 1, the rest on rank 0: rank 0 folds each step into the
    calibration while rank 1 generates the next one; the last step's update waits in the checkpoint."""
    plan = yaml.safe_load(PLAN_2RANK.read_text())
    plan.pop("predictions", None)
    plan["pools"] = [{"name": "others", "gpus": [0]}, {"name": "actor", "gpus": [1]}]
    for stage in plan["stages"]:
        gpu = 1 if stage["model_stage"].startswith("actor/") else 0
        stage.update(pool="actor" if gpu else "others", tp=1, pp=1, dp=1, emus=[[gpu]], micro_batches=1)
    config = write_config(tmp_path, checkpoint_every=4)
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    out = tmp_path / "out"
    assert invoke("run", config, "--out", out).exit_code == 0
    state = read_run_state(out / "checkpoints" / "step-000004" / "controller.json")
    assert state.predictor.calibrator is not None
    assert state.predictor.calibrator.num_updates == 2  # steps 1 and 2 (step 0 is warm-up)
    assert state.predictor.pending is not None and state.predictor.pending.metrics["step"] == 3
    spans = [json.loads(line) for line in (out / "timeline" / "rank-0.jsonl").read_text().splitlines()]
    generation = {s["step"]: s for s in spans if s["name"] == "actor/generation"}
    idle = [s for s in spans if s["name"] == "calibrate (idle)"]
    assert [s["step"] for s in idle] == [2, 3]
    for span in idle:  # inside rank 0's wait for the step's generation
        assert generation[span["step"]]["start"] <= span["start"] <= span["end"] <= generation[span["step"]]["end"]


def pool_trace_run(folder: Path) -> tuple[Path, Path]:
    """4 ranks of 10 MiB each: the pool shrinks to 2, grows back to 4 and shrinks to 3; the run
    and the same run without the trace (its first plan throughout). (The controller searches
    every memory choice the runtime executes: on 2 ranks it now fits dp=2 with recompute, ZeRO-1
    or token budgets where tp or pp was needed before.)"""
    plan = yaml.safe_load((EXAMPLES / "plan-tiny-ppo-4rank.yaml").read_text())
    plan["cluster"]["gpu"]["memory_bytes"] = 10 * 2**20
    plan.pop("predictions", None)
    (folder / "plan.yaml").write_text(yaml.safe_dump(plan))
    trace = {
        **yaml.safe_load((DATA / "trace-spot-2rank.yaml").read_text()),
        "num_steps": 8,
        "gpus": 4,
        "events": [{"step": 2, "gpus": 2, "notice_steps": 1}, {"step": 4, "gpus": 4}, {"step": 6, "gpus": 3}],
    }
    (folder / "trace.yaml").write_text(yaml.safe_dump(trace))
    fields = {"kind": "RunConfig", "version": 1, "plan": "plan.yaml", "num_steps": 8, "checkpoint_every": 4}
    # Small learning rates: the moved run trains in other layouts (other rounding), and at 1e-2
    # Adam's near-eps first updates amplify that until a sampled token flips (a chaotic fork,
    # not lost state). At 1e-4 the runs still train, clip and agree to ~1e-5 (measured).
    fields |= {"rl": {"task": "sort", "seed": 3, "max_new_tokens": 6, "actor_lr": 1e-4, "critic_lr": 1e-4}}
    (folder / "plain.yaml").write_text(yaml.safe_dump(fields))
    # No online calibration: the controller decides from the cost model alone, not measured times.
    traced = {**fields, "trace": "trace.yaml", "policy": "dynarl", "verify_transitions": True}
    traced["online_calibration"] = False
    (folder / "traced.yaml").write_text(yaml.safe_dump(traced))
    return folder / "traced.yaml", folder / "plain.yaml"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_run_through_tp_pp_dp_pool_shrink_and_growth_keeps_its_state_bitwise(tmp_path: Path) -> None:
    """Every live transition is checked by the runtime itself (logical state gathered before
    and after, equal bitwise); the rewards equal those of the run without transitions."""
    traced, plain = pool_trace_run(tmp_path)
    out, plain_out = tmp_path / "traced", tmp_path / "plain"
    assert invoke("run", traced, "--out", out).exit_code == 0
    spans = [json.loads(line) for line in (out / "timeline" / "rank-0.jsonl").read_text().splitlines()]
    checks = [s["args"] for s in spans if s["name"] == "verify state"]
    # At least the announced shrink and the growth back go by checked DAGs; the controller's other,
    # voluntary moves depend on measured step times (efficiency), so their number is not asserted.
    assert len(checks) >= 2 and all(check["equal"] for check in checks)
    # The ranks keep their state in arenas: moved pieces are read straight out of the sender's
    # (by whichever ranks receive: rank 0 may only send).
    every_rank = [json.loads(line) for path in (out / "timeline").glob("rank-*.jsonl") for line in path.open()]
    primitives = [s["args"] for s in every_rank if s["cat"] == "primitive"]
    assert sum(p["bytes_received_direct"] for p in primitives) > 0
    assert all(0 <= p["bytes_received_direct"] <= p["bytes_received"] for p in primitives)
    decisions = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    moves = [(d["observation"]["gpus"], d["decision"]) for d in decisions if d["decision"]["action"] != "keep"]
    layouts = [decision["target_layout"] for _, decision in moves]
    assert {2, 4} <= {int(layout.split(" ")[0]) for layout in layouts}, "a shrink to 2 and a growth back to 4"
    entries = [entry for layout in layouts for entry in layout.split(": ", 1)[1].split(", ")]
    tp_pp_dp = {tuple(int(n) for n in entry.split(" ")[1].split("/")) for entry in entries}
    # The layouts change with the pool (dp follows it; tp and pp moves are covered by the plan-switch tests).
    assert len({dp for _, _, dp in tp_pp_dp}) >= 2, layouts
    assert invoke("run", plain, "--out", plain_out).exit_code == 0
    moved, kept = read_metrics(out), read_metrics(plain_out)
    # Stated tolerance: per-step reward within 0.02 (a sample or two scored differently), KL and
    # losses within 1e-3 relative (layouts change float reduction orders). Measured: rewards equal.
    for a, b in zip(moved, kept, strict=True):
        assert abs(a["reward"] - b["reward"]) <= 0.02
        for field in ("kl", "actor_loss", "critic_loss"):
            assert a[field] == pytest.approx(b[field], rel=1e-3, abs=1e-5), (a["step"], field)


def test_controller_refuses_a_trace_larger_than_the_world(tmp_path: Path) -> None:
    trace = yaml.safe_load((DATA / "trace-spot-2rank.yaml").read_text())
    trace["events"][1]["gpus"] = 3
    (tmp_path / "trace.yaml").write_text(yaml.safe_dump(trace))
    config = write_config(tmp_path)
    line = one_error_line(invoke("run", config, "--out", tmp_path / "out", "--trace", tmp_path / "trace.yaml"))
    assert "the pool reaches 3 GPUs but the run has 2 ranks" in line
    line = one_error_line(
        invoke("run", config, "--out", tmp_path / "out", "--trace", DATA / "trace-spot-2rank.yaml", "--policy", "bogus")
    )
    assert "policy: unknown policy 'bogus'" in line


def alternating_switches(folder: Path, num_steps: int) -> list[dict[str, Any]]:
    """Switches at every step from 1 on, alternating the 2-rank plan with its colocated dp=2 form."""
    plan = yaml.safe_load(PLAN_2RANK.read_text())
    colocated = {**plan, "stages": [{**e, "tp": 1, "pp": 1, "dp": 2, "emus": [[0], [1]]} for e in plan["stages"]]}
    (folder / "colocated.yaml").write_text(yaml.safe_dump(colocated))
    (folder / "original.yaml").write_text(yaml.safe_dump(plan))
    return [{"step": s, "plan": "colocated.yaml" if s % 2 else "original.yaml"} for s in range(1, num_steps)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigkill_during_transitions_keeps_checkpoints_and_resumes_bitwise(tmp_path: Path) -> None:
    """A plan switch before every step: random kills land in transitions often; every finished
    checkpoint stays valid and the resumed run repeats the uninterrupted one bitwise."""
    switches = alternating_switches(tmp_path, 6)
    config = write_config(tmp_path, num_steps=6, checkpoint_every=2, plan_switches=switches)
    whole = tmp_path / "whole"
    start = time.monotonic()
    assert invoke("run", config, "--out", whole).exit_code == 0
    duration = time.monotonic() - start
    assert all("transition" in r["stage_seconds"] for r in read_metrics(whole)[1:])
    chooser = random.Random(5)
    for attempt in range(2):
        out = tmp_path / f"killed-{attempt}"
        result = kill_then_resume(config, out, chooser.uniform(0.3, 0.8) * duration)
        if "already ran 6 of 6 steps" in result.output:
            continue
        assert result.exit_code == 0, result.output
        assert training_records(out) == training_records(whole)


@pytest.mark.multiprocess
def test_a_run_config_fusion_block_reaches_the_run_and_its_timeline(tmp_path: Path) -> None:
    """`fusion: {intra_stage: true}` in the run config (the plan's own block is off): the run
    trains through the fused pipeline, records it, and its plan.yaml says so."""
    plan = yaml.safe_load((EXAMPLES / "plan-tiny-ppo-2rank-intra.yaml").read_text())
    plan["fusion"] = {"intra_stage": False}
    config = write_config(tmp_path, num_steps=2, fusion={"intra_stage": True})
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    out = tmp_path / "out"
    assert invoke("run", config, "--out", out).exit_code == 0
    assert yaml.safe_load((out / "plan.yaml").read_text())["fusion"]["intra_stage"] is True
    spans = [json.loads(line) for line in (out / "timeline" / "rank-1.jsonl").read_text().splitlines()]
    fused = {s["name"] for s in spans if s["cat"] == "fused"}
    assert {"actor F0", "actor B0", "critic F0", "critic B0"} <= fused


def test_the_closing_summary_keeps_long_paths_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from nereus.cli.run_commands import print_summary
    from nereus.runtime.run.summary import RunSummary

    out = "runs/" + "a-long-run-folder-name-" * 4
    summary = RunSummary(
        out, 4, 0, 50, 50, 94.9, 0.023, 0.052, 0.029, 1.3, {"actor/generation": 0.6}, None, out + "/t.json"
    )
    print_summary(summary)
    lines = capsys.readouterr().out.splitlines()
    assert f"ran steps 1-50 of the run on 4 ranks in 94.9 s -> {out}" in lines
    assert f"timeline: {out}/t.json (open in ui.perfetto.dev); summary: nereus report {out}" in lines


@pytest.mark.parametrize(
    ("choice", "pin"),
    [
        ({"train_offload": "params", "full_shard": True}, "use train_offload optimizer"),
    ],
)
def test_a_plan_with_a_choice_the_runtime_lacks_is_refused(tmp_path: Path, choice: dict, pin: str) -> None:
    """Every memory choice is executed; what the runtime cannot lay out is refused, e.g. the
    parameters' shards in host memory on actor/training's dp=1 (FSDP2 shards over replicas)."""
    config = write_config(tmp_path)
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    training = next(s for s in plan["stages"] if s["model_stage"] == "actor/training")
    training.update(choice)
    plan.pop("predictions", None)
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    result = invoke("run", config, "--out", tmp_path / "out")
    assert result.exit_code == 1 and "Traceback" not in result.output
    line = one_error_line(result)
    assert "actor/training" in line and "needs full_shard over dp x cp > 1" in line and pin in line
    assert not (tmp_path / "out").exists()


def test_a_kv_budget_below_one_sequence_is_refused_with_the_bytes_needed(tmp_path: Path) -> None:
    """16 + 50 tokens take 33,792 bytes (512 per token at tp=2), which the cost model's check
    passes; the engine's blocks of 16 tokens round them up to 80 tokens, 40,960 bytes."""
    config = write_config(tmp_path)
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    plan["workload"]["response_len"]["max"] = 50
    generation = next(s for s in plan["stages"] if s["model_stage"] == "actor/generation")
    generation["kv_budget_bytes"] = 36_000
    plan.pop("predictions", None)
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    line = one_error_line(invoke("run", config, "--out", tmp_path / "out"))
    assert "actor/generation: kv_budget_bytes 36000 cannot hold one sequence of the plan's maximum length" in line
    assert "(16 + 50 tokens): it needs 40960 bytes per GPU; raise kv_budget_bytes to at least 40960" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("sampling", "field"), [({"top_p": 1.5}, "top_p"), ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k")]
)
def test_sampling_settings_out_of_range_are_one_line(tmp_path: Path, sampling: dict, field: str) -> None:
    config = write_config(tmp_path, rl={"task": "sort", "seed": 3, "max_new_tokens": 6, **sampling})
    line = one_error_line(invoke("run", config, "--out", tmp_path / "out"))
    assert field in line
    assert not (tmp_path / "out").exists()

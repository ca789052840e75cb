"""`nereus fit`: least squares on run directories, held-out error by plan, and its errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from cli_helpers import invoke, one_error_line
from repo_paths import EXAMPLES

from nereus.cost.calibration import Calibration
from nereus.cost.fit import STEP_KEY, fit_runs, held_out_errors, measured_plan, predict, read_run, run_errors
from nereus.spec.io import load_document, save_document
from nereus.spec.plan import Plan

pytestmark = pytest.mark.logic

EXAMPLES = EXAMPLES
TRUE = Calibration(
    gemm=0.25,
    attention=0.3,
    launch_overhead_s=3e-4,
    micro_batch_overhead_s=5e-4,
    stage_overhead_s=1e-3,
    link_latency_scale=2.0,
)
PLANS = ("plan-tiny-ppo-4rank.yaml", "plan-tiny-ppo-4rank-relaid.yaml")


def write_run(folder: Path, plan: Plan, sizes: list[tuple[int, int]], noise: float, seed: int) -> Path:
    """A run directory whose metrics the cost model under TRUE would produce, with noise."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    save_document(plan, folder / "plan.yaml")
    (folder / "config.yaml").write_text("kind: RunConfig\nversion: 1\n")
    lines = []
    for step, (prompt_len, response_len) in enumerate(sizes):
        # Warm-up steps are slow: the fit must drop them.
        slow = 5.0 if step < 2 else 1.0
        times = {
            k: v * slow * (1 + rng.gauss(0, noise))
            for k, v in predict(measured_plan(plan, prompt_len, response_len), TRUE).items()
        }
        step_seconds = times.pop(STEP_KEY) + 0.01
        record = {
            "step": step,
            "reward": 0.0,
            "kl": 0.0,
            "response_len_mean": response_len / 2,
            "response_len_max": response_len,
            "prompt_len": prompt_len,
            "actor_loss": 0.0,
            "critic_loss": 0.0,
            "step_seconds": step_seconds,
            "stage_seconds": {**times, "advantages": 0.01},
            "state_bytes_per_rank": [1, 1, 1, 1],
        }
        lines.append(json.dumps(record))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("runs")
    out = []
    for i, name in enumerate(PLANS):
        plan = load_document(EXAMPLES / name)
        assert isinstance(plan, Plan)
        for j, sizes in enumerate(([(16, 8), (16, 24)] * 3, [(20, 40), (16, 12)] * 3)):
            out.append(write_run(root / f"{i}-{j}", plan, sizes, noise=0.01, seed=10 * i + j))
    return out


def test_fit_recovers_the_step_times_and_drops_warm_up(run_dirs: list[Path]) -> None:
    runs = [read_run(d) for d in run_dirs]
    assert all(len(run.steps) == 4 and run.steps[0].step == 2 for run in runs)
    assert run_errors(runs, Calibration()).step_mape > 0.5  # the defaults are far off
    calibration, fitted = fit_runs(runs, Calibration())
    assert {"gemm", "launch_overhead_s", "micro_batch_overhead_s", "link_latency_scale"} <= set(fitted)
    assert "collective_inter" not in fitted  # one node: nothing crosses nodes, the prior stays
    assert calibration.collective_inter == Calibration().collective_inter
    report = run_errors(runs, calibration)
    assert report.step_mape < 0.02
    assert report.mape("actor/generation") < 0.05


@pytest.mark.parametrize("concurrent", [True, False])
def test_fit_prices_pools_as_the_start_says_never_as_fits_best(run_dirs: list[Path], concurrent: bool) -> None:
    """Whether pools of a phase overlap is how the runtime runs them, not a fitted knob: a fit
    on few split plans used to pick serial pools and over-price every split plan."""
    runs = [read_run(d) for d in run_dirs]
    calibration, _ = fit_runs(runs, Calibration(concurrent_pools=concurrent))
    assert calibration.concurrent_pools is concurrent


def test_held_out_error_never_trains_on_the_tested_plan(run_dirs: list[Path]) -> None:
    runs = [read_run(d) for d in run_dirs]
    assert len({run.plan_key for run in runs}) == 2
    report = held_out_errors(runs, Calibration())
    assert report is not None and len(report.runs) == len(runs)
    assert report.step_mape < 0.05
    assert held_out_errors(runs[:2], Calibration()) is None  # one plan: nothing to hold out


def test_fit_cli_writes_what_plan_calibration_reads(run_dirs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "calibration.yaml"
    result = invoke("fit", *run_dirs, "-o", out, "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["held_out"]["step_mape"] < 0.05
    assert set(payload["held_out"]["model_stage_mape"]) >= {"actor/generation", "critic/training"}
    calibration = load_document(out)
    assert isinstance(calibration, Calibration)
    assert calibration.gemm == pytest.approx(payload["calibration"]["gemm"])
    planned = invoke("plan", "--cluster", "h100", "--gpus", "16", "--calibration", out, "--json")
    assert planned.exit_code == 0, planned.output
    table = invoke("fit", *run_dirs[:2], "-o", tmp_path / "one-plan.yaml")
    assert table.exit_code == 0, table.output
    assert "held-out error needs runs of at least two different plans" in table.stdout


def test_fit_errors_name_the_file_and_the_fix(run_dirs: list[Path], tmp_path: Path) -> None:
    assert "not a directory" in one_error_line(invoke("fit", tmp_path / "nope", "-o", tmp_path / "c.yaml"))
    broken = tmp_path / "broken"
    broken.mkdir()
    save_document(load_document(run_dirs[0] / "plan.yaml"), broken / "plan.yaml")
    (broken / "metrics.jsonl").write_text('{"step": 0, "step_seconds": 1.0}\n')
    line = one_error_line(invoke("fit", broken, "-o", tmp_path / "c.yaml"))
    assert "metrics.jsonl: line 1: missing key 'stage_seconds'" in line
    short = tmp_path / "short"
    short.mkdir()
    save_document(load_document(run_dirs[0] / "plan.yaml"), short / "plan.yaml")
    (short / "metrics.jsonl").write_text((run_dirs[0] / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    assert "none after the 2 warm-up steps" in one_error_line(invoke("fit", short, "-o", tmp_path / "c.yaml"))
    assert not (tmp_path / "c.yaml").exists()

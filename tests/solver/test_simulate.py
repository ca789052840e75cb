"""The trace simulator and `nereus simulate` (in-process CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import invoke

from nereus.errors import NereusError
from nereus.solver.plan_search import PlanRequest
from nereus.solver.planner import make_plan
from nereus.solver.policy import Replanner, make_policy, record_from_data, replay
from nereus.solver.simulate import simulate
from nereus.solver.traces import DEFAULT_SHAPE, GrowthConfig, SpotConfig, combined_trace, scaled_lengths, spot_trace
from nereus.spec.io import load_document, save_document
from nereus.spec.plan import Plan
from nereus.spec.presets import cluster_preset, model_preset, workload_preset

pytestmark = pytest.mark.logic

GPUS = 16
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plan() -> Plan:
    workload = workload_preset("ppo").model_copy(update={"response_len": scaled_lengths(DEFAULT_SHAPE, 500)})
    request = PlanRequest(cluster_preset("h100", GPUS), (model_preset("llama-3.1-8b"),), workload, GPUS)
    return make_plan(request).best


@pytest.fixture(scope="module")
def files(plan: Plan, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("sim")
    trace = combined_trace(60, GPUS, GrowthConfig(every_steps=5, end_tokens=2000), SpotConfig(num_changes=11), seed=1)
    save_document(plan, folder / "plan.yaml")
    save_document(trace, folder / "trace.yaml")
    return folder / "plan.yaml", folder / "trace.yaml"


def test_totals_add_up_and_progress_is_reported(plan: Plan) -> None:
    trace = combined_trace(120, GPUS, GrowthConfig(every_steps=5), SpotConfig(num_changes=11), seed=1)
    seen: list[tuple[int, int]] = []
    result = simulate(trace, make_policy("nereus", plan), progress=lambda d, t: seen.append((d, t)))
    assert seen[0] == (1, 120) and seen[-1] == (120, 120) and len(seen) == 120
    assert len(result.steps) == 120 and len(result.log) == 120
    adaptation = sum(r.adaptation_s for r in result.steps)
    assert adaptation == pytest.approx(result.transition_time_s + result.restart_time_s)
    assert result.total_time_s == pytest.approx(result.step_time_s + adaptation)
    ran = 120 - result.num_stalled
    assert result.mean_step_latency_s == pytest.approx(result.total_time_s / ran)
    assert 0 <= result.transition_share < 1
    assert result.num_transitions + result.num_restarts >= 1


def test_noise_is_seeded(plan: Plan) -> None:
    trace = spot_trace(60, GPUS, 1000, SpotConfig(num_changes=11), seed=0)
    replanner = Replanner(plan)

    def run(noise: float, seed: int) -> list[float | None]:
        result = simulate(trace, make_policy("fixed", plan, replanner), noise=noise, seed=seed)
        return [r.latency_s for r in result.steps]

    assert run(0.1, 3) == run(0.1, 3)
    assert run(0.1, 3) != run(0.1, 4) != run(0.0, 0)
    with pytest.raises(ValueError, match="noise"):
        run(-1.0, 0)


def test_trace_must_fit_the_plan(plan: Plan) -> None:
    too_big = spot_trace(30, 32, 1000, SpotConfig(num_changes=11, block_gpus=8), seed=0)
    with pytest.raises(NereusError, match="cluster has 16"):
        simulate(too_big, make_policy("nereus", plan))
    too_small = spot_trace(30, 8, 1000, SpotConfig(num_changes=3, block_gpus=4, min_gpus=4), seed=0)
    with pytest.raises(NereusError, match="starts with 8 GPUs"):
        simulate(too_small, make_policy("nereus", plan))


@pytest.mark.slow  # about 25 s on one core (four policies over the whole trace): kept out of the fast loop, run by CI
def test_cli_compare_json_plot_and_log(files: tuple[Path, Path], tmp_path: Path) -> None:
    plan_file, trace_file = files
    png, log = tmp_path / "sim.png", tmp_path / "log.json"
    result = invoke("simulate", trace_file, "--plan", plan_file, "--compare", "--json", "--plot", png, "--log", log)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["simulator"].startswith("cost-model simulation")
    assert [r["policy"] for r in payload["results"]] == ["nereus", "fixed", "dynarl", "periodic:3"]
    for row in payload["results"]:
        assert row["steps"] == 60 and row["num_transitions"] == sum(
            d["action"] == "transition" for d in row["decisions"]
        )
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    logged = json.loads(log.read_text())
    plan = load_document(plan_file)
    assert isinstance(plan, Plan)
    records = [record_from_data(item) for item in logged["dynarl"]]
    assert replay(records, lambda: make_policy("dynarl", plan)) == []


def test_cli_table_for_one_policy(files: tuple[Path, Path]) -> None:
    plan_file, trace_file = files
    result = invoke("simulate", trace_file, "--plan", plan_file, "--policy", "periodic:5")
    assert result.exit_code == 0, result.output
    assert "periodic:5" in result.stdout and "simulator" in result.stdout


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (("--policy", "greedy"), "--policy: unknown policy 'greedy'"),
        (("--plot", "nowhere/x.png"), "--plot nowhere/x.png: folder nowhere does not exist"),
        (("--plot", "x.gif"), "unknown image type '.gif'"),
    ],
)
def test_cli_errors_are_one_line(files: tuple[Path, Path], extra: tuple[str, ...], fragment: str) -> None:
    plan_file, trace_file = files
    result = invoke("simulate", trace_file, "--plan", plan_file, *extra)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr


def test_cli_wrong_kind(files: tuple[Path, Path]) -> None:
    plan_file, _ = files
    result = invoke("simulate", plan_file, "--plan", plan_file)
    assert result.exit_code == 1 and "expected Trace, got Plan" in result.stderr

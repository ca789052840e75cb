"""`nereus report DIR` and the run's Perfetto trace, on small synthetic run folders whose
numbers are worked out by hand below."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import invoke, one_error_line
from repo_paths import EXAMPLES

from nereus.render.run_report import summarise_run
from nereus.render.run_timeline import stage_layout, write_run_trace

pytestmark = pytest.mark.cli

EXAMPLE_PLAN = EXAMPLES / "plan-tiny-ppo-4rank.yaml"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0
US = 1e6
CONFIG = "kind: RunConfig\nversion: 1\nplan: plan.yaml\nrl: {reward: rule}\n"

# Three steps; a live transition (measured 1.0 s, predicted 0.8 s, 2 primitives) runs before step 1.
STEPS: list[dict[str, Any]] = [
    # The rule-scored reward (config `reward: rule`) takes 0.3 ms; the cost model predicts a model's 30 ms.
    {"step": 0, "reward": 0.1, "step_seconds": 2.0,
     "stage_seconds": {"actor/generation": 1.0, "reward/inference": 0.0003, "actor/training": 0.5, "exchange": 0.25},
     "predicted_step_seconds": 1.5,
     "predicted_stage_seconds": {"actor/generation": 0.8, "reward/inference": 0.03, "actor/training": 0.5},
     "plan_index": 0},
    {"step": 1, "reward": 0.2, "step_seconds": 3.0,
     "stage_seconds": {"actor/generation": 2.0, "actor/training": 0.5, "exchange": 0.25, "transition": 1.0},
     "predicted_step_seconds": 2.0, "predicted_stage_seconds": {"actor/generation": 1.0, "actor/training": 1.0},
     "plan_index": 1},
    # Predictions absent (a run from before they were logged): no error terms, no predicted spans.
    {"step": 2, "reward": 0.6, "step_seconds": 4.0,
     "stage_seconds": {"actor/generation": 2.0, "actor/training": 1.0, "exchange": 0.5}},
]  # fmt: skip

DECISIONS = [
    {"observation": {"step": 0}, "decision": {"step": 0, "action": "keep", "transition_cost_s": None}},
    {"observation": {"step": 1}, "decision": {"step": 1, "action": "transition", "transition_cost_s": 0.7}},
    {"observation": {"step": 2}, "decision": {"step": 2, "action": "transition", "transition_cost_s": 0.5},
     "runtime": "runtime refused the target plan: ..."},
]  # fmt: skip


def rank_spans(rank: int) -> list[dict[str, Any]]:
    """Rank 1 runs everything 10 ms after rank 0; rank 1 alone has a span of a kind the trace writer does not know."""
    lag = 0.01 * rank

    def span(step: int, cat: str, name: str, start: float, end: float, **args: Any) -> dict[str, Any]:
        return {"rank": rank, "step": step, "cat": cat, "name": name, "start": T0 + start + lag,
                "end": T0 + end + lag, "args": args}  # fmt: skip

    spans = [
        span(0, "stage", "actor/generation", 0.0, 1.0),
        span(0, "stage", "actor/training", 1.2, 1.7),
        span(0, "phase", "exchange", 1.7, 1.95),
        span(1, "transition", "transition", 2.0, 3.0, predicted_s=0.8, num_primitives=2),
        span(1, "transition", "build engines and groups", 2.0, 2.05),  # nested: same track
        # Two primitives that overlap without nesting: two lanes.
        span(1, "primitive", "split p0", 2.1, 2.5, id="p0", kind="split", model_stage="actor/training",
             predicted_start_s=0.0, predicted_end_s=0.3, bytes_sent=10, bytes_received=20),
        span(1, "primitive", "merge p1", 2.2, 2.9, id="p1", kind="merge", model_stage="actor/generation",
             predicted_start_s=0.3, predicted_end_s=0.8, bytes_sent=5, bytes_received=5),
        span(1, "stage", "actor/generation", 3.0, 5.0),
        span(1, "stage", "actor/training", 5.0, 5.5),
        span(2, "stage", "actor/generation", 6.0, 8.0),
        span(2, "stage", "actor/training", 8.0, 9.0),
        span(2, "checkpoint", "step-000003", 9.5, 9.8),
    ]  # fmt: skip
    if rank == 0:
        spans.append(span(1, "controller", "decide", 1.96, 1.99))
    if rank == 1:  # predicted beside p0 (same offsets), measured after it
        spans.append(span(1, "primitive", "extend p2", 2.51, 2.6, id="p2", kind="extend",
                          model_stage="reference/inference", predicted_start_s=0.0, predicted_end_s=0.3))  # fmt: skip
    if rank == 1:
        spans.append(span(2, "fused", "actor fwd mb0", 8.1, 8.2, replica=0))
    return spans


def write_lines(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture()
def run_folder(tmp_path: Path) -> Path:
    """plan.yaml has pool `all`; the checkpoint after step 2 (plan 1 in force) calls it `everything`."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml").write_text(CONFIG)
    plan_text = EXAMPLE_PLAN.read_text()
    (folder / "plan.yaml").write_text(plan_text)
    checkpoint = folder / "checkpoints" / "step-000002"
    checkpoint.mkdir(parents=True)
    renamed = plan_text.replace("name: all", "name: everything").replace("pool: all", "pool: everything")
    (checkpoint / "plan.yaml").write_text(renamed)
    write_lines(folder / "metrics.jsonl", STEPS)
    write_lines(folder / "decisions.jsonl", DECISIONS)
    for rank in (0, 1):
        write_lines(folder / "timeline" / f"rank-{rank}.jsonl", rank_spans(rank))
    return folder


def test_report_numbers_equal_hand_computed(run_folder: Path) -> None:
    report = summarise_run(run_folder)
    assert report.num_steps == 3
    assert report.mean_step_s == pytest.approx(3.0) and report.median_step_s == pytest.approx(3.0)
    assert report.run_s == pytest.approx(2.0 + 3.0 + 4.0 + 1.0)
    means = {stage.name: (stage.mean_s, stage.share) for stage in report.stages}
    # The transition is not part of a step.
    assert list(means) == ["actor/generation", "reward/inference", "actor/training", "exchange"]
    assert means["actor/generation"] == pytest.approx((5 / 3, 5 / 9))
    assert means["reward/inference"] == pytest.approx((0.0001, 0.0001 / 3))
    assert means["actor/training"] == pytest.approx((2 / 3, 2 / 9))
    assert means["exchange"] == pytest.approx((1 / 3, 1 / 9))
    assert report.other_s == pytest.approx(3.0 - 8 / 3 - 0.0001)
    assert report.transition_s == pytest.approx(1.0) and report.transition_share == pytest.approx(0.1)
    [move] = report.transitions
    assert (move.step, move.action, move.num_primitives) == (1, "transition", 2)
    assert move.measured_s == pytest.approx(1.0) and move.predicted_s == pytest.approx(0.7)  # the decision's
    errors = {e.name: e for e in report.prediction_errors}
    assert list(errors) == ["actor/generation", "actor/training", "step"]
    assert report.not_compared == ["reward/inference"]
    assert errors["actor/generation"].mape_percent == pytest.approx(100 * (0.2 + 0.5) / 2)
    assert errors["actor/training"].mape_percent == pytest.approx(100 * (0.0 + 1.0) / 2)
    assert errors["step"].mape_percent == pytest.approx(100 * (0.25 + 1 / 3) / 2)
    assert errors["step"].num_steps == 2 and errors["step"].mean_predicted_s == pytest.approx(1.75)
    assert report.reward_first == pytest.approx(0.3) and report.reward_last == pytest.approx(0.3)
    assert report.decisions == {"keep": 1, "transition": 2} and report.num_refused == 1
    assert report.num_spans == 2 * 12 + 3  # 12 on each rank; a controller span, an extend, a fused op


def test_a_reward_model_is_compared(run_folder: Path) -> None:
    (run_folder / "config.yaml").write_text(CONFIG.replace("reward: rule", "reward: model"))
    report = summarise_run(run_folder)
    errors = {e.name: e for e in report.prediction_errors}
    assert report.not_compared == [] and errors["reward/inference"].num_steps == 1
    assert errors["reward/inference"].mape_percent == pytest.approx(100 * (0.03 - 0.0003) / 0.0003)


def test_from_step_leaves_the_warm_up_out(run_folder: Path) -> None:
    report = summarise_run(run_folder, first_step=1)
    assert (report.first_step, report.num_steps, report.mean_step_s) == (1, 2, pytest.approx(3.5))
    assert report.run_s == pytest.approx(3.0 + 4.0 + 1.0) and len(report.transitions) == 1
    errors = {e.name: e.mape_percent for e in report.prediction_errors}
    assert errors == {"actor/generation": pytest.approx(50.0), "actor/training": pytest.approx(100.0),
                      "step": pytest.approx(100 / 3)}  # fmt: skip
    assert report.decisions == {"transition": 2} and report.reward_first == pytest.approx(0.4)
    result = invoke("report", run_folder, "--from-step", "5")
    assert "--from-step 5: " in one_error_line(result) and "has steps 0-2" in result.stderr


def test_rewards_average_the_first_and_last_ten_steps(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(CONFIG)
    steps = [{"step": s, "reward": float(s), "step_seconds": 1.0, "stage_seconds": {}} for s in range(12)]
    write_lines(tmp_path / "metrics.jsonl", steps)
    report = summarise_run(tmp_path)
    assert (report.reward_first, report.reward_last) == (pytest.approx(4.5), pytest.approx(6.5))
    assert report.prediction_errors == [] and report.transitions == [] and report.num_spans == 0
    assert "mean reward: first 10 steps 4.500, last 10 6.500" in invoke("report", tmp_path).stdout


def test_transition_prediction_without_a_decision_or_a_timeline(run_folder: Path) -> None:
    (run_folder / "decisions.jsonl").unlink()  # a configured plan switch: the DAG's makespan
    [move] = summarise_run(run_folder).transitions
    assert move.predicted_s == pytest.approx(0.8) and move.num_primitives == 2
    for path in (run_folder / "timeline").iterdir():
        path.unlink()
    [move] = summarise_run(run_folder).transitions
    assert move.predicted_s is None and move.num_primitives is None


def events_by_process(payload: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    names = {e["pid"]: e["args"]["name"] for e in payload["traceEvents"] if e.get("name") == "process_name"}
    grouped: dict[str, list[dict[str, Any]]] = {name: [] for name in names.values()}
    for event in payload["traceEvents"]:
        grouped[names[event["pid"]]].append(event)
    return grouped


def track_names(events: list[dict[str, Any]]) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}


def assert_stacked(intervals: list[tuple[float, float]], nest: bool) -> None:
    """Spans on one track follow one another or (with `nest`) lie inside one another."""
    open_ends: list[float] = []
    for start, end in sorted(intervals, key=lambda i: (i[0], -i[1])):
        while open_ends and open_ends[-1] <= start + 1e-3:
            open_ends.pop()
        assert not open_ends or (nest and end <= open_ends[-1] + 1e-3), (start, end)
        open_ends.append(end)


def test_trace_has_every_rank_span_on_its_tracks(run_folder: Path) -> None:
    path = write_run_trace(run_folder)
    assert path == run_folder / "timeline.json"
    processes = events_by_process(json.loads(path.read_text()))
    assert set(processes) == {"predicted (cost model)", "rank 0", "rank 1"}
    for rank in (0, 1):
        events = processes[f"rank {rank}"]
        spans = [e for e in events if e["ph"] == "X"]
        assert len(spans) == len(rank_spans(rank))
        tracks = track_names(events)
        expected = ["model-stages", "phases", "transitions", "primitives", "primitives 2", "checkpoints"]
        expected += ["controller"] if rank == 0 else ["fused"]
        assert [tracks[tid] for tid in sorted(tracks)] == expected
        lag_us = 0.01 * rank * US
        generation = [e for e in spans if e["name"] == "actor/generation"]
        assert [e["ts"] for e in generation] == pytest.approx([lag_us, 3 * US + lag_us, 6 * US + lag_us])
        assert generation[0]["dur"] == pytest.approx(US) and generation[0]["args"] == {"step": 0}
        for tid, track in tracks.items():
            assert_stacked([(e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == tid], track == "transitions")


def test_trace_lays_predicted_spans_beside_the_measured_ones(run_folder: Path) -> None:
    out = run_folder.parent / "elsewhere.json"
    assert write_run_trace(run_folder, out) == out and not (run_folder / "timeline.json").exists()
    events = events_by_process(json.loads(out.read_text()))["predicted (cost model)"]
    predicted = [e for e in events if e["ph"] == "X"]
    got = sorted((e["cat"], e["name"], round(e["ts"]), round(e["dur"])) for e in predicted)
    assert got == sorted([
        ("step", "step 0", 0, 1_500_000),
        ("stage", "actor/generation", 0, 800_000),
        ("stage", "reward/inference", 800_000, 30_000),  # inference after generation
        ("stage", "actor/training", 830_000, 500_000),  # training after inference
        ("step", "step 1", 3_000_000, 2_000_000),
        ("stage", "actor/generation", 3_000_000, 1_000_000),
        ("stage", "actor/training", 4_000_000, 1_000_000),
        ("transition", "transition", 2_000_000, 700_000),  # the decision's cost
        ("primitive", "split p0", 2_000_000, 300_000),  # once, not once per rank
        ("primitive", "merge p1", 2_300_000, 500_000),  # the DAG's offsets
        ("primitive", "extend p2", 2_000_000, 300_000),
    ])  # fmt: skip
    tracks = track_names(events)
    assert sorted(tracks.values()) == ["model-stages", "primitives", "primitives 2", "steps", "transitions"]
    for tid in tracks:  # concurrent primitives side by side, not nested
        assert_stacked([(e["ts"], e["ts"] + e["dur"]) for e in predicted if e["tid"] == tid], nest=False)
    pools = {e["args"]["step"]: e["args"]["pool"] for e in predicted if e["cat"] == "stage"}
    assert pools == {0: "all", 1: "everything"}  # each step under the plan then in force


def test_stage_layout_runs_pools_side_by_side_within_a_phase() -> None:
    predicted = {"actor/generation": 1.0, "actor/inference": 0.5, "reference/inference": 0.25,
                 "critic/inference": 0.4, "actor/training": 2.0}  # fmt: skip
    pools = {"actor/generation": "a", "actor/inference": "a", "reference/inference": "b",
             "critic/inference": "b", "actor/training": "a"}  # fmt: skip
    starts = {name: begin for name, _, begin in stage_layout(predicted, pools, 10.0)}
    assert starts == pytest.approx({"actor/generation": 10.0, "actor/inference": 11.0,
                                    "reference/inference": 11.0, "critic/inference": 11.25,
                                    "actor/training": 11.65})  # fmt: skip
    unknown = {name: begin for name, _, begin in stage_layout(predicted, {}, 0.0)}
    assert unknown["critic/inference"] == pytest.approx(1.75)  # no plan: one after another


def test_report_command_prints_tables_json_png_and_trace(run_folder: Path, tmp_path: Path) -> None:
    result = invoke("report", run_folder)
    assert result.exit_code == 0, result.output
    for text in ("3 steps in 10.00 s", "actor/generation", "55.6%", "transitions: 1, 1.00 s, 10.0% of run time",
                 "35.0%", "keep 1, transition 2 (1 refused by the runtime)",
                 "mean reward: 0.300 over the 3 steps"):  # fmt: skip
        assert text in result.stdout, text
    png, trace = tmp_path / "report.png", tmp_path / "trace.json"
    result = invoke("report", run_folder, "--json", "--png", png, "--perfetto", trace)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["transition_share"] == pytest.approx(0.1) and payload["transitions"][0]["predicted_s"] == 0.7
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    assert json.loads(trace.read_text())["traceEvents"]


def corrupt(path: Path, line: int, text: str) -> None:
    lines = path.read_text().splitlines()
    lines[line - 1] = text
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda f: (f / "metrics.jsonl").write_text(""), "metrics.jsonl: no finished step recorded yet"),
        (lambda f: corrupt(f / "metrics.jsonl", 2, '{"step": 1, "rew'), "metrics.jsonl: line 2: not JSON"),
        (lambda f: corrupt(f / "metrics.jsonl", 3, '{"step": 2, "reward": 1}'),
         "metrics.jsonl: line 3: missing field 'step_seconds'"),
        (lambda f: corrupt(f / "metrics.jsonl", 1, json.dumps({**STEPS[0], "step_seconds": "fast"})),
         "metrics.jsonl: line 1: step_seconds: expected a finite number, got 'fast'"),
        (lambda f: corrupt(f / "timeline" / "rank-1.jsonl", 4, "[1, 2]"),
         "rank-1.jsonl: line 4: expected a JSON object, got list"),
        (lambda f: corrupt(f / "decisions.jsonl", 2, '{"decision": {"step": 1}}'),
         "decisions.jsonl: line 2: missing field 'decision.action'"),
        (lambda f: (f / "config.yaml").unlink(), "not a run folder (config.yaml missing)"),
        (lambda f: (f / "config.yaml").write_text(EXAMPLE_PLAN.read_text()), "kind: expected RunConfig, got Plan"),
    ],
)  # fmt: skip
def test_bad_folders_are_one_line_errors(run_folder: Path, damage: Any, expected: str) -> None:
    damage(run_folder)
    assert expected in one_error_line(invoke("report", run_folder))


def test_bad_outputs_and_missing_folders_are_one_line_errors(run_folder: Path, tmp_path: Path) -> None:
    assert "no such folder" in one_error_line(invoke("report", tmp_path / "nowhere"))
    assert "expected a .png file name" in one_error_line(invoke("report", run_folder, "--png", tmp_path / "a.svg"))
    missing = tmp_path / "no" / "trace.json"
    assert "does not exist; create it first" in one_error_line(invoke("report", run_folder, "--perfetto", missing))
    for path in (run_folder / "timeline").iterdir():
        path.unlink()
    trace = tmp_path / "trace.json"
    assert "no span recorded" in one_error_line(invoke("report", run_folder, "--perfetto", trace))
    assert not trace.exists()


def test_report_and_trace_do_not_import_torch(run_folder: Path) -> None:
    """A fresh interpreter: `nereus report` (with --perfetto) reads a run without torch."""
    script = (
        "import sys\nfrom nereus.cli.app import app\n"
        f"app(['report', {str(run_folder)!r}, '--perfetto', {str(run_folder / 't.json')!r}], standalone_mode=False)\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "NO-TORCH"
    assert (run_folder / "t.json").is_file()

"""`nereus schedule fuse` / `migrate` end to end (typer's CliRunner), and the Schedule file check."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from cli_helpers import invoke, one_error_line
from repo_paths import EXAMPLES

pytestmark = pytest.mark.cli

EXAMPLE = EXAMPLES / "plan-tiny-ppo-4rank.yaml"
EXPLICIT = ["--stages", "4,2", "--microbatches", "4,4", "--fwd", "5,4", "--bwd", "10,8", "--act", "1.95,2"]
QUICK = ["--time-limit", "0.3", "--seeds", "1"]
OP_KEYS = {"model", "replica", "microbatch", "stage", "kind", "start", "end"}


@pytest.fixture(scope="module")
def schedule_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("schedule") / "fused.yaml"
    result = invoke("schedule", "fuse", *EXPLICIT, *QUICK, "-o", path)
    assert result.exit_code == 0, result.output
    return path


def test_fuse_explicit_summary() -> None:
    result = invoke("schedule", "fuse", *EXPLICIT, *QUICK)
    assert result.exit_code == 0, result.output
    out = result.stdout
    for words in ("makespan:", "lower bound", "peak activation:", "memory bound", "vs serial 1F1B", "search:"):
        assert words in out


def test_fuse_json_has_per_node_ops_that_recheck() -> None:
    result = invoke("schedule", "fuse", *EXPLICIT, *QUICK, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kind"] == "Schedule" and len(data["nodes"]) == 4
    ends: dict[tuple[str, int, int, int, str], float] = {}
    for node in data["nodes"]:
        previous_end = 0.0
        for op in node["ops"]:
            assert set(op) == OP_KEYS and op["kind"] in ("F", "B")
            assert op["start"] >= previous_end - 1e-9  # a node runs one op at a time, in order
            previous_end = op["end"]
            ends[(op["model"], op["replica"], op["microbatch"], op["stage"], op["kind"])] = op["end"]
    # Re-check the forward chain by hand: F(stage s) starts after F(stage s - 1) ends.
    for node in data["nodes"]:
        for op in node["ops"]:
            if op["kind"] == "F" and op["stage"] > 0:
                prior = ends[(op["model"], op["replica"], op["microbatch"], op["stage"] - 1, "F")]
                assert op["start"] >= prior - 1e-9
    summary = data["summary"]
    assert summary["makespan"] == pytest.approx(max(ends.values()))
    assert summary["lower_bound"] <= summary["makespan"] <= summary["serial_1f1b_makespan"]
    assert summary["speedup_vs_serial"] == pytest.approx(summary["serial_1f1b_makespan"] / summary["makespan"])


def test_written_schedule_checks_and_a_broken_one_fails(schedule_file: Path, tmp_path: Path) -> None:
    assert invoke("check", schedule_file).exit_code == 0
    data = yaml.safe_load(schedule_file.read_text())
    # Start one stage-1 forward before its stage-0 forward ends: a dependency violation.
    for node in data["nodes"]:
        for op in node["ops"]:
            if op["model"] == "actor" and op["stage"] == 1 and op["kind"] == "F":
                op["start"] -= 1.0
                op["end"] -= 1.0
                break
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(data, sort_keys=False))
    result = invoke("check", broken)
    assert result.exit_code == 1
    assert "dependency violated" in result.stdout
    # Swap the node lists of two nodes: ops on the wrong node.
    data = yaml.safe_load(schedule_file.read_text())
    data["nodes"][0]["ops"], data["nodes"][1]["ops"] = data["nodes"][1]["ops"], data["nodes"][0]["ops"]
    broken.write_text(yaml.safe_dump(data, sort_keys=False))
    result = invoke("check", broken)
    assert result.exit_code == 1 and "listed on node" in result.stdout


def test_deadlocked_order_fails_check(schedule_file: Path, tmp_path: Path) -> None:
    data = yaml.safe_load(schedule_file.read_text())
    ops = data["nodes"][0]["ops"]
    data["nodes"][0]["ops"] = sorted(ops, key=lambda op: op["kind"] != "B")  # backwards before any forward
    path = tmp_path / "deadlock.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = invoke("check", path)
    assert result.exit_code == 1 and "deadlock" in result.stdout


def test_gantt_png_svg_and_perfetto(tmp_path: Path) -> None:
    png, svg, trace = tmp_path / "s.png", tmp_path / "s.svg", tmp_path / "s.json"
    assert invoke("schedule", "fuse", *EXPLICIT, *QUICK, "--gantt", png, "--perfetto", trace).exit_code == 0
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 2 * 4 * 4 + 2 * 2 * 4
    assert invoke("schedule", "fuse", *EXPLICIT, *QUICK, "--gantt", svg).exit_code == 0
    assert b"<svg" in svg.read_bytes()[:2000]


def test_plan_form_and_exact(tmp_path: Path) -> None:
    pytest.importorskip("ortools")
    out = tmp_path / "plan-schedule.json"
    result = invoke("schedule", "fuse", "--plan", EXAMPLE, *QUICK, "--exact", "--exact-time-limit", "5", "-o", out)
    assert result.exit_code == 0, result.output
    assert "exact CP-SAT: optimal" in result.stdout
    data = json.loads(out.read_text())
    assert data["time_unit"] == "s" and data["memory_unit"] == "GiB"
    assert data["summary"]["exact"]["status"] == "optimal"
    assert data["summary"]["makespan"] >= data["summary"]["exact"]["makespan"] - 1e-12
    # CP-SAT's least peak at the heuristic's makespan: never above the heuristic's peak, never
    # below the memory lower bound at that makespan, and printed.
    lean, summary = data["summary"]["exact_memory"], data["summary"]
    assert lean["status"] in ("optimal", "feasible") and "exact CP-SAT memory at this makespan" in result.stdout
    assert summary["memory_lower_bound"] <= lean["peak_memory"] + 1e-9 <= summary["peak_memory"] + 2e-9
    assert f"lower bound at this makespan {summary['memory_lower_bound']:.4g}" in result.stdout
    assert invoke("check", out).exit_code == 0


def test_act_cap_trades_makespan_for_memory() -> None:
    """8 micro-batches: the fastest schedule holds about twice the memory bound; under a cap of
    the bound the search returns a slower schedule that fits."""
    args = [*EXPLICIT[:2], "--microbatches", "8,8", *EXPLICIT[4:], *QUICK, "--json"]
    free = json.loads(invoke("schedule", "fuse", *args).stdout)["summary"]
    cap = free["memory_bound"]
    assert free["peak_memory"] > cap
    capped = json.loads(invoke("schedule", "fuse", *args, "--act-cap", str(cap)).stdout)["summary"]
    assert capped["peak_memory"] <= cap + 1e-9
    assert free["makespan"] < capped["makespan"] < capped["serial_1f1b_makespan"]
    for lean in free["lean_alternatives"]:  # the trade-off reported: leaner, slower
        assert lean["peak_memory"] < free["peak_memory"] and lean["makespan"] > free["makespan"]


def test_fuse_prints_the_leaner_alternatives(capsys: pytest.CaptureFixture[str]) -> None:
    """A front-loaded schedule (iteration budget: deterministic) prints one line per leaner
    alternative: its peak, makespan cost and the cap that finds it."""
    from nereus.cli.schedule_commands import _print_fuse
    from nereus.solver.pipeline.document import to_document
    from nereus.solver.pipeline.model import ModelTimes
    from nereus.solver.pipeline.search import SearchConfig, search_fused

    actor = ModelTimes.uniform("actor", 4, 16, 6.6, 13.3, 10.0)
    critic = ModelTimes.uniform("critic", 4, 16, 2.6, 5.2, 5.1)
    document = to_document(search_fused(actor, critic, SearchConfig(time_limit_s=60, seeds=1, max_iterations=300)))
    _print_fuse(document, "rule", [])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("leaner: ")]
    assert len(lines) == len(document.summary.lean_alternatives) > 0
    for line, lean in zip(lines, document.summary.lean_alternatives, strict=True):
        assert f"peak {lean.peak_memory:.4g}" in line and f"--act-cap {lean.activation_cap:.4g}" in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stages", "4"], "--stages: expected two values"),
        (["--stages", "4,x"], "--stages: expected two int values"),
        (["--stages", "4,2", "--microbatches", "4,4"], "missing --fwd, --bwd"),
        (["--stages", "6,4", "--microbatches", "4,4", "--fwd", "1,1", "--bwd", "2,2"], "do not divide"),
        ([*EXPLICIT, "--act-cap", "0.5"], "too small"),
        ([*EXPLICIT, "-o", "/nonexistent/s.yaml"], "does not exist"),
        ([*EXPLICIT, "--gantt", "s.pdf"], ".png or .svg"),
        (["--plan", str(EXAMPLE), "--stages", "4,2"], "drop --stages"),
    ],
)
def test_bad_input_is_one_line(args: list[str], message: str) -> None:
    line = one_error_line(invoke("schedule", "fuse", *args, *QUICK))
    assert message in line


def test_failed_run_leaves_no_file(tmp_path: Path) -> None:
    out = tmp_path / "s.yaml"
    one_error_line(invoke("schedule", "fuse", *EXPLICIT, *QUICK, "--act-cap", "0.5", "-o", out))
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_migrate_json() -> None:
    result = invoke("schedule", "migrate", "--plan", EXAMPLE, "--json", "--batches", "2")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert 0.05 <= data["best_threshold"] <= 0.95
    assert len(data["points"]) == 19
    assert data["with_fusion_s"] == pytest.approx(min(p["total_s"] for p in data["points"]))
    assert data["speedup"] == pytest.approx(data["without_fusion_s"]["total"] / data["with_fusion_s"])
    text = invoke("schedule", "migrate", "--plan", EXAMPLE, "--batches", "1")
    assert text.exit_code == 0 and "with fusion:" in text.stdout


def test_schedule_commands_import_no_torch_or_matplotlib() -> None:
    """Without --exact and without the CP-SAT peak windows, the fused search needs none of them."""
    code = textwrap.dedent(
        f"""
        import sys
        from typer.testing import CliRunner
        from nereus.cli.app import app
        args = ["schedule", "fuse", *{EXPLICIT!r}, *{QUICK!r}, "--json", "--window-share", "0"]
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        print(sorted(m for m in ("torch", "matplotlib", "ortools") if m in sys.modules))
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert run.stdout.strip() == "[]"

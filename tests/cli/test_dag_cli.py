"""`nereus dag build` and `nereus dag show` end to end (typer's CliRunner), plus the Transition file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_helpers import invoke, one_error_line
from plan_helpers import relayout
from repo_paths import EXAMPLES

import nereus.solver.transition
from nereus.render.dot import transition_dot
from nereus.render.tree import primitive_line
from nereus.solver.transition.check import check_result
from nereus.solver.transition.document import from_document, to_document
from nereus.spec.io import load_document, save_document
from nereus.spec.plan import Plan
from nereus.spec.transition import Transition

pytestmark = pytest.mark.cli

EXAMPLE = EXAMPLES / "plan-tiny-ppo-4rank.yaml"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PRIMITIVE_KEYS = {
    "id",
    "kind",
    "model_stage",
    "source_layout",
    "target_layout",
    "gpus_read",
    "gpus_written",
    "alloc_bytes",
    "free_bytes",
    "bytes_intra_node",
    "bytes_inter_node",
    "start_s",
    "end_s",
    "depends_on",
    "ownership_deps",
}


@pytest.fixture(scope="module")
def plan_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example plan with actor/training re-laid out (Split, Merge) and reference/inference moved
    (Extend, Destroy): every primitive kind occurs."""
    plan = load_document(EXAMPLE)
    assert isinstance(plan, Plan)
    relaid = relayout(plan, "actor/training", 2, 1, [[1, 0], [3, 2]])
    relaid = relayout(relaid, "reference/inference", 2, 1, [[0, 2], [1, 3]])
    path = tmp_path_factory.mktemp("plans") / "b.yaml"
    save_document(relaid, path)
    return path


@pytest.fixture(scope="module")
def transition_file(plan_b: Path) -> Path:
    path = plan_b.parent / "t.yaml"
    result = invoke("dag", "build", EXAMPLE, plan_b, "-o", path)
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture(scope="module")
def transition(transition_file: Path) -> Transition:
    document = load_document(transition_file)
    assert isinstance(document, Transition)
    return document


def test_build_prints_a_summary_and_writes_a_file_check_accepts(plan_b: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.yaml"
    result = invoke("dag", "build", EXAMPLE, plan_b, "-o", out)
    assert result.exit_code == 0, result.output
    for text in ("actor/training", "reference/inference", "makespan:", "lower bound", "peak extra memory", "feasible"):
        assert text in result.stdout
    assert "split 2, destroy 2, extend 2, merge 2" in result.stdout
    assert f"wrote {out}" in result.stdout
    check = invoke("check", out)
    assert check.exit_code == 0, check.output
    assert "ok (Transition)" in check.stdout and "warning" not in check.stdout


def test_build_json_has_every_primitive_field(plan_b: Path) -> None:
    result = invoke("dag", "build", EXAMPLE, plan_b, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kind"] == "Transition" and data["version"] == 1
    assert {p["kind"] for p in data["primitives"]} == {"split", "destroy", "extend", "merge"}
    for primitive in data["primitives"]:
        assert set(primitive) >= PRIMITIVE_KEYS, PRIMITIVE_KEYS - set(primitive)
        assert all(set(entry) == {"gpu", "bytes"} for entry in primitive["alloc_bytes"] + primitive["free_bytes"])
        assert primitive["end_s"] >= primitive["start_s"]
    summary = data["summary"]
    assert summary["feasible"] is True and summary["blocking_cycle"] == []
    assert summary["bytes_moved"] >= summary["lower_bound_bytes"] > 0
    assert summary["bytes_moved"] == pytest.approx(sum(summary["bytes_by_link"].values()))
    assert "exact" not in data


def test_document_round_trips_and_replays_clean(transition: Transition) -> None:
    result = from_document(transition)
    assert check_result(result, transition.source, transition.target) == []
    assert to_document(transition.source, transition.target, result) == transition


def test_show_tree_is_the_default(transition_file: Path, transition: Transition) -> None:
    result = invoke("dag", "show", transition_file)
    assert result.exit_code == 0, result.output
    assert "actor/generation: unchanged" in result.stdout
    assert "actor/training: tp=1 pp=2 dp=2 -> tp=2 pp=1 dp=2" in result.stdout
    for primitive in transition.primitives:
        assert f"#{primitive.id} {primitive.kind}" in result.stdout


def test_show_tree_to_file(transition_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "tree.txt"
    result = invoke("dag", "show", transition_file, "--format", "tree", "-o", out)
    assert result.exit_code == 0, result.output
    assert "#0 " in out.read_text(encoding="utf-8") and result.stdout == ""


def test_show_dot(transition_file: Path, transition: Transition) -> None:
    result = invoke("dag", "show", transition_file, "--format", "dot")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert text.startswith("digraph transition {") and text.rstrip().endswith("}")
    edges = sum(len(p.depends_on) for p in transition.primitives)
    assert text.count(" -> p") == edges > 0
    assert all(f"p{p.id} [label=" in text for p in transition.primitives)


def test_dot_draws_ownership_edges_dashed(transition: Transition) -> None:
    last = transition.primitives[-1].model_copy(update={"ownership_deps": [0]})
    text = transition_dot(transition.model_copy(update={"primitives": [*transition.primitives[:-1], last]}))
    assert f'p0 -> p{last.id} [style=dashed, color="#777777"];' in text


def test_show_svg_without_dot_writes_the_dot_file(
    transition_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    out = tmp_path / "dag.svg"
    result = invoke("dag", "show", transition_file, "--format", "svg", "-o", out)
    assert result.exit_code == 0, result.output
    assert not out.exists()
    assert (tmp_path / "dag.dot").read_text(encoding="utf-8").startswith("digraph")
    assert "not on PATH" in result.stderr and str(tmp_path / "dag.dot") in result.stderr


def _fake_dot(folder: Path, body: str) -> str:
    script = folder / "dot"
    script.write_text(f"#!{sys.executable}\nimport sys\n{body}\n", encoding="utf-8")
    script.chmod(0o755)
    return str(script)


def test_show_svg_with_dot_runs_it(transition_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_dot(
        tmp_path,
        "text = sys.stdin.read()\n"
        "assert sys.argv[1:] == ['-Tsvg'] and text.startswith('digraph')\n"
        "sys.stdout.write('<svg xmlns=\"http://www.w3.org/2000/svg\"><!-- %d --></svg>\\n' % len(text))",
    )
    monkeypatch.setattr(shutil, "which", lambda name: fake if name == "dot" else None)
    out = tmp_path / "dag.svg"
    result = invoke("dag", "show", transition_file, "--format", "svg", "-o", out)
    assert result.exit_code == 0, result.output
    assert out.read_text(encoding="utf-8").startswith("<svg")
    to_stdout = invoke("dag", "show", transition_file, "--format", "svg")
    assert to_stdout.exit_code == 0 and to_stdout.stdout.startswith("<svg")


def test_show_svg_when_dot_fails(transition_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_dot(tmp_path, "sys.stderr.write('Error: syntax error in line 1\\n'); sys.exit(2)")
    monkeypatch.setattr(shutil, "which", lambda name: fake)
    line = one_error_line(invoke("dag", "show", transition_file, "--format", "svg"))
    assert "dot -Tsvg" in line and "syntax error" in line


def test_show_json_is_the_document(transition_file: Path, transition: Transition) -> None:
    result = invoke("dag", "show", transition_file, "--format", "json")
    assert result.exit_code == 0, result.output
    assert Transition.model_validate(json.loads(result.stdout)) == transition


def test_show_perfetto_has_one_track_per_gpu(transition_file: Path, transition: Transition, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    result = invoke("dag", "show", transition_file, "--format", "perfetto", "-o", out)
    assert result.exit_code == 0, result.output
    events = json.loads(out.read_text(encoding="utf-8"))["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert tracks == {gpu: f"GPU {gpu}" for gpu in range(4)}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == sum(len(p.gpus) for p in transition.primitives)
    by_id = {p.id: p for p in transition.primitives}
    for event in spans:
        primitive = by_id[event["args"]["id"]]
        assert event["tid"] in primitive.gpus
        assert event["ts"] == pytest.approx(primitive.start_s * 1e6)
        assert event["dur"] == pytest.approx((primitive.end_s - primitive.start_s) * 1e6)
    assert any(e["ph"] == "C" for e in events)


def test_show_gantt_writes_a_png(transition_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "gantt.png"
    result = invoke("dag", "show", transition_file, "--format", "dot", "-o", tmp_path / "d.dot", "--gantt", out)
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_gantt_without_matplotlib_is_one_line(
    transition_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, name, None)
    line = one_error_line(invoke("dag", "show", transition_file, "--gantt", tmp_path / "g.png"))
    assert "matplotlib" in line and "nereus[plot]" in line
    assert not (tmp_path / "g.png").exists()


def test_identical_plans_move_nothing(tmp_path: Path) -> None:
    out = tmp_path / "same.json"
    result = invoke("dag", "build", EXAMPLE, EXAMPLE, "-o", out)
    assert result.exit_code == 0, result.output
    assert "nothing to move" in result.stdout
    assert invoke("check", out).exit_code == 0
    for fmt in ("tree", "dot", "perfetto", "json"):
        assert invoke("dag", "show", out, "--format", fmt).exit_code == 0, fmt


def test_exact_cpsat_is_included(plan_b: Path) -> None:
    pytest.importorskip("ortools")
    result = invoke("dag", "build", EXAMPLE, plan_b, "--exact", "cpsat", "--time-limit", "5", "--json")
    assert result.exit_code == 0, result.output
    (record,) = json.loads(result.stdout)["exact"]
    assert record["solver"] == "cpsat" and record["status"] in ("optimal", "feasible")
    assert record["makespan_s"] > 0 and record["time_limit_s"] == 5.0
    text = invoke("dag", "build", EXAMPLE, plan_b, "--exact", "cpsat", "--time-limit", "5")
    assert "exact cpsat:" in text.stdout


def test_exact_without_the_backend_is_one_line(plan_b: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(nereus.solver.transition, "exact", raising=False)
    monkeypatch.setitem(sys.modules, "nereus.solver.transition.exact", None)
    line = one_error_line(invoke("dag", "build", EXAMPLE, plan_b, "--exact", "scip"))
    assert "--exact scip" in line


def test_infeasible_pair_prints_the_blocking_cycle_and_still_writes(plan_b: Path, tmp_path: Path) -> None:
    # Usable memory just above what the GPUs already hold: no Split can gather its box.
    calibration = tmp_path / "tight.yaml"
    calibration.write_text(
        "kind: Calibration\nversion: 1\nworkspace_fraction: 0.0\nmemory_headroom: 0.9975\n", encoding="utf-8"
    )
    out = tmp_path / "t.yaml"
    result = invoke("dag", "build", EXAMPLE, plan_b, "--calibration", calibration, "-o", out)
    line = one_error_line(result)
    assert "no safe order" in line and "wrote" in line
    assert "feasible: no; blocking:" in result.stdout and "needs" in result.stdout
    check = invoke("check", out)
    assert check.exit_code == 1 and "summary.feasible: the transition has no safe order" in check.stdout
    assert invoke("dag", "show", out).exit_code == 0


def test_check_reports_checker_violations_per_primitive(transition_file: Path, tmp_path: Path) -> None:
    data = json.loads(invoke("dag", "show", transition_file, "--format", "json").stdout)
    dependent = next(p for p in data["primitives"] if p["depends_on"])
    dependent["start_s"] = 0.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data), encoding="utf-8")
    result = invoke("check", bad)
    assert result.exit_code == 1
    assert f"primitives[{dependent['id']}]: primitive {dependent['id']}" in result.stdout


def test_check_warns_on_a_stale_summary(transition_file: Path, tmp_path: Path) -> None:
    data = json.loads(invoke("dag", "show", transition_file, "--format", "json").stdout)
    data["summary"]["makespan_s"] *= 2
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(data), encoding="utf-8")
    result = invoke("check", stale)
    assert result.exit_code == 0, result.output
    assert "summary.makespan_s: warning: stale" in result.stdout
    assert invoke("check", "--strict", stale).exit_code == 1


def test_check_refuses_edges_to_missing_primitives(transition_file: Path, tmp_path: Path) -> None:
    data = json.loads(invoke("dag", "show", transition_file, "--format", "json").stdout)
    data["primitives"][0]["depends_on"] = [99]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data), encoding="utf-8")
    result = invoke("check", bad)
    assert result.exit_code == 1 and "primitives[0].depends_on[0]: refers to no primitive 99" in result.stdout
    assert one_error_line(invoke("dag", "show", bad)).endswith("other than 0")


def test_schema_transition() -> None:
    result = invoke("schema", "Transition")
    assert result.exit_code == 0, result.output
    schema = json.loads(result.stdout)
    assert "PrimitiveRecord" in schema["$defs"] and schema["additionalProperties"] is False


def _other_cluster(plan_b: Path, tmp_path: Path) -> Path:
    plan = load_document(plan_b)
    assert isinstance(plan, Plan)
    other = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"name": "cpu-other"})})
    path = tmp_path / "other.yaml"
    save_document(other, path)
    return path


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("workload", "kind: expected Plan, got Workload"),
        ("missing", "no such file"),
        ("cluster", "plans for different clusters (cpu-1x4 vs cpu-other)"),
        ("stages", "run different model-stages (critic/inference only in"),
        ("transition", "kind: expected Transition, got Plan"),
        ("folder", "does not exist; create it first"),
    ],
)
def test_bad_inputs_are_one_line_errors(case: str, expected: str, plan_b: Path, tmp_path: Path) -> None:
    examples = EXAMPLE.parent
    cases: dict[str, list[str | Path]] = {
        "workload": ["dag", "build", examples / "workload-ppo.yaml", plan_b],
        "missing": ["dag", "build", EXAMPLE, tmp_path / "nope.yaml"],
        "cluster": ["dag", "build", EXAMPLE, _other_cluster(plan_b, tmp_path)],
        "stages": ["dag", "build", EXAMPLE, examples / "plan-tiny-grpo-4rank.yaml"],
        "transition": ["dag", "show", EXAMPLE],
        "folder": ["dag", "build", EXAMPLE, plan_b, "-o", tmp_path / "no" / "t.yaml"],
    }
    assert expected in one_error_line(invoke(*cases[case]))


def test_dag_commands_import_neither_torch_nor_matplotlib(plan_b: Path, tmp_path: Path) -> None:
    """`nereus --help`, `dag build` and `dag show` (without --gantt) stay light (a fresh interpreter)."""
    out = tmp_path / "t.yaml"
    script = textwrap.dedent(f"""
        import sys
        from nereus.cli.app import app
        for argv in (["--help"], ["dag", "--help"],
                     ["dag", "build", {str(EXAMPLE)!r}, {str(plan_b)!r}, "-o", {str(out)!r}],
                     ["dag", "show", {str(out)!r}], ["dag", "show", {str(out)!r}, "--format", "perfetto"],
                     ["check", {str(out)!r}]):
            try:
                code = app(argv, prog_name="nereus", standalone_mode=False)
            except SystemExit as exc:
                code = exc.code
            assert code in (None, 0), (argv, code)
        print(sorted(m for m in ("torch", "matplotlib", "ortools", "pyscipopt") if m in sys.modules))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert out.is_file()


def test_batched_extend_round_trips_and_replays_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """An Extend copying two replicas side by side (batching lowered to two copies a round)
    survives the file form: rebuilt from the document, the checker replays it clean."""
    import nereus.solver.transition.local as local
    from nereus.solver.transition import build_transition

    monkeypatch.setattr(local, "BATCH_MIN_COPIES", 2)
    plan = load_document("examples/plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan, Plan)
    plan_a = relayout(plan, "critic/inference", 1, 1, [[0], [1]])
    plan_b = relayout(plan, "critic/inference", 1, 1, [[0], [1], [2], [3]])
    result = build_transition(plan_a, plan_b)
    assert any(p.kind == "extend" and len(p.adds) == 2 for p in result.primitives)
    document = to_document(plan_a, plan_b, result)
    rebuilt = from_document(document)
    assert [(p.adds, p.copies_from) for p in rebuilt.primitives] == [(p.adds, p.copies_from) for p in result.primitives]
    assert check_result(rebuilt, plan_a, plan_b) == []
    batched = next(p for p in document.primitives if p.kind == "extend" and len(p.adds) == 2)
    assert " | 2 replicas | GPUs " in primitive_line(batched)  # `dag show` says how many it copies


def test_plans_for_16_and_32_gpus_of_one_preset_build_as_a_pool_change(tmp_path: Path) -> None:
    """The pool-growth case: `plan --gpus 16` and `--gpus 32` on h100 write 2- and 4-node clusters."""
    small, large, out = tmp_path / "p16.yaml", tmp_path / "p32.yaml", tmp_path / "t.yaml"
    for gpus, path in (("16", small), ("32", large)):
        assert invoke("plan", "--gpus", gpus, "-o", path).exit_code == 0
    for a, b in ((small, large), (large, small)):
        result = invoke("dag", "build", a, b, "-o", out)
        assert result.exit_code == 0, result.output
        lines = [line for line in result.stderr.splitlines() if line.startswith("sub-pool: ")]
        assert lines == [
            "sub-pool: h100-sxm-2x8 (16 GPUs) is the first 2 of the 4 nodes of h100-sxm-4x8; "
            "the transition runs on h100-sxm-4x8"
        ]
        checked = invoke("check", "--strict", out)
        assert checked.exit_code == 0 and "ok (Transition)" in checked.stdout, checked.output
    # A node of another shape is still refused, with the reason.
    plan = load_document(large)
    assert isinstance(plan, Plan)
    cluster = plan.cluster.model_copy(update={"gpus_per_node": 4, "num_nodes": 8, "name": "h100-sxm-8x4"})
    save_document(plan.model_copy(update={"cluster": cluster}), tmp_path / "other.yaml")
    line = one_error_line(invoke("dag", "build", small, tmp_path / "other.yaml"))
    assert "(h100-sxm-2x8 vs h100-sxm-8x4: gpus_per_node differ)" in line, line

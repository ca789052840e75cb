"""Trace documents, their semantic check, the seeded generators and `nereus trace`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import invoke
from repo_paths import EXAMPLES

from nereus.errors import SpecError
from nereus.solver.traces import GrowthConfig, SpotConfig, combined_trace, sequence_growth_trace, spot_trace
from nereus.spec.check import semantic_problems
from nereus.spec.io import load_document, save_document
from nereus.spec.trace import Trace, TraceEvent, trace_conditions
from nereus.spec.workload import ResponseLengths

pytestmark = pytest.mark.logic

EXAMPLES = EXAMPLES
LENGTHS = ResponseLengths(median=100, p99=300, max=500)


def test_sequence_growth_reaches_paper_lengths_and_is_seeded() -> None:
    trace = sequence_growth_trace(1000, 16, GrowthConfig(), seed=3)
    states = list(trace_conditions(trace))
    assert len(states) == 1000
    assert states[0].response_len.max == 500 and states[-1].response_len.max == 8000
    assert states[500].response_len.max == pytest.approx(500 * 16**0.5, rel=0.15)  # geometric path
    assert trace == sequence_growth_trace(1000, 16, GrowthConfig(), seed=3)
    assert trace != sequence_growth_trace(1000, 16, GrowthConfig(), seed=4)
    assert not semantic_problems(trace)


def test_growth_of_the_median_keeps_the_cap_of_the_run() -> None:
    growth = GrowthConfig(grows="median", max_tokens=16384)
    states = list(trace_conditions(sequence_growth_trace(1000, 16, growth, seed=3)))
    first, last = states[0].response_len, states[-1].response_len
    assert (first.median, first.p99, first.max) == (500, 2500, 8192)  # the ppo preset's own shape
    assert (last.median, last.p99, last.max) == (8000, 16384, 16384)
    assert all(s.response_len.max <= 16384 for s in states)


def test_spot_trace_has_more_than_ten_changes_within_bounds() -> None:
    for seed in range(5):
        trace = spot_trace(1000, 16, 2000, SpotConfig(), seed)
        pool = [e for e in trace.events if e.gpus is not None]
        assert len(pool) > 10
        sizes = [s.gpus for s in trace_conditions(trace)]
        assert min(sizes) >= 8 and max(sizes) == 16
        assert all(e.notice_steps <= e.step for e in pool)
        assert not semantic_problems(trace)


def test_combined_trace_has_both_drifts() -> None:
    trace = combined_trace(1000, 32, GrowthConfig(), SpotConfig(block_gpus=8), seed=1)
    assert sum(e.gpus is not None for e in trace.events) == 12
    assert sum(e.response_len is not None for e in trace.events) >= 99
    assert not semantic_problems(trace)


def test_announced_pool_change_is_visible_during_its_notice() -> None:
    event = TraceEvent(step=5, gpus=8, notice_steps=2)
    trace = Trace(name="t", num_steps=8, gpus=16, response_len=LENGTHS, events=[event])
    states = list(trace_conditions(trace))
    assert [s.announced_gpus for s in states] == [None, None, None, 8, 8, None, None, None]
    assert [s.gpus for s in states] == [16] * 5 + [8] * 3


@pytest.mark.parametrize(
    ("events", "fragment"),
    [
        ([TraceEvent(step=4, efficiency=0.9), TraceEvent(step=2, efficiency=0.8)], "not after the previous"),
        ([TraceEvent(step=20, efficiency=0.9)], "past the trace's last step"),
        ([TraceEvent(step=3)], "changes nothing"),
        ([TraceEvent(step=3, efficiency=0.9, notice_steps=1)], "pool changes only"),
        ([TraceEvent(step=1, gpus=8, notice_steps=3)], "before step 0"),
    ],
)
def test_semantic_check_names_the_field(events: list[TraceEvent], fragment: str) -> None:
    trace = Trace(name="bad", num_steps=10, gpus=16, response_len=LENGTHS, events=events)
    problems = semantic_problems(trace)
    assert problems and any(fragment in p.message for p in problems), problems
    assert problems[0].path.startswith("events[")


def test_roundtrip_and_load_errors(tmp_path: Path) -> None:
    trace = spot_trace(100, 16, 1000, SpotConfig(num_changes=11), seed=0)
    path = tmp_path / "t.yaml"
    save_document(trace, path)
    assert load_document(path) == trace
    path.write_text(path.read_text().replace("num_steps: 100", "num_steps: 100\nsteps_per_hour: 3"))
    with pytest.raises(SpecError, match="steps_per_hour: unknown key"):
        load_document(path)


def test_examples_pass_check() -> None:
    files = sorted(EXAMPLES.glob("trace-*.yaml"))
    assert len(files) >= 3
    result = invoke("check", *files)
    assert result.exit_code == 0, result.output


def test_cli_generate_show_and_schema(tmp_path: Path) -> None:
    out = tmp_path / "spot.yaml"
    result = invoke(
        "trace", "generate", "spot", "--gpus", "32", "--block-gpus", "8", "--seed", "7", "-o", out, "--json"
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["num_pool_changes"] == 12 and summary["gpus_max"] == 32 and summary["gpus_min"] >= 16
    assert load_document(out) == spot_trace(1000, 32, 2000, SpotConfig(block_gpus=8), seed=7)
    shown = invoke("trace", "show", out)
    assert shown.exit_code == 0 and "12 pool changes" in shown.stdout
    schema = invoke("schema", "trace")
    assert schema.exit_code == 0 and "notice_steps" in schema.stdout


def test_cli_generate_errors_are_one_line(tmp_path: Path) -> None:
    missing = invoke("trace", "generate", "seq-growth", "-o", tmp_path / "nope" / "t.yaml")
    assert missing.exit_code == 1 and missing.stderr.startswith("error: --out") and "does not exist" in missing.stderr
    bad = invoke("trace", "generate", "spot", "--gpus", "8", "--block-gpus", "8", "-o", tmp_path / "t.yaml")
    assert bad.exit_code == 1 and "min_gpus" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t.yaml").exists()
    growing = invoke("trace", "generate", "growing-pool", "-o", tmp_path / "g.yaml")
    assert growing.exit_code == 1 and "--end-gpus" in growing.stderr


def test_a_trace_longer_than_max_steps_is_a_schema_error(tmp_path: Path) -> None:
    """Found by the careless-input test: `nereus trace show` walked a trace of 10**30 steps."""
    from cli_helpers import one_error_line

    from nereus.spec.trace import MAX_STEPS

    document = load_document(EXAMPLES / "trace-spot.yaml").model_dump(mode="json")  # type: ignore[union-attr]
    assert Trace.model_validate({**document, "num_steps": MAX_STEPS}).num_steps == MAX_STEPS
    for steps in (MAX_STEPS + 1, 10**30):
        path = tmp_path / f"t{steps}.yaml"
        path.write_text(json.dumps({**document, "num_steps": steps}))
        line = one_error_line(invoke("trace", "show", path))
        assert "num_steps: Input should be less than or equal to 1000000" in line
    generated = invoke("trace", "generate", "spot", "--steps", MAX_STEPS + 1, "--out", tmp_path / "g.yaml")
    assert generated.exit_code == 2 and "'--steps'" in generated.output and not (tmp_path / "g.yaml").exists()

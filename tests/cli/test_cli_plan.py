"""`nereus plan`, `nereus plan explain` and `nereus check` end to end (typer's CliRunner)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from repo_paths import EXAMPLES
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.spec.io import load_document, save_document
from nereus.spec.plan import Plan
from nereus.spec.presets import workload_preset
from nereus.spec.stages import REWARD_INFERENCE

pytestmark = pytest.mark.cli

runner = CliRunner()


def invoke(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args))


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "out.yaml"
    result = invoke("plan", "--gpus", "16", "-o", str(path))
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stdout
    return path


def test_plan_writes_a_file_that_check_accepts(plan_file: Path) -> None:
    assert plan_file.is_file()
    plan = load_document(plan_file)
    assert isinstance(plan, Plan)
    assert plan.predictions is not None
    assert sorted(g for pool in plan.pools for g in pool.gpus) == list(range(16))
    result = invoke("check", str(plan_file))
    assert result.exit_code == 0, result.output
    assert f"{plan_file}: ok (Plan)" in result.stdout
    assert "warning" not in result.stdout


def test_plan_prints_a_table() -> None:
    result = invoke("plan", "--gpus", "16")
    assert result.exit_code == 0, result.output
    for name in ("actor/generation", "critic/training", "step ", "searched"):
        assert name in result.stdout


def test_plan_json() -> None:
    result = invoke("plan", "--gpus", "16", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert {"plan", "search_time_s"} <= set(payload)
    assert payload["plan"]["kind"] == "Plan"
    assert payload["search_time_s"] >= 0
    assert payload["plan"]["predictions"]["step_time_s"] > 0


@pytest.mark.parametrize("gpus", [24, 40, 48, 96])
def test_plan_on_uneven_gpu_counts_passes_check(gpus: int, tmp_path: Path) -> None:
    """dp that does not divide the samples: the busiest replica gets ceil(samples / dp)."""
    path = tmp_path / "plan.yaml"
    result = invoke("plan", "--gpus", str(gpus), "-o", str(path))
    assert result.exit_code == 0, result.output
    check = invoke("check", "--strict", str(path))
    assert check.exit_code == 0, check.output
    assert f"{path}: ok (Plan)" in check.stdout
    assert "warning" not in check.stdout and "error" not in check.stdout


def test_plan_seq_len_is_the_maximum_response(tmp_path: Path) -> None:
    """--seq-len N caps responses at N tokens; the ppo preset's median 500 / p99 2500 / max 8192 scale alike."""
    steps = {}
    for seq_len in (500, 8000):
        path = tmp_path / f"plan-{seq_len}.yaml"
        result = invoke("plan", "--gpus", "16", "--seq-len", str(seq_len), "-o", str(path))
        assert result.exit_code == 0, result.output
        plan = load_document(path)
        assert isinstance(plan, Plan) and plan.predictions is not None
        lengths = plan.workload.response_len
        assert (lengths.median, lengths.p99, lengths.max) == (
            round(500 * seq_len / 8192),
            round(2500 * seq_len / 8192),
            seq_len,
        )
        check = invoke("check", "--strict", str(path))
        assert check.exit_code == 0, check.output
        steps[seq_len] = plan.predictions.step_time_s
    assert steps[8000] > steps[500]


def test_plan_seq_len_must_be_positive() -> None:
    result = invoke("plan", "--gpus", "16", "--seq-len", "0")
    assert_one_line_error(result, "--seq-len must be a positive number of tokens, got 0")


def test_plan_explain(plan_file: Path) -> None:
    result = invoke("plan", "explain", str(plan_file))
    assert result.exit_code == 0, result.output
    assert "step time" in result.stdout
    assert "infeasible" not in result.stdout
    stored = load_document(plan_file)
    assert isinstance(stored, Plan) and stored.predictions is not None
    assert f"step time: {stored.predictions.step_time_s:.4g} s" in result.stdout


def test_plan_explain_json(plan_file: Path) -> None:
    result = invoke("plan", "explain", str(plan_file), "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["memory_problems"] == []
    assert payload["step_time_s"] == pytest.approx(sum(payload["step_breakdown_s"].values()), rel=1e-12)


def assert_one_line_error(result, *fragments: str) -> None:  # type: ignore[no-untyped-def]
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def test_plan_70b_on_8_gpus_is_one_line_error() -> None:
    result = invoke("plan", "--gpus", "8", "--model", "llama-3.3-70b")
    said = "the smallest GPU count that fits is 10; the smallest whole-node count is 16 (2 nodes of 8)"
    assert_one_line_error(result, "no memory-feasible plan", said)
    result = invoke("plan", "--gpus", "8", "--model", "llama-3.3-70b", "--train-offload", "none")
    said = "the smallest GPU count that fits is 20; the smallest whole-node count is 24 (3 nodes of 8)"
    assert_one_line_error(result, "no memory-feasible plan", said)


def llama_70b_config(folder: Path) -> Path:
    """Llama-3.1-70B's config.json as transformers writes it (its published shape)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    config.save_pretrained(folder)
    return folder / "config.json"


def test_plan_70b_ppo_on_2_gpus_names_the_bottleneck(tmp_path: Path) -> None:
    """Issue 47, as a user meets it: Llama-3.1-70B's config.json, PPO on 2 H100s. The refusal
    blamed `actor/inference alone` (the first model-stage that fit nowhere alone) and said 24
    GPUs; it names actor/training, whose AdamW state alone is over 390 GiB per GPU, and says
    that 20 GPUs fit, 24 in whole nodes, all against the one usable capacity."""
    config = llama_70b_config(tmp_path)
    pinned = ("--train-offload", "none")  # the search space, before training-time offload
    result = invoke("plan", "--gpus", "2", "--cluster", "h100", "--model", str(config), "--workload", "ppo", *pinned)
    assert_one_line_error(
        result,
        "closest: colocated placement, pool shared: actor/training alone [tp=2 pp=1 dp=1",
        "> 72.0 GiB usable per GPU",
        "largest term: optimizer 394.",
        "+ workspace 2.4 GiB",
        "the smallest GPU count that fits is 20; the smallest whole-node count is 24 (3 nodes of 8)",
    )
    assert "actor/inference" not in result.stderr and "69.6" not in result.stderr


def test_plan_speaks_of_one_memory_base() -> None:
    """Issue 47: Qwen3-14B PPO on 16 GPUs showed the chosen actor/training at `72.0 / 72.0` and a
    rejected layout at `needs 71.2 GiB > 69.6 GiB usable`. The table, its rejections and the
    JSON all count the workspace and compare with the same 72.0 GiB. Recompute is pinned off:
    since the logits term prices one chunk of the chunked head, the default search fits every
    layout it tries here and rejects none."""
    args = ("plan", "--gpus", "16", "--model", "qwen3-14b", "--workload", "ppo", "--recompute", "none")
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())  # rich wraps long lines
    assert "/ 72.0 │" in result.stdout and "/ 69.6" not in text and "69.6" not in text
    assert "memory/GPU: peak, the 2.4 GiB workspace included, of 72.0 GiB usable (80.0 GiB less 10% headroom)" in text
    rejected = r"needs \d+\.\d GiB > 72\.0 GiB usable \(largest term: \w+ \d+\.\d GiB; workspace 2\.4 GiB\)"
    assert re.search(rejected, text)
    payload = json.loads(invoke(*args, "--json").stdout)
    assert payload["usable_bytes_per_gpu"] == 0.9 * 80 * 2**30
    assert payload["workspace_bytes_per_gpu"] == pytest.approx(0.03 * 80 * 2**30)
    assert all("> 72.0 GiB usable" in line for line in payload["rejections"])
    for prediction in payload["plan"]["predictions"]["model_stages"].values():
        assert prediction["memory_breakdown_bytes"]["workspace"] == int(payload["workspace_bytes_per_gpu"])
        assert prediction["peak_memory_bytes"] <= payload["usable_bytes_per_gpu"]


def test_plan_70b_on_16_gpus_offloads_training_and_shows_host_memory(tmp_path: Path) -> None:
    """Issue 44's acceptance: a plan, with training-time offload, and its host bytes as a column."""
    out = tmp_path / "p.yaml"
    flags = ["--gpus", "16", "--cluster", "h100", "--model", "llama-3.3-70b", "--workload", "ppo", "-o", str(out)]
    result = invoke("plan", *flags)
    assert result.exit_code == 0, result.output
    assert "host (GiB)" in result.stdout and "host-opt" in result.stdout
    plan = load_document(out)
    assert isinstance(plan, Plan)
    assert {e.train_offload for e in plan.stages if e.stage == "training"} == {"optimizer"}
    explained = invoke("plan", "explain", str(out))
    assert "host memory per GPU" in explained.stdout and "training-time offload optimizer" in explained.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--train-offload", "sometimes"], "--train-offload sometimes: use none, optimizer, params or search"),
        (["--train-offload", "params", "--full-shard", "off"], "which --full-shard off excludes"),
        (["--train-offload", "optimizer", "--zero1", "off"], "which --zero1 off excludes"),
    ],
)
def test_train_offload_pins_that_contradict_are_one_line_errors(flags: list[str], message: str) -> None:
    assert_one_line_error(invoke("plan", "--gpus", "8", *flags), message)


def test_plan_more_gpus_than_the_cluster() -> None:
    result = invoke("plan", "--cluster", "h100-sxm-2x8", "--gpus", "100000")
    assert_one_line_error(result, "--gpus 100000 exceeds the 16 GPUs of cluster h100-sxm-2x8")


def test_plan_unknown_workload() -> None:
    expected = (
        "--workload nope: no such file or folder, and not a workload preset "
        "(presets: ppo, grpo, grpo-long, remax, tiny-ppo, grpo-async)"
    )
    assert_one_line_error(invoke("plan", "--workload", "nope"), expected)


QWEN25_7B = {  # Qwen/Qwen2.5-7B's published config.json (the fields nereus reads)
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}


@pytest.mark.parametrize("name", ["grpo", "remax"])
def test_grpo_and_remax_presets_score_with_a_rule_and_a_reward_model_is_one_field_away(
    name: str, tmp_path: Path
) -> None:
    """As verl's GRPO/ReMax examples and TRL's GRPO quick start: no reward/inference model-stage;
    `reward: MODEL` in the workload prices one (docs/cli.md quotes Qwen2.5-7B on 8 GPUs:
    28.98 s with the rule, 31.70 s with a reward model)."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    preset = workload_preset(name)
    assert preset.reward is None and preset.reference == preset.actor
    save_document(preset.model_copy(update={"reward": preset.actor}), tmp_path / "with-rm.yaml")
    steps = {}
    for workload in (name, str(tmp_path / "with-rm.yaml")):
        result = invoke(
            "plan", "--model", str(tmp_path / "config.json"), "--workload", workload, "--gpus", "8", "--json"
        )
        assert result.exit_code == 0, result.output
        plan = json.loads(result.stdout)["plan"]
        stages = {entry["model_stage"] for entry in plan["stages"]}
        assert (REWARD_INFERENCE in stages) == (workload != name), stages
        steps[workload != name] = plan["predictions"]["step_time_s"]
    assert steps[False] < steps[True]


def test_plan_gpus_must_be_positive() -> None:
    result = invoke("plan", "--gpus", "0")
    assert result.exit_code == 2  # a usage error (typer's range check)
    assert "Traceback" not in result.output


def test_stale_predictions_warn_and_fail_strict(plan_file: Path, tmp_path: Path) -> None:
    plan = load_document(plan_file)
    assert isinstance(plan, Plan) and plan.predictions is not None
    edited = plan.model_copy(
        update={"predictions": plan.predictions.model_copy(update={"step_time_s": plan.predictions.step_time_s * 2})}
    )
    path = tmp_path / "edited.yaml"
    save_document(edited, path)
    result = invoke("check", str(path))
    assert result.exit_code == 0, result.output
    assert "warning: stale" in result.stdout
    assert "predictions.step_time_s" in result.stdout
    strict = invoke("check", "--strict", str(path))
    assert strict.exit_code == 1, strict.output
    assert "warning: stale" in strict.stdout


def _edited(plan_file: Path, tmp_path: Path, edit: Any) -> Path:
    data = yaml.safe_load(plan_file.read_text())
    edit(data["predictions"])
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_any_stored_prediction_that_differs_warns_and_fails_strict(plan_file: Path, tmp_path: Path) -> None:
    """Not only the step time and each model-stage's total: every stored number is recomputed."""
    stage = "actor/training"

    def edit(predictions: dict[str, Any]) -> None:
        breakdown = predictions["model_stages"][stage]["memory_breakdown_bytes"]
        breakdown["optimizer"] += 1
        predictions["step_breakdown_s"]["generation"] *= 1.01
        predictions["model_stages"][stage]["time_breakdown_s"]["invented"] = 1.0

    path = _edited(plan_file, tmp_path, edit)
    result = invoke("check", str(path))
    assert result.exit_code == 0, result.output
    assert f"{stage}.memory_breakdown_bytes.optimizer: warning: stale: stored " in result.stdout
    assert "predictions.step_breakdown_s.generation: warning: stale: stored" in result.stdout
    assert f"predictions.model_stages.{stage}.time_breakdown_s.invented: warning: stale: stored, but" in result.stdout
    assert result.stdout.count("warning: stale") == 3, result.stdout
    assert invoke("check", "--strict", str(path)).exit_code == 1


def test_a_negative_byte_count_in_predictions_is_an_error(plan_file: Path, tmp_path: Path) -> None:
    def edit(predictions: dict[str, Any]) -> None:
        predictions["model_stages"]["actor/training"]["memory_breakdown_bytes"]["optimizer"] = -1

    result = invoke("check", str(_edited(plan_file, tmp_path, edit)))
    assert result.exit_code == 1, result.output
    assert "memory_breakdown_bytes.optimizer" in result.stdout and "greater than or equal to 0" in result.stdout


def test_plan_cli_does_not_import_torch(tmp_path: Path) -> None:
    """`nereus --help`, `plan` and `check` run without importing torch, vLLM or transformers (a fresh
    interpreter), whether or not they are installed."""
    out = tmp_path / "p.yaml"
    script = textwrap.dedent(f"""
        import sys
        import nereus.spec, nereus.cost, nereus.solver
        import nereus.solver.plan_search, nereus.solver.planner
        from nereus.cli.app import app
        for argv in (["--help"], ["plan", "--gpus", "16", "-o", {str(out)!r}], ["check", {str(out)!r}],
                     ["plan", "explain", {str(out)!r}]):
            try:
                code = app(argv, prog_name="nereus", standalone_mode=False)
            except SystemExit as exc:
                code = exc.code
            assert code in (None, 0), (argv, code)
        print(sorted(m for m in ("torch", "vllm", "transformers") if m in sys.modules))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert out.is_file()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--gpus", "1000000"], "cluster preset 'h100': 1000000 GPUs; nereus handles clusters of at most 16384"),
        (["--cluster", "h100-99999x8"], "799992 GPUs; nereus handles clusters of at most 16384"),
    ],
)
def test_a_cluster_too_large_to_search_is_refused_at_once(args: list[str], expected: str) -> None:
    """Found by the careless-input test: these searched for minutes (or overflowed) before."""
    assert_one_line_error(invoke("plan", *args), expected)


def test_top_is_bounded() -> None:
    """Found by the careless-input test: `--top 15756` searched and built plans for 40 s."""
    from nereus.cli.plan_commands import MAX_TOP

    refused = invoke("plan", "--top", str(MAX_TOP + 1))
    assert refused.exit_code == 2 and "'--top'" in refused.output  # a usage error (typer's range check)
    listed = invoke("plan", "--top", str(MAX_TOP), "--json")
    assert listed.exit_code == 0, listed.output
    assert len(json.loads(listed.stdout)["alternatives"]) == MAX_TOP - 1


def test_a_cluster_file_too_large_is_a_schema_error(tmp_path: Path) -> None:
    data = yaml.safe_load((EXAMPLES / "cluster-h100-2x8.yaml").read_text())
    data["gpus_per_node"] = 10**30
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert_one_line_error(
        invoke("plan", "--cluster", str(path)), "gpus_per_node: Input should be less than or equal to 16384"
    )

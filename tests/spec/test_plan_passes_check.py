"""`nereus plan` never writes a file `nereus check` rejects (issue 47).

A property over random Model and Workload documents, valid ones and careless ones (KV heads
not dividing the heads, odd head widths, reversed llama3 bands, sequences past the model's
positions, groups of one, a critic under grpo, lengths out of order, ...): whenever `plan`
exits 0 with `-o`, `check` finds that file ok; otherwise `plan` refuses, exit 1, one line
per problem, and writes nothing. The model comes as a Model YAML or as a Hugging Face
config.json (Llama, Qwen2, Qwen3) holding the same shapes. The examples are the same on
every run (derandomized); each plans a small model on two GPUs, about 10 s of CPU in all.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.spec.check import check_file

pytestmark = pytest.mark.cli


#: The careless edits, one per example (None: none).
FAULTS = [
    None,
    "kv_heads",
    "odd_head_dim",
    "hidden",
    "llama3_bands",
    "positions",
    "group_of_one",
    "critic",
    "lengths_out_of_order",
    "mini_batches",
]


@st.composite
def documents(draw: st.DrawFn, fault: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Model document `m` and a Workload of it: consistent, but for the careless edit `fault`."""
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    model: dict[str, Any] = {
        "kind": "Model",
        "version": 1,
        "name": "m",
        "num_layers": draw(st.integers(1, 4)),
        "hidden_dim": heads * head_dim,
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": head_dim,
        "ffn_dim": draw(st.sampled_from([64, 128, 256])),
        "vocab_size": draw(st.sampled_from([64, 128, 512])),
        "tied_embeddings": draw(st.booleans()),
        "max_positions": draw(st.sampled_from([512, 2048, 8192])),
    }
    scaling = draw(st.sampled_from([None, "linear", "llama3"]))
    if scaling == "linear":
        model["rope_scaling"] = {"type": "linear", "factor": draw(st.sampled_from([1.0, 2.0, 4.0]))}
    elif scaling == "llama3" or fault == "llama3_bands":
        low, high = (4.0, 1.0) if fault == "llama3_bands" else (1.0, 4.0)
        model["rope_scaling"] = {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_positions": 256,
        }
    if fault == "kv_heads":
        model["num_kv_heads"] = draw(st.integers(1, 8).filter(lambda n: heads % n))
    if fault == "odd_head_dim":
        model["head_dim"] = draw(st.sampled_from([3, 15, 31]))
    if fault == "hidden":
        model["hidden_dim"] = draw(st.integers(8, 300))  # a Model document gives head_dim itself: no fault

    algorithm = draw(st.sampled_from(["ppo", "grpo", "remax"]))
    median = draw(st.integers(1, 64))
    p99 = median + draw(st.integers(0, 128))
    prompt_len = draw(st.sampled_from([8, 64, 256]))
    longest = p99 + draw(st.integers(0, 512))
    if fault == "positions":
        longest = max(p99, 16384 - prompt_len + draw(st.integers(1, 1000)))
    samples = 1 if fault == "group_of_one" else draw(st.sampled_from([2, 4])) if algorithm == "grpo" else 1
    workload: dict[str, Any] = {
        "kind": "Workload",
        "version": 1,
        "name": "w",
        "algorithm": algorithm,
        "actor": "m",
        "reference": draw(st.sampled_from(["m", None])),
        "reward": draw(st.sampled_from(["m", None])),
        "prompts_per_step": draw(st.sampled_from([4, 8, 16])),
        "samples_per_prompt": samples,
        "prompt_len": prompt_len,
        "response_len": {
            "median": median,
            "p99": p99,
            "max": max(1, median - 1) if fault == "lengths_out_of_order" else longest,
        },
        "mini_batches": 3 if fault == "mini_batches" else draw(st.sampled_from([1, 2, 4])),
        "micro_batch_size": draw(st.sampled_from([1, 2])),
        "dtype": draw(st.sampled_from(["bf16", "fp32"])),
    }
    if (algorithm == "ppo") != (fault == "critic"):
        workload["critic"] = "m"
    return model, workload


def as_hf_config(model: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The Model document as the config.json of a Hugging Face folder of `model_type`."""
    config = {
        "model_type": model_type,
        "num_hidden_layers": model["num_layers"],
        "hidden_size": model["hidden_dim"],
        "num_attention_heads": model["num_heads"],
        "num_key_value_heads": model["num_kv_heads"],
        "head_dim": model["head_dim"],
        "intermediate_size": model["ffn_dim"],
        "vocab_size": model["vocab_size"],
        "tie_word_embeddings": model["tied_embeddings"],
        "max_position_embeddings": model["max_positions"],
        "sliding_window": None,
    }
    if model["hidden_dim"] == model["num_heads"] * model["head_dim"] and model_type != "qwen3":
        del config["head_dim"]  # derived from the hidden size, as most published configs leave it
    scaling = model.get("rope_scaling")
    if scaling is not None:
        block = {key: value for key, value in scaling.items() if key != "type"}
        if "original_max_positions" in block:
            block["original_max_position_embeddings"] = block.pop("original_max_positions")
        config["rope_scaling"] = {"rope_type": scaling["type"], **block}
    return config


@pytest.mark.parametrize("form", [None, "llama", "qwen2", "qwen3"], ids=["yaml", "hf-llama", "hf-qwen2", "hf-qwen3"])
@pytest.mark.parametrize("fault", FAULTS)
def test_plan_never_writes_a_file_check_rejects(fault: str | None, form: str | None) -> None:
    """`form`: the model as a Model YAML (None) or as the config.json of that model type."""

    @settings(
        max_examples=4 if fault is None else 1,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(documents=documents(fault))
    def plan_then_check(documents: tuple[dict[str, Any], dict[str, Any]]) -> None:
        plan_and_check(*documents, form)

    plan_then_check()


def plan_and_check(model: dict[str, Any], workload: dict[str, Any], form: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source = folder / "model.yaml"
        if form is None:
            source.write_text(yaml.safe_dump(model), encoding="utf-8")
        else:
            source = folder / "m"
            source.mkdir()
            (source / "config.json").write_text(json.dumps(as_hf_config(model, form)), encoding="utf-8")
        (folder / "workload.yaml").write_text(yaml.safe_dump(workload), encoding="utf-8")
        out = folder / "plan.yaml"
        args = ["plan", "--model", str(source), "--workload", str(folder / "workload.yaml")]
        result = CliRunner().invoke(app, [*args, "--cluster", "h100", "--gpus", "2", "-o", str(out)])
        assert result.exit_code in (0, 1), result.output
        if result.exit_code == 0:
            checked = check_file(out)
            assert checked.ok, checked.errors
        else:
            lines = result.stderr.strip().splitlines()
            assert lines and all(line.startswith("error: ") for line in lines), result.output
            assert "Traceback" not in result.output
            assert not out.exists()

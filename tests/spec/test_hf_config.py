"""Hugging Face config.json -> Model: every field that changes the numbers is read, in both
RoPE formats, and an option nereus does not implement is refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.errors import NereusError
from nereus.spec.hf_config import model_from_hf_config
from nereus.spec.model import LinearRopeScaling, Llama3RopeScaling

LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_type": "llama3",
}

pytestmark = pytest.mark.logic


def _base(model_type: str, **fields: Any) -> dict[str, Any]:
    config = {
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 96,
    }
    return {**config, **fields}


def _write(tmp_path: Path, config: dict[str, Any], folder: str = "m") -> Path:
    path = tmp_path / folder
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def test_both_rope_formats_give_the_same_model(tmp_path: Path) -> None:
    old = _base("llama", rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, rms_norm_eps=1e-5)
    old["max_position_embeddings"] = 256
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {**LLAMA3_SCALING, "rope_theta": 500000.0}
    a = model_from_hf_config(_write(tmp_path, old, "old"), name="x")
    b = model_from_hf_config(_write(tmp_path, new, "new") / "config.json", name="x")
    assert a == b
    assert a.rope_theta == 500000.0 and a.rms_norm_eps == 1e-5 and a.max_positions == 256
    assert a.rope_scaling == Llama3RopeScaling(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_positions=64
    )


def test_defaults_are_transformers_per_model_type(tmp_path: Path) -> None:
    model = model_from_hf_config(_write(tmp_path, _base("qwen2", tie_word_embeddings=True)))
    # Qwen2Config: eps 1e-6, theta 10000, 32768 positions; q/k/v biases always.
    assert (model.rms_norm_eps, model.rope_theta, model.max_positions) == (1e-6, 10000.0, 32768)
    assert model.qkv_bias and model.tied_embeddings and not model.qk_norm
    assert model.rope_scaling is None and model.activation == "silu"


def test_linear_scaling_default_rope_type_and_activation(tmp_path: Path) -> None:
    config = _base("qwen3", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6})
    config["hidden_act"] = "gelu_pytorch_tanh"
    model = model_from_hf_config(_write(tmp_path, config))
    assert model.rope_scaling == LinearRopeScaling(type="linear", factor=2.0)
    assert model.rope_theta == 1e6 and model.activation == "gelu_pytorch_tanh" and model.qk_norm
    plain = model_from_hf_config(_write(tmp_path, _base("llama", rope_scaling={"type": "default"}), "plain"))
    assert plain.rope_scaling is None


def test_mistral_without_sliding_window_is_read(tmp_path: Path) -> None:
    model = model_from_hf_config(_write(tmp_path, _base("mistral", sliding_window=None)))
    assert model.max_positions == 131072 and not model.qkv_bias


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"model_type": "gemma"}, "model_type: 'gemma'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type: 'yarn'"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type: 'dynamic'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor: missing"),
        ({"rope_theta": "big"}, "rope_theta: 'big'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "relu2"}, "hidden_act: 'relu2'"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ],
)
def test_unimplemented_options_are_refused_by_name(tmp_path: Path, fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(NereusError, match="config.json: " + fragment.replace("(", r"\(").replace(".", r"\.")):
        model_from_hf_config(_write(tmp_path, {**_base("llama"), **fields}))


@pytest.mark.parametrize("fields", [{}, {"sliding_window": 4096}])
def test_mistral_sliding_window_is_refused(tmp_path: Path, fields: dict[str, Any]) -> None:
    with pytest.raises(NereusError, match="sliding_window"):
        model_from_hf_config(_write(tmp_path, _base("mistral", **fields)))


def test_qwen_sliding_window_is_refused(tmp_path: Path) -> None:
    with pytest.raises(NereusError, match="use_sliding_window"):
        model_from_hf_config(_write(tmp_path, _base("qwen2", use_sliding_window=True)))


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(NereusError, match=r"config\.json: not found"):
        model_from_hf_config(tmp_path)


@pytest.mark.cli
@pytest.mark.parametrize("suffix", ["", "/config.json"])
def test_plan_accepts_a_folder_or_its_config(tmp_path: Path, suffix: str) -> None:
    folder = _write(tmp_path, _base("qwen2", tie_word_embeddings=True, rope_theta=1e6), "tiny-qwen")
    out = tmp_path / "plan.yaml"
    result = CliRunner().invoke(
        app, ["plan", "--model", f"{folder}{suffix}", "--workload", "grpo", "--gpus", "2", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    text = out.read_text(encoding="utf-8")
    assert "rope_theta: 1.0e+06" in text and "qkv_bias: true" in text


@pytest.mark.cli
def test_plan_refuses_an_unimplemented_option_in_one_line(tmp_path: Path) -> None:
    folder = _write(tmp_path, _base("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    result = CliRunner().invoke(app, ["plan", "--model", str(folder), "--gpus", "2"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "rope_scaling.rope_type: 'yarn'" in lines[0], result.stderr

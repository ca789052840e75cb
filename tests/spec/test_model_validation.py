"""Model configs validated as transformers validates them (issue 47): head widths, KV heads,
the two RoPE formats in one file, and the positions a workload's sequences need.

The configs are written by transformers' own config classes (`save_pretrained`), and what
transformers makes of the same file is read back with `AutoConfig.from_pretrained` and
compared with what nereus makes of it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from check_lines import names_file
from repo_paths import EXAMPLES
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.errors import NereusError
from nereus.spec.check import check_file
from nereus.spec.hf_config import model_from_hf_config
from nereus.spec.model import LinearRopeScaling, Llama3RopeScaling, Model
from nereus.spec.presets import model_preset

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.logic

#: Small layers and vocabulary: only the attention shapes matter to these rules.
SMALL: dict[str, Any] = {"num_hidden_layers": 2, "intermediate_size": 256, "vocab_size": 128}
#: Qwen2.5-7B's shapes (its config.json), max_position_embeddings aside.
QWEN25_7B: dict[str, Any] = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
    "vocab_size": 152064,
    "rope_theta": 1e6,
}
#: Qwen3-8B's shapes (its config.json).
QWEN3_8B: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 36,
    "vocab_size": 151936,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1e6,
}


def saved(folder: Path, class_name: str, **fields: Any) -> Path:
    """A config.json written by `transformers.<class_name>(**fields).save_pretrained`."""
    if class_name == "MistralConfig":
        fields.setdefault("sliding_window", None)
    getattr(transformers, class_name)(**fields).save_pretrained(folder)
    return folder


def edited(folder: Path, **changes: Any) -> Path:
    """The folder's config.json with keys changed (None: removed)."""
    path = folder / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(changes)
    config = {key: value for key, value in config.items() if value is not None or key not in changes}
    path.write_text(json.dumps(config), encoding="utf-8")
    return folder


def transformers_reads(folder: Path) -> Any:
    """transformers' config of the folder (its warnings silenced)."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers.AutoConfig.from_pretrained(folder)


def plan(*args: str | Path) -> Any:
    return CliRunner().invoke(app, ["plan", *map(str, args)])


def refused_in_one_line(result: Any, *parts: str) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert all(part in lines[0] for part in parts), (parts, lines[0])
    return str(lines[0])


# ---- the issue's three architectures ----


def test_kv_heads_not_dividing_the_heads_is_refused_by_plan(tmp_path: Path) -> None:
    """32 query heads over 5 KV heads planned (exit 0) and wrote a plan `check` rejected."""
    folder = saved(tmp_path / "m", "Qwen2Config", hidden_size=4096, num_attention_heads=32, num_key_value_heads=5)
    out = tmp_path / "plan.yaml"
    refused_in_one_line(
        plan("--model", folder, "--gpus", "8", "-o", out),
        "config.json: num_key_value_heads: 5 KV heads do not divide 32 query heads",
    )
    assert not out.exists()
    # transformers' config class takes it; its attention cannot run it (32 // 5 = 6 repeats
    # of 5 KV heads are 30 heads for 32 queries).
    assert transformers_reads(folder).num_key_value_heads == 5


def test_hidden_size_not_a_multiple_of_the_heads_is_refused_as_llama_refuses_it(tmp_path: Path) -> None:
    """hidden 4000 over 24 heads planned with head_dim 166; transformers' LlamaConfig refuses it."""
    folder = saved(tmp_path / "m", "LlamaConfig", hidden_size=4096, num_attention_heads=32, **SMALL)
    edited(folder, hidden_size=4000, num_attention_heads=24, num_key_value_heads=8, head_dim=None)
    with pytest.raises(Exception, match=r"hidden size \(4000\) is not a multiple"):
        transformers_reads(folder)
    refused_in_one_line(
        plan("--model", folder, "--gpus", "8"),
        "hidden_size: 4000 is not a multiple of num_attention_heads 24; transformers' LlamaConfig refuses it",
    )
    # an explicit head_dim does not save it: LlamaConfig checks the hidden size all the same
    edited(folder, head_dim=128)
    with pytest.raises(Exception, match="not a multiple"):
        transformers_reads(folder)
    with pytest.raises(NereusError, match="hidden_size: 4000 is not a multiple"):
        model_from_hf_config(folder)


@pytest.mark.parametrize(
    ("class_name", "hidden", "heads", "kv", "floored"),
    [("Qwen2Config", 4000, 24, 8, 166), ("Qwen2Config", 4096, 30, 6, 136), ("MistralConfig", 4096, 30, 30, 136)],
)
def test_a_floored_head_dim_is_refused_naming_head_dim(
    tmp_path: Path, class_name: str, hidden: int, heads: int, kv: int, floored: int
) -> None:
    """Qwen2's and Mistral's config classes take 4000 / 24 or 4096 / 30 and floor the head width
    (MistralConfig writes the floored head_dim into the file; a file without it floors the
    same); nereus asks for an explicit head_dim, which gives both the same network."""
    shapes = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, **SMALL)
    folder = edited(saved(tmp_path / "m", class_name, **shapes), head_dim=None)
    config = transformers_reads(folder)
    assert (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads) == floored
    refused_in_one_line(
        plan("--model", folder, "--gpus", "8"),
        f"hidden_size: {hidden} is not a multiple of num_attention_heads {heads}; set head_dim "
        f"(transformers would floor it to {floored})",
    )
    model = model_from_hf_config(edited(folder, head_dim=floored))
    assert (model.head_dim, model.hidden_dim, model.num_heads) == (floored, hidden, heads)


# ---- what transformers takes, nereus takes the same way ----

#: (config class, hidden, heads, KV heads, head_dim or None) over the rules' edges.
SHAPES = [
    (class_name, *shape)
    for class_name in ("LlamaConfig", "Qwen2Config", "Qwen3Config", "MistralConfig")
    for shape in [
        (64, 4, 2, None),  # plain GQA
        (64, 4, 4, None),  # no GQA
        (64, 4, 3, None),  # KV heads not dividing
        (96, 4, 1, 16),  # multi-query, explicit head_dim
        (60, 4, 2, None),  # head width 15: odd
        (4000, 24, 8, None),  # not a multiple, no head_dim
        (4000, 24, 8, 128),  # not a multiple, head_dim given
        (4096, 32, 8, 64),  # head_dim below hidden / heads (Qwen3-style)
    ]
]


@pytest.mark.parametrize(("class_name", "hidden", "heads", "kv", "head_dim"), SHAPES)
def test_nereus_takes_what_transformers_takes_with_its_shapes(
    tmp_path: Path, class_name: str, hidden: int, heads: int, kv: int, head_dim: int | None
) -> None:
    """Every config transformers refuses, nereus refuses; every one nereus takes, transformers
    takes with the same head width and KV heads. nereus refuses more only where transformers'
    network could not run or would floor the head width (docs/hf-models.md)."""
    fields = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, **SMALL)
    base = dict(fields, hidden_size=heads * 16)  # a shape every config class takes
    folder = edited(saved(tmp_path / "m", class_name, **base), hidden_size=hidden, head_dim=head_dim)
    try:
        theirs = transformers_reads(folder)
    except Exception:  # transformers' validators raise their own classes
        theirs = None
    try:
        ours: Model | None = model_from_hf_config(folder)
    except NereusError as error:
        ours, why = None, str(error)
    if theirs is None:
        assert ours is None
        return
    their_head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    if ours is not None:
        assert (ours.head_dim, ours.num_kv_heads, ours.num_heads) == (their_head_dim, kv, heads)
        return
    stricter = ("KV heads do not divide", "is odd", "set head_dim (transformers would floor it")
    assert any(reason in why for reason in stricter), why


# ---- two RoPE formats in one config ----

L3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
ROPE_CASES: dict[str, dict[str, Any]] = {
    "block-theta-over-top-theta": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 5e5},
    "top-theta-fills-the-block": {"rope_parameters": {"rope_type": "default"}, "rope_theta": 5e5},
    "scaling-replaces-parameters": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "rope_theta": 5e5,
    },
    "scaling-llama3-over-linear": {
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "rope_scaling": L3,
        "rope_theta": 5e5,
    },
    "scaling-with-its-own-theta": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "rope_scaling": {**L3, "rope_theta": 7e5},
    },
    "null-scaling-keeps-parameters": {
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "rope_scaling": None,
        "rope_theta": 5e5,
    },
    "empty-scaling-keeps-parameters": {
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "rope_scaling": {},
        "rope_theta": 5e5,
    },
    "default-scaling-drops-linear": {
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "rope_scaling": {"type": "default"},
        "rope_theta": 5e5,
    },
    "llama3-original-from-max-positions": {
        "rope_scaling": {key: value for key, value in L3.items() if key != "original_max_position_embeddings"},
        "rope_theta": 5e5,
    },
    "nested-by-layer-type": {
        "num_hidden_layers": 2,
        "layer_types": ["full_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 3e5}},
    },
}


def expected_rope(parameters: dict[str, Any]) -> tuple[float, LinearRopeScaling | Llama3RopeScaling | None]:
    """The (theta, scaling) of transformers' standardised `rope_parameters`."""
    if "full_attention" in parameters:
        parameters = parameters["full_attention"]
    kind = parameters["rope_type"]
    scaling: LinearRopeScaling | Llama3RopeScaling | None = None
    if kind == "linear":
        scaling = LinearRopeScaling(type="linear", factor=parameters["factor"])
    elif kind == "llama3":
        scaling = Llama3RopeScaling(
            type="llama3",
            factor=parameters["factor"],
            low_freq_factor=parameters["low_freq_factor"],
            high_freq_factor=parameters["high_freq_factor"],
            original_max_positions=parameters["original_max_position_embeddings"],
        )
    return float(parameters["rope_theta"]), scaling


@pytest.mark.parametrize("class_name", ["LlamaConfig", "Qwen2Config", "Qwen3Config"])
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_formats_in_one_config_read_as_transformers_reads_them(tmp_path: Path, class_name: str, case: str) -> None:
    """Where `rope_parameters` and a top-level `rope_theta`/`rope_scaling` disagree, nereus
    follows transformers' precedence: the same theta and scaling from the same file."""
    shapes = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    folder = edited(saved(tmp_path / "m", class_name, **shapes), rope_parameters=None, rope_theta=None)
    path = folder / "config.json"
    config = {**json.loads(path.read_text(encoding="utf-8")), **ROPE_CASES[case]}
    path.write_text(json.dumps(config), encoding="utf-8")
    model = model_from_hf_config(folder)
    assert (model.rope_theta, model.rope_scaling) == expected_rope(transformers_reads(folder).rope_parameters)


def test_the_issue_rope_case_takes_transformers_second_format(tmp_path: Path) -> None:
    """nereus took `rope_parameters`; transformers 5.23 takes the top-level rope_scaling/rope_theta."""
    folder = saved(tmp_path / "m", "LlamaConfig", hidden_size=64, num_attention_heads=4, max_position_embeddings=256)
    edited(
        folder,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_theta=5e5,
    )
    model = model_from_hf_config(folder)
    assert model.rope_theta == 5e5 and model.rope_scaling == LinearRopeScaling(type="linear", factor=2.0)


def test_layer_types_must_name_every_layer(tmp_path: Path) -> None:
    folder = saved(tmp_path / "m", "Qwen3Config", hidden_size=64, num_attention_heads=4, **SMALL)
    edited(folder, layer_types=["full_attention"] * 3)
    with pytest.raises(Exception, match="must be equal to the number of `layer_types`"):
        transformers_reads(folder)
    with pytest.raises(NereusError, match="layer_types: 3 entries for num_hidden_layers 2"):
        model_from_hf_config(folder)


def test_reversed_llama3_bands_are_refused(tmp_path: Path) -> None:
    folder = saved(tmp_path / "m", "LlamaConfig", hidden_size=64, num_attention_heads=4, **SMALL)
    edited(folder, rope_parameters={**L3, "low_freq_factor": 4.0, "high_freq_factor": 4.0, "rope_theta": 5e5})
    with pytest.raises(NereusError, match=r"rope_parameters\.high_freq_factor: 4.0 is not above low_freq_factor 4.0"):
        model_from_hf_config(folder)


# ---- positions ----


@pytest.mark.cli
def test_a_workload_longer_than_max_position_embeddings_is_refused_by_plan(tmp_path: Path) -> None:
    """A Qwen2.5-7B-shaped config with 4096 positions planned under grpo (1024 + 8192 tokens)."""
    folder = saved(tmp_path / "qwen", "Qwen2Config", **QWEN25_7B, max_position_embeddings=4096)
    out = tmp_path / "plan.yaml"
    refused_in_one_line(
        plan("--model", folder, "--workload", "grpo", "--gpus", "8", "-o", out),
        "prompt_len 1024 + response_len.max 8192 = 9216 tokens",
        "max_positions 4096 (max_position_embeddings)",
        "at most 3072",
    )
    assert not out.exists()


@pytest.mark.cli
def test_seq_len_beyond_the_positions_is_refused(tmp_path: Path) -> None:
    """`--seq-len 100000` on Qwen3-8B (40960 positions) planned."""
    folder = saved(tmp_path / "qwen3", "Qwen3Config", **QWEN3_8B)
    refused_in_one_line(
        plan("--model", folder, "--gpus", "8", "--seq-len", "100000"),
        "1024 + response_len.max 100000 = 101024 tokens",
        "max_positions 40960",
        "at most 39936",
    )


@pytest.mark.cli
def test_the_llama_2_preset_is_refused_under_grpo() -> None:
    assert model_preset("llama-2-7b").max_positions == 4096
    refused_in_one_line(
        plan("--model", "llama-2-7b", "--workload", "grpo", "--gpus", "8"),
        "9216 tokens exceed model llama-2-7b's max_positions 4096",
    )


@pytest.mark.cli
def test_linear_scaling_extends_the_positions_llama3_does_not(tmp_path: Path) -> None:
    """Linear RoPE scaling stretches max_position_embeddings by its factor (4096 x 4 takes the
    9216 tokens of grpo); llama3's max_position_embeddings already is its extended context."""
    shapes = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **SMALL)
    linear = saved(tmp_path / "linear", "LlamaConfig", **shapes, max_position_embeddings=4096)
    edited(linear, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    assert model_from_hf_config(linear).position_limit() == 16384
    out = tmp_path / "plan.yaml"
    result = plan("--model", linear, "--workload", "grpo", "--gpus", "2", "-o", out)
    assert result.exit_code == 0, result.output
    assert check_file(out).ok, check_file(out).errors
    refused_in_one_line(
        plan("--model", linear, "--workload", "grpo", "--gpus", "2", "--seq-len", "16000"),
        "= 17024 tokens exceed model",
        "16384 positions (max_positions 4096 x rope_scaling.factor 4)",
        "at most 15360",
    )
    llama3 = saved(tmp_path / "llama3", "LlamaConfig", **shapes, max_position_embeddings=4096)
    edited(llama3, rope_parameters={**L3, "original_max_position_embeddings": 1024, "rope_theta": 5e5})
    assert model_from_hf_config(llama3).position_limit() == 4096
    refused_in_one_line(plan("--model", llama3, "--workload", "grpo", "--gpus", "2"), "max_positions 4096")


def test_the_presets_positions_are_their_published_configs() -> None:
    """max_position_embeddings of each preset's published config.json."""
    published = {
        "llama-3.1-8b": 131072,
        "llama-3.3-70b": 131072,
        "qwen3-8b": 40960,
        "qwen3-14b": 40960,
        "qwen3-32b": 40960,
        "qwen3-30b-a3b": 40960,
        "llama-2-7b": 4096,
        "llama-13b": 2048,
        "llama-33b": 2048,
        "llama-65b": 2048,
    }
    assert {name: model_preset(name).position_limit() for name in published} == published


def test_check_refuses_a_plan_whose_workload_outgrows_its_model(tmp_path: Path) -> None:
    """`nereus check` on a plan file applies the same rule as `plan` and `run`."""
    source = yaml.safe_load((EXAMPLES / "plan-tiny-ppo-4rank.yaml").read_text(encoding="utf-8"))
    source["workload"]["response_len"]["max"] = 2100
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(source), encoding="utf-8")
    result = check_file(path)
    line = next(line for line in result.errors if "response_len.max" in line)
    assert names_file(line, path)
    assert "16 + response_len.max 2100 = 2116 tokens exceed model tiny's max_positions 2048" in line

"""Presets and examples survive save -> load unchanged; parameter counts match public figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo_paths import EXAMPLES

from nereus.errors import NereusError
from nereus.spec import Cluster, Document, load_document, save_document, to_json, to_yaml
from nereus.spec.presets import GPU_KINDS, MODELS, WORKLOAD_NAMES, cluster_preset, model_from_hf_config, workload_preset

pytestmark = pytest.mark.logic

EXAMPLES = EXAMPLES
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def _documents() -> list[tuple[str, Document]]:
    docs: list[tuple[str, Document]] = [(f"model:{name}", model) for name, model in MODELS.items()]
    docs += [(f"workload:{name}", workload_preset(name)) for name in WORKLOAD_NAMES]
    docs += [(f"workload:grpo@{actor}", workload_preset("grpo", actor)) for actor in ("qwen3-14b", "tiny")]
    docs += [(f"cluster:{gpu}@{n}", cluster_preset(gpu, n)) for gpu in GPU_KINDS for n in (8, 64)]
    docs += [("cluster:h100-sxm-8x8", cluster_preset("h100-sxm-8x8"))]
    docs += [(f"example:{path.name}", load_document(path)) for path in EXAMPLE_FILES]
    return docs


DOCUMENTS = _documents()
IDS = [name for name, _ in DOCUMENTS]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
@pytest.mark.parametrize(("name", "document"), DOCUMENTS, ids=IDS)
def test_save_load_roundtrip(tmp_path: Path, name: str, document: Document, suffix: str) -> None:
    path = tmp_path / f"doc{suffix}"
    save_document(document, path)
    loaded = load_document(path)
    assert type(loaded) is type(document)
    assert loaded == document
    # A second round writes the same bytes: the format is a fixed point.
    again = tmp_path / f"again{suffix}"
    save_document(loaded, again)
    assert again.read_text(encoding="utf-8") == path.read_text(encoding="utf-8")
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(("name", "document"), DOCUMENTS, ids=IDS)
def test_yaml_starts_with_kind_then_version(name: str, document: Document) -> None:
    lines = to_yaml(document).splitlines()
    assert lines[0] == f"kind: {document.kind}"  # type: ignore[attr-defined]
    assert lines[1] == "version: 1"


@pytest.mark.parametrize(("name", "document"), DOCUMENTS, ids=IDS)
def test_json_starts_with_kind_then_version(name: str, document: Document) -> None:
    data = json.loads(to_json(document))
    assert list(data)[:2] == ["kind", "version"]
    assert data["kind"] == document.kind  # type: ignore[attr-defined]
    assert data["version"] == 1


def test_yaml_of_model_is_block_style_one_field_per_line() -> None:
    """A model's fields are all scalars; it is still written as `key: value` lines, not `{...}`."""
    model = MODELS["llama-3.1-8b"]
    lines = to_yaml(model).splitlines()
    assert lines[:3] == ["kind: Model", "version: 1", "name: llama-3.1-8b"]
    assert not any(line.startswith("{") for line in lines)
    assert len(lines) == len(model.model_dump(exclude_none=True))


def test_cluster_presets_are_sized_as_asked() -> None:
    for gpu in GPU_KINDS:
        for n in (8, 64):
            cluster = cluster_preset(gpu, n)
            assert isinstance(cluster, Cluster)
            assert cluster.num_gpus == n
    big = cluster_preset("h100-sxm-8x8")
    assert (big.num_nodes, big.gpus_per_node, big.num_gpus) == (8, 8, 64)


# --- parameter counts against published figures ------------------------------------------


@pytest.mark.parametrize(
    ("name", "params"),
    [("llama-3.1-8b", 8_030_261_248), ("llama-2-7b", 6_738_415_616), ("llama-3.3-70b", 70_553_706_496)],
)
def test_exact_parameter_counts(name: str, params: int) -> None:
    assert MODELS[name].num_params() == params


@pytest.mark.parametrize(
    ("name", "low", "high"), [("qwen3-8b", 8.1e9, 8.3e9), ("qwen3-14b", 14.7e9, 14.9e9), ("qwen3-32b", 32.7e9, 32.9e9)]
)
def test_qwen3_parameter_counts(name: str, low: float, high: float) -> None:
    assert low <= MODELS[name].num_params() <= high


def test_value_head_replaces_lm_head() -> None:
    model = MODELS["llama-3.1-8b"]
    lm = model.vocab_size * model.hidden_dim
    assert model.num_params("lm") - model.num_params("value") == lm - model.hidden_dim - 1


# --- Hugging Face config.json --------------------------------------------------------------


def _write_config(tmp_path: Path, folder: str, config: dict[str, object]) -> Path:
    path = tmp_path / folder / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def test_hf_llama_config_matches_preset(tmp_path: Path) -> None:
    path = _write_config(
        tmp_path,
        "Llama-3.1-8B",
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rms_norm_eps": 1e-05,
            "max_position_embeddings": 131072,
            "torch_dtype": "bfloat16",
        },
    )
    model = model_from_hf_config(path)
    assert model.name == "Llama-3.1-8B"
    assert model.model_copy(update={"name": "llama-3.1-8b"}) == MODELS["llama-3.1-8b"]
    assert model.num_params() == 8_030_261_248
    assert model_from_hf_config(path, name="mine").name == "mine"


def test_hf_qwen2_config_has_qkv_bias(tmp_path: Path) -> None:
    path = _write_config(
        tmp_path,
        "Qwen2.5-0.5B",
        {
            "model_type": "qwen2",
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_attention_heads": 14,
            "num_hidden_layers": 24,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
        },
    )
    model = model_from_hf_config(path)
    assert model.qkv_bias and not model.qk_norm and model.tied_embeddings
    assert (model.num_heads, model.num_kv_heads, model.head_dim) == (14, 2, 64)
    assert model.num_params() == 494_032_768  # Qwen2.5-0.5B, as Hugging Face counts it


def test_hf_qwen3_config_has_qk_norm_and_explicit_head_dim(tmp_path: Path) -> None:
    path = _write_config(
        tmp_path,
        "Qwen3-0.6B",
        {
            "model_type": "qwen3",
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_attention_heads": 16,
            "num_hidden_layers": 28,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "attention_bias": False,
        },
    )
    model = model_from_hf_config(path)
    assert model.qk_norm and not model.qkv_bias
    assert model.head_dim == 128  # not hidden_size // heads = 64
    assert model.num_params() == 596_049_920  # Qwen3-0.6B


def test_hf_config_of_unsupported_model_type(tmp_path: Path) -> None:
    path = _write_config(
        tmp_path,
        "gpt2",
        {
            "model_type": "gpt2",
            "n_embd": 768,
            "n_head": 12,
            "n_layer": 12,
            "vocab_size": 50257,
        },
    )
    with pytest.raises(NereusError, match="gpt2"):
        model_from_hf_config(path)


def test_hf_config_missing_field_and_bad_json(tmp_path: Path) -> None:
    path = _write_config(
        tmp_path,
        "no-vocab",
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 172,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
        },
    )
    with pytest.raises(NereusError, match="vocab_size"):
        model_from_hf_config(path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(NereusError):
        model_from_hf_config(bad)


def test_hf_config_with_zero_heads_is_a_user_error(tmp_path: Path) -> None:
    path = _write_config(
        tmp_path,
        "zero-heads",
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 172,
            "num_attention_heads": 0,
            "num_hidden_layers": 2,
            "vocab_size": 64,
        },
    )
    with pytest.raises(NereusError, match="num_attention_heads"):
        model_from_hf_config(path)

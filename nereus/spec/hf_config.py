"""A Model document from a Hugging Face `config.json` (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral).

Every field that changes what the network computes is read, or the config is refused with
one line naming the field: an option nereus does not implement (a sliding window, YaRN
RoPE, an o_proj bias, ...) is never dropped silently. Both RoPE formats in use are read:
`rope_theta` + `rope_scaling` (checkpoints published so far) and the `rope_parameters`
block transformers 5 writes; a file holding both is read with transformers 5.23's
precedence (`rope_from_hf`). The shapes are held to transformers' rules, and to the few more
a network transformers could not run or would silently change needs (docs/hf-models.md).

A key a config leaves out takes the value transformers' config class gives it (its
defaults, per model type, are in `HF_DEFAULTS`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

from pydantic import ValidationError

from nereus.errors import NereusError
from nereus.spec.check import experts_rule, gqa_rule, head_dim_rule, llama3_rule, model_problems
from nereus.spec.model import Activation, LinearRopeScaling, Llama3RopeScaling, Model, MoE, RopeScaling

HF_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")
#: Model types whose attention normalises queries and keys per head.
_QK_NORM_TYPES = ("qwen3", "qwen3_moe")
CONFIG_NAME = "config.json"

_COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "sliding_window": None,
    "use_sliding_window": False,
    "head_dim": None,
    "num_key_value_heads": None,
}
#: What transformers' config class of each model type assumes for a key the file lacks.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON_DEFAULTS, "max_position_embeddings": 2048},
    "qwen2": {**_COMMON_DEFAULTS, "max_position_embeddings": 32768},
    "qwen3": {**_COMMON_DEFAULTS, "max_position_embeddings": 32768, "head_dim": 128},
    "mistral": {**_COMMON_DEFAULTS, "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen3_moe": {
        **_COMMON_DEFAULTS,
        "max_position_embeddings": 32768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": None,
    },
}
#: The config.json key of each MoE field of the Model document.
_HF_MOE_FIELDS = {
    "moe.num_experts": "num_experts",
    "moe.experts_per_token": "num_experts_per_tok",
    "moe.expert_ffn_dim": "moe_intermediate_size",
    "moe.sparse_step": "decoder_sparse_step",
    "moe.dense_layers": "mlp_only_layers",
}
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def config_file(path: Path) -> Path:
    """The config.json of a Hugging Face folder, or `path` itself when it names the file."""
    if path.is_dir():
        path = path / CONFIG_NAME
        if not path.is_file():
            raise NereusError(f"{path}: not found; a Hugging Face model folder holds a config.json")
    elif not path.is_file():
        raise NereusError(f"{path}: not found; give a Hugging Face model folder or its config.json")
    return path


def read_hf_config(path: Path) -> dict[str, Any]:
    """The JSON object of a config.json (folder or file), or a NereusError naming the file."""
    path = config_file(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NereusError(f"{path}: not a readable JSON config: {exc}") from None
    if not isinstance(config, dict):
        raise NereusError(f"{path}: expected a JSON object")
    return config


def model_from_hf_config(path: Path, name: str | None = None) -> Model:
    """The Model of a Hugging Face folder or config.json (NereusError naming the field otherwise)."""
    file = config_file(path)
    config = read_hf_config(file)
    default_name = config.get("_name_or_path") or file.parent.name
    try:
        return model_from_hf_dict(config, name or default_name or "hf-model")
    except (_Refused, ValidationError) as exc:
        raise NereusError(f"{file}: {_message(exc)}") from None


class _Refused(Exception):
    """A config field nereus cannot honour: `field: why`."""


def _message(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return f"{'.'.join(str(part) for part in first['loc'])}: {first['msg']}"
    return str(exc)


def _value(config: dict[str, Any], key: str) -> Any:
    """The config's value of `key`, or transformers' default for its model type."""
    return config[key] if key in config else HF_DEFAULTS[config["model_type"]][key]


def _positive_int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _Refused(f"{key}: missing or not a positive integer")
    return value


def _optional_positive_int(config: dict[str, Any], key: str) -> int | None:
    """The config's positive integer `key`, or transformers' default for it (None when it has none)."""
    if _value(config, key) is None:
        return None
    return _positive_int({key: _value(config, key)}, key)


def model_from_hf_dict(config: dict[str, Any], name: str) -> Model:
    """The Model of a parsed config.json (raises _Refused or ValidationError on a bad field)."""
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise _Refused(
            f"model_type: {model_type!r} is not a decoder nereus implements; supported: {', '.join(HF_MODEL_TYPES)}"
        )
    sizes = {key: _positive_int(config, key) for key in _REQUIRED}
    layer_types = config.get("layer_types")
    if layer_types is not None and not isinstance(layer_types, list):
        raise _Refused(f"layer_types: expected a list, got {layer_types!r}")
    if layer_types is not None and len(layer_types) != sizes["num_hidden_layers"]:
        raise _Refused(
            f"layer_types: {len(layer_types)} entries for num_hidden_layers {sizes['num_hidden_layers']}; "
            "give one per layer (transformers refuses it too)"
        )
    _refuse_unimplemented(config)
    heads = sizes["num_attention_heads"]
    kv_heads = _optional_positive_int(config, "num_key_value_heads") or heads
    gqa = gqa_rule(heads, kv_heads)
    if gqa:
        raise _Refused(f"num_key_value_heads: {gqa}")
    theta, scaling = rope_from_hf(config)
    model = Model(
        name=name,
        num_layers=sizes["num_hidden_layers"],
        hidden_dim=sizes["hidden_size"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_head_dim(config, sizes["hidden_size"], heads),
        ffn_dim=sizes["intermediate_size"],
        vocab_size=sizes["vocab_size"],
        tied_embeddings=_value(config, "tie_word_embeddings"),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type in _QK_NORM_TYPES,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(_value(config, "rms_norm_eps")),
        activation=_activation(config),
        max_positions=_positive_int({**HF_DEFAULTS[model_type], **config}, "max_position_embeddings"),
        moe=_moe(config) if model_type == "qwen3_moe" else None,
    )
    experts = experts_rule(model)
    if experts:
        raise _Refused(f"{_HF_MOE_FIELDS[experts[0]]}: {experts[1]}")
    problem = next(model_problems(model), None)
    assert problem is None, f"a config.json rule missed: {problem}"
    return model


def _moe(config: dict[str, Any]) -> MoE:
    """The experts of a Qwen3-MoE config. transformers 5 writes `num_local_experts` where
    published checkpoints say `num_experts` (its config maps one onto the other): either is
    read, and a file giving both with different counts is refused."""
    given: dict[str, Any] = {key: config[key] for key in ("num_experts", "num_local_experts") if key in config}
    if len(set(map(repr, given.values()))) > 1:
        raise _Refused(
            f"num_local_experts: {given['num_local_experts']!r} disagrees with num_experts {given['num_experts']!r}; "
            "keep one of them"
        )
    key = next(iter(given), "num_experts")
    experts = _positive_int({key: given.get(key, _value(config, "num_experts"))}, key)
    dense = _value(config, "mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(layer, bool) or not isinstance(layer, int) for layer in dense):
        raise _Refused(f"mlp_only_layers: expected a list of layer indices, got {dense!r}")
    norm = _value(config, "norm_topk_prob")
    if not isinstance(norm, bool):
        raise _Refused(f"norm_topk_prob: expected true or false, got {norm!r}")
    moe = MoE(
        num_experts=experts,
        experts_per_token=_positive_int({**HF_DEFAULTS["qwen3_moe"], **config}, "num_experts_per_tok"),
        expert_ffn_dim=_positive_int({**HF_DEFAULTS["qwen3_moe"], **config}, "moe_intermediate_size"),
        norm_topk_prob=norm,
        sparse_step=_positive_int({**HF_DEFAULTS["qwen3_moe"], **config}, "decoder_sparse_step"),
        dense_layers=list(dense),
    )
    return moe


def _head_dim(config: dict[str, Any], hidden: int, heads: int) -> int:
    """The config's head_dim, or hidden_size / num_attention_heads, refused as transformers'
    config classes refuse it: LlamaConfig wants hidden_size a multiple of the heads even beside
    an explicit head_dim. Qwen2's and Mistral's would floor the quotient (4000 / 24 -> 166);
    nereus asks for head_dim instead, which gives both the same network."""
    head_dim = _optional_positive_int(config, "head_dim")
    if hidden % heads and (head_dim is None or config["model_type"] == "llama"):
        fix = (
            "transformers' LlamaConfig refuses it"
            if config["model_type"] == "llama"
            else f"set head_dim (transformers would floor it to {hidden // heads})"
        )
        raise _Refused(f"hidden_size: {hidden} is not a multiple of num_attention_heads {heads}; {fix}")
    head_dim = head_dim or hidden // heads
    odd = head_dim_rule(head_dim)
    if odd:
        raise _Refused(f"head_dim: {odd}")
    return head_dim


def _activation(config: dict[str, Any]) -> Activation:
    act = _value(config, "hidden_act")
    if act not in get_args(Activation):
        raise _Refused(f"hidden_act: {act!r} is not implemented; nereus has {', '.join(get_args(Activation))}")
    result: Activation = act
    return result


def _refuse_unimplemented(config: dict[str, Any]) -> None:
    """Options that change the network and that the runtime does not compute."""
    # Qwen2's q/k/v bias is implied by its model type; elsewhere attention_bias also adds an o_proj bias.
    if config["model_type"] != "qwen2" and _value(config, "attention_bias"):
        raise _Refused("attention_bias: true adds q/k/v/o biases; nereus implements q/k/v biases for qwen2 only")
    if _value(config, "mlp_bias"):
        raise _Refused("mlp_bias: true is not implemented (the MLP has no biases in nereus)")
    if config["model_type"] == "mistral" and _value(config, "sliding_window") is not None:
        raise _Refused("sliding_window: sliding-window attention is not implemented; set it to null")
    if _value(config, "use_sliding_window"):
        raise _Refused("use_sliding_window: sliding-window attention is not implemented; set it to false")
    layer_types = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise _Refused("layer_types: only full_attention layers are implemented")
    factor = config.get("partial_rotary_factor")
    if factor not in (None, 1, 1.0):
        raise _Refused(f"partial_rotary_factor: {factor} is not implemented (RoPE on the whole head only)")


def rope_from_hf(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) as transformers 5.23 reads them from either format or both: a non-empty
    top-level `rope_scaling` replaces the `rope_parameters` block whole; the theta is that
    block's `rope_theta`, else the top-level `rope_theta`, else the model type's default. A
    block nested by layer type (`{"full_attention": {...}}`) is read for full attention."""
    if config.get("rope_scaling"):
        block, field = config["rope_scaling"], "rope_scaling"
    else:
        block, field = config.get("rope_parameters"), "rope_parameters"
    if isinstance(block, dict) and "full_attention" in (config.get("layer_types") or ()) and "full_attention" in block:
        block, field = block["full_attention"], f"{field}.full_attention"
    if block is not None and not isinstance(block, dict):
        raise _Refused(f"{field}: expected an object, got {block!r}")
    block = block or {}
    theta_field = f"{field}.rope_theta" if "rope_theta" in block else "rope_theta"
    theta = block.get("rope_theta", _value(config, "rope_theta"))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise _Refused(f"{theta_field}: {theta!r} is not a positive number")
    return float(theta), _scaling(block, field, config)


def _scaling(block: dict[str, Any], field: str, config: dict[str, Any]) -> RopeScaling | None:
    kind = block.get("rope_type", block.get("type", "default"))
    if kind == "default":
        return None
    try:
        if kind == "linear":
            return LinearRopeScaling(type="linear", factor=float(block["factor"]))
        if kind == "llama3":
            # transformers puts a top-level original_max_position_embeddings first, then the
            # block's, then max_position_embeddings
            original = config.get("original_max_position_embeddings") or block.get(
                "original_max_position_embeddings", _value(config, "max_position_embeddings")
            )
            scaling = Llama3RopeScaling(
                type="llama3",
                factor=float(block["factor"]),
                low_freq_factor=float(block["low_freq_factor"]),
                high_freq_factor=float(block["high_freq_factor"]),
                original_max_positions=original,
            )
            bands = llama3_rule(scaling)
            if bands:
                raise _Refused(f"{field}.high_freq_factor: {bands}")
            return scaling
    except KeyError as missing:
        raise _Refused(f"{field}.{missing.args[0]}: missing for rope_type {kind!r}") from None
    except (TypeError, ValueError) as exc:
        raise _Refused(f"{field}: {_message(exc)}") from None
    raise _Refused(f"{field}.rope_type: {kind!r} is not implemented; nereus has default, linear and llama3")

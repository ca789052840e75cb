"""Tiny random Hugging Face folders made by transformers itself, and whole-model views of
Hugging Face weights, for the HF tests."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from repo_paths import EXAMPLES

from nereus.runtime.hf.files import check_weights
from nereus.runtime.hf.load import read_stored
from nereus.runtime.hf.names import NAME_TABLE, hf_tensors
from nereus.runtime.state.shard_layout import param_infos
from nereus.spec.model import Head, Model

#: Shapes every tiny test model shares (GQA: 4 query heads over 2 KV heads).
TINY_SHAPES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "bos_token_id": None,
    "pad_token_id": 0,
}


def randomise(model: Any) -> None:
    """Values far from the default init so every term matters: a small embedding (the first
    norm then depends on eps), O(0.1) matrices and biases (none zero), norms around one."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(0.02 * noise)
            else:
                param.copy_(0.1 * noise)


def save_random_model(
    folder: Path, class_name: str, fields: dict[str, Any], sharded: bool = False, head: str = "ForCausalLM"
) -> Path:
    """A randomised fp32 model of config `transformers.<class_name>` with `head` (the
    AutoModel<head> class) saved at `folder` (sharded: with an index)."""
    import transformers

    config = getattr(transformers, class_name)(**{**TINY_SHAPES, **fields})
    torch.manual_seed(0)
    model = getattr(transformers, f"AutoModel{head}").from_config(config, dtype=torch.float32)
    randomise(model)
    model.save_pretrained(folder, max_shard_size="100KB" if sharded else "1GB")
    assert (folder / "model.safetensors.index.json").is_file() == sharded
    return folder


def tiny_math_model() -> ModuleType:
    """examples/tiny_math_model.py (a script, not a package): its tokenizer and folder makers."""
    spec = importlib.util.spec_from_file_location("tiny_math_model", EXAMPLES / "tiny_math_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_logical(folder: Path, model: Model, head: Head) -> dict[str, torch.Tensor]:
    """Every parameter the folder holds, whole, as float32."""
    entries = check_weights(folder, model, head)
    whole: dict[str, torch.Tensor] = {}
    for info in param_infos(model, head):
        if info.name in entries:
            box = tuple((0, size) for size in info.global_shape)
            whole[info.name] = read_stored(entries[info.name], box)
    return whole


def as_hf_state(logical: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole runtime parameters under their Hugging Face names (experts one tensor per expert,
    as transformers writes them)."""
    return {key: piece for name, tensor in logical.items() for key, piece in hf_tensors(name, tensor).items()}


def runtime_name(name: str) -> str | None:
    """The runtime name of a Hugging Face tensor through `NAME_TABLE` (None for one the runtime
    has no place for, or one expert's piece of an expert stack)."""
    for ours, theirs in NAME_TABLE:
        match = re.fullmatch(re.escape(theirs).replace(r"\{i\}", r"(\d+)"), name)
        if match:
            return ours.replace("{i}", match.group(1)) if match.groups() else ours
    return None

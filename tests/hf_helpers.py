"""Tiny random Hugging Face folders made by transformers itself, for the HF tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from repo_paths import EXAMPLES

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

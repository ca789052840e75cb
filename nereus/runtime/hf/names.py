"""The one table between Hugging Face tensor names and the runtime's parameter names.

The runtime's names are the sharding contract's (`shard_layout`); Hugging Face's are those of
`LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` / `MistralForCausalLM`, and
`score.weight` of their `...ForSequenceClassification` (a reward model's value head). Every
entry is (runtime pattern, Hugging Face pattern), `{i}` standing for a layer index.
"""

from __future__ import annotations

import re

NAME_TABLE: tuple[tuple[str, str], ...] = (
    ("embed.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attn.q_proj.bias", "model.layers.{i}.self_attn.q_proj.bias"),
    ("layers.{i}.attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attn.k_proj.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    ("layers.{i}.attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attn.v_proj.bias", "model.layers.{i}.self_attn.v_proj.bias"),
    ("layers.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.mlp.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("final_norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("value_head.weight", "score.weight"),
    # transformers' sequence-classification score has no bias: this name is nereus's own.
    ("value_head.bias", "score.bias"),
)

#: Runtime parameters a Hugging Face checkpoint may lack: a new value head starts from the
#: runtime's own initialisation (a critic made from an actor), and sequence-classification
#: heads have no bias.
OPTIONAL = frozenset({"value_head.weight", "value_head.bias"})


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\{i\}", r"(\d+)") + "$")


#: NAME_TABLE compiled once, each way (immutable).
_TO_HF = tuple((_regex(ours), theirs) for ours, theirs in NAME_TABLE)
_FROM_HF = tuple((_regex(theirs), ours) for ours, theirs in NAME_TABLE)


def _translate(name: str, table: tuple[tuple[re.Pattern[str], str], ...]) -> str | None:
    for pattern, target in table:
        match = pattern.match(name)
        if match:
            return target.replace("{i}", match.group(1)) if match.groups() else target
    return None


def hf_name(name: str) -> str:
    """The Hugging Face name of a runtime parameter."""
    translated = _translate(name, _TO_HF)
    if translated is None:
        raise ValueError(f"runtime parameter {name!r} has no Hugging Face name")
    return translated


def runtime_name(name: str) -> str | None:
    """The runtime name of a Hugging Face tensor (None for one the runtime has no place for)."""
    return _translate(name, _FROM_HF)

"""The one table between Hugging Face tensor names and the runtime's parameter names.

The runtime's names are the sharding contract's (`shard_layout`); Hugging Face's are those of
`LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` / `MistralForCausalLM`, and
`score.weight` of their `...ForSequenceClassification` (a reward model's value head). Every
entry is (runtime pattern, Hugging Face pattern), `{i}` standing for a layer index.

Qwen3-MoE's sparse layers (`Qwen3MoeForCausalLM`): the router is `mlp.gate.weight`; the
runtime stacks each layer's experts, expert index first (`layers.{i}.mlp.experts.gate_proj`
[E, F, hidden], `up_proj` [E, F, hidden], `down_proj` [E, hidden, F]; `shard_layout`), while a
checkpoint holds them in one of two layouts (`ExpertLayout`, `EXPERT_TABLE`): one tensor per
expert and projection, `model.layers.{i}.mlp.experts.{j}.gate_proj.weight` (what transformers
5.19's `save_pretrained` writes and what published checkpoints hold; the layout nereus exports),
or transformers 5's in-memory stacks, `mlp.experts.gate_up_proj` [E, 2F, hidden] (gate rows,
then up rows) and `mlp.experts.down_proj` [E, hidden, F], which nereus also reads. A runtime
parameter's `sources` say which checkpoint tensors hold which part of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from nereus.runtime.state.shard_layout import Box, ParamInfo

if TYPE_CHECKING:
    import torch

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
    ("layers.{i}.mlp.router.weight", "model.layers.{i}.mlp.gate.weight"),
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


#: NAME_TABLE compiled once (immutable).
_TO_HF = tuple((_regex(ours), theirs) for ours, theirs in NAME_TABLE)


def hf_name(name: str) -> str:
    """The Hugging Face name of a runtime parameter."""
    for pattern, target in _TO_HF:
        match = pattern.match(name)
        if match:
            return target.replace("{i}", match.group(1)) if match.groups() else target
    raise ValueError(f"runtime parameter {name!r} has no Hugging Face name")


#: How a checkpoint stores a sparse layer's experts (module docstring).
ExpertLayout = Literal["per_expert", "stacked"]

#: Expert stacks: runtime projection -> (per-expert name with {j} for the expert, stacked
#: name, the stacked tensor's rows of this projection: 0 for the first half, 1 for the second,
#: None for the whole tensor). `{i}` is the layer.
EXPERT_TABLE: dict[str, tuple[str, str, int | None]] = {
    "gate_proj": (
        "model.layers.{i}.mlp.experts.{j}.gate_proj.weight",
        "model.layers.{i}.mlp.experts.gate_up_proj",
        0,
    ),
    "up_proj": ("model.layers.{i}.mlp.experts.{j}.up_proj.weight", "model.layers.{i}.mlp.experts.gate_up_proj", 1),
    "down_proj": (
        "model.layers.{i}.mlp.experts.{j}.down_proj.weight",
        "model.layers.{i}.mlp.experts.down_proj",
        None,
    ),
}


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor holding a part of a runtime parameter."""

    hf: str
    """The checkpoint tensor's name."""
    box: Box
    """The part of the runtime parameter it holds."""
    hf_start: tuple[int, ...]
    """Where that part starts in the checkpoint tensor, per runtime dim."""
    hf_shape: tuple[int, ...]
    """The checkpoint tensor's whole shape."""
    per_expert: bool = False
    """The checkpoint tensor is one expert of the stack: it lacks the runtime's dim 0."""


_EXPERT_STACK = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\w+)$")


def hf_tensors(name: str, whole: torch.Tensor) -> dict[str, torch.Tensor]:
    """A whole runtime parameter as the checkpoint tensors transformers writes (an expert stack
    as one tensor per expert, views of `whole`)."""
    match = _EXPERT_STACK.match(name)
    if match is None:
        return {hf_name(name): whole}
    layer, projection = match.groups()
    if projection not in EXPERT_TABLE:
        raise ValueError(f"runtime parameter {name!r} has no Hugging Face name")
    pattern = EXPERT_TABLE[projection][0].replace("{i}", layer)
    return {pattern.replace("{j}", str(j)): expert for j, expert in enumerate(whole)}


def expert_layout(hf_names: set[str] | frozenset[str]) -> ExpertLayout:
    """The layout of a checkpoint's experts, from its tensor names."""
    return "stacked" if any(name.endswith(".mlp.experts.gate_up_proj") for name in hf_names) else "per_expert"


def sources(info: ParamInfo, layout: ExpertLayout = "per_expert") -> list[Source]:
    """The checkpoint tensors of a runtime parameter, with the part each holds."""
    whole = tuple((0, size) for size in info.global_shape)
    zeros = tuple(0 for _ in info.global_shape)
    if not info.expert:
        return [Source(hf_name(info.name), whole, zeros, info.global_shape)]
    assert info.layer is not None
    projection = info.name.rsplit(".", 1)[1]
    per_expert, stacked, half = EXPERT_TABLE[projection]
    per_expert, stacked = (name.replace("{i}", str(info.layer)) for name in (per_expert, stacked))
    if layout == "stacked":
        if half is None:
            return [Source(stacked, whole, zeros, info.global_shape)]
        experts, rows, hidden = info.global_shape
        return [Source(stacked, whole, (0, half * rows, 0), (experts, 2 * rows, hidden))]
    return [
        Source(per_expert.replace("{j}", str(j)), ((j, 1), *whole[1:]), zeros, info.global_shape[1:], per_expert=True)
        for j in range(info.global_shape[0])
    ]

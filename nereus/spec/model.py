"""Model: the hyperparameters of a Llama-style decoder, including every one that changes
the numbers it computes (RoPE, RMSNorm eps, activation), so a runtime built from it computes
the network a Hugging Face checkpoint of the same config computes."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from nereus.spec.base import Document, StrictModel
from nereus.spec.stages import Head

#: The MLP's gate activation (Hugging Face `hidden_act`): SiLU for SwiGLU, or a GELU.
Activation = Literal["silu", "gelu", "gelu_pytorch_tanh"]


class LinearRopeScaling(StrictModel):
    """Position interpolation: every RoPE frequency divided by `factor`."""

    type: Literal["linear"]
    """Scaling kind."""
    factor: float = Field(gt=0)
    """How many times longer than trained the positions may go."""


class Llama3RopeScaling(StrictModel):
    """Llama 3.1's frequency-dependent RoPE scaling: long wavelengths divided by `factor`,
    short ones kept, those in between interpolated smoothly."""

    type: Literal["llama3"]
    """Scaling kind."""
    factor: float = Field(gt=0)
    """Divisor of the low frequencies."""
    low_freq_factor: float = Field(gt=0)
    """Wavelengths above original_max_positions / low_freq_factor are fully scaled."""
    high_freq_factor: float = Field(gt=0)
    """Wavelengths below original_max_positions / high_freq_factor are not scaled."""
    original_max_positions: int = Field(gt=0)
    """Context length the model was pre-trained with (`original_max_position_embeddings`)."""


#: RoPE scaling, told apart by `type`.
RopeScaling = Annotated[LinearRopeScaling | Llama3RopeScaling, Field(discriminator="type")]


class Model(Document):
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention.

    The parameter count is derived from these fields, never stored.
    """

    kind: Literal["Model"] = "Model"
    name: str = Field(min_length=1)
    """Name used in plans and reports, e.g. `llama-3.1-8b`."""
    num_layers: int = Field(gt=0)
    """Transformer blocks (`num_hidden_layers`)."""
    hidden_dim: int = Field(gt=0)
    """Residual-stream width (`hidden_size`)."""
    num_heads: int = Field(gt=0)
    """Query heads (`num_attention_heads`)."""
    num_kv_heads: int = Field(gt=0)
    """Key/value heads (`num_key_value_heads`); equal to num_heads without GQA."""
    head_dim: int = Field(gt=0)
    """Width of one attention head."""
    ffn_dim: int = Field(gt=0)
    """SwiGLU inner width (`intermediate_size`)."""
    vocab_size: int = Field(gt=0)
    """Vocabulary size."""
    tied_embeddings: bool = False
    """Whether the LM head reuses the input embedding matrix."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on queries and keys per head (Qwen3)."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """RoPE base frequency (`rope_theta`): 10000 for Llama 1/2, 500000 for Llama 3, 1e6 for Qwen2.5/3."""
    rope_scaling: RopeScaling | None = None
    """RoPE frequency scaling (`rope_scaling`); None for plain RoPE."""
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    """Epsilon inside every RMSNorm (`rms_norm_eps`)."""
    activation: Activation = "silu"
    """The MLP's gate activation (`hidden_act`)."""
    max_positions: int = Field(default=2048, gt=0)
    """Positions the model was trained for (`max_position_embeddings`); `position_limit` is the
    longest sequence (prompt plus response) it takes."""

    def position_limit(self) -> int:
        """The longest sequence (prompt plus response) the model takes: `max_positions`, times
        the factor of a linear RoPE scaling, which stretches the positions the model was trained
        for (a config with `max_position_embeddings` 4096 and linear factor 4 takes 16384).
        Llama 3's scaling extends nothing further: its `max_position_embeddings` already is the
        extended context (131072 for 8192 pre-trained positions), the original length only
        placing its frequency bands. vLLM derives the same `max_model_len`."""
        if isinstance(self.rope_scaling, LinearRopeScaling):
            return int(self.max_positions * self.rope_scaling.factor)
        return self.max_positions

    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        q_dim = self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        attention = self.hidden_dim * (q_dim + 2 * kv_dim) + q_dim * self.hidden_dim
        if self.qkv_bias:
            attention += q_dim + 2 * kv_dim
        if self.qk_norm:
            attention += 2 * self.head_dim
        mlp = 3 * self.hidden_dim * self.ffn_dim
        norms = 2 * self.hidden_dim
        return attention + mlp + norms

    def embedding_params(self) -> int:
        """Parameters of the input embedding."""
        return self.vocab_size * self.hidden_dim

    def head_params(self, head: Head = "lm") -> int:
        """Parameters of the final norm and the output head."""
        if head == "value":
            return self.hidden_dim + self.hidden_dim + 1
        lm = 0 if self.tied_embeddings else self.vocab_size * self.hidden_dim
        return self.hidden_dim + lm

    def num_params(self, head: Head = "lm") -> int:
        """Total parameters with the given output head."""
        return self.embedding_params() + self.num_layers * self.layer_params() + self.head_params(head)

"""Model: the hyperparameters of a Llama-style decoder."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nereus.spec.base import Document

#: An LM head predicts the vocabulary (actor, reference); a value head predicts one
#: scalar per token (critic, reward model).
Head = Literal["lm", "value"]


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

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


class MoE(StrictModel):
    """Mixture-of-experts MLPs, as Qwen3-MoE builds them: in a sparse layer a linear router
    scores every expert per token, the token goes to its `experts_per_token` best (softmax,
    then top-k, renormalised when `norm_topk_prob`), and each expert is a SwiGLU MLP
    `expert_ffn_dim` wide. Layers listed in `dense_layers`, or off the `sparse_step` rhythm,
    keep the dense MLP of width `ffn_dim`."""

    num_experts: int = Field(gt=0)
    """Experts per sparse layer (`num_experts`; transformers 5 writes `num_local_experts`)."""
    experts_per_token: int = Field(gt=0)
    """Experts each token is routed to (`num_experts_per_tok`)."""
    expert_ffn_dim: int = Field(gt=0)
    """SwiGLU inner width of one expert (`moe_intermediate_size`)."""
    norm_topk_prob: bool = False
    """Whether the chosen experts' router probabilities are renormalised to sum to 1."""
    sparse_step: int = Field(default=1, gt=0)
    """Every `sparse_step`-th layer is sparse (`decoder_sparse_step`; 1: all of them)."""
    dense_layers: list[int] = Field(default_factory=list)
    """Layer indices that keep the dense MLP whatever the step (`mlp_only_layers`)."""

    def is_sparse(self, layer: int) -> bool:
        """Whether block `layer` (0-based) has the expert MLP (transformers' rule)."""
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    def expert_params(self, hidden_dim: int) -> int:
        """Parameters of one expert's SwiGLU MLP."""
        return 3 * hidden_dim * self.expert_ffn_dim


class Model(Document):
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU MLP (or a mixture of SwiGLU experts),
    grouped-query attention.

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
    moe: MoE | None = None
    """Mixture-of-experts MLPs (Qwen3-MoE); None for a dense model."""

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

    def sparse_layers(self) -> int:
        """Blocks whose MLP is a mixture of experts (0 for a dense model)."""
        moe = self.moe
        return 0 if moe is None else sum(moe.is_sparse(layer) for layer in range(self.num_layers))

    def attention_params(self) -> int:
        """Parameters of one block's attention (projections, biases, query/key norms)."""
        q_dim = self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        attention = self.hidden_dim * (q_dim + 2 * kv_dim) + q_dim * self.hidden_dim
        if self.qkv_bias:
            attention += q_dim + 2 * kv_dim
        if self.qk_norm:
            attention += 2 * self.head_dim
        return attention

    def mlp_params(self, active: bool = False) -> float:
        """MLP parameters per block, averaged over the blocks: all of them held (`active`
        False), or those one token computes with (its routed experts and the router)."""
        dense = 3 * self.hidden_dim * self.ffn_dim
        moe = self.moe
        if moe is None:
            return float(dense)
        experts = moe.experts_per_token if active else moe.num_experts
        sparse_mlp = experts * moe.expert_params(self.hidden_dim) + self.hidden_dim * moe.num_experts
        sparse = self.sparse_layers()
        return (sparse * sparse_mlp + (self.num_layers - sparse) * dense) / self.num_layers

    def layer_params(self, active: bool = False) -> float:
        """Parameters of one transformer block (averaged over the blocks of a mixture of
        experts, whose sparse and dense blocks differ); `active`: those one token computes with."""
        return self.attention_params() + self.mlp_params(active) + 2 * self.hidden_dim

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
        return self.embedding_params() + round(self.num_layers * self.layer_params()) + self.head_params(head)

    def active_params(self, head: Head = "lm") -> int:
        """Parameters one token computes with (all of them for a dense model)."""
        blocks = round(self.num_layers * self.layer_params(active=True))
        return self.embedding_params() + blocks + self.head_params(head)

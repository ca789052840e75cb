"""Published long-response RL set-ups: each framework recipe's step as a Workload document, its
model, GPU count and the layout it documents (sequence/context-parallel degree, rollout tp,
recomputation, the rollout engine's memory share, sleeping models).

Read from the frameworks' own recipes, at the commits cited:

* verl's DAPO recipe for Qwen2.5-32B,
  https://github.com/volcengine/verl/blob/03150d4fa825bcca1ec5c0a3f582cf6449148112/recipe/dapo/run_dapo_qwen2.5_32b.sh:
  16 nodes x 8 GPUs, max_prompt_length 2048, max_response_length 20480, 512 prompts x 16
  responses per step, mini-batches of 32 prompts, the `dapo` rule as reward, FSDP
  (fsdp_size -1: over every GPU) with `ulysses_sequence_parallel_size` 8 for the actor and the
  reference, gradient checkpointing, param and optimizer offload, vLLM rollout tp 4 at
  gpu_memory_utilization 0.80, use_dynamic_bsz with 2048 + 20480 tokens per GPU for the actor
  and the log-prob passes.
* verl's DAPO recipe for Qwen2.5-Math-7B,
  https://github.com/volcengine/verl/blob/3592251ee1a5c2fae6bddcf3e51440cab63c07bd/recipe/dapo/test_dapo_7b_math.sh:
  8 nodes x 8 GPUs, prompts 2048, responses 8192, 512 x 16 per step, mini-batches of 32
  prompts, Ulysses sequence parallel 4, fsdp_size 32, gradient checkpointing, param and
  optimizer offload, rollout tp 4 at 0.80, max_position_embeddings overridden to 32768,
  use_dynamic_bsz with 2 x (2048 + 8192) tokens per GPU for the actor, 3 x for log-probs.
* NeMo-RL's DAPO recipe for Qwen2.5-Math-7B,
  https://github.com/NVIDIA-NeMo/RL/blob/423aa0a55ab7fdc3744b9fea97b9dd6108f4ff71/examples/configs/recipes/llm/dapo-qwen2.5-7b.yaml:
  16 nodes x 8 GPUs, max_total_sequence_length 16384 with prompts of at most 2048
  (max_input_seq_length), 512 x 16 per step, `context_parallel_size` 4 on its DTensor path
  (2 with tp 4 and pp 2 on its Megatron one), vLLM tp 2 at gpu_memory_utilization 0.7; its
  defaults (examples/configs/grpo_math_1B.yaml) keep DTensor tp 1, no activation checkpointing
  and no CPU offload, generation colocated with training; the recipe turns sequence packing off
  (train_micro_batch_size and logprob_batch_size 1).

A Workload document cannot say how a framework parallelises: the layout each recipe documents
is kept beside its document (`Setup`). benchmarks/long_context.py plans each set-up and prices
its own layout; tests/spec/test_long_response_setups.py checks the documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nereus.spec.hf_config import model_from_hf_dict
from nereus.spec.io import document_from_data
from nereus.spec.model import Model
from nereus.spec.plan import Recompute
from nereus.spec.workload import Workload

#: Qwen2.5-32B's config.json (Qwen/Qwen2.5-32B on the Hugging Face hub): the fields nereus reads.
QWEN25_32B: dict[str, Any] = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "num_hidden_layers": 64,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
#: Qwen2.5-Math-7B's config.json (Qwen/Qwen2.5-Math-7B), with max_position_embeddings 32768 as
#: verl's recipe overrides it (the hub's 4096 holds no 10k-token sequence; NeMo-RL sets 16384).
QWEN25_MATH_7B: dict[str, Any] = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
#: The set-ups' models by the names their documents use.
HF_CONFIGS: dict[str, dict[str, Any]] = {"qwen2.5-32b": QWEN25_32B, "qwen2.5-math-7b": QWEN25_MATH_7B}


def setup_model(name: str) -> Model:
    """The model a set-up's document names (one of `HF_CONFIGS`)."""
    return model_from_hf_dict(HF_CONFIGS[name], name)


@dataclass(frozen=True)
class Setup:
    """One published long-response run: its workload, GPUs and the layout its recipe documents."""

    url: str
    """The recipe, at the commit read."""
    document: dict[str, Any]
    """The Workload document (YAML's fields) of the run."""
    gpus: int
    sequence_parallel: int
    """The documented Ulysses (verl) or context-parallel (NeMo-RL DTensor) degree of its training
    and log-prob passes; data parallel (fully sharded) over the rest."""
    rollout_tp: int
    """The rollout engine's (vLLM's) tensor-parallel degree."""
    rollout_memory_fraction: float
    """The rollout engine's share of a GPU for weights and KV cache (gpu_memory_utilization)."""
    recompute: Recompute
    """Training's recomputation: `full` under gradient/activation checkpointing, else `none`."""
    train_tokens: int | None = None
    """Tokens one training micro-batch of a replica (its sp/cp group) is packed to: verl's
    `ppo_max_token_len_per_gpu` under use_dynamic_bsz times the Ulysses degree (verl's actor
    multiplies them); None: one sequence per micro-batch (the document's micro_batch_size)."""
    inference_tokens: int | None = None
    """The log-prob pass's token budget per micro-batch of a replica (verl's
    `log_prob_max_token_len_per_gpu` times the Ulysses degree); None: one sequence each."""

    def workload(self) -> Workload:
        """The document as a Workload (a SpecError names a bad field)."""
        workload = document_from_data(self.document, self.url)
        assert isinstance(workload, Workload)
        return workload

    def model(self) -> Model:
        return setup_model(self.document["actor"])


def dapo_document(name: str, model: str, response_max: int, prompt_max: int = 2048) -> dict[str, Any]:
    """DAPO's step as these recipes run it: 512 prompts x 16 responses, mini-batches of 32
    prompts (16 per step), no KL term (no reference in the loss) and a rule as reward."""
    return {
        "version": 1,
        "kind": "Workload",
        "name": name,
        "algorithm": "grpo",
        "actor": model,
        "reference": None,
        "reward": None,
        "prompts_per_step": 512,
        "samples_per_prompt": 16,
        "prompt_len": prompt_max,
        # The recipes give the cap only; DAPO's overlong buffer (the last 4k tokens) penalises
        # the longest, so the median and p99 are placed below the cap.
        "response_len": {"median": response_max // 4, "p99": response_max * 3 // 4, "max": response_max},
        "ppo_epochs": 1,
        "mini_batches": 16,
        "micro_batch_size": 1,
        "dtype": "bf16",
    }


SETUPS: dict[str, Setup] = {
    "verl-dapo-qwen2.5-32b": Setup(
        "https://github.com/volcengine/verl/blob/03150d4fa825bcca1ec5c0a3f582cf6449148112/recipe/dapo/run_dapo_qwen2.5_32b.sh",
        dapo_document("verl-dapo-qwen2.5-32b", "qwen2.5-32b", 20480),
        gpus=128,
        sequence_parallel=8,
        rollout_tp=4,
        rollout_memory_fraction=0.80,
        recompute="full",
        train_tokens=(2048 + 20480) * 8,
        inference_tokens=(2048 + 20480) * 8,
    ),
    "verl-dapo-qwen2.5-math-7b": Setup(
        "https://github.com/volcengine/verl/blob/3592251ee1a5c2fae6bddcf3e51440cab63c07bd/recipe/dapo/test_dapo_7b_math.sh",
        dapo_document("verl-dapo-qwen2.5-math-7b", "qwen2.5-math-7b", 8192),
        gpus=64,
        sequence_parallel=4,
        rollout_tp=4,
        rollout_memory_fraction=0.80,
        recompute="full",
        train_tokens=(2048 + 8192) * 2 * 4,
        inference_tokens=(2048 + 8192) * 3 * 4,
    ),
    "nemo-rl-dapo-qwen2.5-math-7b": Setup(
        "https://github.com/NVIDIA-NeMo/RL/blob/423aa0a55ab7fdc3744b9fea97b9dd6108f4ff71/examples/configs/recipes/llm/dapo-qwen2.5-7b.yaml",
        dapo_document("nemo-rl-dapo-qwen2.5-math-7b", "qwen2.5-math-7b", 16384 - 2048),
        gpus=128,
        sequence_parallel=4,
        rollout_tp=2,
        rollout_memory_fraction=0.7,
        recompute="none",
    ),
}

"""Published long-response RL set-ups as Workload documents, and the `grpo-long` preset that
follows them.

Each set-up is taken from the framework's own recipe, at the commit cited:

* verl's DAPO recipe for Qwen2.5-32B,
  https://github.com/volcengine/verl/blob/03150d4fa825bcca1ec5c0a3f582cf6449148112/recipe/dapo/run_dapo_qwen2.5_32b.sh:
  16 nodes x 8 GPUs, max_prompt_length 2048, max_response_length 20480, 512 prompts x 16
  responses per step, mini-batches of 32 prompts, the `dapo` rule as reward, FSDP with
  `ulysses_sequence_parallel_size` 8 for the actor and the reference, vLLM rollout tp 4.
* verl's DAPO recipe for Qwen2.5-Math-7B,
  https://github.com/volcengine/verl/blob/3592251ee1a5c2fae6bddcf3e51440cab63c07bd/recipe/dapo/test_dapo_7b_math.sh:
  8 nodes x 8 GPUs, prompts 2048, responses 8192, 512 x 16 per step, mini-batches of 32
  prompts, Ulysses sequence parallel 4, fsdp_size 32, rollout tp 4.
* NeMo-RL's DAPO recipe for Qwen2.5-Math-7B,
  https://github.com/NVIDIA-NeMo/RL/blob/423aa0a55ab7fdc3744b9fea97b9dd6108f4ff71/examples/configs/recipes/llm/dapo-qwen2.5-7b.yaml:
  16 nodes x 8 GPUs, max_total_sequence_length 16384 with prompts of at most 2048
  (max_input_seq_length), 512 x 16 per step, `context_parallel_size` 4 on its DTensor path
  (2 with tp 4 and pp 2 on its Megatron one), vLLM tp 2.

Workload documents cannot say how a framework parallelises; the set-up's documented SP/CP
degree is kept beside each document, and checked against what Ulysses needs of the model
(each rank keeps whole attention heads: the degree divides the query and the KV heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from nereus.spec.io import load_document
from nereus.spec.presets import MODELS, workload_preset
from nereus.spec.workload import Workload

pytestmark = pytest.mark.logic


@dataclass(frozen=True)
class Setup:
    """One published long-response run: its workload, GPUs and sequence/context parallelism."""

    url: str
    document: dict[str, Any]
    """The Workload document (YAML's fields) of the run."""
    gpus: int
    sequence_parallel: int
    """The documented Ulysses (verl) or context-parallel (NeMo-RL) degree of its training."""
    heads: tuple[int, int]
    """The model's query and KV heads (its config.json)."""


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


SETUPS = {
    "verl-dapo-qwen2.5-32b": Setup(
        "https://github.com/volcengine/verl/blob/03150d4fa825bcca1ec5c0a3f582cf6449148112/recipe/dapo/run_dapo_qwen2.5_32b.sh",
        dapo_document("verl-dapo-qwen2.5-32b", "qwen2.5-32b", 20480),
        gpus=128,
        sequence_parallel=8,
        heads=(40, 8),
    ),
    "verl-dapo-qwen2.5-math-7b": Setup(
        "https://github.com/volcengine/verl/blob/3592251ee1a5c2fae6bddcf3e51440cab63c07bd/recipe/dapo/test_dapo_7b_math.sh",
        dapo_document("verl-dapo-qwen2.5-math-7b", "qwen2.5-math-7b", 8192),
        gpus=64,
        sequence_parallel=4,
        heads=(28, 4),
    ),
    "nemo-rl-dapo-qwen2.5-math-7b": Setup(
        "https://github.com/NVIDIA-NeMo/RL/blob/423aa0a55ab7fdc3744b9fea97b9dd6108f4ff71/examples/configs/recipes/llm/dapo-qwen2.5-7b.yaml",
        dapo_document("nemo-rl-dapo-qwen2.5-math-7b", "qwen2.5-math-7b", 16384 - 2048),
        gpus=128,
        sequence_parallel=4,
        heads=(28, 4),
    ),
}


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_published_setup_is_a_valid_workload(name: str, tmp_path: Any) -> None:
    import yaml

    setup = SETUPS[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(setup.document, sort_keys=False))
    workload = load_document(path)
    assert isinstance(workload, Workload)
    assert workload.samples_per_step == 512 * 16 and workload.reward is None
    assert workload.prompt_len + workload.response_len.max >= 10240  # 10k-22k tokens a sequence
    # Ulysses keeps whole heads per rank: the documented degree divides the query and KV heads,
    # and the GPUs hold whole sequence-parallel groups.
    query_heads, kv_heads = setup.heads
    assert query_heads % setup.sequence_parallel == 0 and kv_heads % setup.sequence_parallel == 0
    assert setup.gpus % setup.sequence_parallel == 0


def test_grpo_long_reaches_past_every_published_cap() -> None:
    preset = workload_preset("grpo-long", "qwen3-8b")
    assert preset.algorithm == "grpo" and preset.reward is None and preset.reference == preset.actor
    assert (preset.prompt_len, preset.response_len.median, preset.response_len.max) == (1024, 8192, 32768)
    assert preset.response_len.p99 == 24576 and preset.micro_batch_size == 1
    for setup in SETUPS.values():
        assert preset.response_len.max >= setup.document["response_len"]["max"]
    # Qwen3-8B takes 40960 positions: a whole 1k + 32k sequence fits.
    assert preset.prompt_len + preset.response_len.max <= MODELS["qwen3-8b"].max_positions
    # The same sample count as the `grpo` preset: only the lengths differ.
    assert preset.samples_per_step == workload_preset("grpo").samples_per_step


def test_grpo_long_round_trips_as_a_document(tmp_path: Any) -> None:
    from nereus.spec.io import save_document

    preset = workload_preset("grpo-long")
    save_document(preset, tmp_path / "grpo-long.yaml")
    assert load_document(tmp_path / "grpo-long.yaml") == preset

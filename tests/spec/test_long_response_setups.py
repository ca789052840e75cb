"""Published long-response RL set-ups (nereus/spec/long_response_setups.py holds them as
Workload documents with the layout each recipe documents), and the `grpo-long` preset that
follows them."""

from __future__ import annotations

from typing import Any

import pytest

from nereus.spec.io import load_document
from nereus.spec.long_response_setups import SETUPS
from nereus.spec.presets import MODELS, workload_preset
from nereus.spec.workload import Workload

pytestmark = pytest.mark.logic


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
    model = setup.model()
    query_heads, kv_heads = model.num_heads, model.num_kv_heads
    assert query_heads % setup.sequence_parallel == 0 and kv_heads % setup.sequence_parallel == 0
    assert setup.gpus % setup.sequence_parallel == 0
    assert setup.gpus % setup.rollout_tp == 0 and kv_heads % setup.rollout_tp == 0
    assert workload.prompt_len + workload.response_len.max <= model.max_positions
    assert setup.workload() == workload
    # A token budget (verl's dynamic batch size times the Ulysses degree) holds a whole sequence.
    for budget in (setup.train_tokens, setup.inference_tokens):
        assert budget is None or budget >= workload.prompt_len + workload.response_len.max


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

"""Exactly the network transformers computes: tiny random Llama (plain and llama3 RoPE
scaling), Qwen2 (qkv bias, tied embeddings), Qwen3 (q/k norm, wide heads) and Mistral (no
sliding window; a GELU gate) models, each with GQA, are made and saved by `transformers`
itself, loaded by nereus into every layout with tp * pp <= 4 the model admits, and compared
with `AutoModelForCausalLM`: logits within 1e-5 (fp32) and greedy generations
token-identical; so are the layouts with tp * pp <= 2 on dp=2 fully sharded (FSDP2).
Perturbing RoPE theta, RMSNorm eps or the qkv bias breaks the agreement
(so the comparison can fail)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.one_rank

from hf_helpers import read_logical, save_random_model  # noqa: E402

from nereus.runtime.comm.spawn import spawn  # noqa: E402
from nereus.runtime.generation.generate import SamplingConfig, generate  # noqa: E402
from nereus.runtime.hf.load import load_engine  # noqa: E402
from nereus.runtime.model.engine import Engine, EngineConfig  # noqa: E402
from nereus.runtime.model.parallel_groups import admissible_layouts  # noqa: E402
from nereus.runtime.model.transformer import Batch, ReferenceModel  # noqa: E402
from nereus.runtime.state.shard_layout import RankLayout  # noqa: E402
from nereus.spec.hf_config import model_from_hf_config  # noqa: E402
from nereus.spec.model import Model  # noqa: E402

WORLD = 4
TOL = 1e-5
VOCAB, ROWS, SEQ, NEW_TOKENS = 96, 4, 12, 8
_SHAPES = {"num_hidden_layers": 4, "vocab_size": VOCAB, "eos_token_id": None}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
#: name -> (config class, its fields beyond the shapes, saved sharded).
CONFIGS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "llama": ("LlamaConfig", {"rms_norm_eps": 1e-6, "tie_word_embeddings": False}, True),
    "llama3-rope": (
        "LlamaConfig",
        {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}, "rms_norm_eps": 1e-5},
        False,
    ),
    "qwen2": (
        "Qwen2Config",
        {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        False,
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, True),
    "mistral": ("MistralConfig", {"sliding_window": None, "rms_norm_eps": 1e-5, "hidden_act": "gelu"}, False),
}


def make_folder(root: Path, name: str) -> Path:
    class_name, fields, sharded = CONFIGS[name]
    return save_random_model(root / name, class_name, {**_SHAPES, **fields}, sharded)


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded rows (0 to 3 pads) of random tokens."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, VOCAB, (ROWS, SEQ), generator=generator)
    mask = torch.arange(SEQ).unsqueeze(0) >= torch.tensor([0, 3, 1, 2]).unsqueeze(1)
    return tokens.masked_fill(~mask, 0), mask


def transformers_outputs(folder: Path) -> dict[str, torch.Tensor]:
    """Logits of the padded batch (positions counted over real tokens) and greedy continuations
    of the unpadded prompts, both by transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens, mask = inputs()
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=mask.long(), position_ids=positions).logits
        prompts = tokens[:, 4:]  # columns 4.. hold real tokens in every row
        generated = model.generate(prompts, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return {"logits": logits, "generated": generated[:, prompts.shape[1] :]}


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("hf")
    folders = {name: make_folder(root, name) for name in CONFIGS}
    return {name: (folder, transformers_outputs(folder)) for name, folder in folders.items()}


def _masked_error(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor) -> float:
    return float((ours - theirs).abs()[mask].max())


def world_worker(rank: int, world: int, cases: dict[str, tuple[Path, dict[str, torch.Tensor]]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    tokens, mask = inputs()
    results: dict[str, Any] = {}
    for name, (folder, expected) in cases.items():
        model = model_from_hf_config(folder)
        for tp, pp, dp in admissible_layouts(model, WORLD):
            full_shard = dp == 2 and tp * pp <= 2
            if dp > 1 and not full_shard:
                continue
            layout = RankLayout(tp, pp, dp, tuple(range(tp * pp * dp)))
            engine = Engine.create(model, "lm", layout, EngineConfig(full_shard=full_shard))
            if engine is None:
                continue
            assert load_engine(engine, folder) == []
            logits = engine.logits(Batch(tokens, mask), num_microbatches=2 if pp > 1 else 1)
            prompts = tokens[:, 4:].tolist()
            sampled = generate(engine, prompts, SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=0.0))
            results[f"{name} tp={tp} pp={pp}{' dp=2 full_shard' if full_shard else ''}"] = {
                "logits": _masked_error(logits, expected["logits"], mask),
                "generated": sampled.responses() == expected["generated"].tolist(),
            }
            if (tp, pp) == (2, 2):
                results[f"{name} critic"] = critic_from_actor(engine, folder)
    return results


def critic_from_actor(actor: Engine, folder: Path) -> bool:
    """A critic loaded from the actor's folder: the actor's weights, a new value head."""
    critic = Engine.create(actor.model, "value", actor.groups.layout)
    assert critic is not None
    kept = load_engine(critic, folder)
    heads = {"value_head.weight", "value_head.bias"}
    same = all(torch.equal(p, actor.params[n]) for n, p in critic.params.items() if n not in heads)
    return same and (set(kept) == heads if critic.pipeline_stage.is_last else kept == [])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_layout_computes_what_transformers_computes(cases: dict[str, Any]) -> None:
    results: dict[str, Any] = {}
    for rank_results in spawn(world_worker, WORLD, cases):
        for key, value in rank_results.items():
            results.setdefault(key, []).append(value)
    expected_layouts = {(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)}
    layouts = {f"{n} tp={tp} pp={pp}" for n in CONFIGS for tp, pp in expected_layouts}
    layouts |= {f"{n} tp={tp} pp={pp} dp=2 full_shard" for n in CONFIGS for tp, pp in ((1, 1), (2, 1), (1, 2))}
    assert set(results) == layouts | {f"{n} critic" for n in CONFIGS}
    for key in set(results) - layouts:
        assert all(results.pop(key)), key
    for key, per_rank in results.items():
        for errors in per_rank:
            assert errors["logits"] < TOL, (key, errors)
            assert errors["generated"], key


def _reference_error(folder: Path, model: Model) -> float:
    reference = ReferenceModel(model)
    logical = read_logical(folder, model, "lm")
    with torch.no_grad():
        for name, param in reference.named_logical_parameters().items():
            param.copy_(logical[name])
        tokens, mask = inputs()
        return _masked_error(reference(tokens, mask), transformers_outputs(folder)["logits"], mask)


@pytest.mark.parametrize(
    ("case", "change"),
    [
        ("qwen2", {"rope_theta": 10000.0}),
        ("llama3-rope", {"rope_scaling": None}),
        ("llama", {"rms_norm_eps": 1e-5}),
        ("qwen2", {"qkv_bias": False}),
    ],
)
def test_perturbing_a_number_breaks_parity(cases: dict[str, Any], case: str, change: dict[str, Any]) -> None:
    folder = cases[case][0]
    model = model_from_hf_config(folder)
    assert _reference_error(folder, model) < TOL
    perturbed = model.model_copy(update=change)
    assert _reference_error(folder, perturbed) > 100 * TOL, change

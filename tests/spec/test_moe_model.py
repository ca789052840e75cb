"""Mixture-of-experts models (Qwen3-MoE): the Model document read from configs transformers
writes (both expert-count keys), its parameter counts against transformers' own module, careless
configs refused naming the field, and the planner pricing held against active parameters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nereus.errors import NereusError
from nereus.spec.check import layout_problem, model_problems
from nereus.spec.hf_config import model_from_hf_config
from nereus.spec.model import MoE
from nereus.spec.presets import model_preset

pytestmark = pytest.mark.logic

SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=6,
    num_experts_per_tok=2,
    vocab_size=128,
)


def _saved(tmp_path: Path, name: str = "moe", **fields: Any) -> Path:
    """A Qwen3-MoE folder written by transformers' own config class."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / name
    transformers.Qwen3MoeConfig(**{**SMALL, **fields}).save_pretrained(folder)
    return folder


def _edited(folder: Path, **fields: Any) -> Path:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def test_a_transformers_config_reads_as_the_experts_it_builds(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fields = dict(mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True)
    model = model_from_hf_config(_saved(tmp_path, **fields))
    assert model.moe == MoE(
        num_experts=6, experts_per_token=2, expert_ffn_dim=32, norm_topk_prob=True, sparse_step=1, dense_layers=[1]
    )
    assert model.qk_norm and not model.qkv_bias and model.sparse_layers() == 3
    torch.manual_seed(0)
    built = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**SMALL, **fields}))
    assert model.num_params() == sum(p.numel() for p in built.parameters())
    # what one token computes with: the dense layer's MLP, and 2 of the 6 experts elsewhere
    expert = 3 * 64 * 32
    assert model.num_params() - model.active_params() == 3 * (6 - 2) * expert


def test_both_expert_count_keys_read_alike_and_a_disagreement_is_refused(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    written = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert "num_local_experts" in written  # transformers 5 writes the new key
    published = {k: v for k, v in written.items() if k != "num_local_experts"} | {"num_experts": 6}
    other = tmp_path / "published"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(published), encoding="utf-8")
    assert model_from_hf_config(folder, name="x") == model_from_hf_config(other, name="x")
    with pytest.raises(NereusError, match=r"config.json: num_local_experts: 6 disagrees with num_experts 8"):
        model_from_hf_config(_edited(other, num_local_experts=6, num_experts=8))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_experts_per_tok": 7}, r"num_experts_per_tok: 7 experts per token exceed the 6 experts; choose at most"),
        ({"mlp_only_layers": [4]}, r"mlp_only_layers: layer 4 is outside 0..3"),
        ({"decoder_sparse_step": 5}, r"decoder_sparse_step: no layer is sparse"),
        ({"mlp_only_layers": "all"}, r"mlp_only_layers: expected a list of layer indices"),
        ({"num_experts_per_tok": 0}, r"num_experts_per_tok: missing or not a positive integer"),
    ],
)
def test_careless_expert_configs_are_refused_in_one_line(tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    folder = _edited(_saved(tmp_path), **fields)
    with pytest.raises(NereusError, match=message) as refused:
        model_from_hf_config(folder)
    assert "\n" not in str(refused.value) and str(folder / "config.json") in str(refused.value)


def test_a_model_document_is_held_to_the_same_rules() -> None:
    model = model_preset("qwen3-30b-a3b")
    assert model.moe is not None
    bad = model.model_copy(update={"moe": model.moe.model_copy(update={"experts_per_token": 200})})
    assert [p.path for p in model_problems(bad)] == ["moe.experts_per_token"]
    assert layout_problem(model, 8, 1) is None
    narrow = model.model_copy(update={"moe": model.moe.model_copy(update={"expert_ffn_dim": 100})})
    assert layout_problem(narrow, 8, 1) == "tp=8 does not divide the expert MLP width 100 (qwen3-30b-a3b)"
    assert layout_problem(narrow, 4, 1) is None  # the dense width no sparse-only model uses is not asked


def test_qwen3_30b_a3b_counts_and_prices_its_active_parameters() -> None:
    from nereus.cost.calibration import DEFAULT_CALIBRATION
    from nereus.cost.stage import StageCostModel
    from nereus.spec.presets import cluster_preset, workload_preset

    model = model_preset("qwen3-30b-a3b")
    # Qwen's model card: 30.5B parameters in all, 3.3B activated
    assert round(model.num_params() / 1e9, 1) == 30.5 and round(model.active_params() / 1e9, 1) == 3.4
    workload = workload_preset("grpo", actor=model.name)
    cost = StageCostModel(model, "lm", "training", workload, cluster_preset("h100", 16), DEFAULT_CALIBRATION)
    head = 2.0 * model.vocab_size * model.hidden_dim
    blocks = cost.dense_flops_per_token() - head
    # the forward computes with the routed experts only, while every expert is held
    assert blocks == pytest.approx(2.0 * (model.active_params() - 2 * model.vocab_size * model.hidden_dim), rel=1e-3)
    held = float(cost.params_per_gpu(1, 1))
    assert held == pytest.approx(model.num_params(), rel=1e-6)


def test_nereus_run_takes_an_expert_model_with_its_weights_checked(tmp_path: Path) -> None:
    from nereus.runtime.hf.run_setup import hf_weights

    transformers = pytest.importorskip("transformers")
    folder = _saved(tmp_path)
    config = transformers.AutoConfig.from_pretrained(folder)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    weights = hf_weights(folder)
    assert weights.model.moe is not None and weights.model.moe.num_experts == 6


def test_a_planned_expert_model_is_written_and_read_back_as_planned(tmp_path: Path) -> None:
    from nereus.solver.plan_search import PlanRequest
    from nereus.solver.planner import make_plan
    from nereus.spec.check import check_file
    from nereus.spec.io import load_document, save_document
    from nereus.spec.presets import cluster_preset, workload_preset

    model = model_preset("qwen3-30b-a3b")
    request = PlanRequest(cluster_preset("h100", 16), (model,), workload_preset("grpo", model.name), 16)
    plan = make_plan(request).best
    save_document(plan, tmp_path / "p.yaml")
    assert check_file(tmp_path / "p.yaml").ok
    assert load_document(tmp_path / "p.yaml") == plan

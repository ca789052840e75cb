"""Exactly the network transformers computes for Qwen3-MoE: tiny random `Qwen3MoeForCausalLM`
models (8 experts, 2 per token, one dense layer by `mlp_only_layers`, `norm_topk_prob` both
ways) saved by transformers itself, loaded by nereus into every layout with tp * pp * ep <= 4
(ep = 2 alone, with tp = 2 and with pp = 2; ep = 4) and compared with transformers: logits
within 1e-5 (fp32) and greedy generations token-identical. The checkpoint layouts (one tensor
per expert, as transformers 5.19 saves; transformers' stacked in-memory layout) read the
same, the export writes what transformers reads, routing replay and the auxiliary loss
follow their definitions, and a perturbed router breaks the agreement (so the comparison
can fail)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_helpers import as_hf_state, read_logical, save_random_model  # noqa: E402
from test_hf_parity import NEW_TOKENS, TOL, VOCAB, inputs, transformers_outputs  # noqa: E402
from test_hf_parity import _masked_error as masked_error  # noqa: E402

from nereus.runtime.comm.spawn import spawn  # noqa: E402
from nereus.runtime.generation.generate import SamplingConfig, generate  # noqa: E402
from nereus.runtime.hf.files import check_weights  # noqa: E402
from nereus.runtime.hf.load import load_engine  # noqa: E402
from nereus.runtime.model.engine import Engine  # noqa: E402
from nereus.runtime.model.losses import NextTokenLoss  # noqa: E402
from nereus.runtime.model.moe import Routes, load_balancing_loss, route  # noqa: E402
from nereus.runtime.model.parallel_groups import admissible_layouts  # noqa: E402
from nereus.runtime.model.transformer import Batch, ReferenceModel  # noqa: E402
from nereus.runtime.state.shard_layout import RankLayout  # noqa: E402
from nereus.spec.hf_config import model_from_hf_config  # noqa: E402
from nereus.spec.model import Model  # noqa: E402

WORLD = 4
#: The tiny Qwen3-MoE: layer 1 dense, the others sparse; each expert 32 wide (tp <= 4 divides it).
MOE_FIELDS: dict[str, Any] = {
    "num_hidden_layers": 4,
    "vocab_size": VOCAB,
    "eos_token_id": None,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "mlp_only_layers": [1],
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
}
CASES = {"moe": {"norm_topk_prob": False}, "moe-norm": {"norm_topk_prob": True}}


def make_folder(root: Path, name: str) -> Path:
    return save_random_model(root / name, "Qwen3MoeConfig", {**MOE_FIELDS, **CASES[name]}, sharded=name == "moe")


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("moe")
    folders = {name: make_folder(root, name) for name in CASES}
    return {name: (folder, transformers_outputs(folder)) for name, folder in folders.items()}


def layouts(model: Model) -> list[tuple[int, int, int]]:
    """Every (tp, pp, ep) with tp * pp * ep <= 4 the model admits (ep dividing its 8 experts)."""
    return [(tp, pp, ep) for ep in (1, 2, 4) for tp, pp, dp in admissible_layouts(model, WORLD // ep) if dp == 1]


def world_worker(rank: int, world: int, cases: dict[str, tuple[Path, dict[str, torch.Tensor]]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    tokens, mask = inputs()
    results: dict[str, Any] = {}
    for name, (folder, expected) in cases.items():
        model = model_from_hf_config(folder)
        for tp, pp, ep in layouts(model):
            engine = Engine.create(model, "lm", RankLayout(tp, pp, 1, tuple(range(tp * pp * ep)), ep=ep))
            if engine is None:
                continue
            assert load_engine(engine, folder) == []
            logits = engine.logits(Batch(tokens, mask), num_microbatches=2 if pp > 1 else 1)
            sampled = generate(
                engine, tokens[:, 4:].tolist(), SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=0.0)
            )
            results[f"{name} tp={tp} pp={pp} ep={ep}"] = {
                "logits": masked_error(logits, expected["logits"], mask),
                "generated": sampled.responses() == expected["generated"].tolist(),
            }
    return results


@pytest.mark.one_rank
@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_layout_computes_what_transformers_computes(cases: dict[str, Any]) -> None:
    results: dict[str, Any] = {}
    for rank_results in spawn(world_worker, WORLD, cases):
        for key, value in rank_results.items():
            results.setdefault(key, []).append(value)
    expected = {(1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 1), (1, 4, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)}
    expected.add((1, 1, 4))
    assert set(results) == {f"{n} tp={tp} pp={pp} ep={ep}" for n in CASES for tp, pp, ep in expected}
    for key, per_rank in results.items():
        for errors in per_rank:
            assert errors["logits"] < TOL, (key, errors)
            assert errors["generated"], key


def reference(folder: Path, model: Model | None = None) -> ReferenceModel:
    model = model or model_from_hf_config(folder)
    ref = ReferenceModel(model)
    logical = read_logical(folder, model, "lm")
    with torch.no_grad():
        for name, param in ref.named_logical_parameters().items():
            param.copy_(logical[name])
    return ref


@pytest.mark.one_rank
def test_a_perturbed_router_breaks_parity(cases: dict[str, Any]) -> None:
    folder, expected = cases["moe-norm"]
    tokens, mask = inputs()
    ref = reference(folder)
    with torch.no_grad():
        assert masked_error(ref(tokens, mask), expected["logits"], mask) < TOL
        flipped = ref.model.model_copy(update={"moe": ref.model.moe.model_copy(update={"norm_topk_prob": False})})
        assert masked_error(reference(folder, flipped)(tokens, mask), expected["logits"], mask) > 100 * TOL
        ref.param("layers.2.mlp.router.weight").mul_(-1.0)
        assert masked_error(ref(tokens, mask), expected["logits"], mask) > 100 * TOL


@pytest.mark.one_rank
def test_transformers_writes_one_tensor_per_expert_and_the_stacked_layout_reads_the_same(
    cases: dict[str, Any], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    folder = cases["moe-norm"][0]
    model = model_from_hf_config(folder)
    saved = load_file(str(folder / "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in saved
    assert "model.layers.0.mlp.gate.weight" in saved
    assert not any(name.endswith("gate_up_proj") for name in saved)
    logical = read_logical(folder, model, "lm")
    assert logical["layers.0.mlp.experts.gate_proj"].shape == (8, 32, 64)
    assert torch.equal(
        logical["layers.3.mlp.experts.down_proj"][5], saved["model.layers.3.mlp.experts.5.down_proj.weight"]
    )
    # transformers' in-memory layout: gate and up stacked in one tensor, experts first
    stacked = {name: t for name, t in saved.items() if ".mlp.experts." not in name}
    for layer in (0, 2, 3):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up = [
            torch.cat([saved[f"{prefix}{j}.gate_proj.weight"], saved[f"{prefix}{j}.up_proj.weight"]]) for j in range(8)
        ]
        stacked[prefix + "gate_up_proj"] = torch.stack(gate_up)
        stacked[prefix + "down_proj"] = torch.stack([saved[f"{prefix}{j}.down_proj.weight"] for j in range(8)])
    other = tmp_path / "stacked"
    other.mkdir()
    (other / "config.json").write_text((folder / "config.json").read_text())
    save_file(stacked, str(other / "model.safetensors"))
    again = read_logical(other, model, "lm")
    assert set(again) == set(logical)
    assert all(torch.equal(again[name], logical[name]) for name in logical)
    # the export's naming is what transformers saved, tensor for tensor
    exported = as_hf_state(logical)
    assert set(exported) == set(saved)
    assert all(torch.equal(exported[name], saved[name]) for name in saved)


@pytest.mark.one_rank
def test_a_missing_expert_is_named(cases: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from nereus.errors import NereusError

    folder = cases["moe-norm"][0]
    saved = load_file(str(folder / "model.safetensors"))
    del saved["model.layers.2.mlp.experts.6.up_proj.weight"]
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(saved, str(tmp_path / "model.safetensors"))
    with pytest.raises(NereusError, match=r"model\.layers\.2\.mlp\.experts\.6\.up_proj\.weight is missing"):
        check_weights(tmp_path, model_from_hf_config(folder), "lm")


@pytest.mark.one_rank
def test_routing_replay_uses_the_given_experts_with_the_routers_weights(cases: dict[str, Any]) -> None:
    folder = cases["moe-norm"][0]
    ref = reference(folder)
    tokens, mask = inputs()
    with torch.no_grad():
        routes = Routes()
        plain = ref(tokens, mask, routes)
        assert set(routes.chosen) == {0, 2, 3}
        # replaying the router's own choice changes nothing, bit for bit
        same = ref(tokens, mask, Routes(replay=dict(routes.chosen)))
        assert torch.equal(same, plain)
        # replaying other experts uses them: the chosen ones are those replayed
        other = {layer: (chosen + 1) % 8 for layer, chosen in routes.chosen.items()}
        replayed = Routes(replay=other)
        changed = ref(tokens, mask, replayed)
        assert all(torch.equal(replayed.chosen[layer], other[layer]) for layer in other)
        assert (changed - plain).abs().max() > 1e-3
    logits = torch.randn(5, 8)
    experts = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [7, 0]])
    weights, chosen = route(logits, 2, True, experts)
    probs = logits.softmax(-1).gather(-1, experts)
    assert torch.equal(chosen, experts)
    assert torch.allclose(weights, probs / probs.sum(-1, keepdim=True))


@pytest.mark.one_rank
def test_the_auxiliary_loss_is_transformers(cases: dict[str, Any]) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    folder = cases["moe"][0]
    ref = reference(folder)
    tokens, mask = inputs()
    routes = Routes(keep_logits=True)
    with torch.no_grad():
        ref(tokens)
    ref(tokens, None, routes)
    layers = [routes.router_logits[layer].reshape(-1, 8) for layer in sorted(routes.router_logits)]
    ours = load_balancing_loss(layers, 8, 2)
    theirs = load_balancing_loss_func(tuple(layers), 8, 2)
    assert torch.allclose(ours, theirs, atol=1e-7, rtol=1e-6)
    masked = load_balancing_loss(layers, 8, 2, mask.reshape(-1))
    assert torch.allclose(masked, load_balancing_loss_func(tuple(layers), 8, 2, mask.long()), atol=1e-7, rtol=1e-6)
    masked.backward()
    assert ref.param("layers.0.mlp.router.weight").grad is not None


@dataclass(frozen=True)
class CrossEntropyWithAux(NextTokenLoss):
    """The language-model loss with the router's auxiliary loss (`rl.router_aux_loss_coef`)."""

    router_aux_loss_coef: float = 0.0


AUX_COEF = 0.5


def predicted_tokens(mask: torch.Tensor) -> torch.Tensor:
    """The real tokens after a real token (a left-padded row's first token follows a pad)."""
    return torch.nn.functional.pad(mask[:, 1:] & mask[:, :-1], (1, 0))


def aux_worker(rank: int, world: int, folder: Path, coef: float) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = model_from_hf_config(folder)
    engine = Engine.create(model, "lm", RankLayout(1, 1, 1, (0,)))
    assert engine is not None
    assert load_engine(engine, folder) == []
    tokens, mask = inputs()
    engine.zero_grad()
    batch = Batch(tokens, mask, {"loss_mask": predicted_tokens(mask)})
    loss = engine.forward_backward(batch, CrossEntropyWithAux(coef))
    routers = {name: param.grad.clone() for name, param in engine.params.items() if name.endswith("router.weight")}
    return {"loss": loss, "routers": routers, "aux": list(engine.router_aux_losses)}


def transformers_loss_with_aux(folder: Path, coef: float) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """transformers' `Qwen3MoeForCausalLM` with `output_router_logits`: the mean next-token
    cross-entropy over real tokens plus coef x its `aux_loss`; the routers' gradients by layer."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, router_aux_loss_coef=coef, output_router_logits=True
    )
    tokens, mask = inputs()
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=tokens, attention_mask=mask.long(), position_ids=positions)
    log_probs = out.logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    weights = predicted_tokens(mask)[:, 1:].float()
    loss = -(log_probs * weights).sum() / weights.sum() + coef * out.aux_loss
    loss.backward()
    grads = {i: layer.mlp.gate.weight.grad for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")}
    return loss.detach(), grads


@pytest.mark.one_rank
@pytest.mark.multiprocess
def test_the_auxiliary_loss_option_trains_the_router_as_transformers_does(cases: dict[str, Any]) -> None:
    folder = cases["moe-norm"][0]
    expected_loss, expected_grads = transformers_loss_with_aux(folder, AUX_COEF)
    (ours,) = spawn(aux_worker, 1, folder, AUX_COEF)
    (plain,) = spawn(aux_worker, 1, folder, 0.0)
    assert abs(ours["loss"] - float(expected_loss)) < 1e-5
    assert len(ours["aux"]) == 1 and plain["aux"] == []
    assert sorted(expected_grads) == [0, 2, 3]
    for layer, grad in expected_grads.items():
        name = f"layers.{layer}.mlp.router.weight"
        assert torch.allclose(ours["routers"][name], grad, atol=1e-5), name
        # the term changes the router's gradient (so the comparison can fail)
        assert (plain["routers"][name] - grad).abs().max() > 1e-3, name
    _, without = transformers_loss_with_aux(folder, 0.0)
    assert torch.allclose(plain["routers"]["layers.0.mlp.router.weight"], without[0], atol=1e-5)

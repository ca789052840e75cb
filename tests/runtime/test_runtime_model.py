"""The decoder, its sharding contract, the vocabulary-parallel loss and AdamW (one process)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.adamw import AdamW, AdamWConfig
from nereus.runtime.model.engine import Engine
from nereus.runtime.model.initialization import init_logical_param, init_logical_params, shard_params
from nereus.runtime.model.losses import NextTokenLoss, ValueLoss
from nereus.runtime.model.tensor_parallel import TensorParallel
from nereus.runtime.model.transformer import Batch, DecoderPipelineStage, ReferenceModel, positions_from_mask
from nereus.runtime.state.shard_layout import RankLayout, param_infos, position_boxes, state_key
from nereus.spec.model import Head, Model
from nereus.spec.presets import MODELS

pytestmark = pytest.mark.one_rank

TINY = MODELS["tiny"]
VARIANT = TINY.model_copy(update={"name": "tiny-variant", "qkv_bias": True, "qk_norm": True, "tied_embeddings": False})
MODEL_HEADS = [(TINY, "lm"), (VARIANT, "lm"), (TINY, "value"), (MODELS["tiny-wide"], "lm")]


def reference(model: Model, head: Head, seed: int = 3) -> ReferenceModel:
    ref = ReferenceModel(model, head)
    logical = init_logical_params(model, head, seed, randomize_all=True)
    with torch.no_grad():
        for name, param in ref.named_logical_parameters().items():
            param.copy_(logical[name])
    return ref


def single_stage(model: Model, head: Head, seed: int = 3) -> DecoderPipelineStage:
    stage = DecoderPipelineStage(model, head, TensorParallel.single(), 1, 0)
    shard = shard_params(init_logical_params(model, head, seed, randomize_all=True), model, head, 1, 1, 0, 0)
    with torch.no_grad():
        for name, param in stage.named_parameters():
            param.copy_(shard[name])
    return stage


@pytest.mark.parametrize(("model", "head"), MODEL_HEADS, ids=lambda x: getattr(x, "name", x))
def test_stage_parameters_are_the_contract_boxes(model: Model, head: Head) -> None:
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            boxes = position_boxes(model, head, tp, pp)
            for stage in range(pp):
                for tp_rank in range(tp):
                    module = DecoderPipelineStage(model, head, TensorParallel(tp, tp_rank), pp, stage)
                    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
                    expected = {
                        name: tuple(length for _, length in box) for name, box in boxes[stage * tp + tp_rank].items()
                    }
                    assert shapes == expected, (tp, pp, stage, tp_rank)


def padded_batch(model: Model, rows: int = 3, seq: int = 7) -> Batch:
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, model.vocab_size, (rows, seq), generator=generator)
    mask = torch.ones(rows, seq, dtype=torch.bool)
    mask[1, :2] = False  # a left-padded row
    fields = {"value_targets": torch.randn(rows, seq, generator=generator)}
    return Batch(tokens, mask, fields)


@pytest.mark.parametrize(("model", "head"), MODEL_HEADS[:3], ids=lambda x: getattr(x, "name", x))
def test_stage_matches_independent_reference(model: Model, head: Head) -> None:
    """The sharding-ready stage (one rank) against the plain full-weight model: outputs and grads."""
    ref, stage = reference(model, head), single_stage(model, head)
    batch = padded_batch(model)
    objective = ValueLoss() if head == "value" else NextTokenLoss()
    mask, weights = batch.mask(), objective.weights(batch)

    def loss_of(output: torch.Tensor, module: ReferenceModel | DecoderPipelineStage) -> torch.Tensor:
        return (objective.token_losses(output, batch, module) * weights).sum() / weights.sum()

    ref_output = ref(batch.tokens, mask)
    # The engine's way: the objective runs inside the stage's forward, on its final hidden states.
    stage_loss = stage(batch.tokens, mask, positions_from_mask(mask), reduce=lambda out: loss_of(out, stage))
    with torch.no_grad():
        stage_output = stage(batch.tokens, mask, positions_from_mask(mask))
    losses = []
    for output, loss in ((ref_output, loss_of(ref_output, ref)), (stage_output, stage_loss)):
        loss.backward()
        losses.append((output.detach(), float(loss.detach())))
    assert torch.allclose(losses[0][0], losses[1][0], atol=1e-6)
    assert losses[0][1] == pytest.approx(losses[1][1], abs=1e-6)
    ref_grads = ref.named_logical_parameters()
    for name, param in stage.named_parameters():
        assert param.grad is not None and torch.allclose(param.grad, ref_grads[name].grad, atol=1e-6), name  # type: ignore[arg-type]


def test_left_padding_does_not_change_real_tokens() -> None:
    ref = reference(TINY, "lm")
    tokens = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), tokens], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        plain, with_pad = ref(tokens), ref(padded, mask)
    assert torch.allclose(plain, with_pad[:, 3:], atol=1e-5)
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 0, 1, 2, 3, 4, 5]]


def test_adamw_matches_torch() -> None:
    config = AdamWConfig(lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.2)
    generator = torch.Generator().manual_seed(5)
    ours = {"a": torch.nn.Parameter(torch.randn(3, 4, generator=generator)), "b": torch.nn.Parameter(torch.randn(7))}
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours.values()]
    optimizer = AdamW(ours, config)
    reference_optimizer = torch.optim.AdamW(theirs, lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.2)
    for _ in range(5):
        for mine, other in zip(ours.values(), theirs, strict=True):
            grad = torch.randn(mine.shape, generator=generator)
            mine.grad, other.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference_optimizer.step()
    for (name, mine), other in zip(ours.items(), theirs, strict=True):
        assert torch.allclose(mine, other, atol=1e-6)
        assert torch.allclose(optimizer.exp_avg_sq[name], reference_optimizer.state[other]["exp_avg_sq"], atol=1e-7)
        assert optimizer.exp_avg[name].dtype == torch.float32
    assert optimizer.step_count == 5


@pytest.mark.parametrize("kwargs", [{"lr": 0.0}, {"beta1": 1.0}, {"eps": 0.0}, {"weight_decay": -1.0}])
def test_adamw_config_refuses_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="AdamW"):
        AdamWConfig(**kwargs)


def test_initial_values_depend_on_seed_and_name_only() -> None:
    infos = {info.name: info for info in param_infos(TINY)}
    a = init_logical_param(infos["layers.1.attn.q_proj.weight"], seed=4)
    assert torch.equal(a, init_logical_params(TINY, "lm", 4)["layers.1.attn.q_proj.weight"])
    assert not torch.equal(a, init_logical_param(infos["layers.2.attn.q_proj.weight"], seed=4))
    assert torch.equal(init_logical_param(infos["final_norm.weight"], seed=4), torch.ones(64))
    assert float(a.std()) == pytest.approx(0.02, rel=0.2)


def test_batch_names_a_missing_field() -> None:
    with pytest.raises(ValueError, match="no field 'value_targets'"):
        ValueLoss().token_losses(
            torch.zeros(1, 2), Batch(torch.zeros(1, 2, dtype=torch.long)), reference(TINY, "value")
        )


def state_worker(rank: int, world: int) -> dict[str, object]:
    engine = Engine.create(TINY, "lm", RankLayout(1, 1, 1, (0,)))
    assert engine is not None
    batch = padded_batch(TINY, rows=2)
    engine.train_step(batch, NextTokenLoss())
    engine.forward_backward(batch, NextTokenLoss())
    state = {key: tensor.clone() for key, tensor in engine.local_state().items()}
    families = sorted({key.split("/")[0] for key in state})
    other = Engine.create(TINY, "lm", RankLayout(1, 1, 1, (0,)), engine.config)
    assert other is not None
    other.load_local_state(state, engine.optimizer_step)
    engine.update()
    other.update()
    same = all(torch.equal(engine.local_state()[k], other.local_state()[k]) for k in state)
    errors = []
    try:
        Engine.create(TINY, "lm", RankLayout(1, 1, 2, (0, 1)))
    except ValueError as exc:
        errors.append(str(exc))
    broken = [
        {k: v for k, v in state.items() if k != state_key("param", "embed.weight")},
        {**state, state_key("param", "final_norm.weight"): torch.zeros(3)},
        {**state, "momentum/embed.weight": torch.zeros(1)},
        {k: v for k, v in state.items() if k != state_key("exp_avg", "embed.weight")},
    ]
    for bad in broken:
        try:
            other.load_local_state(bad, 1)
        except ValueError as exc:
            errors.append(str(exc))
    return {"families": families, "same": same, "step": other.optimizer_step, "errors": errors}


@pytest.mark.multiprocess
def test_local_state_round_trip_and_refusals() -> None:
    (result,) = spawn(state_worker, 1)
    assert result["families"] == ["exp_avg", "exp_avg_sq", "grad", "param"]
    assert result["same"] and result["step"] == 2
    errors = result["errors"]
    assert len(errors) == 5
    assert "not all ranks of this 1-rank world" in errors[0]
    assert "lacks parameters embed.weight" in errors[1]
    assert "shape (3,)" in errors[2]
    assert "momentum/embed.weight" in errors[3]
    assert "exp_avg for some parameters" in errors[4]


def test_engine_refuses_a_layout_the_model_does_not_admit() -> None:
    with pytest.raises(ValueError, match="tp=3 does not divide the 4 attention heads"):
        Engine.create(TINY, "lm", RankLayout(3, 1, 1, (0, 1, 2)))


def test_whole_sequences_attend_causally_without_a_sequence_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training and inference forwards of left- and right-padded rows call scaled-dot-product
    attention in its causal form (no mask tensor); the real tokens' outputs are those of
    the unpadded rows and the pads' are finite."""
    calls: list[tuple[object, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        mask = kwargs.get("attn_mask")
        calls.append((None if mask is None else tuple(mask.shape), bool(kwargs.get("is_causal"))))  # type: ignore[attr-defined]
        return sdpa(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    stage = single_stage(TINY, "lm")
    tokens = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(4))
    padded = torch.zeros(2, 9, dtype=torch.long)
    padded[0, 3:8], padded[1, 1:6] = tokens[0], tokens[1]  # left and right pads
    mask = padded != 0
    out = stage(padded, mask, positions_from_mask(mask))
    assert calls and all(shape is None and causal for shape, causal in calls)
    plain = stage(tokens, torch.ones_like(tokens, dtype=torch.bool), positions_from_mask(tokens >= 0))
    assert torch.allclose(out[0, 3:8], plain[0], atol=1e-5) and torch.allclose(out[1, 1:6], plain[1], atol=1e-5)
    assert torch.isfinite(out).all()

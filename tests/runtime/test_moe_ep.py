"""Expert parallelism against the single-process reference model: a tiny mixture-of-experts
decoder (4 experts, 2 per token, one dense layer) trained in layouts with ep = 2 (alone, with
tp = 2, with pp = 2, with dp = 2) on a 4-rank gloo world. Each rank compares its shards (its
block of experts, its copy of every other weight) with the reference's logits, loss, gradients
and the parameters and AdamW moments after three optimizer steps (test_runtime_parallel's
check), so the all-to-all dispatch and combine, their backward, the ep ranks' split of the
sequences and the gradient sums (dp x ep for shared weights, dp for experts) are all held to
the plain computation. Layouts the runtime does not execute with ep are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_runtime_parallel import (
    OPTIMIZER,
    ROWS,
    STEPS,
    TOL,
    _max_error,
    make_batches,
    merge_rank_errors,
    reference_run,
)

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.engine import Engine, EngineConfig
from nereus.runtime.model.grad_norm import global_grad_norm
from nereus.runtime.model.initialization import shard_params
from nereus.runtime.model.losses import NextTokenLoss
from nereus.runtime.state.checkpoint import load_checkpoint, save_checkpoint
from nereus.runtime.state.reshard import execute
from nereus.runtime.state.reshard_plan import plan_reshard
from nereus.runtime.state.shard_layout import STATE_FAMILIES, RankLayout, state_key
from nereus.runtime.state.sharded_state import cut, gather, random_logical_state, state_meta
from nereus.spec.model import Model, MoE
from nereus.spec.presets import MODELS

pytestmark = pytest.mark.one_rank

WORLD = 4
#: tiny with 4 experts of width 32, 2 per token, renormalised; layer 1 keeps the dense MLP.
TINY_MOE: Model = MODELS["tiny"].model_copy(
    update={
        "name": "tiny-moe",
        "tied_embeddings": False,
        "moe": MoE(num_experts=4, experts_per_token=2, expert_ffn_dim=32, norm_topk_prob=True, dense_layers=[1]),
    }
)
#: (tp, pp, dp, ep) with ep = 2, every one on 4 ranks or fewer; ep = 1 as the control.
LAYOUTS = [(1, 1, 1, 1), (1, 1, 1, 2), (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2), (1, 1, 1, 4)]
#: Memory choices with ep = 2 checked like the layouts: ZeRO-1 with dp = 2 and dp = 1 (full
#: sharding, training-time offload and token budgets are refused with ep > 1).
CONFIGS: dict[str, tuple[tuple[int, int, int, int], EngineConfig]] = {
    "zero1 dp=2 ep=2": ((1, 1, 2, 2), EngineConfig(optimizer=OPTIMIZER, shard_across_dp=True)),
    "zero1 dp=1 ep=2": ((1, 1, 1, 2), EngineConfig(optimizer=OPTIMIZER, shard_across_dp=True)),
}


def reduced_grads(engine: Engine) -> dict[str, torch.Tensor]:
    """Every gradient this rank holds, reduced whole: the live ones, or under ZeRO-1 (which sums
    each replica's rows over dp x cp only into that replica, the other rows keeping its own
    contribution) each replica's reduced rows gathered from it (collective over dp x cp)."""
    state = engine.whole_state(["grad"])
    if not engine.zero1:
        return state
    whole = {name: state[state_key("grad", name)].clone() for name in engine.params}
    engine._all_gather_rows(whole)
    return {state_key("grad", name): grad for name, grad in whole.items()}


def check_layout(
    dims: tuple[int, int, int, int], ref: dict, config: EngineConfig | None = None
) -> dict[str, float] | None:
    """Run one layout on ranks 0..n-1 (collective over the world); this rank's errors."""
    tp, pp, dp, ep = dims
    layout = RankLayout(tp, pp, dp, tuple(range(tp * pp * dp * ep)), ep=ep)
    engine = Engine.create(TINY_MOE, "lm", layout, config or EngineConfig(optimizer=OPTIMIZER))
    if engine is None:
        return None
    g = engine.groups

    def shard_of(whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_params(whole, TINY_MOE, "lm", tp, pp, g.pp_rank, g.tp.rank, ep, g.ep.rank)

    engine.load_logical_params(ref["logical"])
    batches = make_batches("lm", 7)
    num_microbatches = 2 if pp > 1 else 1
    first = batches[0].rows(0, ROWS // dp)  # inference runs this replica's batch as given
    errors = {"output": float((engine.logits(first, num_microbatches) - ref["output"][: ROWS // dp]).abs().max())}
    for step, batch in enumerate(batches):
        engine.zero_grad()
        loss = engine.forward_backward(batch, NextTokenLoss(), num_microbatches)
        if step == 0:
            errors["loss"] = abs(loss - ref["loss"])
            errors["grad"] = _max_error(reduced_grads(engine), "grad", ref["grads"], shard_of)
            errors["grad norm"] = abs(global_grad_norm(engine) - ref["grad_norm"])
        engine.update()
    state = engine.whole_state(["param", "exp_avg", "exp_avg_sq"])
    for family in ("param", "exp_avg", "exp_avg_sq"):
        key = "params" if family == "param" else family
        errors[f"{family} after {STEPS} steps"] = _max_error(state, family, ref[key], shard_of)
    return errors


def check_transition(ref: dict) -> dict[str, float] | None:
    """One step at ep = 2 (ranks 0, 1), the state moved live (`reshard`) to tp = 2, ep = 1 (ranks
    2, 3), which takes the remaining steps: the reference's state after them, as if nothing moved."""
    source = RankLayout(1, 1, 1, (0, 1), ep=2)
    target = RankLayout(2, 1, 1, (2, 3))
    engines = {
        layout: Engine.create(TINY_MOE, "lm", layout, EngineConfig(optimizer=OPTIMIZER)) for layout in (source, target)
    }
    batches = make_batches("lm", 7)
    rank = dist.get_rank()
    state: dict[str, torch.Tensor] = {}
    step = None
    if engines[source] is not None:
        engine = engines[source]
        engine.load_logical_params(ref["logical"])
        engine.train_step(batches[0], NextTokenLoss())
        state, step = engine.local_state(), engine.optimizer_step
    families = ("param", "exp_avg", "exp_avg_sq")
    state = {key: tensor for key, tensor in state.items() if key.split("/")[0] in families}
    plan = plan_reshard(state_meta(TINY_MOE, "lm", source, families), state_meta(TINY_MOE, "lm", target, families))
    moved = execute(plan, rank, state, step)
    engine = engines[target]
    if engine is None:
        return None
    assert moved.step == 1
    engine.load_local_state(moved.tensors, moved.step)
    for batch in batches[1:]:
        engine.train_step(batch, NextTokenLoss())
    g = engine.groups

    def shard_of(whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_params(whole, TINY_MOE, "lm", 2, 1, g.pp_rank, g.tp.rank)

    final = engine.local_state()
    return {
        f"{family} after a move": _max_error(final, family, ref["params" if family == "param" else family], shard_of)
        for family in families
    }


def world_worker(rank: int, world: int, ref: dict) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    results = {}
    for dims in LAYOUTS:
        errors = check_layout(dims, ref)
        if errors is not None:
            results["tp={} pp={} dp={} ep={}".format(*dims)] = errors
    for name, (dims, config) in CONFIGS.items():
        errors = check_layout(dims, ref, config)
        if errors is not None:
            results[name] = errors
    moved = check_transition(ref)
    if moved is not None:
        results["ep=2 -> tp=2"] = moved
    return results


@pytest.mark.multiprocess
@pytest.mark.slow
def test_expert_parallel_layouts_match_the_reference() -> None:
    ref = reference_run(TINY_MOE, "lm", seed=7)
    grads = ref["grads"]
    assert isinstance(grads, dict)
    ref["grad_norm"] = float(torch.cat([g.reshape(-1) for g in grads.values()]).double().norm())
    merged = merge_rank_errors(spawn(world_worker, WORLD, ref))
    layouts = {"tp={} pp={} dp={} ep={}".format(*dims) for dims in LAYOUTS}
    assert set(merged) == layouts | set(CONFIGS) | {"ep=2 -> tp=2"}
    for case, errors in merged.items():
        for quantity, error in errors.items():
            assert error < TOL, (case, quantity, error)


def dispatch_worker(rank: int, world: int, ref: dict) -> tuple[bool, bool]:
    """Whether torch._dynamo was loaded before, and after, an ep = 2 engine (tp = 1) ran every
    dispatch: the replicated one (logits, routing, a cached generation) and the all-to-all one
    (a training step)."""
    import sys

    from nereus.runtime.generation.generate import SamplingConfig, generate

    torch.set_num_threads(1)
    before = "torch._dynamo" in sys.modules
    engine = Engine.create(TINY_MOE, "lm", RankLayout(1, 1, 1, (0, 1), ep=2), EngineConfig(optimizer=OPTIMIZER))
    assert engine is not None
    engine.load_logical_params(ref["logical"])
    batch = make_batches("lm", 7)[0]
    engine.logits(batch)
    engine.routing(batch)
    generate(engine, batch.tokens[:2, :4].tolist(), SamplingConfig(max_new_tokens=3, temperature=1.0, seed=0))
    engine.train_step(batch, NextTokenLoss())
    return before, "torch._dynamo" in sys.modules


@pytest.mark.multiprocess
def test_expert_parallel_dispatch_leaves_dynamo_unloaded() -> None:
    """The ep ranks meet through plain collectives (tp = 1): no DTensor, whose constructor
    imports torch._dynamo on its first call, ~35 MB of a CPU rank's private memory that the
    memory tracker would count in the model-stage that ran first (benchmarks/moe_runtime.py)."""
    for before, after in spawn(dispatch_worker, 2, reference_run(TINY_MOE, "lm", seed=7)):
        assert not before  # a fresh rank: the check below can fail
        assert not after


def test_the_reference_uses_every_expert() -> None:
    """The check above is not vacuous: every sparse layer sends tokens to every expert."""
    from nereus.runtime.model.moe import Routes
    from nereus.runtime.model.transformer import ReferenceModel

    ref_run = reference_run(TINY_MOE, "lm", seed=7)
    model = ReferenceModel(TINY_MOE)
    with torch.no_grad():
        for name, param in model.named_logical_parameters().items():
            param.copy_(ref_run["logical"][name])  # type: ignore[index]
        routes = Routes()
        batch = make_batches("lm", 7)[0]
        model(batch.tokens, batch.attention_mask, routes)
    assert set(routes.chosen) == {0, 2, 3}
    for chosen in routes.chosen.values():
        assert set(chosen.unique().tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("dims", "config", "message"),
    [
        ((1, 1, 1, 3), EngineConfig(), "ep=3 does not divide the 4 experts"),
        ((1, 1, 2, 2), EngineConfig(full_shard=True), "without full_shard"),
        ((1, 1, 1, 2), EngineConfig(token_budget=64), "without token_budget"),
        ((1, 1, 1, 2), EngineConfig(train_offload="optimizer"), "without train_offload optimizer"),
    ],
)
def test_unexecuted_expert_layouts_are_refused_by_name(
    dims: tuple[int, int, int, int], config: EngineConfig, message: str
) -> None:
    tp, pp, dp, ep = dims
    layout = RankLayout(tp, pp, dp, tuple(range(tp * pp * dp * ep)), ep=ep)
    with pytest.raises(ValueError, match=message):
        Engine.create(TINY_MOE, "lm", layout, config)
    dense = RankLayout(1, 1, 1, (0, 1), ep=2)
    with pytest.raises(ValueError, match="tiny has none"):
        Engine.create(MODELS["tiny"], "lm", dense)


def layout(dims: tuple[int, int, int, int], first: int) -> RankLayout:
    """The (tp, pp, dp, ep) layout on consecutive ranks from `first`."""
    tp, pp, dp, ep = dims
    return RankLayout(tp, pp, dp, tuple(range(first, first + tp * pp * dp * ep)), ep=ep)


def assert_loads_bitwise(tmp_path, source, logical: dict[str, torch.Tensor], target: RankLayout) -> None:
    """`logical` cut as `source` lays it out, saved, loaded into `target` and gathered: the same."""
    save_checkpoint(tmp_path / "ckpt", source, {rank: cut(source, logical, rank) for rank in source.layout.ranks}, 9)
    loaded = {rank: load_checkpoint(tmp_path / "ckpt", target, rank) for rank in target.ranks}
    back = gather(loaded[target.ranks[0]].meta, {rank: state.tensors for rank, state in loaded.items()})
    assert back.keys() == logical.keys()
    assert all(torch.equal(back[key], logical[key]) for key in logical)


@pytest.mark.parametrize(
    ("saved_dims", "loaded_dims"),
    [
        ((1, 1, 1, 2), (1, 1, 1, 1)),
        ((2, 1, 1, 2), (1, 1, 1, 4)),
        ((1, 1, 1, 4), (2, 2, 1, 1)),
        ((1, 2, 2, 2), (1, 1, 1, 2)),
    ],
)
def test_a_checkpoint_saved_at_one_ep_loads_bitwise_at_another(tmp_path, saved_dims, loaded_dims) -> None:
    """Resume with another ep: the saved experts' blocks and the ep ranks' shared copies load
    into any layout bitwise (each distinct box stored once)."""

    source = state_meta(TINY_MOE, "lm", layout(saved_dims, 0), STATE_FAMILIES)
    logical = random_logical_state(source, 3)
    experts = source.rank_boxes(0)["param/layers.0.mlp.experts.gate_proj"]
    assert experts[0] == (0, 4 // saved_dims[3])  # ep rank 0 holds the first block of experts
    assert_loads_bitwise(tmp_path, source, logical, layout(loaded_dims, 3))


@pytest.mark.parametrize(("saved_dims", "loaded_dims"), [((1, 1, 2, 2), (1, 1, 1, 1)), ((1, 1, 1, 1), (1, 1, 2, 2))])
def test_a_zero1_checkpoint_with_ep_loads_bitwise_at_another_ep(tmp_path, saved_dims, loaded_dims) -> None:
    """ZeRO-1 with ep = 2: the AdamW moments split over dp inside each ep rank's boxes (experts
    and shared copies alike) save and load into another ep, and back, bitwise."""
    zero1 = ("exp_avg", "exp_avg_sq")

    source = state_meta(TINY_MOE, "lm", layout(saved_dims, 0), STATE_FAMILIES, dp_sharded=zero1)
    assert_loads_bitwise(tmp_path, source, random_logical_state(source, 5), layout(loaded_dims, 4))

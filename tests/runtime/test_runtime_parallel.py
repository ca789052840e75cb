"""Tensor, pipeline and data parallelism against the single-process reference model.

One 8-rank gloo world (spawned once per module) runs every (tp, pp, dp) layout with
tp * pp * dp <= 8 that the tiny model admits, plus model variants (qkv bias, qk-norm,
untied head; value head) on layouts that exercise each code path. Each rank compares its
shards with the matching slices of the reference's logits, loss, gradients and the
parameters and AdamW moments after three optimizer steps, and returns the largest error.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.adamw import AdamWConfig
from nereus.runtime.model.engine import Engine, EngineConfig
from nereus.runtime.model.initialization import init_logical_params, shard_params
from nereus.runtime.model.losses import NextTokenLoss, Objective, ValueLoss
from nereus.runtime.model.parallel_groups import admissible_layouts
from nereus.runtime.model.pipeline import (
    Op,
    check_op_lists,
    forward_only,
    one_f_one_b,
    op_lists_from_schedule,
    parse_op,
    parse_op_lists,
)
from nereus.runtime.model.transformer import Batch, ReferenceModel
from nereus.runtime.state.shard_layout import RankLayout, state_key
from nereus.spec.model import Head, Model
from nereus.spec.presets import MODELS

pytestmark = pytest.mark.one_rank

WORLD = 8
TOL = 1e-5
TINY = MODELS["tiny"]
#: qkv bias, qk-norm and an untied LM head, on the tiny shapes.
VARIANT = TINY.model_copy(update={"name": "tiny-variant", "qkv_bias": True, "qk_norm": True, "tied_embeddings": False})
#: eps well above fp32 gradient noise, so Adam does not blow ulp-level differences up to lr-sized steps.
OPTIMIZER = AdamWConfig(lr=1e-3, eps=1e-4, weight_decay=0.1)
ROWS, SEQ, STEPS = 16, 10, 3


LAYOUTS = admissible_layouts(TINY, WORLD)
#: Variant models run on layouts that cover KV replication, tied/untied pipelines and dp.
VARIANT_CASES: list[tuple[str, Model, Head, tuple[int, int, int]]] = [
    ("variant", VARIANT, "lm", (4, 2, 1)),
    ("variant", VARIANT, "lm", (2, 2, 2)),
    ("variant", VARIANT, "lm", (1, 4, 2)),
    ("value", TINY, "value", (4, 1, 2)),
    ("value", TINY, "value", (2, 4, 1)),
    ("value", TINY, "value", (1, 2, 1)),
]
CASES: list[tuple[str, Model, Head, tuple[int, int, int]]] = [
    ("tiny", TINY, "lm", layout) for layout in LAYOUTS
] + VARIANT_CASES


def make_batches(head: Head, seed: int) -> list[Batch]:
    """STEPS batches with padding on the left and a loss mask (and value targets)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(STEPS):
        tokens = torch.randint(0, TINY.vocab_size, (ROWS, SEQ), generator=generator)
        pad = torch.randint(0, 3, (ROWS,), generator=generator)
        mask = torch.arange(SEQ).unsqueeze(0) >= pad.unsqueeze(1)
        loss_mask = mask & (torch.rand(ROWS, SEQ, generator=generator) > 0.2)
        fields = {"loss_mask": loss_mask}
        if head == "value":
            fields["value_targets"] = torch.randn(ROWS, SEQ, generator=generator)
        batches.append(Batch(tokens, mask, fields))
    return batches


def objective_for(head: Head) -> Objective:
    return ValueLoss() if head == "value" else NextTokenLoss()


def reference_run(model: Model, head: Head, seed: int) -> dict[str, object]:
    """Logits, loss and gradients of the first batch, then the state after STEPS AdamW steps."""
    torch.manual_seed(0)
    logical = init_logical_params(model, head, seed, randomize_all=True)
    ref = ReferenceModel(model, head)
    params = ref.named_logical_parameters()
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(logical[name])
    c = OPTIMIZER
    optimizer = torch.optim.AdamW(
        list(params.values()), lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps, weight_decay=c.weight_decay
    )
    objective = objective_for(head)
    out: dict[str, object] = {"logical": logical}
    for step, batch in enumerate(make_batches(head, seed)):
        optimizer.zero_grad()
        output = ref(batch.tokens, batch.attention_mask)
        weights = objective.weights(batch)
        loss = (objective.token_losses(output, batch, ref) * weights).sum() / weights.sum()
        loss.backward()
        if step == 0:
            out["output"] = output.detach()
            out["loss"] = float(loss.detach())
            out["grads"] = {name: p.grad.clone() for name, p in params.items()}  # type: ignore[union-attr]
        optimizer.step()
    out["params"] = {name: p.detach().clone() for name, p in params.items()}
    out["exp_avg"] = {name: optimizer.state[p]["exp_avg"] for name, p in params.items()}
    out["exp_avg_sq"] = {name: optimizer.state[p]["exp_avg_sq"] for name, p in params.items()}
    return out


def _max_error(local: dict[str, torch.Tensor], family: str, whole: dict[str, torch.Tensor], shard_of) -> float:
    expected = shard_of(whole)
    assert {k for k in local if k.startswith(family + "/")} == {state_key(family, n) for n in expected}
    return max(float((local[state_key(family, n)] - t).abs().max()) for n, t in expected.items())


def check_case(
    model: Model, head: Head, dims: tuple[int, int, int], ref: dict, schedule=None, num_microbatches: int = 2
) -> dict[str, float] | None:
    """Run one layout on ranks 0..n-1 (collective over the world); this rank's errors."""
    tp, pp, dp = dims
    layout = RankLayout(tp, pp, dp, tuple(range(tp * pp * dp)))
    engine = Engine.create(model, head, layout, EngineConfig(optimizer=OPTIMIZER))
    if engine is None:
        return None
    stage, tp_rank = engine.groups.pp_rank, engine.groups.tp.rank

    def shard_of(whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_params(whole, model, head, tp, pp, stage, tp_rank)

    engine.load_logical_params(ref["logical"])
    batches = make_batches(head, 7)
    objective = objective_for(head)
    num_microbatches = num_microbatches if pp > 1 else 1
    first = batches[0].rows(0, ROWS // dp)  # inference runs this replica's batch as given
    output = engine.logits(first, num_microbatches) if head == "lm" else engine.values(first, num_microbatches)
    errors = {"output": float((output - ref["output"][: ROWS // dp]).abs().max())}
    for step, batch in enumerate(batches):
        engine.zero_grad()
        loss = engine.forward_backward(batch, objective, num_microbatches, schedule)
        if step == 0:
            errors["loss"] = abs(loss - ref["loss"])
            errors["grad"] = _max_error(engine.local_state(), "grad", ref["grads"], shard_of)
        engine.update()
    state = engine.local_state()
    for family in ("param", "exp_avg", "exp_avg_sq"):
        key = "params" if family == "param" else family
        errors[f"{family} after {STEPS} steps"] = _max_error(state, family, ref[key], shard_of)
    assert engine.optimizer_step == STEPS
    return errors


def gpipe(pp: int, num_microbatches: int) -> list[list[dict[str, object]]]:
    """All forwards then all backwards, as solver-style dicts (a non-1F1B schedule)."""
    return [
        [{"kind": "F", "microbatch": mb} for mb in range(num_microbatches)]
        + [{"kind": "B", "microbatch": mb} for mb in reversed(range(num_microbatches))]
        for _ in range(pp)
    ]


def fused_actor_schedule() -> list[list[Op]]:
    """The actor's op lists from a fused actor-critic schedule found by `nereus schedule fuse`'s search."""
    from nereus.solver.pipeline.document import to_document
    from nereus.solver.pipeline.model import ModelTimes
    from nereus.solver.pipeline.search import SearchConfig, search_fused

    actor = ModelTimes.uniform("actor", 4, 4, forward=1.0, backward=2.0)
    critic = ModelTimes.uniform("critic", 2, 4, forward=1.0, backward=2.0)
    result = search_fused(actor, critic, SearchConfig(time_limit_s=1, seeds=1, max_iterations=300))
    return op_lists_from_schedule(to_document(result), "actor")


def world_worker(rank: int, world: int, fused: list[list[Op]]) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    kinds = {name: (model, head) for name, model, head, _ in CASES}
    refs = {name: reference_run(model, head, 7) for name, (model, head) in kinds.items()}
    results: dict[str, dict[str, float]] = {}
    for name, model, head, dims in CASES:
        errors = check_case(model, head, dims, refs[name])
        if errors is not None:
            results[f"{name}-{dims}"] = errors
    errors = check_case(TINY, "lm", (1, 4, 1), refs["tiny"], schedule=gpipe(4, 2))
    if errors is not None:
        results["gpipe-(1, 4, 1)"] = errors
    errors = check_case(TINY, "lm", (1, 4, 1), refs["tiny"], schedule=fused, num_microbatches=4)
    if errors is not None:
        results["fused-(1, 4, 1)"] = errors
    errors = check_accumulation(refs["tiny"])
    if errors is not None:
        results["accumulate-(2, 2, 2)"] = errors
    return results


def check_accumulation(ref: dict) -> dict[str, float] | None:
    """Two forward_backward calls without zero_grad hold twice the gradient (no double reduction)."""
    tp, pp, dp = 2, 2, 2
    engine = Engine.create(TINY, "lm", RankLayout(tp, pp, dp, tuple(range(8))))
    assert engine is not None
    engine.load_logical_params(ref["logical"])
    batch = make_batches("lm", 7)[0]
    for _ in range(2):
        engine.forward_backward(batch, NextTokenLoss(), 2)
    twice = {name: 2 * grad for name, grad in ref["grads"].items()}

    def shard_of(whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_params(whole, TINY, "lm", tp, pp, engine.groups.pp_rank, engine.groups.tp.rank)

    return {"grad": _max_error(engine.local_state(), "grad", twice, shard_of)}


def merge_rank_errors(per_rank: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Case -> quantity -> the largest error any rank saw."""
    merged: dict[str, dict[str, float]] = {}
    for rank_results in per_rank:
        for case, errors in rank_results.items():
            into = merged.setdefault(case, {})
            for key, value in errors.items():
                into[key] = max(into.get(key, 0.0), value)
    return merged


def test_layouts_cover_the_tiny_model() -> None:
    assert len(LAYOUTS) == 24
    assert (4, 2, 1) in LAYOUTS and (1, 1, 8) in LAYOUTS and (1, 2, 3) in LAYOUTS and (8, 1, 1) not in LAYOUTS


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_layout_matches_reference() -> None:
    """One test for the whole world (a parametrised one would spawn it once per xdist worker);
    the failure message names every layout and quantity that is off."""
    fused = fused_actor_schedule()
    assert fused != one_f_one_b(4, 4)  # the fused order is not plain 1F1B
    merged = merge_rank_errors(spawn(world_worker, WORLD, fused))
    extra = {"gpipe-(1, 4, 1)", "fused-(1, 4, 1)", "accumulate-(2, 2, 2)"}
    expected_cases = {f"{name}-{dims}" for name, _, _, dims in CASES} | extra
    assert set(merged) == expected_cases
    for case, errors in merged.items():
        assert case.startswith("accumulate") or set(errors) >= {
            "output",
            "loss",
            "grad",
            f"param after {STEPS} steps",
            f"exp_avg after {STEPS} steps",
        }
    bad = {case: {k: v for k, v in errors.items() if not v <= TOL} for case, errors in merged.items()}
    bad = {case: errors for case, errors in bad.items() if errors}
    assert not bad, f"errors above {TOL}: {bad}"


# ---- schedules (pure logic) ----


def test_one_f_one_b_shape() -> None:
    schedule = one_f_one_b(4, 6)
    assert [str(op) for op in schedule[0][:5]] == ["F0", "F1", "F2", "F3", "B0"]
    assert [str(op) for op in schedule[3][:4]] == ["F0", "B0", "F1", "B1"]
    check_op_lists(schedule, 6, backward=True)
    check_op_lists(forward_only(3, 2), 2, backward=False)


def test_parse_ops_accepts_solver_forms() -> None:
    assert parse_op({"kind": "B", "microbatch": 2}) == Op("B", 2)
    assert parse_op(("F", 0)) == Op("F", 0)
    assert parse_op_lists(gpipe(2, 2))[1][2] == Op("B", 1)
    with pytest.raises(ValueError, match="W ops"):
        parse_op({"kind": "W", "microbatch": 0})


def test_check_op_lists_refuses_bad_schedules() -> None:
    # Stage 0 waits for B0 from stage 1, which first waits for F1 that stage 0 has not sent.
    deadlock = [[Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1)], [Op("F", 1), Op("F", 0), Op("B", 0), Op("B", 1)]]
    with pytest.raises(ValueError, match="deadlocks"):
        check_op_lists(deadlock, 2, backward=True)
    with pytest.raises(ValueError, match="once each"):
        check_op_lists([[Op("F", 0), Op("B", 0)]], 2, backward=True)
    with pytest.raises(ValueError, match="B0 comes before F0"):
        check_op_lists([[Op("B", 0), Op("F", 0)]], 1, backward=True)


def test_op_lists_from_schedule_picks_one_replica() -> None:
    def op(model: str, replica: int, mb: int, stage: int, kind: str) -> SimpleNamespace:
        return SimpleNamespace(model=model, replica=replica, microbatch=mb, stage=stage, kind=kind)

    critic = SimpleNamespace(name="critic", forward=[1.0], replica_microbatches=[[0, 2], [1, 3]])
    nodes = [
        SimpleNamespace(ops=[op("critic", 1, 1, 0, "F"), op("critic", 0, 0, 0, "F"), op("critic", 1, 3, 0, "F")]),
        SimpleNamespace(ops=[op("critic", 1, 3, 0, "B"), op("critic", 1, 1, 0, "B")]),
    ]
    schedule = SimpleNamespace(models=[critic], nodes=nodes)
    lists = op_lists_from_schedule(schedule, "critic", replica=1)  # type: ignore[arg-type]
    assert [[str(o) for o in ops] for ops in lists] == [["F0", "F1", "B1", "B0"]]
    with pytest.raises(ValueError, match="no model 'actor'"):
        op_lists_from_schedule(schedule, "actor")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 replicas"):
        op_lists_from_schedule(schedule, "critic", replica=2)  # type: ignore[arg-type]

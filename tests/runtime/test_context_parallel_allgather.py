"""Context parallelism by all-gathered keys and values (`ContextParallel.method` "allgather")
on gloo ranks, against cp = 1 and against Ulysses.

2 ranks: every Hugging Face family nereus loads runs the padded odd-length batch of
test_context_parallel at cp=2 all-gather against cp=1 on each rank alone (log-probs, the PPO
loss over two micro-batches, every gradient, within 1e-5 in fp32), with both recomputes on
one family and a critic; a checkpoint saved at cp=2 all-gather (replicated and ZeRO-1 over the
cp ranks) resumes at cp=2 Ulysses, at cp=1, and back, each step equal to the engine that went
on; live transitions whose training and inference model-stages change cp and method keep the
state bitwise. 4 ranks: tp=2 x cp=2 (cp beyond the KV heads after tp) and cp=4 on a model of
3 query heads and 1 KV head (cp beyond the query heads, which Ulysses refuses) equal cp=1.
The all-gather method cuts each sequence zigzag (rank c holds runs c and 2 cp - 1 - c of 2 cp),
so every one of these runs crosses runs held by other ranks; the cut's causal work is balanced.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_context_parallel import (  # noqa: E402
    FAMILIES,
    FP32,
    OPTIMIZER,
    TOL,
    errors,
    make_batch,
    objective_for,
    relaid_plan,
    run,
)
from test_hf_parity import make_folder  # noqa: E402
from test_transition_executor import assert_state_kept, walk  # noqa: E402

from nereus.runtime.comm.spawn import spawn  # noqa: E402
from nereus.runtime.hf.load import load_engine  # noqa: E402
from nereus.runtime.model.context_parallel import ContextParallel  # noqa: E402
from nereus.runtime.model.engine import Engine, EngineConfig  # noqa: E402
from nereus.runtime.state.checkpoint import load_checkpoint, save_checkpoint_distributed  # noqa: E402
from nereus.runtime.state.shard_layout import RankLayout  # noqa: E402
from nereus.runtime.state.sharded_state import dp_sharded_families, state_meta  # noqa: E402
from nereus.solver.transition.schedule import build_transition  # noqa: E402
from nereus.spec.hf_config import model_from_hf_config  # noqa: E402
from nereus.spec.plan import Plan  # noqa: E402
from nereus.spec.presets import MODELS  # noqa: E402

pytestmark = pytest.mark.multiprocess

ALLGATHER = EngineConfig(cp_method="allgather")

#: (tp, cp, method, emus) of every training and inference model-stage in each plan of the walk.
WALK = [
    (1, 2, "allgather", [[0, 1]]),
    (1, 2, "ulysses", [[1, 0]]),
    (1, 1, "ulysses", [[0], [1]]),
    (1, 2, "allgather", [[1, 0]]),
]


def walk_plan(tp: int, cp: int, method: str, emus: list[list[int]]) -> Plan:
    """`relaid_plan` with the training and inference model-stages' cp method set."""
    plan = relaid_plan(tp, cp, emus)
    stages = [entry.model_copy(update={"cp_method": method}) if entry.cp > 1 else entry for entry in plan.stages]
    return Plan.model_validate(plan.model_copy(update={"stages": stages}).model_dump())


def resume(rank: int, folder: Path) -> dict[str, float | bool]:
    """Saved at one (cp, method), resumed at another: the state bitwise, then a step equal to the
    engine that went on (replicated, and ZeRO-1 split over the cp ranks)."""
    model, head = MODELS["tiny"], "lm"
    families = ("param", "exp_avg", "exp_avg_sq")
    batch = make_batch(model.vocab_size)
    solo, cut = RankLayout(1, 1, 1, (rank,)), RankLayout(1, 1, 1, (0, 1), cp=2)
    moves = (
        ("allgather->ulysses", cut, "allgather", cut, "ulysses"),
        ("allgather->cp1", cut, "allgather", solo, "ulysses"),
        ("cp1->allgather", solo, "ulysses", cut, "allgather"),
    )
    out: dict[str, float | bool] = {}
    for sharding, zero1 in (("replicated", False), ("zero1", True)):
        split = dp_sharded_families(FP32, "training", zero1, False)
        for name, layout, method, other, other_method in moves:
            key = f"{sharding} {name}"
            config = EngineConfig(optimizer=OPTIMIZER, init_seed=5, shard_across_dp=zero1, cp_method=method)
            engine = Engine.create(model, head, layout, config)
            assert engine is not None
            engine.train_step(batch, objective_for(engine))
            whole = engine.whole_state(families)
            saved_on = layout if layout.cp > 1 else RankLayout(1, 1, 1, (0,))
            state = {k: t for k, t in engine.local_state().items() if k.split("/")[0] in families}
            meta = state_meta(model, head, saved_on, families, dp_sharded=split if layout.cp > 1 else ())
            path = folder / f"allgather-{key.replace(' ', '-')}"
            save_checkpoint_distributed(
                path, meta, rank, state if rank in saved_on.ranks else {}, engine.optimizer_step
            )
            loaded = load_checkpoint(path, other, rank)
            out[f"{key} exact"] = set(loaded.tensors) == set(whole) and all(
                torch.equal(loaded.tensors[k], whole[k]) for k in whole
            )
            other_config = EngineConfig(optimizer=OPTIMIZER, init_seed=5, shard_across_dp=zero1, cp_method=other_method)
            resumed = Engine.create(model, head, other, other_config)
            assert resumed is not None
            resumed.load_local_state(loaded.tensors, loaded.step)
            resumed_loss = resumed.train_step(batch, objective_for(resumed))
            going_loss = engine.train_step(batch, objective_for(engine))
            params, going = resumed.whole_state(("param",)), engine.whole_state(("param",))
            out[f"{key} loss"] = abs(resumed_loss - going_loss)
            out[f"{key} params"] = max(float((params[k] - going[k]).abs().max()) for k in going)
    return out


def compare(rank: int, model: Any, head: Any, load: Any, config: EngineConfig) -> dict[str, float]:
    solo = run(model, head, RankLayout(1, 1, 1, (rank,)), load, config)
    cut = run(model, head, RankLayout(1, 1, 1, (0, 1), cp=2), load, config)
    assert solo is not None and cut is not None
    return errors(cut, solo, model, head, 1)


def world_worker(
    rank: int, world: int, folders: dict[str, Path], tmp: Path, plans: list[Plan], transitions: list[Any]
) -> dict[str, Any]:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, folder in folders.items():
        model = model_from_hf_config(folder)

        def load(engine: Engine, folder: Path = folder) -> None:
            assert load_engine(engine, folder) == []

        results[f"{name} cp=2 allgather vs cp=1"] = compare(rank, model, "lm", load, ALLGATHER)
    llama = model_from_hf_config(folders["llama"])
    for recompute in ("full", "selective"):
        config = EngineConfig(recompute=recompute, cp_method="allgather")
        load = lambda engine: load_engine(engine, folders["llama"])  # noqa: E731
        results[f"llama recompute={recompute}"] = compare(rank, llama, "lm", load, config)
    critic = EngineConfig(init_seed=2, cp_method="allgather")
    results["tiny critic"] = compare(rank, MODELS["tiny"], "value", lambda engine: None, critic)
    results["resume"] = resume(rank, tmp)
    results["walk"] = walk(rank, world, plans, transitions)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("allgather")
    folders = {name: make_folder(root, name) for name in FAMILIES}
    plans = [walk_plan(*layout) for layout in WALK]
    built = [build_transition(a, b) for a, b in itertools.pairwise(plans)]
    assert all(t.feasible for t in built)
    transitions = [(t.primitives, t.schedule) for t in built]
    return spawn(world_worker, 2, folders, tmp_path_factory.mktemp("checkpoints"), plans, transitions)


def test_allgather_equals_cp1_on_every_family(results: list[dict[str, Any]]) -> None:
    expected = {f"{name} cp=2 allgather vs cp=1" for name in FAMILIES}
    for per_rank in results:
        cases = {key: value for key, value in per_rank.items() if key not in ("resume", "walk")}
        assert expected <= set(cases) and "tiny critic" in cases
        for key, value in cases.items():
            assert max(value.values()) < TOL, (key, value)


def test_resume_across_cp_and_method(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        outcome = per_rank["resume"]
        assert len(outcome) == 2 * 3 * 3, sorted(outcome)
        for key, value in outcome.items():
            assert value is True if key.endswith(" exact") else value < TOL, (key, value)


def test_live_transitions_across_cp_method_keep_state_bitwise(results: list[dict[str, Any]]) -> None:
    plans = [walk_plan(*layout) for layout in WALK]
    assert_state_kept(plans, [result["walk"] for result in results])
    assert {e.cp_method for e in plans[0].stages if e.cp > 1} == {"allgather"}


def beyond_worker(rank: int, world: int) -> dict[str, float]:
    """tp=2 x cp=2 on tiny (one KV head per tensor rank, cp=2) and cp=4 on a model of 3 query
    heads and 1 KV head (cp beyond both), all-gather, against cp=1 on each rank alone."""
    torch.set_num_threads(1)
    tiny = MODELS["tiny"]
    three = tiny.model_copy(update={"name": "three-heads", "num_heads": 3, "num_kv_heads": 1, "head_dim": 16})
    config = EngineConfig(init_seed=3, cp_method="allgather")
    out: dict[str, float] = {}
    for name, model, layout, tp in (
        ("tp=2 x cp=2", tiny, RankLayout(2, 1, 1, (0, 1, 2, 3), cp=2), 2),
        ("cp=4 beyond 3 query heads", three, RankLayout(1, 1, 1, (0, 1, 2, 3), cp=4), 1),
    ):
        solo = run(model, "lm", RankLayout(1, 1, 1, (rank,)), lambda engine: None, config)
        cut = run(model, "lm", layout, lambda engine: None, config)
        assert solo is not None and cut is not None
        for key, value in errors(cut, solo, model, "lm", tp).items():
            out[f"{name} {key}"] = value
    return out


def test_allgather_beyond_the_heads_equals_cp1() -> None:
    for per_rank in spawn(beyond_worker, 4):
        assert len(per_rank) == 6
        for key, value in per_rank.items():
            assert value < TOL, (key, value)


def test_allgather_needs_no_head_rule_but_cp_above_one() -> None:
    three = MODELS["tiny"].model_copy(update={"name": "three-heads", "num_heads": 3, "num_kv_heads": 1})
    with pytest.raises(ValueError, match="cp=2 must divide the 3 attention heads"):
        Engine.create(three, "lm", RankLayout(1, 1, 1, (0, 1), cp=2))
    plan = relaid_plan(1, 1, [[0], [1]])
    entry = plan.stages[-1].model_dump()
    entry["cp_method"] = "allgather"
    with pytest.raises(ValueError, match="cp_method allgather needs cp > 1"):
        type(plan.stages[-1]).model_validate(entry)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_allgather_cut_is_zigzag_and_balances_the_causal_work(cp: int) -> None:
    seq = 2 * cp * 5
    ranks = [ContextParallel(size=cp, rank=rank, method="allgather") for rank in range(cp)]
    held = ranks[0].columns(seq)
    assert sorted(col for columns in held for col in columns) == list(range(seq))
    runs = ranks[0].runs(seq)
    for rank in range(cp):
        assert runs[rank] == ((5 * rank, 5 * rank + 5), (5 * (2 * cp - 1 - rank), 5 * (2 * cp - rank)))
    work = [sum(col + 1 for col in columns) for columns in held]  # keys each query sees, causal
    assert len(set(work)) == 1
    contiguous = [sum(col + 1 for col in columns) for columns in ContextParallel(cp, 0).columns(seq)]
    assert max(contiguous) / min(contiguous) > 2
    with pytest.raises(ValueError, match=f"cannot be cut into the 2 x cp={cp} runs"):
        ranks[0].runs(2 * cp - 1)

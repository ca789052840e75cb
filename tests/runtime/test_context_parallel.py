"""Context parallelism (Ulysses, `nereus.runtime.model.context_parallel`) on 2 gloo ranks.

Each Hugging Face family nereus loads (made random by transformers itself, as in the parity
tests) runs a left- and right-padded batch of odd length (uneven columns: 6 and 5) at cp=2,
at tp=2 and alone on each rank (cp=1): the log-probs, the loss of a PPO objective with every
term (sequence-mean weights, KL, entropy: the entropy reads the column a cp rank borrows)
over two micro-batches, and every gradient agree within 1e-5 (fp32); tp=2 x cp=1 against
tp=1 x cp=2 shard by shard. A critic (value head, clipped value loss) and both activation
recomputes are checked the same way on one family. A checkpoint saved at cp=2 loads into
cp=1 bitwise, and one saved at cp=1 into both cp=2 ranks, and training resumes on either.
Live transitions between plans whose training and inference model-stages change cp (cp=2 ->
dp=2 -> tp=2 -> cp=2 on the other rank order) keep every model-stage's logical state bitwise.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")

from run_helpers import PLAN_2RANK  # noqa: E402
from test_hf_parity import CONFIGS, make_folder  # noqa: E402
from test_transition_executor import assert_state_kept, walk  # noqa: E402

from nereus.runtime.comm.spawn import spawn  # noqa: E402
from nereus.runtime.hf.load import load_engine  # noqa: E402
from nereus.runtime.model.adamw import AdamWConfig  # noqa: E402
from nereus.runtime.model.engine import Engine, EngineConfig  # noqa: E402
from nereus.runtime.model.initialization import box_slice  # noqa: E402
from nereus.runtime.model.losses import Objective  # noqa: E402
from nereus.runtime.model.transformer import Batch  # noqa: E402
from nereus.runtime.rl.objectives import ClippedValueObjective, PolicyObjective  # noqa: E402
from nereus.runtime.state.checkpoint import load_checkpoint, save_checkpoint_distributed  # noqa: E402
from nereus.runtime.state.shard_layout import RankLayout, local_box, param_infos  # noqa: E402
from nereus.runtime.state.sharded_state import dp_sharded_families, state_meta  # noqa: E402
from nereus.solver.transition.schedule import build_transition  # noqa: E402
from nereus.spec.hf_config import model_from_hf_config  # noqa: E402
from nereus.spec.model import Head, Model  # noqa: E402
from nereus.spec.plan import Plan  # noqa: E402
from nereus.spec.presets import MODELS, workload_preset  # noqa: E402

pytestmark = pytest.mark.multiprocess

WORLD = 2
TOL = 1e-5
ROWS, SEQ = 4, 11
OPTIMIZER = AdamWConfig(lr=1e-3, eps=1e-4, weight_decay=0.1)
FAMILIES = list(CONFIGS)
FP32 = workload_preset("tiny-ppo")


def make_batch(vocab: int) -> Batch:
    """Rows with 0-2 left pads and one right-padded row, a loss mask on most real tokens, and
    the PPO and critic fields."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, vocab, (ROWS, SEQ), generator=generator)
    columns = torch.arange(SEQ).unsqueeze(0)
    mask = (columns >= torch.tensor([0, 2, 1, 0]).unsqueeze(1)) & (columns < torch.tensor([11, 11, 11, 8]).unsqueeze(1))
    loss_mask = mask & (torch.rand(ROWS, SEQ, generator=generator) > 0.25)
    loss_mask[:, 0] = False

    def noise(scale: float) -> torch.Tensor:
        return scale * torch.randn(ROWS, SEQ, generator=generator)

    fields = {
        "loss_mask": loss_mask,
        "old_log_probs": -4.0 + noise(0.3),
        "ref_log_probs": -4.0 + noise(0.3),
        "advantages": noise(1.0),
        "old_values": noise(0.5),
        "returns": noise(1.0),
    }
    return Batch(tokens.masked_fill(~mask, 0), mask, fields)


def objective_for(engine: Engine) -> Objective:
    if engine.head == "value":
        return ClippedValueObjective(0.2, "seq-mean-token-mean")
    return PolicyObjective(0.2, 0.1, 0.01, "seq-mean-token-mean")


def run(model: Model, head: Head, layout: RankLayout, load: Any, config: EngineConfig) -> dict[str, Any] | None:
    """Inference outputs, the loss and the gradients of one batch (collective over the layout)."""
    engine = Engine.create(model, head, layout, config)
    if engine is None:
        return None
    load(engine)
    batch = make_batch(model.vocab_size)
    output = engine.log_probs(batch) if head == "lm" else engine.values(batch)
    engine.zero_grad()
    loss = engine.forward_backward(batch, objective_for(engine), num_microbatches=2)
    grads = {key.partition("/")[2]: t.clone() for key, t in engine.local_state().items() if key.startswith("grad/")}
    return {"output": output, "loss": loss, "grads": grads, "tp_rank": engine.groups.tp.rank}


def errors(ours: dict[str, Any], solo: dict[str, Any], model: Model, head: Head, tp: int) -> dict[str, float]:
    """Largest differences from the cp=1 single-rank run (its gradients cut to our tensor rank's boxes)."""
    infos = {info.name: info for info in param_infos(model, head)}
    grad = 0.0
    assert set(ours["grads"]) == set(solo["grads"])
    for name, tensor in ours["grads"].items():
        expected = box_slice(solo["grads"][name], local_box(infos[name], model, tp, ours["tp_rank"]))
        grad = max(grad, float((tensor - expected).abs().max()))
    return {
        "output": float((ours["output"] - solo["output"]).abs().max()),
        "loss": abs(ours["loss"] - solo["loss"]),
        "grad": grad,
    }


def compare(rank: int, model: Model, head: Head, load: Any, config: EngineConfig) -> dict[str, dict[str, float]]:
    """cp=2 and tp=2 on both ranks against cp=1 on each rank alone."""
    solo = run(model, head, RankLayout(1, 1, 1, (rank,)), load, config)
    assert solo is not None
    cp = run(model, head, RankLayout(1, 1, 1, (0, 1), cp=2), load, config)
    tp = run(model, head, RankLayout(2, 1, 1, (0, 1)), load, config)
    assert cp is not None and tp is not None
    return {
        "cp=2 vs cp=1": errors(cp, solo, model, head, 1),
        "tp=2 vs cp=1": errors(tp, solo, model, head, 2),
        "tp=2 vs cp=2": errors(tp, cp, model, head, 2),  # cp=2 ranks hold whole tensors
    }


#: The ways an engine may split its state across the dp x cp ranks of a position.
SHARDINGS: dict[str, dict[str, Any]] = {
    "replicated": {},
    "zero1": {"shard_across_dp": True},
    "full_shard": {"full_shard": True},
}


def resume(rank: int, folder: Path) -> dict[str, bool | float]:
    """Checkpoints across cp, replicated and with the state split over the cp ranks (ZeRO-1,
    FSDP2 over dp x cp = 1 x 2): cp=2 -> cp=1 and cp=1 -> cp=2 (each rank alone), and live
    (a replica's whole state, `Engine.whole_state`) cp=2 -> dp=2 on the same two ranks; the
    state bitwise, then one more step each, equal to the engine that went on."""
    model, head = MODELS["tiny"], "lm"
    families = ("param", "exp_avg", "exp_avg_sq")
    batch = make_batch(model.vocab_size)
    out: dict[str, bool | float] = {}
    solo_layout, cp_layout = RankLayout(1, 1, 1, (rank,)), RankLayout(1, 1, 1, (0, 1), cp=2)
    dp_layout = RankLayout(1, 1, 2, (0, 1))
    for sharding, choices in SHARDINGS.items():
        config = EngineConfig(optimizer=OPTIMIZER, init_seed=5, **choices)
        split = dp_sharded_families(FP32, "training", "shard_across_dp" in choices, "full_shard" in choices)

        def trained(layout: RankLayout, config: EngineConfig = config) -> Engine:
            engine = Engine.create(model, head, layout, config)
            assert engine is not None
            engine.train_step(batch, objective_for(engine))
            return engine

        cp_engine, solo_engine = trained(cp_layout), trained(solo_layout)
        moves = (("cp2->cp1", cp_engine, solo_layout), ("cp1->cp2", solo_engine, cp_layout))
        for name, engine, other_layout in (*moves, ("cp2->dp2 live", cp_engine, dp_layout)):
            key = f"{sharding} {name}"
            layout = engine.groups.layout
            whole = engine.whole_state(families)  # collective over the engine's dp x cp ranks
            if name.endswith("live"):
                tensors, step = whole, engine.optimizer_step
            else:
                saved_on = layout if layout.cp > 1 else RankLayout(1, 1, 1, (0,))  # one writer at cp=1
                state = {k: t for k, t in engine.local_state().items() if k.split("/")[0] in families}
                meta = state_meta(model, head, saved_on, families, dp_sharded=split if layout.cp > 1 else ())
                mine = state if rank in saved_on.ranks else {}
                save_checkpoint_distributed(folder / key.replace(" ", "-"), meta, rank, mine, engine.optimizer_step)
                loaded = load_checkpoint(folder / key.replace(" ", "-"), other_layout, rank)
                tensors, step = loaded.tensors, loaded.step
            out[f"{key} exact"] = set(tensors) == set(whole) and all(torch.equal(tensors[k], whole[k]) for k in whole)
            resumed = Engine.create(model, head, other_layout, config)
            assert resumed is not None
            resumed.load_local_state(tensors, step)
            resumed_loss = resumed.train_step(batch, objective_for(resumed))
            going_loss = engine.train_step(batch, objective_for(engine))
            params, going = resumed.whole_state(("param",)), engine.whole_state(("param",))
            out[f"{key} loss"] = abs(resumed_loss - going_loss)
            out[f"{key} params"] = max(float((params[k] - going[k]).abs().max()) for k in going)
            out[f"{key} step"] = float(resumed.optimizer_step == engine.optimizer_step)
    return out


#: (tp, cp, emus) of every training and inference model-stage in each plan of the walk.
RELAYOUTS = [(1, 2, [[0, 1]]), (1, 1, [[0], [1]]), (2, 1, [[0, 1]]), (1, 2, [[1, 0]])]


def relaid_plan(tp: int, cp: int, emus: list[list[int]]) -> Plan:
    """The 2-rank PPO plan with its training and inference model-stages laid out so."""
    document = yaml.safe_load(PLAN_2RANK.read_text())
    document.pop("predictions", None)
    for entry in document["stages"]:
        if not entry["model_stage"].endswith("/generation"):
            entry.update(tp=tp, pp=1, cp=cp, dp=len(emus), emus=emus)
    return Plan.model_validate(document)


def world_worker(
    rank: int, world: int, folders: dict[str, Path], tmp: Path, plans: list[Plan], transitions: list[Any]
) -> dict[str, Any]:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, folder in folders.items():
        model = model_from_hf_config(folder)

        def load(engine: Engine, folder: Path = folder) -> None:
            assert load_engine(engine, folder) == []

        for key, value in compare(rank, model, "lm", load, EngineConfig()).items():
            results[f"{name} {key}"] = value
    model = model_from_hf_config(folders["llama"])
    for recompute in ("full", "selective"):
        config = EngineConfig(recompute=recompute)
        load = lambda engine: load_engine(engine, folders["llama"])  # noqa: E731
        for key, value in compare(rank, model, "lm", load, config).items():
            results[f"llama recompute={recompute} {key}"] = value
    tiny = MODELS["tiny"]
    for key, value in compare(rank, tiny, "value", lambda engine: None, EngineConfig(init_seed=2)).items():
        results[f"tiny critic {key}"] = value
    results["resume"] = resume(rank, tmp)
    results["walk"] = walk(rank, world, plans, transitions)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("cp")
    folders = {name: make_folder(root, name) for name in FAMILIES}
    plans = [relaid_plan(*layout) for layout in RELAYOUTS]
    # Built once here: every rank must walk the very same primitives in the same order.
    built = [build_transition(a, b) for a, b in itertools.pairwise(plans)]
    assert all(t.feasible for t in built)
    transitions = [(t.primitives, t.schedule) for t in built]
    return spawn(world_worker, WORLD, folders, tmp_path_factory.mktemp("checkpoints"), plans, transitions)


def test_cp_equals_cp1_and_tp_on_every_family(results: list[dict[str, Any]]) -> None:
    expected = {f"{name} {pair}" for name in FAMILIES for pair in ("cp=2 vs cp=1", "tp=2 vs cp=1", "tp=2 vs cp=2")}
    for per_rank in results:
        cases = {key: value for key, value in per_rank.items() if key not in ("resume", "walk")}
        assert expected <= set(cases)
        assert any(key.startswith("tiny critic") for key in cases)
        for key, value in cases.items():
            assert max(value.values()) < TOL, (key, value)


def test_checkpoints_resume_across_cp(results: list[dict[str, Any]]) -> None:
    """Replicated, ZeRO-1 and full sharding over the cp ranks: saved, loaded and moved live exactly."""
    moves = ("cp2->cp1", "cp1->cp2", "cp2->dp2 live")
    for per_rank in results:
        outcome = per_rank["resume"]
        assert len(outcome) == 4 * len(moves) * len(SHARDINGS), sorted(outcome)
        for sharding, move in itertools.product(SHARDINGS, moves):
            key = f"{sharding} {move}"
            assert outcome[f"{key} exact"] and outcome[f"{key} step"] == 1.0, (key, outcome)
            assert outcome[f"{key} loss"] < TOL and outcome[f"{key} params"] < TOL, (key, outcome)


def test_cp_refuses_pp_and_heads_it_cannot_split() -> None:
    """Checked before any process group: one line naming the field."""
    tiny = MODELS["tiny"]
    with pytest.raises(ValueError, match="cp=2 pp=2: context parallelism runs with pp 1"):
        Engine.create(tiny, "lm", RankLayout(1, 2, 1, (0, 1, 2, 3), cp=2))
    three = tiny.model_copy(update={"name": "three-heads", "num_heads": 3, "num_kv_heads": 1, "head_dim": 16})
    with pytest.raises(ValueError, match="cp=2 must divide the 3 attention heads"):
        Engine.create(three, "lm", RankLayout(1, 1, 1, (0, 1), cp=2))


def test_live_transitions_across_cp_keep_state_bitwise(results: list[dict[str, Any]]) -> None:
    plans = [relaid_plan(*layout) for layout in RELAYOUTS]
    assert_state_kept(plans, [result["walk"] for result in results])
    cut = [e for e in plans[0].stages if e.cp == 2]
    assert len(cut) == 6 and all(len(e.emus[0]) == 2 for e in cut)


def sharded_worker(rank: int, world: int) -> dict[str, float]:
    """cp=2 x dp=2 (replicated, ZeRO-1, FSDP2, training-time optimizer offload) against cp=1 on
    each rank alone: the loss and the whole parameters after one AdamW step."""
    torch.set_num_threads(1)
    model, head = MODELS["tiny"], "lm"
    batch = make_batch(model.vocab_size)
    options: dict[str, dict[str, Any]] = {
        "replicated": {},
        "zero1": {"shard_across_dp": True},
        "full_shard": {"full_shard": True},
        "train_offload": {"train_offload": "optimizer"},
    }
    out: dict[str, float] = {}
    for name, choices in options.items():
        config = EngineConfig(optimizer=OPTIMIZER, init_seed=3, **choices)
        solo = Engine.create(model, head, RankLayout(1, 1, 1, (rank,)), config)
        cut = Engine.create(model, head, RankLayout(1, 1, 2, (0, 1, 2, 3), cp=2), config)
        assert solo is not None and cut is not None
        expected_loss = solo.train_step(batch, objective_for(solo))
        loss = cut.train_step(batch, objective_for(cut))
        whole, expected = cut.whole_state(("param",)), solo.local_state()
        out[f"{name} loss"] = abs(loss - expected_loss)
        out[f"{name} params"] = max(float((whole[k] - expected[k]).abs().max()) for k in expected if k in whole)
        out[f"{name} keys"] = float(set(whole) == {k for k in expected if k.startswith("param/")})
        if name in ("zero1", "full_shard"):  # the moments split over dp x cp = 4 ranks, not dp = 2
            share = cut.state_bytes()["optimizer"] / solo.state_bytes()["optimizer"]
            out[f"{name} optimizer share"] = share
    # tiny has 4 heads and 2 KV heads: tp=2 leaves one KV head per tensor rank, which cp=2
    # cannot split, so each cp rank repeats it for its query head (the planner's `cp_rule`).
    assert model.num_kv_heads // 2 % 2 == 1
    solo_run = run(model, head, RankLayout(1, 1, 1, (rank,)), lambda engine: None, EngineConfig(init_seed=3))
    beyond = run(model, head, RankLayout(2, 1, 1, (0, 1, 2, 3), cp=2), lambda engine: None, EngineConfig(init_seed=3))
    assert solo_run is not None and beyond is not None
    for key, value in errors(beyond, solo_run, model, head, 2).items():
        out[f"tp=2 x cp=2 beyond the KV heads {key}"] = value
    return out


def test_cp_with_data_parallel_sharding_equals_cp1() -> None:
    """4 ranks: two replicas of cp=2, under every way the replicas may split the state (over
    dp x cp); and tp=2 x cp=2, whose cp exceeds the KV heads after tp (repeated), against cp=1."""
    for per_rank in spawn(sharded_worker, 4):
        for key, value in per_rank.items():
            if key.endswith(" keys"):
                assert value == 1.0, key
            elif key.endswith(" optimizer share"):  # a quarter, give or take the uneven rows
                assert 0.2 < value < 0.3, (key, value)
            else:
                assert value < TOL, (key, value)

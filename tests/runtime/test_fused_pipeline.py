"""The fused actor-critic pipeline (intra-stage fusion) against separate actor and critic training.

Engine level: in a 2-rank world (pp=2, dp=1) and a 4-rank world (pp=2 with dp=2, and pp=2
with tp=2), actor and critic engines train two mini-batches through a fused schedule, while
twin engines (same layouts, same initial weights) train each model alone with 1F1B; the
losses, gradients, parameters and AdamW moments must agree to 1e-6 (fp32). At pp=1 x dp=2,
fused training under FSDP2's full sharding equals it without, and counts the same saved bytes.
Run level: one PPO step of a plan with `fusion.intra_stage` equals the same plan unfused (pp=2,
and cp=2 fully sharded).
Plan level: a plan whose critic does not mirror the actor's ranks is refused with one line.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.adamw import AdamWConfig
from nereus.runtime.model.engine import Engine, EngineConfig
from nereus.runtime.model.fused_pipeline import (
    FusedPart,
    OpTiming,
    OrderedSends,
    check_fused_schedule,
    fused_train_step,
    message_orders,
)
from nereus.runtime.model.fused_schedule import fused_schedule, intra_stage_problems, reversed_stages
from nereus.runtime.model.losses import NextTokenLoss, ValueLoss
from nereus.runtime.model.pipeline import Op, Sends
from nereus.runtime.model.transformer import Batch
from nereus.runtime.rl.optimization import update_rules
from nereus.runtime.rl.stages import build_stages
from nereus.runtime.rl.step import rl_step
from nereus.runtime.rl.update import fused_training, sync_plans
from nereus.runtime.state.shard_layout import RankLayout
from nereus.solver.pipeline.document import to_document
from nereus.solver.pipeline.model import ModelTimes
from nereus.solver.pipeline.search import SearchConfig, search_fused
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.presets import MODELS
from nereus.spec.run_config import RLConfig
from nereus.spec.schedule import Schedule

pytestmark = pytest.mark.one_rank

TINY = MODELS["tiny"]
TOL = 1e-6
#: eps well above fp32 gradient noise, so Adam does not blow ulp-level differences up.
OPTIMIZER = AdamWConfig(lr=1e-3, eps=1e-4, weight_decay=0.1)
ROWS, SEQ, MINI_BATCHES = 8, 10, 2
ACTOR_MICROBATCHES, CRITIC_MICROBATCHES = 4, 2


def schedule_for(actor_microbatches: int, critic_microbatches: int, num_stages: int = 2) -> Schedule:
    """A fused schedule searched for uniform stage times (critic forward faster than the actor's)."""
    actor = ModelTimes.uniform("actor", num_stages, actor_microbatches, forward=1.0, backward=2.0)
    critic = ModelTimes.uniform("critic", num_stages, critic_microbatches, forward=0.5, backward=1.0)
    return to_document(search_fused(actor, critic, SearchConfig(time_limit_s=5, seeds=1, max_iterations=300)))


def make_batch(head: str, seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY.vocab_size, (ROWS, SEQ), generator=generator)
    pad = torch.randint(0, 3, (ROWS,), generator=generator)
    mask = torch.arange(SEQ).unsqueeze(0) >= pad.unsqueeze(1)
    fields = {"loss_mask": mask & (torch.rand(ROWS, SEQ, generator=generator) > 0.2)}
    if head == "value":
        fields["value_targets"] = torch.randn(ROWS, SEQ, generator=generator)
    return Batch(tokens, mask, fields)


def engines(tp: int, pp: int, dp: int, world: int) -> tuple[Engine | None, Engine | None]:
    """Actor on ranks 0..n-1 stage-major; critic on the same ranks with the stages reversed."""
    actor_layout = RankLayout(tp, pp, dp, tuple(range(world)))
    stages = [[actor_layout.rank_at(d, s, r) for r in range(tp)] for d in range(dp) for s in range(pp)]
    critic_ranks = [rank for d in range(dp) for s in reversed(range(pp)) for rank in stages[d * pp + s]]
    critic_layout = RankLayout(tp, pp, dp, tuple(critic_ranks))
    actor = Engine.create(TINY, "lm", actor_layout, EngineConfig(OPTIMIZER, init_seed=1))
    critic = Engine.create(TINY, "value", critic_layout, EngineConfig(OPTIMIZER, init_seed=2))
    return actor, critic


def largest_difference(a: Engine, b: Engine | None, families: tuple[str, ...] = ("param", "grad", "exp_avg")) -> float:
    """The largest difference of two engines' state tensors of `families` (same layout)."""
    assert b is not None
    mine, theirs = a.local_state(), b.local_state()
    assert mine.keys() == theirs.keys() or families == ("param",)
    # under full sharding a rank may hold no rows of a small tensor
    keys = [key for key in mine if key.split("/")[0] in families and mine[key].numel()]
    return max(float((mine[key] - theirs[key]).abs().max()) for key in keys)


def fused_vs_separate(rank: int, world: int, layouts: list[tuple[int, int, int]], schedule: Schedule) -> dict[str, Any]:
    """Per layout: the largest loss and state difference between fused and separate training."""
    torch.set_num_threads(1)
    counts = {record.name: record.microbatches for record in schedule.models}
    results: dict[str, Any] = {}
    for tp, pp, dp in layouts:
        fused_actor, fused_critic = engines(tp, pp, dp, world)
        solo_actor, solo_critic = engines(tp, pp, dp, world)
        assert fused_actor and fused_critic and solo_actor and solo_critic
        loss_error, timings = 0.0, []
        for mini_batch in range(MINI_BATCHES):
            actor_batch, critic_batch = make_batch("lm", 10 + mini_batch), make_batch("value", 20 + mini_batch)
            parts = [
                FusedPart("actor", fused_actor, actor_batch, NextTokenLoss()),
                FusedPart("critic", fused_critic, critic_batch, ValueLoss()),
            ]
            (actor_loss, critic_loss), step_timings = fused_train_step(parts, schedule)
            timings += step_timings
            solo_actor_loss = solo_actor.train_step(actor_batch, NextTokenLoss(), counts["actor"])
            solo_critic_loss = solo_critic.train_step(critic_batch, ValueLoss(), counts["critic"])
            loss_error = max(loss_error, abs(actor_loss - solo_actor_loss), abs(critic_loss - solo_critic_loss))
        results[f"tp{tp}-pp{pp}-dp{dp}"] = {
            "loss": loss_error,
            "actor": largest_difference(fused_actor, solo_actor),
            "critic": largest_difference(fused_critic, solo_critic),
            "moved": largest_difference(fused_actor, engines(tp, pp, dp, world)[0], ("param",)),
            "timings": timings,
            "stages": (fused_actor.groups.pp_rank, fused_critic.groups.pp_rank),
        }
    return results


def check_world(outcomes: list[dict[str, Any]], schedule: Schedule) -> None:
    node_ops = check_fused_schedule(schedule)
    for rank, result in enumerate(outcomes):
        for name, errors in result.items():
            assert errors["loss"] < TOL, (rank, name, errors["loss"])
            assert errors["actor"] < TOL, (rank, name, errors["actor"])
            assert errors["critic"] < TOL, (rank, name, errors["critic"])
            assert errors["moved"] > 1e-4, (rank, name, "the updates changed the weights")
            actor_stage, critic_stage = errors["stages"]
            assert critic_stage == 1 - actor_stage, (rank, name, errors["stages"])
            # The rank ran its node's ops in the schedule's order, each once per mini-batch.
            timings: list[OpTiming] = errors["timings"]
            ran = [(t.model, t.stage, Op(t.kind, t.microbatch)) for t in timings]
            assert ran == node_ops[actor_stage] * MINI_BATCHES, (rank, name)
            assert all(t.start <= t.ready <= t.end for t in timings) and all(t.rank == rank for t in timings)
            assert all(a.end <= b.start for a, b in itertools.pairwise(timings))


@pytest.mark.multiprocess
def test_fused_training_equals_separate_training_on_two_ranks() -> None:
    schedule = schedule_for(ACTOR_MICROBATCHES, CRITIC_MICROBATCHES)
    # The fused order truly interleaves: both models on a node, not one after the other.
    models_on_node_0 = [op.model for op in schedule.nodes[0].ops]
    assert models_on_node_0 != sorted(models_on_node_0) and models_on_node_0 != sorted(models_on_node_0)[::-1]
    check_world(spawn(fused_vs_separate, 2, [(1, 2, 1)], schedule), schedule)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fused_training_equals_separate_training_with_dp_and_tp() -> None:
    schedule = schedule_for(ACTOR_MICROBATCHES, CRITIC_MICROBATCHES)
    check_world(spawn(fused_vs_separate, 4, [(1, 2, 2), (2, 2, 1)], schedule), schedule)


def fused_full_shard(rank: int, world: int, schedule: Schedule) -> dict[str, Any]:
    """Actor and critic at pp=1 x dp=2, fused, with and without FSDP2's full sharding: per
    setting the losses, the whole weights after training and the most autograd-saved bytes."""
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for full_shard in (False, True):
        layout = RankLayout(1, 1, world, tuple(range(world)))
        actor = Engine.create(TINY, "lm", layout, EngineConfig(OPTIMIZER, init_seed=1, full_shard=full_shard))
        critic = Engine.create(TINY, "value", layout, EngineConfig(OPTIMIZER, init_seed=2, full_shard=full_shard))
        assert actor is not None and critic is not None and actor.full_shard is full_shard
        losses, saved = [], 0
        for mini_batch in range(MINI_BATCHES):
            parts = [
                FusedPart("actor", actor, make_batch("lm", 10 + mini_batch), NextTokenLoss()),
                FusedPart("critic", critic, make_batch("value", 20 + mini_batch), ValueLoss()),
            ]
            step_losses, timings = fused_train_step(parts, schedule)
            losses += step_losses
            saved = max([saved] + [t.saved_bytes for t in timings])
        results[f"full_shard={full_shard}"] = (losses, actor.weights(), critic.weights(), saved)
    return results


@pytest.mark.multiprocess
def test_fused_training_under_full_sharding_equals_it_without() -> None:
    """FSDP2's parameters are DTensors and its gathered weights live only during a forward or
    backward: the fused executor trains them as it trains plain ones, and counts neither as
    activations (the same saved bytes either way)."""
    schedule = schedule_for(ACTOR_MICROBATCHES, CRITIC_MICROBATCHES, num_stages=1)
    for outcome in spawn(fused_full_shard, 2, schedule):
        (losses, actor, critic, saved), (sharded_losses, sharded_actor, sharded_critic, sharded_saved) = (
            outcome["full_shard=False"],
            outcome["full_shard=True"],
        )
        assert sharded_losses == pytest.approx(losses, abs=TOL)
        for plain, sharded in ((actor, sharded_actor), (critic, sharded_critic)):
            assert plain.keys() == sharded.keys()
            assert max(float((plain[k] - sharded[k]).abs().max()) for k in plain) < TOL
        assert 0 < sharded_saved == saved


# ---- the schedule's checks (no processes) ----


def reordered(schedule: Schedule, first_on_node: dict[int, str]) -> Schedule:
    """`schedule` with every node's ops of one model moved ahead of the other's (each model's own order kept)."""
    nodes = []
    for node in schedule.nodes:
        first = first_on_node[node.node]
        ops = [op for op in node.ops if op.model == first] + [op for op in node.ops if op.model != first]
        nodes.append(node.model_copy(update={"ops": ops}))
    return schedule.model_copy(update={"nodes": nodes})


def test_a_fused_order_that_deadlocks_is_refused_before_running() -> None:
    schedule = schedule_for(2, 2)
    # Serial order (all actor ops, then all critic ops, on every node) runs ...
    check_fused_schedule(reordered(schedule, {0: "actor", 1: "actor"}))
    # ... but node 0 starting with the critic (its last stage) while node 1 starts with the
    # actor's last stage leaves both waiting for the other's first stage.
    with pytest.raises(ValueError, match="fused pipeline schedule deadlocks: node 0 at critic F0 of stage 1"):
        check_fused_schedule(reordered(schedule, {0: "critic", 1: "actor"}))


def test_a_schedule_missing_an_op_is_refused() -> None:
    schedule = schedule_for(2, 2)
    node = schedule.nodes[1]
    broken = node.model_copy(update={"ops": node.ops[1:]})
    with pytest.raises(ValueError, match="pipeline stage"):
        check_fused_schedule(schedule.model_copy(update={"nodes": [schedule.nodes[0], broken]}))


def test_sends_are_posted_in_the_order_the_peer_receives_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL pairs messages in posting order: a message produced early is held until the ones
    its peer receives first are posted (this schedule produces them in another order)."""
    schedule = schedule_for(ACTOR_MICROBATCHES, CRITIC_MICROBATCHES)
    produced, received = message_orders(schedule, check_fused_schedule(schedule))
    assert any(produced[pair] != received[pair] for pair in produced)
    posted: dict[int, list[tuple[str, str, int]]] = {}

    def record(self: Sends, lane: str, op: Op, tensor: torch.Tensor, dst: int, tag: int, group: Any) -> None:
        posted.setdefault(dst, []).append((lane, op.kind, op.microbatch))

    monkeypatch.setattr(Sends, "post", record)
    for node in range(schedule.num_nodes):
        sends = OrderedSends(node, received)
        for model, kind, mb in produced[(node, 1 - node)]:
            sends.post(model, Op(kind, mb), torch.zeros(1), 1 - node, 0, None)  # type: ignore[arg-type]
        assert not sends.held
    assert posted == {1 - node: received[(node, 1 - node)] for node in range(2)}


# ---- plans ----


def two_rank_plan(fused: bool, critic_emus: list[list[int]] | None = None, critic_pp: int = 2) -> Plan:
    """The example's tiny PPO on ranks 0 and 1: inference and generation dp=2, actor training
    pp=2 on [0, 1], critic training pp=2 on [1, 0] (the fused layout) unless told otherwise."""
    example = load_document("examples/plan-tiny-ppo-4rank.yaml")
    assert isinstance(example, Plan)
    document = example.model_dump(mode="json")
    document["cluster"]["gpus_per_node"] = 2
    document["pools"] = [{"name": "all", "gpus": [0, 1]}]
    document["workload"]["prompts_per_step"] = 8
    critic_emus = critic_emus or ([[1, 0]] if critic_pp == 2 else [[0], [1]])
    layouts = {name: (1, 1, 2, [[0], [1]], 1) for name in (s["model_stage"] for s in document["stages"])}
    layouts["actor/training"] = (1, 2, 1, [[0, 1]], 2)
    layouts["critic/training"] = (1, critic_pp, len(critic_emus), critic_emus, 2)
    document["stages"] = [
        {"model_stage": name, "pool": "all", "tp": tp, "pp": pp, "dp": dp, "emus": emus, "micro_batches": mb}
        for name, (tp, pp, dp, emus, mb) in layouts.items()
    ]
    document["fusion"] = {"intra_stage": fused}
    return Plan.model_validate(document)


def test_intra_stage_plans_are_checked() -> None:
    assert intra_stage_problems(two_rank_plan(fused=True)) == []
    assert intra_stage_problems(two_rank_plan(fused=False, critic_emus=[[0, 1]])) == []
    (same_order,) = intra_stage_problems(two_rank_plan(fused=True, critic_emus=[[0, 1]]))
    assert same_order.startswith("fusion.intra_stage: critic/training emus [[0, 1]] must be actor/training's")
    assert "[[1, 0]]" in same_order
    (other_pp,) = intra_stage_problems(two_rank_plan(fused=True, critic_pp=1))
    assert "critic/training is tp=1 pp=1 dp=2" in other_pp
    plan = two_rank_plan(fused=True)
    no_critic = plan.model_copy(update={"stages": [e for e in plan.stages if e.role != "critic"]})
    assert "no critic/training stage" in intra_stage_problems(no_critic)[0]
    assert all("\n" not in line for line in (same_order, other_pp))


def test_reversed_stages_keeps_tensor_ranks_in_order() -> None:
    entry = two_rank_plan(fused=True).stage_plan("actor/training")
    wide = entry.model_copy(update={"tp": 2, "pp": 2, "dp": 2, "emus": [[0, 1, 2, 3], [4, 5, 6, 7]]})
    assert reversed_stages(wide) == [[2, 3, 0, 1], [6, 7, 4, 5]]
    cut = entry.model_copy(update={"tp": 1, "cp": 2, "pp": 2, "dp": 1, "emus": [[0, 1, 2, 3]]})
    assert reversed_stages(cut) == [[2, 3, 0, 1]]  # a stage is its tp x cp ranks
    assert reversed_stages(cut.model_copy(update={"pp": 1, "emus": [[0, 1]]})) == [[0, 1]]


def context_parallel_plan(fused: bool) -> Plan:
    """`two_rank_plan` with actor and critic training each one replica over cp=2 ranks, fully
    sharded (FSDP2 over the cp ranks): the fused pipeline is then one stage on both ranks."""
    document = two_rank_plan(fused).model_dump(mode="json")
    for entry in document["stages"]:
        if entry["model_stage"].endswith("/training"):
            entry.update(tp=1, pp=1, cp=2, dp=1, emus=[[0, 1]], full_shard=True)
    return Plan.model_validate(document)


def test_the_run_time_schedule_is_the_plans_whatever_its_predictions() -> None:
    plan = two_rank_plan(fused=True)
    schedule = fused_schedule(plan)
    assert fused_schedule(plan.model_copy(update={"predictions": None})).nodes == schedule.nodes
    assert [(m.name, m.microbatches, m.replica_nodes) for m in schedule.models] == [
        ("actor", 2, [[0, 1]]),
        ("critic", 2, [[1, 0]]),
    ]
    assert schedule.summary.speedup_vs_serial > 1.0
    check_fused_schedule(schedule)


# ---- one RL step ----


TRAINING_OBJECTIVES = {"actor/training": NextTokenLoss(), "critic/training": ValueLoss()}


def fused_and_plain_step(rank: int, world: int, make_plan: Any = two_rank_plan) -> dict[str, float]:
    """One PPO step under the fused plan and under the same plan unfused, in one world."""
    torch.set_num_threads(1)
    config = RLConfig(max_new_tokens=6, seed=3)
    runs = {}
    for fused in (True, False):
        plan = make_plan(fused)
        stages = build_stages(plan, config)
        metrics = rl_step(plan, config, stages, sync_plans(stages), 0).metrics
        runs[fused] = (metrics, stages)
    (fused_metrics, fused_stages), (plain_metrics, plain_stages) = runs[True], runs[False]
    errors = {
        "actor_loss": abs(fused_metrics.actor_loss - plain_metrics.actor_loss),
        "critic_loss": abs((fused_metrics.critic_loss or 0.0) - (plain_metrics.critic_loss or 0.0)),
    }
    for name in ("actor/training", "critic/training", "critic/inference"):
        families = ("param",) if name.endswith("inference") else ("param", "grad", "exp_avg")
        errors[name] = largest_difference(fused_stages[name].engine, plain_stages[name].engine, families)  # type: ignore[arg-type]
    errors["fused_training_s"] = fused_metrics.stage_seconds["critic/training"]
    # The op timings the RL step hands out: each of the two updates (mini-batches) runs this
    # rank's node of the schedule once.
    plan, seconds = make_plan(True), {}
    batch = make_batch("value", 5)
    jobs = [(fused_stages[name], batch, objective) for name, objective in TRAINING_OBJECTIVES.items()]
    rules = update_rules(config, 0, list(fused_stages))
    timings = fused_training(plan, jobs[0], jobs[1], seconds, rules, {})[2]
    node_ops = check_fused_schedule(fused_schedule(plan))[fused_stages["actor/training"].engine.groups.pp_rank]  # type: ignore[union-attr]
    ran = [(t.update, t.model, t.stage, Op(t.kind, t.microbatch)) for t in timings]  # type: ignore[arg-type]
    errors["timings_match"] = float(ran != [(update, *item) for update in range(2) for item in node_ops])
    errors["timed_both"] = float(abs(seconds["actor/training"] - seconds["critic/training"]) > 1e-3)
    return errors


@pytest.mark.multiprocess
@pytest.mark.parametrize("make_plan", [two_rank_plan, context_parallel_plan], ids=["pp2", "cp2-full-shard"])
def test_an_rl_step_with_intra_stage_fusion_equals_the_unfused_step(make_plan: Any) -> None:
    for errors in spawn(fused_and_plain_step, 2, make_plan):
        assert errors["fused_training_s"] > 0
        for name, error in errors.items():
            if name != "fused_training_s":
                assert error < TOL, (name, error)

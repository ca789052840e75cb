"""Inter-stage fusion: sample-level generation with long-tail migration, and inference on the
freed ranks, give exactly the unfused step's samples and its log-probs and values."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.generation.generate import SamplingConfig
from nereus.runtime.rl.fused_rollout import EARLY_CHUNK, EVENT_KINDS, fused_rollout, plan_moves
from nereus.runtime.rl.inter_stage import (
    inter_stage_problems,
    migration_mechanism,
    migration_settings,
)
from nereus.runtime.rl.rollout import sampled
from nereus.runtime.rl.scoring import run_inference
from nereus.runtime.rl.stages import build_stages, rollout_batch
from nereus.runtime.rl.step import rl_step
from nereus.runtime.rl.update import sync_plans
from nereus.spec.io import load_document
from nereus.spec.plan import Fusion, Plan
from nereus.spec.run_config import RLConfig

pytestmark = pytest.mark.one_rank

EXAMPLE = "examples/plan-tiny-ppo-2rank-fused.yaml"
SAMPLING = SamplingConfig(max_new_tokens=32, temperature=1.0, seed=11)
#: Short prompts on replica 0 (samples 0-5), long ones on replica 1, so migrated rows must shift.
PROMPT_LENS = [3, 4, 2, 3, 4, 2, 8, 6, 9, 7, 6, 8]
PROMPTS = [[1] + [3 + (i * 7 + k) % 10 for k in range(n - 1)] for i, n in enumerate(PROMPT_LENS)]
#: A long tail: two samples run far past the rest (one per replica), one short sample must move.
BUDGETS = [2, 3, 3, 4, 2, 5, 20, 3, 4, 2, 3, 17]


def example_plan(**fusion: Any) -> Plan:
    plan = load_document(EXAMPLE)
    assert isinstance(plan, Plan)
    return plan.model_copy(update={"fusion": Fusion(**fusion)}) if fusion else plan


# ---- the fused rollout on two ranks against the unfused phases ----


def rollout_worker(rank: int, world: int, mechanisms: list[str]) -> dict[str, Any]:
    plan = example_plan()
    stages = build_stages(plan, RLConfig(reward="model", seed=1))
    sampling = dataclasses.replace(SAMPLING, eos_token_id=None)
    responses = sampled(stages["actor/generation"], PROMPTS, sampling, BUDGETS)[0]
    batch = rollout_batch(PROMPTS, responses, 0)
    unfused = run_inference(stages, batch, {})
    mask = batch.field("loss_mask")
    settings = dataclasses.replace(migration_settings(plan, plan.fusion), threshold=0.25)
    out: dict[str, Any] = {}
    for mechanism in mechanisms:
        fused = fused_rollout(stages, PROMPTS, sampling, settings, {}, BUDGETS, mechanism)
        out[mechanism] = {
            "same_samples": fused.responses == responses,
            "errors": {name: float(((unfused[name] - fused.inferred[name]) * mask).abs().max()) for name in unfused},
            "migration": fused.migration,
            "events": fused.events,
        }
    return out


def two_rank_worker(rank: int, world: int) -> tuple[dict[str, Any], list[Any]]:
    """What both 2-rank tests check, one after the other on the same ranks (each builds its own
    stages): the fused rollout under both mechanisms, then the RL step with and without fusion."""
    return rollout_worker(rank, world, ["kv-transfer", "recompute"]), step_worker(rank, world)


@pytest.fixture(scope="module")
def two_rank_results() -> list[tuple[dict[str, Any], list[Any]]]:
    """Per rank, `two_rank_worker`'s results (one spawn of 2 ranks for the two tests)."""
    return spawn(two_rank_worker, 2)


@pytest.mark.multiprocess
def test_fused_rollout_gives_the_unfused_samples_log_probs_and_values(
    two_rank_results: list[tuple[dict[str, Any], list[Any]]],
) -> None:
    results = [rollout for rollout, _ in two_rank_results]
    for rank, by_mechanism in enumerate(results):
        for mechanism, result in by_mechanism.items():
            assert result["same_samples"], (rank, mechanism)
            assert set(result["errors"]) == {
                "actor/inference",
                "reference/inference",
                "critic/inference",
                "reward/inference",
            }
            assert max(result["errors"].values()) < 1e-5, (rank, mechanism, result["errors"])
            migration = result["migration"]
            # Samples 5 (budget 5), 6 and 11 remain at the threshold (3 of 12): replica 1 keeps
            # two, so sample 5 moves there and rank 0 is freed.
            assert (migration.remaining, migration.destinations, migration.moved) == (3, (1,), (5,))
            assert migration.mechanism == mechanism
            events = result["events"]
            assert {event.kind for event in events} <= set(EVENT_KINDS)
            assert [event.time_s for event in events] == sorted(event.time_s for event in events)
            assert all(event.rank == rank for event in events)
            finished = [s for event in events if event.kind == "sample_finished" for s in event.samples]
            inferred = {e.model_stage for e in events if e.kind == "inference_start"}
            assert len(inferred) == 4
            if rank == 0:
                # The freed rank starts on the nine samples finished before the migration (in
                # chunks) while rank 1 decodes the tail (samples 6 and 11).
                kinds = [event.kind for event in events]
                assert kinds.index("migration_end") < kinds.index("inference_start")
                first = next(event for event in events if event.kind == "inference_start")
                assert first.samples == (0, 1, 2, 3, 4, 7, 8, 9)[:EARLY_CHUNK]
                assert sorted(finished) == [0, 1, 2, 3, 4]
            else:
                assert sorted(finished) == [5, 6, 7, 8, 9, 10, 11]


def four_rank_plan(generation: tuple[int, int]) -> Plan:
    """The example on 4 ranks: actor/generation in (tp, pp) with dp=2, the critic's inference
    in pp=2 (dp=2), the other model-stages one EMU per rank."""
    document = example_plan().model_dump(mode="json")
    document["cluster"]["gpus_per_node"] = 4
    document["pools"] = [{"name": "all", "gpus": [0, 1, 2, 3]}]
    tp, pp = generation
    layouts = {"actor/generation": (tp, pp), "critic/inference": (1, 2), "critic/training": (1, 2)}
    for stage in document["stages"]:
        tp, pp = layouts.get(stage["model_stage"], (1, 1))
        size = tp * pp
        stage.update(tp=tp, pp=pp, dp=4 // size, emus=[list(range(d * size, (d + 1) * size)) for d in range(4 // size)])
    return Plan.model_validate(document)


def sharded_rollout_worker(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for generation in ((2, 1), (1, 2)):
        plan = four_rank_plan(generation)
        stages = build_stages(plan, RLConfig(seed=1))
        sampling = dataclasses.replace(SAMPLING, eos_token_id=None)
        responses = sampled(stages["actor/generation"], PROMPTS, sampling, BUDGETS)[0]
        batch = rollout_batch(PROMPTS, responses, 0)
        unfused = run_inference(stages, batch, {})
        settings = dataclasses.replace(migration_settings(plan, plan.fusion), threshold=0.25)
        for mechanism in ("kv-transfer", "recompute"):
            fused = fused_rollout(stages, PROMPTS, sampling, settings, {}, BUDGETS, mechanism)
            error = max(
                float(((unfused[n] - fused.inferred[n]) * batch.field("loss_mask")).abs().max()) for n in unfused
            )
            out[f"tp{generation[0]}-pp{generation[1]}-{mechanism}"] = (
                fused.responses == responses,
                error,
                fused.migration,
            )
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_migration_moves_cache_rows_under_tp_and_pp() -> None:
    """Generation replicas of tp=2 or pp=2: every (stage, tensor rank) sends its own cache rows."""
    for rank, cases in enumerate(spawn(sharded_rollout_worker, 4)):
        assert len(cases) == 4
        for case, (same, error, migration) in cases.items():
            assert same and error < 1e-5, (rank, case, error)
            assert migration is not None and migration.moved == (5,) and migration.mechanism in case


# ---- the RL step with the fusion switch ----


def step_worker(rank: int, world: int) -> list[Any]:
    plan = example_plan()
    config = RLConfig(seed=2, max_new_tokens=8)
    runs = []
    for fusion in (Fusion(), Fusion(inter_stage=True, migration_threshold=0.3)):
        torch.manual_seed(config.seed)
        stages = build_stages(plan, config)
        result = rl_step(plan, config, stages, sync_plans(stages), 0, fusion=fusion)
        runs.append((result.metrics, len(result.events)))
    return runs


@pytest.mark.multiprocess
def test_rl_step_with_inter_stage_fusion_matches_the_unfused_step(
    two_rank_results: list[tuple[dict[str, Any], list[Any]]],
) -> None:
    (unfused, no_events), (fused, num_events) = two_rank_results[0][1]
    assert no_events == 0 and num_events > 0
    for name in ("reward", "score", "response_len_mean", "response_len_min", "response_len_max", "prompt_len"):
        assert getattr(fused, name) == getattr(unfused, name), name
    assert fused.kl == pytest.approx(unfused.kl, abs=1e-6)
    assert fused.actor_loss == pytest.approx(unfused.actor_loss, abs=1e-5)
    assert fused.critic_loss == pytest.approx(unfused.critic_loss, abs=1e-5)


# ---- planning the migration and refusing plans fusion cannot run ----


def test_moves_go_to_the_fewest_fullest_replicas() -> None:
    destinations, moves = plan_moves([[0, 1], [5], [9, 10, 11], []], 2)
    assert destinations == [0, 2]
    assert moves == {(1, 0): [5]}
    destinations, moves = plan_moves([[1], [4], [8], [12]], 1)
    assert destinations == [0]
    assert moves == {(1, 0): [4], (2, 0): [8], (3, 0): [12]}


def test_mechanism_follows_the_cost_model() -> None:
    profile = migration_settings(example_plan(), Fusion(inter_stage=True)).profile
    fast_link = dataclasses.replace(profile, transfer_bytes_per_s=1e15, transfer_latency_s=0.0)
    slow_link = dataclasses.replace(profile, transfer_bytes_per_s=1.0)
    assert migration_mechanism(fast_link, 100, 1) == "kv-transfer"
    assert migration_mechanism(slow_link, 100, 1) == "recompute"


def test_threshold_defaults_to_the_migration_sweeps_best() -> None:
    plan = example_plan()
    assert migration_settings(plan, Fusion(inter_stage=True, migration_threshold=0.4)).threshold == 0.4
    best = migration_settings(plan, Fusion(inter_stage=True)).threshold
    assert 0.05 <= best <= 0.95


def test_plans_fusion_cannot_run_are_refused_with_the_field() -> None:
    config = RLConfig()
    assert inter_stage_problems(example_plan(), Fusion(inter_stage=True), config) == []
    assert inter_stage_problems(example_plan(), Fusion(), config) == []  # off: nothing to check
    document = example_plan().model_dump(mode="json")
    generation = next(s for s in document["stages"] if s["model_stage"] == "actor/generation")
    generation.update(dp=1, tp=2, emus=[[0, 1]])
    one_replica = Plan.model_validate(document)
    assert inter_stage_problems(one_replica, Fusion(inter_stage=True), config)[0].startswith(
        "needs actor/generation dp >= 2"
    )
    document = example_plan().model_dump(mode="json")
    for stage in document["stages"]:
        if stage["model_stage"].endswith("/inference"):
            stage.update(dp=1, tp=2, emus=[[0, 1]])
    spanning = Plan.model_validate(document)
    (problem,) = inter_stage_problems(spanning, Fusion(inter_stage=True), config)
    assert "no inference model-stage has a replica clear" in problem
    (problem,) = inter_stage_problems(example_plan(), Fusion(inter_stage=True, migration_threshold=0.01), config)
    assert "under one sample" in problem

"""The plan-driven RL step on spawned worlds: finite metrics, bitwise weight sync, determinism."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import nereus.runtime.rl.step as step_module
from nereus.errors import NereusError
from nereus.runtime.comm.spawn import spawn
from nereus.runtime.rl.stages import ModelStageRuntime, build_stages, rollout_batch
from nereus.runtime.rl.step import StepResult, rl_step
from nereus.runtime.rl.update import old_log_probs_from_training, sync_plans
from nereus.runtime.run import rank_loop
from nereus.runtime.run.folder import prepare_folder
from nereus.runtime.run.run_setup import RunSetup
from nereus.runtime.state.sharded_state import gather, state_meta
from nereus.solver.admission import plan_problems
from nereus.spec.io import load_document
from nereus.spec.plan import Fusion, Plan
from nereus.spec.run_config import RLConfig, RunConfig
from nereus.spec.run_folder import StepMetrics

pytestmark = pytest.mark.one_rank

EXAMPLE = "examples/plan-tiny-ppo-4rank.yaml"
CONFIG = RLConfig(max_new_tokens=6, seed=3)


#: Split placement: generation and reference on rank 0, actor inference and training on rank 1.
SPLIT = {
    "actor/generation": (1, 1, 1, [[0]], 1),
    "actor/inference": (1, 1, 1, [[1]], 2),
    "reference/inference": (1, 1, 1, [[0]], 1),
    "actor/training": (1, 1, 1, [[1]], 2),
}


def two_rank_plan(algorithm: str = "ppo", split: bool = False) -> Plan:
    """The example's tiny models on ranks 0 and 1. Colocated: every model-stage on both ranks in
    a different layout so that the weight syncs reshard (tp=2 <- pp=2, dp=2 <- pp=2, ...).
    Split (critic-free algorithms): the `SPLIT` pools, so weights cross between disjoint ranks."""
    example = load_document(EXAMPLE)
    assert isinstance(example, Plan)
    document = example.model_dump(mode="json")
    layouts = {
        "actor/generation": (2, 1, 1, [[0, 1]], 1),
        "actor/inference": (1, 1, 2, [[0], [1]], 2),
        "reference/inference": (1, 2, 1, [[0, 1]], 2),
        "reward/inference": (1, 1, 2, [[0], [1]], 1),
        "critic/inference": (2, 1, 1, [[0, 1]], 1),
        "actor/training": (1, 2, 1, [[0, 1]], 2),
        "critic/training": (1, 1, 2, [[0], [1]], 1),
    }
    critic = algorithm == "ppo"
    document["cluster"]["gpus_per_node"] = 2
    document["pools"] = [{"name": "all", "gpus": [0, 1]}]
    if split:
        assert algorithm != "ppo"
        layouts = SPLIT
        document["pools"] = [{"name": "gen", "gpus": [0]}, {"name": "train", "gpus": [1]}]
    document["workload"].update(
        algorithm=algorithm,
        critic="tiny" if critic else None,
        prompts_per_step=4 if algorithm == "grpo" else 8,
        samples_per_prompt=2 if algorithm == "grpo" else 1,
    )
    document["stages"] = [
        {
            "model_stage": name,
            "pool": document["pools"][emus[0][0] if split else 0]["name"],
            "tp": tp,
            "pp": pp,
            "dp": dp,
            "emus": emus,
            "micro_batches": mb,
        }
        for name, (tp, pp, dp, emus, mb) in layouts.items()
        if critic or not name.startswith("critic")
    ]
    return Plan.model_validate(document)


def logical_params(stage: ModelStageRuntime) -> dict[str, torch.Tensor]:
    """The stage's whole parameters, gathered from every rank (collective)."""
    mine = {}
    if stage.engine is not None:
        mine = {k: v.clone() for k, v in stage.engine.local_state().items() if k.startswith("param/")}
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, (dist.get_rank(), mine))
    meta = state_meta(stage.model, stage.head, stage.layout, ("param",))
    return gather(meta, {rank: state for rank, state in states if state})


def run_and_check_sync(rank: int, world: int, plan: Plan, config: RLConfig, num_steps: int) -> dict[str, Any]:
    stages = build_stages(plan, config)
    syncs = sync_plans(stages)
    initial = logical_params(stages["actor/training"])
    metrics = [rl_step(plan, config, stages, syncs, step).metrics for step in range(num_steps)]
    trained = logical_params(stages["actor/training"])
    synced = {
        name: all(torch.equal(trained[key], value[key]) for key in trained)
        for name in ("actor/generation", "actor/inference")
        for value in [logical_params(stages[name])]
    }
    if "critic/training" in stages:
        critic = logical_params(stages["critic/training"])
        inference = logical_params(stages["critic/inference"])
        synced["critic/inference"] = all(torch.equal(critic[key], inference[key]) for key in critic)
    reference = logical_params(stages["reference/inference"])
    return {
        "metrics": metrics,
        "synced": synced,
        "actor_moved": any(not torch.equal(initial[key], trained[key]) for key in initial),
        "reference_kept": all(torch.equal(initial[key], reference[key]) for key in initial),
    }


def numbers(metrics: StepMetrics) -> tuple[Any, ...]:
    """Everything a step measured except wall times."""
    return (
        metrics.reward,
        metrics.kl,
        metrics.response_len_mean,
        metrics.response_len_max,
        metrics.actor_loss,
        metrics.critic_loss,
    )


@pytest.mark.multiprocess
def test_ppo_steps_are_finite_synced_and_deterministic() -> None:
    plan = two_rank_plan("ppo")
    assert plan_problems(plan, 2, CONFIG) == []
    first = spawn(run_and_check_sync, 2, plan, CONFIG, 3)
    second = spawn(run_and_check_sync, 2, plan, CONFIG, 3)
    result = first[0]
    assert [numbers(m) for m in result["metrics"]] == [numbers(m) for m in first[1]["metrics"]]  # ranks agree
    for metrics in result["metrics"]:
        assert all(math.isfinite(value) for value in numbers(metrics))
        assert 1 <= metrics.response_len_mean <= metrics.response_len_max <= CONFIG.max_new_tokens
        assert set(metrics.stage_seconds) >= {"actor/generation", "actor/training", "critic/training", "weight_sync"}
        assert all(seconds >= 0 for seconds in metrics.stage_seconds.values())
        assert len(metrics.state_bytes_per_rank) == 2 and min(metrics.state_bytes_per_rank) > 0
    assert result["metrics"][0].kl == 0.0  # the actor starts at the reference
    assert result["metrics"][-1].kl != 0.0
    assert result["synced"] == {"actor/generation": True, "actor/inference": True, "critic/inference": True}
    assert result["actor_moved"] and result["reference_kept"]
    assert [numbers(m) for m in result["metrics"]] == [numbers(m) for m in second[0]["metrics"]]


def runs_in_turn(rank: int, world: int, runs: list[tuple[Plan, RLConfig, int]]) -> list[dict[str, Any]]:
    """`run_and_check_sync` for each (plan, config, steps) in turn on the same ranks, each with
    stages of its own (one start-up of the ranks for several runs)."""
    return [run_and_check_sync(rank, world, plan, config, num_steps) for plan, config, num_steps in runs]


@pytest.mark.multiprocess
def test_critic_free_algorithms_run() -> None:
    """GRPO on split pools and ReMax colocated, one after the other on the same 2 ranks."""
    plans = {algorithm: two_rank_plan(algorithm, split) for algorithm, split in (("grpo", True), ("remax", False))}
    assert all(plan_problems(plan, 2, CONFIG) == [] for plan in plans.values())
    results = spawn(runs_in_turn, 2, [(plan, CONFIG, 2) for plan in plans.values()])[0]
    for algorithm, result in zip(plans, results, strict=True):
        assert all(math.isfinite(value) for m in result["metrics"] for value in numbers(m) if value is not None)
        assert all(m.critic_loss is None for m in result["metrics"]), algorithm
        assert result["synced"] == {"actor/generation": True, "actor/inference": True}, algorithm
        assert result["actor_moved"] and result["reference_kept"], algorithm


def run_with_old_log_probs_from(
    rank: int, world: int, plan: Plan, config: RLConfig, from_training: bool
) -> tuple[list[tuple[Any, ...]], list[dict[str, float]], dict[str, torch.Tensor]]:
    """Two steps with the old log-probs from the training forward or from the actor/inference
    pass: every step's numbers, gradient norms and the trained weights."""
    if not from_training:
        step_module.old_log_probs_from_training = lambda plan, fusion: False  # type: ignore[assignment]
    stages = build_stages(plan, config)
    syncs = sync_plans(stages)
    metrics = [rl_step(plan, config, stages, syncs, step).metrics for step in range(2)]
    return [numbers(m) for m in metrics], [m.grad_norm for m in metrics], logical_params(stages["actor/training"])


def old_log_probs_both_ways(rank: int, world: int, plan: Plan, config: RLConfig) -> tuple[Any, Any]:
    """`run_with_old_log_probs_from` from the training forward, then (the rule patched in this
    process from then on) from the inference pass, each run with stages of its own."""
    skipped = run_with_old_log_probs_from(rank, world, plan, config, True)
    return skipped, run_with_old_log_probs_from(rank, world, plan, config, False)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_old_log_probs_from_training_equal_the_inference_pass_bitwise() -> None:
    """GRPO with one update per batch skips the actor/inference pass: the training forward's
    log-probs serve as the old ones, and every number of the run stays the same bits."""
    plan = one_update_plan()
    assert plan_problems(plan, 2, CONFIG) == [] and old_log_probs_from_training(plan, plan.fusion)
    skipped, inferred = spawn(old_log_probs_both_ways, 2, plan, CONFIG)[0]
    assert skipped[0] == inferred[0] and skipped[1] == inferred[1]
    assert skipped[0][1][1] != 0.0  # the kl of step 1 (from the old log-probs) is measured
    assert all(torch.equal(skipped[2][key], value) for key, value in inferred[2].items())


def one_update_plan() -> Plan:
    """The split GRPO plan with one update per batch (one mini-batch of one epoch)."""
    plan = two_rank_plan("grpo", split=True)
    plan.workload.mini_batches = 1
    return plan


def test_old_log_probs_come_from_training_only_for_one_on_policy_update() -> None:
    plan = one_update_plan()
    assert old_log_probs_from_training(plan, plan.fusion)
    assert not old_log_probs_from_training(plan, Fusion(inter_stage=True))
    for field, value in (("ppo_epochs", 2), ("mini_batches", 2)):
        other = plan.model_copy(deep=True)
        setattr(other.workload, field, value)
        assert not old_log_probs_from_training(other, other.fusion)
    assert not old_log_probs_from_training(two_rank_plan("ppo"), plan.fusion)


@pytest.mark.multiprocess
def test_stop_at_eos_off_runs_every_response_to_its_limit() -> None:
    """With EOS honoured some response of the untrained actor stops early (else this test
    could not fail); with `stop_at_eos` off every response is exactly `max_new_tokens` long."""
    plan = two_rank_plan("grpo", split=True)
    stops = (True, False)
    runs = [(plan, RLConfig(max_new_tokens=24, seed=3, stop_at_eos=stop), 2) for stop in stops]
    results = spawn(runs_in_turn, 2, runs)[0]  # both runs on the same 2 ranks, in turn
    lengths = {
        stop: [(m.response_len_mean, m.response_len_max) for m in result["metrics"]]
        for stop, result in zip(stops, results, strict=True)
    }
    assert any(mean < 24 for mean, _ in lengths[True])
    assert lengths[False] == [(24.0, 24), (24.0, 24)]


def test_plan_problems_name_the_mismatch() -> None:
    example = load_document(EXAMPLE)
    assert isinstance(example, Plan)
    assert plan_problems(example, 4, CONFIG) == []
    assert plan_problems(example, 2, CONFIG) == ["the plan uses GPU 3 but the world has 2 ranks (0..1)"]
    crowded = example.model_copy(deep=True)
    crowded.stages[0].micro_batches = 9
    assert plan_problems(crowded, 4, CONFIG) == ["actor/generation: 16 rows over dp=2 cannot fill micro_batches=9"]
    lonely = two_rank_plan("grpo")
    lonely.workload.samples_per_prompt = 1
    assert "grpo needs samples_per_prompt >= 2" in plan_problems(lonely, 2, CONFIG)[0]
    criticless = two_rank_plan("grpo")
    criticless.workload.algorithm = "ppo"
    assert plan_problems(criticless, 2, CONFIG) == ["ppo needs critic/inference and critic/training stages"]


def test_rollout_batch_pads_and_marks_responses() -> None:
    batch = rollout_batch([[1, 5], [1, 6, 7]], [[8, 2], [9]], pad_id=0)
    assert batch.tokens.tolist() == [[0, 1, 5, 8, 2], [1, 6, 7, 9, 0]]
    assert batch.mask().tolist() == [[False, True, True, True, True], [True, True, True, True, False]]
    assert batch.field("loss_mask").tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0]]


def run_rank_recording_steps(rank: int, world: int, setup: RunSetup) -> list[StepMetrics]:
    """`nereus run`'s loop on this rank (`rank_loop.run_rank`), returning what each step measured here."""
    measured: list[StepMetrics] = []

    def recording(*args: Any, **kwargs: Any) -> StepResult:
        result = rl_step(*args, **kwargs)
        measured.append(result.metrics)
        return result

    rank_loop.rl_step = recording  # type: ignore[assignment]
    rank_loop.run_rank(rank, world, setup)
    return measured


@pytest.mark.multiprocess
@pytest.mark.slow
def test_example_four_rank_plan_runs_a_step(tmp_path: Path) -> None:
    """The colocated 4-rank example plan as written (tp=2 inference, pp=2 x dp=2 training)."""
    plan = load_document(EXAMPLE)
    assert isinstance(plan, Plan)
    setup = RunSetup(RunConfig(rl=CONFIG, num_steps=1), plan, 4, tmp_path / "run", 0, None, False)
    prepare_folder(setup)
    metrics = spawn(run_rank_recording_steps, 4, setup)
    assert [numbers(m) for m in metrics[0]] == [numbers(m) for m in metrics[3]]
    assert math.isfinite(metrics[0][0].actor_loss) and metrics[0][0].critic_loss is not None
    assert len(metrics[0][0].state_bytes_per_rank) == 4


def test_run_config_is_strict(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("kind: RunConfig\nversion: 1\nrl: {task: add, actor_lr: 1, seed: 2}\nnum_steps: 5\n")
    config = load_document(path)
    assert isinstance(config, RunConfig)
    assert (config.rl.task, config.rl.actor_lr, config.rl.seed, config.num_steps) == ("add", 1.0, 2, 5)
    assert config.rl.kl_coef == RLConfig().kl_coef
    for body, message in [
        ("rl: {task: mul}", "rl.task: unknown task 'mul'; choose from sort, add"),
        ("rl: {actor_lr: -1.0}", "rl.actor_lr"),
        ("rl: {clip: 0.1}", "rl.clip"),
        ("num_steps: '5'", "num_steps"),
    ]:
        path.write_text(f"kind: RunConfig\nversion: 1\n{body}\n")
        with pytest.raises(NereusError, match=re.escape(message)):
            load_document(path)

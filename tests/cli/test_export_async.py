"""`nereus export verl|openrlhf` of async plans: verl's one-step-off and fully async trainers'
keys checked against their configs in the pinned wheel, OpenRLHF's asynchronous-training flags
against its pinned parser, and what the trainers cannot express listed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import invoke, one_error_line
from peers import assert_openrlhf_parses, openrlhf_flags, unpacked_wheel, verl_async_config, verl_type

from nereus.interop.openrlhf import export_openrlhf
from nereus.interop.verl import export_verl, one_step_off
from nereus.solver.plan_search import PlanRequest
from nereus.solver.planner import make_plan
from nereus.spec.io import save_document
from nereus.spec.plan import Plan
from nereus.spec.presets import cluster_preset, models_for, workload_preset

pytestmark = pytest.mark.cli

ASYNC_KEYS = ("rollout.nnodes", "rollout.n_gpus_per_node", "trainer.nnodes", "trainer.n_gpus_per_node")


@pytest.fixture(scope="session")
def peer_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = getattr(request.config, "cache", None)
    return Path(cache.mkdir("peer-wheels")) if cache is not None else tmp_path_factory.mktemp("peer-wheels")


@pytest.fixture(scope="module")
def async_plan() -> Plan:
    workload = workload_preset("grpo-async")
    request = PlanRequest(cluster_preset("h100", 64), models_for(workload, None), workload, 64)
    return make_plan(request).best


def with_async(plan: Plan, staleness: int, partial: bool) -> Plan:
    update = {"max_staleness": staleness, "partial_rollout": partial}
    return plan.model_copy(update={"workload": plan.workload.model_copy(update=update), "predictions": None})


def verl_settings(plan: Plan, tmp_path: Path) -> dict[str, Any]:
    save_document(plan, tmp_path / "plan.yaml")
    result = invoke("export", "verl", tmp_path / "plan.yaml", "--json")
    assert result.exit_code == 0, result.output
    settings: dict[str, Any] = json.loads(result.stdout)["settings"]
    return settings


@pytest.mark.parametrize(("staleness", "partial"), [(1, False), (2, False), (1, True)])
def test_every_async_verl_key_exists_in_its_trainer_with_its_type(
    peer_root: Path, async_plan: Plan, tmp_path: Path, staleness: int, partial: bool
) -> None:
    root = unpacked_wheel("verl", peer_root)
    plan = with_async(async_plan, staleness, partial)
    trainer = "one_step_off" if one_step_off(plan) else "fully_async"
    assert (trainer == "one_step_off") == (staleness == 1 and not partial)
    config = verl_async_config(root, trainer)
    settings = verl_settings(plan, tmp_path)
    for key, value in settings.items():
        expected = verl_type(root, config, key)
        assert isinstance(value, expected) and not (expected is int and isinstance(value, bool)), (key, value)
    generation = plan.stage_plan("actor/generation")
    assert settings["rollout.nnodes"] * settings["rollout.n_gpus_per_node"] == len(generation.gpus)
    trained = len(plan.stage_plan("actor/training").gpus)
    assert settings["trainer.nnodes"] * settings["trainer.n_gpus_per_node"] == trained
    if trainer == "fully_async":
        assert settings["async_training.staleness_threshold"] == staleness - 1
        assert settings["async_training.partial_rollout"] is partial
        assert settings["data.train_batch_size"] == 0
        prompts = settings["actor_rollout_ref.actor.ppo_mini_batch_size"] * settings["async_training.require_batches"]
        assert prompts == plan.workload.prompts_per_step
    else:
        assert not any(key.startswith("async_training.") for key in settings)


def test_verl_lists_what_its_fully_async_staleness_bounds_otherwise(async_plan: Plan) -> None:
    assert not [d for d in export_verl(async_plan).differences if "staleness" in d.planned]
    export = export_verl(with_async(async_plan, 2, False))
    listed = [d for d in export.differences if d.planned.startswith("max_staleness 2")]
    assert len(listed) == 1 and "staleness_threshold=1.0" in listed[0].exported
    # the exported plan keeps the split: generation on the rollout pool, the rest on the trainer's
    exported = export.exported_plan
    assert {p.name for p in exported.pools} == {"rollout_pool", "trainer_pool"}
    assert exported.stage_plan("actor/generation").pool == "rollout_pool"
    assert export.exported_step_s == pytest.approx(export.planned_step_s, rel=0.25)


def test_sync_plans_export_no_async_keys(tmp_path: Path, async_plan: Plan) -> None:
    sync = async_plan.model_copy(
        update={"workload": async_plan.workload.model_copy(update={"execution": "sync", "max_staleness": None})}
    )
    settings = verl_settings(sync, tmp_path)
    assert not any(key.startswith(("rollout.", "async_training.")) for key in settings)
    flags = export_openrlhf(sync).settings
    assert not any("async" in flag or "partial_rollout" in flag for flag in flags)


@pytest.mark.parametrize(("staleness", "partial"), [(1, False), (3, True)])
def test_async_openrlhf_flags_exist_in_its_parser(
    peer_root: Path, async_plan: Plan, staleness: int, partial: bool
) -> None:
    flags = openrlhf_flags(unpacked_wheel("openrlhf", peer_root))
    settings = export_openrlhf(with_async(async_plan, staleness, partial)).settings
    assert settings["--train.async_enable"] is True
    assert settings["--train.async_queue_size"] == staleness
    assert ("--train.partial_rollout_enable" in settings) is partial
    assert "--vllm.enable_sleep" not in settings  # OpenRLHF refuses sleeping engines under async
    assert_openrlhf_parses(settings, flags)


def test_async_with_staleness_zero_lists_openrlhfs_smallest_queue(async_plan: Plan) -> None:
    export = export_openrlhf(with_async(async_plan, 0, False))
    assert export.settings["--train.async_queue_size"] == 1
    assert [d for d in export.differences if d.planned.startswith("max_staleness 0")]


def test_an_async_plan_without_a_generation_pool_is_refused_in_one_line(tmp_path: Path) -> None:
    workload = workload_preset("grpo")
    request = PlanRequest(cluster_preset("h100", 8), models_for(workload, None), workload, 8)
    colocated = make_plan(request).best
    assert len(colocated.pools) == 1
    plan = colocated.model_copy(
        update={"workload": colocated.workload.model_copy(update={"execution": "async"}), "predictions": None}
    )
    save_document(plan, tmp_path / "plan.yaml")
    result = invoke("export", "verl", tmp_path / "plan.yaml")
    assert result.exit_code == 1
    assert "workload.execution" in one_error_line(result) and "pool of its own" in one_error_line(result)
    with pytest.raises(ValueError, match="rollout pool apart from the trainer's"):
        export_verl(plan)

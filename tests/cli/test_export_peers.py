"""`nereus export verl|openrlhf`: every key and flag checked against the pinned releases, and
the warning block lists exactly what the trainer runs differently."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_helpers import invoke, one_error_line
from peers import assert_openrlhf_parses, openrlhf_flags, unpacked_wheel, verl_config, verl_type

from nereus.interop.common import per_gpu_micro_batch
from nereus.interop.openrlhf import export_openrlhf
from nereus.interop.verl import export_verl
from nereus.spec.check import semantic_problems
from nereus.spec.io import load_document, save_document
from nereus.spec.plan import Plan, Pool

pytestmark = pytest.mark.cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_PLANS = sorted(EXAMPLES.glob("plan-*.yaml"))


@pytest.fixture(scope="session")
def peer_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = getattr(request.config, "cache", None)
    return Path(cache.mkdir("peer-wheels")) if cache is not None else tmp_path_factory.mktemp("peer-wheels")


@pytest.fixture(scope="module")
def plan_64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plan64") / "plan.yaml"
    result = invoke("plan", "--gpus", "64", "-o", out)
    assert result.exit_code == 0, result.output
    return out


def split_plan() -> Plan:
    """The 4-rank PPO example split in two pools: the actor on GPUs 0-1, the rest on 2-3."""
    plan = load_document(EXAMPLES / "plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan, Plan)
    stages = []
    for entry in plan.stages:
        gpus = [0, 1] if entry.role == "actor" else [2, 3]
        pool = "actor" if entry.role == "actor" else "others"
        stages.append(entry.model_copy(update={"pool": pool, "tp": 2, "pp": 1, "dp": 1, "emus": [gpus]}))
    pools = [Pool(name="actor", gpus=[0, 1]), Pool(name="others", gpus=[2, 3])]
    split = plan.model_copy(update={"stages": stages, "pools": pools, "predictions": None})
    assert not [p for p in semantic_problems(split) if p.severity == "error"]
    return split


def _plans(plan_64: Path) -> list[Path]:
    return [*EXAMPLE_PLANS, plan_64]


def test_every_verl_key_exists_in_verl_with_its_type(peer_root: Path, plan_64: Path) -> None:
    root = unpacked_wheel("verl", peer_root)
    config = verl_config(root)
    for path in _plans(plan_64):
        result = invoke("export", "verl", path, "--json")
        assert result.exit_code == 0, result.output
        settings: dict[str, Any] = json.loads(result.stdout)["settings"]
        assert settings["trainer.nnodes"] * settings["trainer.n_gpus_per_node"] >= 1
        for key, value in settings.items():
            expected = verl_type(root, config, key)
            assert isinstance(value, expected) and not (expected is int and isinstance(value, bool)), (
                path.name,
                key,
                value,
                expected,
            )


def test_verl_yaml_and_overrides_say_the_same(tmp_path: Path) -> None:
    out = tmp_path / "verl.yaml"
    result = invoke("export", "verl", EXAMPLE_PLANS[0], "--format", "yaml", "-o", out)
    assert result.exit_code == 0, result.output
    nested = yaml.safe_load(out.read_text())
    overrides = invoke("export", "verl", EXAMPLE_PLANS[0]).stdout.splitlines()
    assert overrides
    for line in overrides:
        key, value = line.split("=", 1)
        node = nested
        for part in key.split("."):
            node = node[part]
        assert str(node).lower() == value.lower(), line


def test_every_openrlhf_flag_exists_in_its_parser(peer_root: Path, plan_64: Path) -> None:
    flags = openrlhf_flags(unpacked_wheel("openrlhf", peer_root))
    assert len(flags) > 100  # the parser was read, not an empty file
    for path in _plans(plan_64):
        result = invoke("export", "openrlhf", path, "--json")
        assert result.exit_code == 0, result.output
        assert_openrlhf_parses(json.loads(result.stdout)["settings"], flags, path.name)


def _changed(plan: Plan, exported: Plan) -> set[str]:
    """The model-stages whose layout, GPUs or per-GPU micro-batch the export changed."""
    out = set()
    for entry in plan.stages:
        other = exported.stage_plan(entry.model_stage)
        same = (entry.tp, entry.pp, entry.dp, sorted(entry.gpus)) == (other.tp, other.pp, other.dp, sorted(other.gpus))
        micro = entry.stage == "generation" or per_gpu_micro_batch(plan, entry) == per_gpu_micro_batch(plan, other)
        if not (same and micro):
            out.add(entry.model_stage)
    return out


def test_verl_warning_lists_exactly_what_a_split_placement_loses(tmp_path: Path) -> None:
    plan = split_plan()
    export = export_verl(plan)
    listed = {d.planned.split(" ")[0] for d in export.differences}
    # verl's one resource pool spreads every model-stage over all 4 GPUs: all seven move.
    assert listed == _changed(plan, export.exported_plan) == {e.model_stage for e in plan.stages}
    assert all(sorted(e.gpus) == [0, 1, 2, 3] for e in export.exported_plan.stages)
    path = tmp_path / "split.yaml"
    save_document(plan, path)
    result = invoke("export", "verl", path)
    assert result.exit_code == 0, result.output
    block = result.stderr.splitlines()
    assert block[0] == "warning: verl 0.9.1 cannot express 7 decision(s) of this plan:"
    assert sum(line.startswith("  - plan: ") for line in block) == 7
    assert "all 4 GPUs" in block[1]
    assert block[-1].startswith(f"  predicted step time: {export.planned_step_s:.4g} s as planned, ")
    assert "overrides" not in result.stderr and "trainer.nnodes=1" in result.stdout


def test_openrlhf_runs_the_split_placement_nearly_as_planned() -> None:
    plan = split_plan()
    export = export_openrlhf(plan)
    # Only the critic's values move: OpenRLHF computes them with the critic's training micro-batch.
    assert _changed(plan, export.exported_plan) == {"critic/inference"}
    listed = [d.planned.split(",")[0] for d in export.differences]
    assert listed == ["critic/inference tp=2 pp=1 dp=1 on GPUs 2-3", "dtype fp32"]  # the example is fp32
    assert export.settings["--actor.num_gpus_per_node"] == 2 and export.settings["--critic.num_gpus_per_node"] == 2
    assert export.settings["--train.colocate_critic_reward"] is True
    assert "--train.colocate_all" not in export.settings and "--train.colocate_actor_ref" not in export.settings
    assert export.settings["--vllm.num_engines"] == 1 and export.settings["--vllm.tensor_parallel_size"] == 2


def test_openrlhf_lists_pipeline_and_tied_layouts() -> None:
    plan = load_document(EXAMPLES / "plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan, Plan)
    export = export_openrlhf(plan)
    listed = {d.planned.split(" ")[0] for d in export.differences} - {"dtype"}
    assert listed == _changed(plan, export.exported_plan)
    assert "actor/training" in listed  # pp=2 there: DeepSpeed has no pipeline parallelism
    assert all(e.pp == 1 for e in export.exported_plan.stages)


def test_remax_on_openrlhf_is_one_line(tmp_path: Path) -> None:
    plan = load_document(EXAMPLES / "plan-tiny-grpo-4rank.yaml")
    assert isinstance(plan, Plan)
    remax = plan.model_copy(update={"workload": plan.workload.model_copy(update={"algorithm": "remax"})})
    path = tmp_path / "remax.yaml"
    save_document(remax, path)
    out = tmp_path / "flags.txt"
    line = one_error_line(invoke("export", "openrlhf", path, "-o", out))
    assert line.startswith(f"error: {path}: algorithm 'remax': OpenRLHF 0.11.2 has no remax estimator")
    assert not out.exists()
    assert invoke("export", "verl", path).exit_code == 0  # verl has a remax estimator


def test_full_sharding_exports_as_zero_3_and_as_a_difference_to_verl_megatron() -> None:
    """A fully sharded actor/training: OpenRLHF's one ZeRO stage becomes 3 and shards every
    DeepSpeed model (the others listed as changed); verl's Megatron trainer lists it as lost."""
    plan = split_plan()
    stages = [s.model_copy(update={"full_shard": s.model_stage == "actor/training"}) for s in plan.stages]
    plan = plan.model_copy(update={"stages": stages})
    openrlhf = export_openrlhf(plan)
    assert openrlhf.settings["--ds.zero_stage"] == 3
    sharded = {s.model_stage for s in openrlhf.exported_plan.stages if s.full_shard}
    assert sharded == {s.model_stage for s in plan.stages if s.stage != "generation"}
    changed = {d.planned for d in openrlhf.differences if "fully sharded" in d.exported}
    assert changed == {f"{name} whole parameters on every replica" for name in sharded - {"actor/training"}}
    verl = export_verl(plan)
    lost = [d for d in verl.differences if d.planned == "actor/training fully sharded over dp"]
    assert len(lost) == 1 and "Megatron" in lost[0].exported
    assert verl.settings["actor_rollout_ref.actor.megatron.use_distributed_optimizer"] is True
    assert not any(s.full_shard for s in verl.exported_plan.stages)


def offloading_plan() -> Plan:
    """The split 4-rank PPO example with actor/training's optimizer in host memory and
    critic/training's parameters there too (fully sharded: `params` needs it)."""
    plan = split_plan()
    offload = {"actor/training": {"train_offload": "optimizer"}}
    offload["critic/training"] = {"train_offload": "params", "full_shard": True}
    stages = [s.model_copy(update=offload.get(s.model_stage, {})) for s in plan.stages]
    return plan.model_copy(update={"stages": stages})


def test_training_time_offload_exports_to_adam_offload_and_verl_offload(peer_root: Path, tmp_path: Path) -> None:
    """OpenRLHF: `--ds.adam_offload` (DeepSpeed's ZeRO-Offload: the Adam step on the host) for
    every trained model, with no parameter offload (the critic's is listed as lost); verl's
    Megatron trainer: `optimizer_offload` and `param_offload` per trained model, which put the
    states to sleep between phases (listed: verl steps on the GPU). Every flag and key exists in
    the pinned releases."""
    plan = offloading_plan()
    openrlhf = export_openrlhf(plan)
    assert openrlhf.settings["--ds.adam_offload"] is True and openrlhf.settings["--ds.zero_stage"] == 3
    offloaded = {s.model_stage: s.train_offload for s in openrlhf.exported_plan.stages if s.stage == "training"}
    assert offloaded == {"actor/training": "optimizer", "critic/training": "optimizer"}
    lost = [d for d in openrlhf.differences if d.planned.startswith("critic/training parameters, gradients")]
    assert len(lost) == 1 and "--ds.adam_offload" in lost[0].exported
    verl = export_verl(plan)
    section = "actor_rollout_ref.actor.megatron"
    assert verl.settings[f"{section}.optimizer_offload"] is True
    assert verl.settings[f"{section}.param_offload"] is False
    assert verl.settings["critic.megatron.optimizer_offload"] is True
    assert verl.settings["critic.megatron.param_offload"] is True
    assert all(s.offload and s.train_offload == "none" for s in verl.exported_plan.stages if s.stage == "training")
    slept = {d.planned.split()[0] for d in verl.differences if "they sleep" in d.exported}
    assert slept == {"actor/training", "critic/training"}
    path = tmp_path / "plan.yaml"
    save_document(plan, path)
    flags = openrlhf_flags(unpacked_wheel("openrlhf", peer_root))
    for flag, value in json.loads(invoke("export", "openrlhf", path, "--json").stdout)["settings"].items():
        assert flag in flags and (value is not True or flags[flag].get("action") == "'store_true'"), flag
    root = unpacked_wheel("verl", peer_root)
    config = verl_config(root)
    for key, value in json.loads(invoke("export", "verl", path, "--json").stdout)["settings"].items():
        assert isinstance(value, verl_type(root, config, key)), (key, value)

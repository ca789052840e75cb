"""Context parallelism (a plan's `cp`) in the exports: verl's Megatron `context_parallel_size`
for the actor, the reference and the critic (their inference runs with their training's), or its
FSDP backend's `ulysses_sequence_parallel_size` for the same three (`--backend fsdp`),
OpenRLHF's `--ds.ring_attn_size` (one size for every DeepSpeed model); what the trainer cannot
express is listed, as every other layout it changes. Every key and flag exists, with its type,
in the pinned releases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import invoke
from peers import VERL_FSDP_CONFIG, assert_openrlhf_parses, openrlhf_flags, unpacked_wheel, verl_config, verl_type

from nereus.interop.openrlhf import export_openrlhf
from nereus.interop.verl import export_verl
from nereus.spec.check import semantic_problems
from nereus.spec.io import load_document, save_document
from nereus.spec.plan import Plan, StagePlan

pytestmark = pytest.mark.cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="session")
def peer_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = getattr(request.config, "cache", None)
    return Path(cache.mkdir("peer-wheels")) if cache is not None else tmp_path_factory.mktemp("peer-wheels")


def with_cp(cps: dict[str, int], example: str = "plan-tiny-ppo-4rank.yaml") -> Plan:
    """The 4-rank example with every model-stage on all 4 GPUs, tp=1 pp=1, and context
    parallelism `cps[model_stage]` (1 where not named): dp = 4 / cp replicas; the critic's
    values in micro-batches of its training's size (both trainers compute them so)."""
    plan = load_document(EXAMPLES / example)
    assert isinstance(plan, Plan)
    return on_four_gpus(plan, "cp", cps)


def on_four_gpus(plan: Plan, degree: str, degrees: dict[str, int]) -> Plan:
    """`plan` (a 4-rank example) with every model-stage on all 4 GPUs, tp=1 pp=1, and the replica
    dimension `degree` (`cp`, `ep`) at `degrees[model_stage]` (1 where not named): dp = 4 /
    degree replicas; the critic's values in micro-batches of its training's size."""
    stages: list[StagePlan] = []
    for entry in plan.stages:
        size = degrees.get(entry.model_stage, 1)
        emus = [list(range(k * size, (k + 1) * size)) for k in range(4 // size)]
        micro_batches = plan.workload.mini_batches if entry.model_stage == "critic/inference" else 1
        update = {"tp": 1, "pp": 1, degree: size, "dp": len(emus), "emus": emus, "micro_batches": micro_batches}
        stages.append(entry.model_copy(update=update))
    pools = [plan.pools[0].model_copy(update={"gpus": [0, 1, 2, 3]})]
    out = plan.model_copy(update={"stages": [s.model_copy(update={"pool": pools[0].name}) for s in stages]})
    out = out.model_copy(update={"pools": pools, "predictions": None})
    assert not [p for p in semantic_problems(out) if p.severity == "error"], semantic_problems(out)
    return out


def test_verl_megatron_takes_each_models_context_parallel_size() -> None:
    # tiny has 2 KV heads, so cp is at most 2 (tp x cp divides them): the reference keeps cp 1.
    cps = {"actor/training": 2, "actor/inference": 2, "reference/inference": 1}
    plan = with_cp({**cps, "critic/training": 2, "critic/inference": 2})
    export = export_verl(plan)
    assert export.settings["actor_rollout_ref.actor.megatron.context_parallel_size"] == 2
    assert export.settings["actor_rollout_ref.ref.megatron.context_parallel_size"] == 1
    assert export.settings["critic.megatron.context_parallel_size"] == 2
    exported = {e.model_stage: e.cp for e in export.exported_plan.stages}
    assert exported == {e.model_stage: e.cp for e in plan.stages}
    # Every layout is verl's as planned: nothing to list.
    assert export.differences == []


def test_verl_lists_inference_cp_unlike_training_and_a_served_reward_model() -> None:
    """verl computes old log-probs on the actor's training workers: an actor/inference planned
    without cp runs with training's cp=2 (listed); the reward model is served by vLLM, which has
    no context parallelism (listed, saying so)."""
    plan = with_cp({"actor/training": 2, "reward/inference": 2})
    export = export_verl(plan)
    listed = {d.planned.split(" ")[0]: d for d in export.differences}
    assert set(listed) == {"actor/inference", "reward/inference"}
    assert listed["actor/inference"].planned.startswith("actor/inference tp=1 pp=1 dp=4")
    assert "tp=1 cp=2 pp=1 dp=2" in listed["actor/inference"].exported
    assert "actor's training workers" in listed["actor/inference"].exported
    assert listed["reward/inference"].planned.startswith("reward/inference tp=1 cp=2 pp=1 dp=2")
    assert "vLLM, which takes a tensor and a pipeline size only" in listed["reward/inference"].exported
    cps = {e.model_stage: e.cp for e in export.exported_plan.stages}
    assert cps["actor/inference"] == 2 and cps["reward/inference"] == 1


def test_verl_fsdp_takes_each_models_ulysses_size_and_lists_tp() -> None:
    """verl's FSDP backend: the actor's, the reference's and the critic's Ulysses degree is their
    cp; their FSDP workers shard everything over all 4 GPUs (the plan's unsharded replicas are
    listed), and a planned tp becomes Ulysses x data parallel (listed, saying why)."""
    cps = {"actor/training": 2, "actor/inference": 2, "reference/inference": 1}
    plan = with_cp({**cps, "critic/training": 2, "critic/inference": 2})
    export = export_verl(plan, "fsdp")
    assert export.settings["actor_rollout_ref.actor.ulysses_sequence_parallel_size"] == 2
    assert export.settings["actor_rollout_ref.ref.ulysses_sequence_parallel_size"] == 1
    assert export.settings["critic.ulysses_sequence_parallel_size"] == 2
    assert not [key for key in export.settings if ".megatron." in key]
    exported = {e.model_stage: (e.tp, e.cp, e.pp, e.full_shard) for e in export.exported_plan.stages}
    assert exported["actor/training"] == (1, 2, 1, True) and exported["reference/inference"] == (1, 1, 1, True)
    assert exported["actor/generation"][3] is False  # vLLM holds whole weights
    listed = {d.planned.split(" ")[0] for d in export.differences}
    assert listed == {"actor/training", "actor/inference", "reference/inference", "critic/training", "critic/inference"}
    assert all("fully sharded over dp" in d.exported for d in export.differences)
    # tp=2 on the actor's training: FSDP has none, so 4 GPUs run Ulysses 2 x data parallel 2.
    tp2 = plan.model_copy(
        update={
            "stages": [
                e.model_copy(update={"tp": 2, "cp": 1, "dp": 2}) if e.model_stage == "actor/training" else e
                for e in plan.stages
            ]
        }
    )
    moved = [d for d in export_verl(tp2, "fsdp").differences if d.planned.startswith("actor/training tp=2")]
    assert len(moved) == 1 and "no tensor or pipeline parallelism" in moved[0].exported


def test_verl_fsdp_lists_allgather_cp_and_megatron_takes_it() -> None:
    """verl's FSDP workers have Ulysses only: an all-gather KV actor exports at cp 1, listed with
    the reason; Megatron's context_parallel_size covers it."""
    plan = with_cp({"actor/training": 2, "actor/inference": 2, "reference/inference": 1})
    stages = [e.model_copy(update={"cp_method": "allgather"}) if e.cp > 1 else e for e in plan.stages]
    plan = plan.model_copy(update={"stages": stages})
    fsdp = export_verl(plan, "fsdp")
    assert fsdp.settings["actor_rollout_ref.actor.ulysses_sequence_parallel_size"] == 1
    listed = [d for d in fsdp.differences if d.planned.startswith("actor/training tp=1 cp=2 allgather")]
    assert len(listed) == 1 and "Ulysses only" in listed[0].exported, fsdp.differences
    megatron = export_verl(plan, "megatron")
    assert megatron.settings["actor_rollout_ref.actor.megatron.context_parallel_size"] == 2
    trained = next(e for e in megatron.exported_plan.stages if e.model_stage == "actor/training")
    assert (trained.cp, trained.cp_method) == (2, "allgather")


def test_openrlhf_ring_attention_is_one_size_for_every_deepspeed_model() -> None:
    plan = with_cp({"actor/training": 2, "actor/inference": 2, "critic/training": 2, "critic/inference": 2})
    export = export_openrlhf(plan)
    assert export.settings["--ds.ring_attn_size"] == 2 and export.settings["--ds.packing_samples"] is True
    cps = {e.model_stage: e.cp for e in export.exported_plan.stages}
    assert cps == {e.model_stage: 1 if e.stage == "generation" else 2 for e in plan.stages}
    # The reference and the reward model were planned without cp: they get the actor's ring size.
    listed = {d.planned.split(" ")[0]: d for d in export.differences if not d.planned.startswith("dtype")}
    assert set(listed) == {"reference/inference", "reward/inference"}
    assert all("one ring attention size (2) for every model" in d.exported for d in listed.values())
    plain = export_openrlhf(with_cp({}))
    assert plain.settings["--ds.ring_attn_size"] == 1 and "--ds.packing_samples" not in plain.settings


def test_cp_keys_and_flags_exist_in_the_pinned_releases(peer_root: Path, tmp_path: Path) -> None:
    path = tmp_path / "cp.yaml"
    save_document(with_cp({"actor/training": 2, "reference/inference": 2, "critic/training": 2}), path)
    root = unpacked_wheel("verl", peer_root)
    config = verl_config(root)
    settings = json.loads(invoke("export", "verl", path, "--json").stdout)["settings"]
    assert settings["actor_rollout_ref.actor.megatron.context_parallel_size"] == 2
    for key, value in settings.items():
        assert isinstance(value, verl_type(root, config, key)), (key, value)
    fsdp_config = verl_config(root, VERL_FSDP_CONFIG)
    settings = json.loads(invoke("export", "verl", path, "--backend", "fsdp", "--json").stdout)["settings"]
    assert settings["actor_rollout_ref.actor.ulysses_sequence_parallel_size"] == 2
    assert settings["critic.ulysses_sequence_parallel_size"] == 2
    for key, value in settings.items():
        assert isinstance(value, verl_type(root, fsdp_config, key)), (key, value)
    flags = openrlhf_flags(unpacked_wheel("openrlhf", peer_root))
    settings = json.loads(invoke("export", "openrlhf", path, "--json").stdout)["settings"]
    assert settings["--ds.ring_attn_size"] == 2
    assert_openrlhf_parses(settings, flags)

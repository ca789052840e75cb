"""Expert parallelism (a mixture-of-experts plan's `ep`) in the exports: verl's Megatron
`expert_model_parallel_size` (with `expert_tensor_parallel_size` = tp) for the actor, the
reference and the critic, and the rollout's vLLM expert parallelism (`data_parallel_size` ep,
`expert_parallel_size` tp x ep); OpenRLHF cannot express it (listed). Every key exists, with its
type, in the pinned verl release; a dense plan's export has none of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import invoke
from peers import assert_openrlhf_parses, openrlhf_flags, unpacked_wheel, verl_config, verl_type
from test_export_cp import on_four_gpus

from nereus.interop.openrlhf import export_openrlhf
from nereus.interop.verl import export_verl
from nereus.spec.io import load_document, save_document
from nereus.spec.model import MoE
from nereus.spec.plan import Plan

pytestmark = pytest.mark.cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: tiny with 4 experts of width 32, 2 per token.
EXPERTS = MoE(num_experts=4, experts_per_token=2, expert_ffn_dim=32)
EXPERT_KEYS = ("expert_model_parallel_size", "expert_tensor_parallel_size", "expert_parallel_size")


@pytest.fixture(scope="session")
def peer_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = getattr(request.config, "cache", None)
    return Path(cache.mkdir("peer-wheels")) if cache is not None else tmp_path_factory.mktemp("peer-wheels")


def with_ep(eps: dict[str, int], experts: bool = True) -> Plan:
    """The 4-rank example (tiny, with experts when `experts`) with every model-stage on all 4
    GPUs, tp=1 pp=1, and expert parallelism `eps[model_stage]` (1 where not named)."""
    plan = load_document(EXAMPLES / "plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan, Plan)
    if experts:
        plan = plan.model_copy(update={"models": [m.model_copy(update={"moe": EXPERTS}) for m in plan.models]})
    return on_four_gpus(plan, "ep", eps)


EVERY_EP = {
    "actor/generation": 2,
    "actor/training": 2,
    "actor/inference": 2,
    "reference/inference": 4,
    "critic/training": 2,
    "critic/inference": 2,
}


def test_verl_writes_megatrons_and_the_rollouts_expert_parallel_sizes() -> None:
    export = export_verl(with_ep(EVERY_EP))
    s = export.settings
    assert s["actor_rollout_ref.actor.megatron.expert_model_parallel_size"] == 2
    assert s["actor_rollout_ref.ref.megatron.expert_model_parallel_size"] == 4
    assert s["critic.megatron.expert_model_parallel_size"] == 2
    assert s["actor_rollout_ref.actor.megatron.expert_tensor_parallel_size"] == 1  # nereus's expert tp = tp
    assert s["actor_rollout_ref.rollout.tensor_model_parallel_size"] == 1
    assert s["actor_rollout_ref.rollout.data_parallel_size"] == 2
    assert s["actor_rollout_ref.rollout.expert_parallel_size"] == 2
    exported = {e.model_stage: e.ep for e in export.exported_plan.stages}
    # The reward model is served by vLLM without expert parallelism; everything else as planned.
    assert exported == {**{e.model_stage: e.ep for e in with_ep(EVERY_EP).stages}, "reward/inference": 1}
    assert export.differences == []


def test_verl_lists_an_inference_ep_unlike_training_and_a_served_reward_model() -> None:
    export = export_verl(with_ep({"actor/training": 2, "reward/inference": 2}))
    listed = {d.planned.split(" ")[0]: d for d in export.differences}
    assert set(listed) == {"actor/inference", "reward/inference"}
    assert "tp=1 ep=2 pp=1 dp=2" in listed["actor/inference"].exported
    assert listed["reward/inference"].planned.startswith("reward/inference tp=1 ep=2 pp=1 dp=2")


def test_a_dense_plans_export_has_no_expert_keys() -> None:
    settings = export_verl(with_ep({}, experts=False)).settings
    assert not [key for key in settings if key.rsplit(".", 1)[-1] in EXPERT_KEYS]
    # An MoE plan at ep = 1 writes Megatron's sizes (1) and leaves the rollout alone.
    moe = export_verl(with_ep({})).settings
    assert moe["actor_rollout_ref.actor.megatron.expert_model_parallel_size"] == 1
    assert "actor_rollout_ref.rollout.expert_parallel_size" not in moe


def test_openrlhf_cannot_express_ep_and_lists_it() -> None:
    export = export_openrlhf(with_ep({"actor/training": 2, "actor/generation": 2}))
    assert all(e.ep == 1 for e in export.exported_plan.stages)
    listed = {d.planned.split(" ")[0]: d for d in export.differences if not d.planned.startswith("dtype")}
    assert {"actor/training", "actor/generation"} <= set(listed)
    assert "cannot express expert parallelism" in listed["actor/training"].exported


def test_ep_keys_exist_in_the_pinned_releases(peer_root: Path, tmp_path: Path) -> None:
    path = tmp_path / "ep.yaml"
    save_document(with_ep(EVERY_EP), path)
    root = unpacked_wheel("verl", peer_root)
    config = verl_config(root)
    settings = json.loads(invoke("export", "verl", path, "--json").stdout)["settings"]
    assert settings["actor_rollout_ref.rollout.expert_parallel_size"] == 2
    for key, value in settings.items():
        assert isinstance(value, verl_type(root, config, key)), (key, value)
    flags = openrlhf_flags(unpacked_wheel("openrlhf", peer_root))
    assert_openrlhf_parses(json.loads(invoke("export", "openrlhf", path, "--json").stdout)["settings"], flags)

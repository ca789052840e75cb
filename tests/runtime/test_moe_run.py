"""`nereus run` on a transformers-made Qwen3-MoE folder (4 experts, 2 per token, one dense
layer): a GRPO run plans itself, its samples' log-probs are transformers', and `nereus export
hf` writes the per-expert tensors transformers saved, bitwise (a learning rate too small to
move a float32 weight). A run with every model-stage at ep = 2 on 2 ranks computes what the
same run at ep = 1 computes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from cli_helpers import invoke
from hf_helpers import save_random_model
from run_helpers import TIMING_FIELDS

from nereus.spec.io import load_document, save_document
from nereus.spec.plan import Plan, StagePlan
from nereus.spec.run_folder import read_metrics
from tests.cli.test_hf_run_export import check_samples

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.cli

#: The tiny Qwen3-MoE every test runs (tiny-ppo's sort task: a 32-token vocabulary).
FIELDS: dict[str, Any] = {
    "num_hidden_layers": 2,
    "vocab_size": 32,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "mlp_only_layers": [0],
    "max_position_embeddings": 256,
    "eos_token_id": 2,
}


def moe_folder(root: Path) -> Path:
    folder = save_random_model(root / "moe-tiny", "Qwen3MoeConfig", FIELDS)
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 256}\n')
    return folder


def write_config(root: Path, name: str = "run.yaml", **fields: object) -> Path:
    document = {
        "kind": "RunConfig",
        "version": 1,
        "model": "moe-tiny",
        "workload": "tiny-ppo",
        "num_steps": 2,
        "checkpoint_every": 1,
        "rl": {"task": "sort", "seed": 3, "max_new_tokens": 4, "log_samples": 6},
        **fields,
    }
    path = root / name
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_moe_run_samples_what_transformers_computes_and_exports_back_bitwise(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    source = moe_folder(tmp_path)
    config = write_config(
        tmp_path, num_steps=1, rl={"task": "sort", "seed": 3, "max_new_tokens": 4, "actor_lr": 1e-30, "log_samples": 6}
    )
    result = invoke("run", config, "--nproc", "2", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    plan = load_document(tmp_path / "run" / "plan.yaml")
    assert isinstance(plan, Plan) and plan.models[0].moe is not None
    check_samples(tmp_path / "run", source)
    exported = tmp_path / "exported"
    result = invoke("export", "hf", tmp_path / "run", "--step", "1", "-o", exported)
    assert result.exit_code == 0, result.output
    before, after = load_file(source / "model.safetensors"), load_file(exported / "model.safetensors")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in after and "model.layers.1.mlp.gate.weight" in after
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)


def ep_plan(root: Path, source: Path, ep: int) -> Path:
    """A 2-rank plan for the folder's model with every model-stage one replica of (tp 1, pp 1, ep)."""
    path = root / f"plan-ep{ep}.yaml"
    result = invoke("plan", "--model", source, "--workload", "tiny-ppo", "--gpus", "2", "-o", path)
    assert result.exit_code == 0, result.output
    plan = load_document(path)
    assert isinstance(plan, Plan)
    pool = plan.pools[0].model_copy(update={"name": "all", "gpus": [0, 1]})
    emus = [[0, 1]] if ep == 2 else [[0], [1]]
    update = {"pool": "all", "tp": 1, "pp": 1, "ep": ep, "dp": len(emus), "emus": emus}
    # the memory choices expert parallelism runs without, wherever the planner picked them
    plain = {"zero1": False, "full_shard": False, "offload": False, "train_offload": "none", "token_budget": None}
    stages = []
    for stage in plan.stages:
        fields = stage.model_dump()
        fields.update(update)
        fields.update({k: v for k, v in plain.items() if fields.get(k) not in (None, v)})
        stages.append(StagePlan.model_validate(fields))
    save_document(plan.model_copy(update={"pools": [pool], "stages": stages, "predictions": None}), path)
    return path


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_run_at_ep_2_computes_what_the_run_at_ep_1_computes(tmp_path: Path) -> None:
    source = moe_folder(tmp_path)
    records = {}
    for ep in (1, 2):
        plan = ep_plan(tmp_path, source, ep)
        config = write_config(tmp_path, f"run-ep{ep}.yaml", plan=plan.name)
        result = invoke("run", config, "--out", tmp_path / f"run-ep{ep}")
        assert result.exit_code == 0, result.output
        stored = load_document(tmp_path / f"run-ep{ep}" / "plan.yaml")
        assert isinstance(stored, Plan) and {s.ep for s in stored.stages} == {ep}
        metrics = [
            {k: v for k, v in r.items() if k not in TIMING_FIELDS and isinstance(v, float)}
            for r in read_metrics(tmp_path / f"run-ep{ep}")
        ]
        samples = [json.loads(line) for line in (tmp_path / f"run-ep{ep}" / "samples.jsonl").read_text().splitlines()]
        records[ep] = metrics, samples
    (metrics_1, samples_1), (metrics_2, samples_2) = records[1], records[2]
    assert [[s["response_ids"] for s in samples_1]] == [[s["response_ids"] for s in samples_2]]
    for one, two in zip(metrics_1, metrics_2, strict=True):
        assert one.keys() == two.keys()
        assert all(abs(one[k] - two[k]) < 1e-5 for k in one), (one, two)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_routing_replay_in_a_run_records_the_mismatch_and_replays_the_rollouts_routing(tmp_path: Path) -> None:
    """The rollout's routing recorded and compared with the trainer's every step; with nothing
    between them to differ (the same weights, fp32, one update per step) the mismatch is 0 and
    the replayed run computes what the plain one does."""
    from nereus.spec.presets import workload_preset

    moe_folder(tmp_path)
    # fp32 throughout (no rounding for the routers to differ by) and one update per step, on the
    # weights that sampled it (a later mini-batch's router has moved: replay then matters)
    workload = tmp_path / "workload.yaml"
    save_document(workload_preset("tiny-ppo").model_copy(update={"dtype": "fp32", "mini_batches": 1}), workload)
    records = {}
    for replay in (False, True):
        rl = {"task": "sort", "seed": 3, "max_new_tokens": 4, "log_samples": 6, "routing_replay": replay}
        config = write_config(tmp_path, f"run-{replay}.yaml", rl=rl, workload=str(workload))
        result = invoke("run", config, "--nproc", "2", "--out", tmp_path / f"run-{replay}")
        assert result.exit_code == 0, result.output
        metrics = read_metrics(tmp_path / f"run-{replay}")
        assert [r["routing_mismatch"] for r in metrics] == [0.0, 0.0]
        records[replay] = [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in metrics]
    # the same numbers up to rounding: pad tokens replay the generation engine's experts, so an
    # expert's rows (and the order of its gradient sum) may differ
    for plain, replayed in zip(records[False], records[True], strict=True):
        assert plain.keys() == replayed.keys()
        for key, value in plain.items():
            assert _close(value, replayed[key]), (key, value, replayed[key])


def _close(a: Any, b: Any) -> bool:
    """Equal, numbers within 1e-5 (relative where large), in nested dicts and lists alike."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-5 * max(1.0, abs(a))
    return bool(a == b)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_router_aux_loss_option_is_recorded_every_step(tmp_path: Path) -> None:
    """`rl.router_aux_loss_coef` > 0: every step records the router's load-balancing loss (a
    positive number: its value is experts_per_token under perfectly balanced routing)."""
    moe_folder(tmp_path)
    rl = {"task": "sort", "seed": 3, "max_new_tokens": 4, "log_samples": 6, "router_aux_loss_coef": 0.01}
    config = write_config(tmp_path, rl=rl)
    result = invoke("run", config, "--nproc", "2", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2
    assert all(isinstance(r["router_aux_loss"], float) and r["router_aux_loss"] > 0 for r in metrics), metrics

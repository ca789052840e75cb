"""A colocated vLLM engine's sleep and wake: which level, which calls a step makes on vLLM's
`LLM` (through `EngineSleep`, whose only contact with vLLM is `LLM.sleep` and `LLM.wake_up`,
here a recorder), the phase times a step records, and what the cost model keeps resident
while the engine sleeps. The calls themselves run on GPUs only (vLLM's CPU backend has no
sleep mode): `benchmarks/gpu_check.py --device cuda` times them in its vLLM section."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from plan_helpers import relayout
from repo_paths import EXAMPLES

from nereus.cost.calibration import Calibration
from nereus.cost.plan_cost import evaluate_plan, usable_capacity
from nereus.cost.vllm_engine import (
    ENGINE_START_KEY,
    SLEEP_KEY,
    WAKE_KEY,
    WEIGHT_LOAD_KEY,
    colocated_generation,
    engine_memory,
    engine_sleep_level,
    peaks_beside_engine,
    weight_bytes_per_gpu,
)
from nereus.runtime.generation.vllm_engine import (
    KV_CACHE,
    WEIGHTS,
    EngineSleep,
    VLLMEngine,
    engine_phase_seconds,
)
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.stages import ACTOR_GENERATION, ACTOR_TRAINING

pytestmark = pytest.mark.logic

#: Every model-stage on the same 4 GPUs (a colocated pool).
COLOCATED = EXAMPLES / "plan-tiny-grpo-4rank.yaml"


class RecordingLLM:
    """vLLM's `LLM` as `EngineSleep` sees it: the calls it was asked to make."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", list(tags)))


def _plan() -> Plan:
    plan = load_document(COLOCATED)
    assert isinstance(plan, Plan)
    return plan


def split_plan() -> Plan:
    """Generation on GPUs 0-1, training on GPUs 2-3 (inference stays where it was)."""
    plan = relayout(_plan(), ACTOR_GENERATION, 1, 1, [[0], [1]])
    return relayout(plan, ACTOR_TRAINING, 1, 1, [[2], [3]])


def step(sleeper: EngineSleep) -> None:
    """One RL step as the runtime drives the engine: generate, sleep, sync the weights."""
    sleeper.wake()  # generation
    sleeper.sleep()  # after the rollout
    sleeper.wake((WEIGHTS,))  # the weight sync: its weights' memory back ...
    sleeper.loaded()  # ... and filled


def test_an_engine_sleeps_only_beside_training_and_where_vllm_has_a_sleep_mode() -> None:
    colocated, split = _plan(), split_plan()
    assert colocated_generation(colocated) and not colocated_generation(split)
    assert engine_sleep_level(colocated, sleep_mode=True) == 2  # synced every step: level 2
    assert engine_sleep_level(colocated, sleep_mode=False) is None  # vLLM on CPUs: stays allocated
    assert engine_sleep_level(split, sleep_mode=True) is None  # no training beside it


def test_a_level_2_step_drops_everything_and_the_sync_then_the_generation_wake_it() -> None:
    llm = RecordingLLM()
    sleeper = EngineSleep(llm, 2)
    step(sleeper)
    assert llm.calls == [("sleep", 2), ("wake_up", [WEIGHTS])]
    assert sleeper.asleep == {KV_CACHE}  # the KV cache stays asleep until the next generation
    step(sleeper)
    assert llm.calls[2:] == [("wake_up", [KV_CACHE]), ("sleep", 2), ("wake_up", [WEIGHTS])]
    sleeper.wake()
    sleeper.wake()  # awake: nothing more to call
    assert llm.calls[5:] == [("wake_up", [KV_CACHE])]
    assert len(sleeper.seconds[SLEEP_KEY]) == 2 and len(sleeper.seconds[WAKE_KEY]) == 4


def test_after_a_level_2_sleep_only_a_weight_load_lets_the_engine_generate() -> None:
    llm = RecordingLLM()
    sleeper = EngineSleep(llm, 2)
    sleeper.sleep()
    with pytest.raises(AssertionError, match="weight sync loads them first"):
        sleeper.wake()
    level1 = EngineSleep(RecordingLLM(), 1)  # level 1 kept them in host memory: it may wake at once
    level1.sleep()
    level1.wake()
    assert level1.llm.calls == [("sleep", 1), ("wake_up", [WEIGHTS, KV_CACHE])]


def test_an_engine_that_never_sleeps_makes_no_call() -> None:
    llm = RecordingLLM()
    sleeper = EngineSleep(llm, None)
    step(sleeper)
    step(sleeper)
    assert llm.calls == [] and sleeper.asleep == set() and sleeper.seconds == {}


def test_a_step_records_the_engine_start_once_and_one_loads_seconds() -> None:
    assert engine_phase_seconds({WEIGHT_LOAD_KEY: [0.2, 0.4], SLEEP_KEY: [0.1, 0.3], WAKE_KEY: []}) == {
        WEIGHT_LOAD_KEY: pytest.approx(0.3),
        SLEEP_KEY: pytest.approx(0.4),
    }
    engine = VLLMEngine(RecordingLLM(), replica=0, tp_group=None, sleep_level=2, start_s=5.0)
    engine.sleep()
    phases = engine.drain_phases()
    assert phases[ENGINE_START_KEY] == 5.0 and SLEEP_KEY in phases
    assert engine.drain_phases() == {}  # drained: the next step records only what it did


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_on_cpus_has_no_sleep_mode() -> None:
    from nereus.runtime.generation.vllm_engine import sleep_mode_available

    assert not sleep_mode_available()


def test_asleep_the_engine_leaves_training_the_kv_caches_memory() -> None:
    """Awake, the engine keeps its weights and KV pool on the GPUs training shares; asleep at
    level 1 its weights wait in host memory, at level 2 nothing is kept."""
    calibration = Calibration()
    plan = _plan()
    weights = weight_bytes_per_gpu(plan, calibration, 2, 1)
    kv_pool = evaluate_plan(plan, calibration).predictions.model_stages[ACTOR_GENERATION].memory_breakdown_bytes
    awake, level1, level2 = (engine_memory(plan, calibration, level) for level in (None, 1, 2))
    assert plan.stage_plan(ACTOR_GENERATION).kv_budget_bytes is None  # room for every sample
    assert awake.device == pytest.approx(weights + kv_pool["kv_cache"], rel=1e-9) and awake.host == 0
    assert (level1.device, level1.host) == (0.0, weights)
    assert (level2.device, level2.host) == (0.0, 0.0)
    # A KV budget (vLLM allocates all of it) that, kept awake, overflows the GPUs training shares.
    training = evaluate_plan(plan, calibration).predictions.model_stages[ACTOR_TRAINING].peak_memory_bytes
    limit = usable_capacity(plan.cluster, calibration)
    assert training < limit
    stages = [
        e.model_copy(update={"kv_budget_bytes": int(limit - training)}) if e.model_stage == ACTOR_GENERATION else e
        for e in plan.stages
    ]
    big = plan.model_copy(update={"stages": stages, "predictions": None})
    beside_awake, beside_asleep = peaks_beside_engine(big, calibration, None), peaks_beside_engine(big, calibration, 2)
    assert ACTOR_TRAINING in beside_asleep and ACTOR_GENERATION not in beside_asleep
    assert (
        beside_asleep[ACTOR_TRAINING]
        == evaluate_plan(big, calibration).predictions.model_stages[ACTOR_TRAINING].peak_memory_bytes
    )
    assert beside_awake[ACTOR_TRAINING] > limit >= beside_asleep[ACTOR_TRAINING]

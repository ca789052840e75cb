"""Phase 1 of a step, generation: each actor/generation replica samples responses for its
share of the prompts, or, under inter-stage fusion, the fused rollout (`fused_rollout`)
generates them and runs the inference model-stages on the samples as they finish."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from nereus.runtime.generation.generate import generate
from nereus.runtime.generation.kv_cache import KVBudget
from nereus.runtime.generation.sampling import SamplingConfig
from nereus.runtime.rl.fused_rollout import RolloutEvent, fused_rollout
from nereus.runtime.rl.inter_stage import migration_settings
from nereus.runtime.rl.stages import ModelStageRuntime, Rollout, by_replica, local_state_bytes, rollout_batch
from nereus.runtime.rl.timing import timed
from nereus.runtime.state.sharded_state import even_split
from nereus.spec.plan import Fusion, Plan


def rollout(
    plan: Plan,
    stages: dict[str, ModelStageRuntime],
    prompts: list[list[int]],
    sampling: SamplingConfig,
    fusion: Fusion,
    seconds: dict[str, float],
    events: list[RolloutEvent],
    idle: Callable[[], None] | None = None,
) -> Rollout:
    """Every prompt's response (collective), fused or not as `fusion` says; the fused rollout's
    events on this rank are appended to `events`. ReMax also generates greedily (its baseline).
    A rank with no part in generation first runs `idle`."""
    inferred = None
    generation = stages["actor/generation"]
    budget = kv_budget(plan, stages)
    if fusion.inter_stage:
        fused = fused_rollout(stages, prompts, sampling, migration_settings(plan, fusion), seconds, kv_budget=budget)
        responses, inferred = fused.responses, fused.inferred
        events.extend(fused.events)
    else:
        with timed(seconds, "actor/generation"):
            responses = generate_responses(generation, prompts, sampling, idle=idle, kv_budget=budget)
    greedy = greedy_batch = None
    if plan.workload.algorithm == "remax":
        with timed(seconds, "actor/generation"):
            greedy_sampling = dataclasses.replace(sampling, temperature=0.0)
            greedy = generate_responses(generation, prompts, greedy_sampling, kv_budget=budget)
        greedy_batch = rollout_batch(prompts, greedy, sampling.pad_token_id)
    batch = rollout_batch(prompts, responses, sampling.pad_token_id)
    return Rollout(responses, batch, inferred, greedy, greedy_batch)


def generate_responses(
    stage: ModelStageRuntime,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    budgets: list[int] | None = None,
    idle: Callable[[], None] | None = None,
    kv_budget: KVBudget | None = None,
) -> list[list[int]]:
    """Every prompt's response, each replica sampling its contiguous share; prompt i is sample
    i (its tokens come from its own generator, whichever replica decodes it) and stops after
    `budgets[i]` tokens when given. A rank with no part in generation first runs `idle`;
    `kv_budget` bounds each replica's KV pool (default: room for its share at the longest)."""
    engine = stage.engine
    mine = None
    if engine is None and idle is not None:
        idle()
    if engine is not None:
        start, stop = even_split(len(prompts), stage.layout.dp)[engine.groups.replica]
        if stop > start:
            share = None if budgets is None else budgets[start:stop]
            mine = generate(engine, prompts[start:stop], sampling, range(start, stop), share, kv_budget).responses()
        else:
            mine = []
    return [response for share in by_replica(stage, mine) for response in share]


def kv_budget(plan: Plan, stages: dict[str, ModelStageRuntime]) -> KVBudget:
    """The generation replicas' KV pool on this rank: the plan's `kv_budget_bytes` (None: room
    for every sample), within the rank's memory (CUDA: the device's free memory; CPU: the
    cluster's per-GPU memory less the engine states resident on this rank)."""
    entry = stages["actor/generation"].plan
    return KVBudget(entry.kv_budget_bytes, plan.cluster.gpu.memory_bytes, local_state_bytes(stages))

"""Phase 1 of a step, generation: each actor/generation replica samples responses for its
share of the prompts, or, under inter-stage fusion, the fused rollout (`fused_rollout`)
generates them and runs the inference model-stages on the samples as they finish. A replica
is nereus's own engine, or a vLLM engine (`generation.engine: vllm`), which also gives the
log-probability it sampled every response token with (`Rollout.rollout_log_probs`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from nereus.cost.vllm_engine import engine_sleep_level
from nereus.runtime.comm.world import device
from nereus.runtime.generation.engine_choice import generation_engine, max_model_len, one_sequence_kv_bytes
from nereus.runtime.generation.generate import generate
from nereus.runtime.generation.kv_cache import KVBudget, memory_left
from nereus.runtime.generation.sampling import SamplingConfig
from nereus.runtime.generation.vllm_engine import VLLMEngine, sleep_mode_available, start_engine
from nereus.runtime.model.transformer import Batch
from nereus.runtime.rl.fused_rollout import RolloutEvent, fused_rollout
from nereus.runtime.rl.inter_stage import migration_settings
from nereus.runtime.rl.stages import ModelStageRuntime, Rollout, by_replica, local_state_bytes, rollout_batch
from nereus.runtime.rl.timing import timed
from nereus.runtime.state.sharded_state import even_split
from nereus.spec.plan import Fusion, Plan
from nereus.spec.run_config import RunConfig
from nereus.spec.stages import ACTOR_GENERATION


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
    inferred = engine_log_probs = engine_routes = None
    generation = stages[ACTOR_GENERATION]
    budget = kv_budget(plan, stages)
    if fusion.inter_stage:
        fused = fused_rollout(stages, prompts, sampling, migration_settings(plan, fusion), seconds, kv_budget=budget)
        responses, inferred, engine_log_probs = fused.responses, fused.inferred, fused.log_probs
        events.extend(fused.events)
    else:
        with timed(seconds, ACTOR_GENERATION):
            responses, engine_log_probs, engine_routes = sampled(
                generation, prompts, sampling, idle=idle, kv_budget=budget
            )
    greedy = greedy_batch = None
    if plan.workload.algorithm == "remax":
        with timed(seconds, ACTOR_GENERATION):
            greedy_sampling = dataclasses.replace(sampling, temperature=0.0)
            greedy = sampled(generation, prompts, greedy_sampling, kv_budget=budget)[0]
        greedy_batch = rollout_batch(prompts, greedy, sampling.pad_token_id)
    if generation.rollout_engine is not None:  # a colocated pool's vLLM engine frees its GPU memory
        generation.rollout_engine.sleep()
    batch = rollout_batch(prompts, responses, sampling.pad_token_id)
    behaviour = None if engine_log_probs is None else token_aligned(prompts, engine_log_probs, batch.tokens.shape)
    routes = None
    if engine_routes is not None:  # what vLLM's decoding routed to
        routes = routes_aligned(prompts, engine_routes, batch.tokens.shape)
    elif generation.model.moe is not None and generation.rollout_engine is None and not fusion.inter_stage:
        with timed(seconds, ACTOR_GENERATION):
            routes = replica_routing(generation, batch)
    return Rollout(responses, batch, inferred, greedy, greedy_batch, behaviour, routes)


def replica_routing(stage: ModelStageRuntime, batch: Batch) -> torch.Tensor:
    """`Engine.routing` of the whole batch, each replica of `stage` on its rows (collective)."""
    engine = stage.engine
    mine = None if engine is None else engine.routing(engine.replica_rows(batch))
    return torch.cat(by_replica(stage, mine))


def sampled(
    stage: ModelStageRuntime,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    budgets: list[int] | None = None,
    idle: Callable[[], None] | None = None,
    kv_budget: KVBudget | None = None,
) -> tuple[list[list[int]], list[list[float]] | None, list[torch.Tensor] | None]:
    """Every prompt's response, each replica sampling its contiguous share; prompt i is sample
    i (its tokens come from its own generator, whichever replica decodes it) and stops after
    `budgets[i]` tokens when given. A rank with no part in generation first runs `idle`;
    `kv_budget` bounds each replica's KV pool (default: room for its share at the longest).
    With the responses: the engine's log-probability of every response token when a
    vLLM engine sampled them (None from nereus's own engine: the trainer's are the reference) and
    the experts its decoding routed every position of each sequence to (`Generated.routes`; None
    from nereus's own engine or a dense model)."""
    engine = stage.engine
    mine: tuple[list[list[int]], list[list[float]] | None, list[torch.Tensor] | None] | None = None
    if engine is None and idle is not None:
        idle()
    if engine is not None:
        start, stop = even_split(len(prompts), stage.layout.dp)[engine.groups.replica]
        share = None if budgets is None else budgets[start:stop]
        if stage.rollout_engine is not None:
            assert stage.rollout_engine.replica == engine.groups.replica, "checked when the engine started"
            generated = stage.rollout_engine.generate(prompts[start:stop], sampling, range(start, stop), share)
            mine = (generated.responses, generated.log_probs, generated.routes)
        elif stop > start:
            responses = generate(
                engine, prompts[start:stop], sampling, range(start, stop), share, kv_budget
            ).responses()
            mine = (responses, None, None)
        else:
            mine = ([], None, None)
    shares = by_replica(stage, mine)
    responses = [response for part, _, _ in shares for response in part]
    log_probs = routes = None
    if all(part is not None for _, part, _ in shares):
        log_probs = [row for _, part, _ in shares for row in part]
    if all(part is not None for _, _, part in shares):
        routes = [row for _, _, part in shares for row in part]
    return responses, log_probs, routes


def routes_aligned(prompts: list[list[int]], rows: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """Per-position routing (`Generated.routes`: position p of prompt plus response) as a
    [b, t, layers, k] `moe.ROUTES_FIELD` tensor over the rollout batch (`rollout_batch`'s
    columns: prompts left-padded to the widest), -1 where nothing was routed."""
    width = max(len(prompt) for prompt in prompts)
    layers, top_k = rows[0].shape[1:]
    aligned = torch.full((*shape, layers, top_k), -1, dtype=torch.long)
    for row, (prompt, routed) in enumerate(zip(prompts, rows, strict=True)):
        start = width - len(prompt)
        aligned[row, start : start + routed.shape[0]] = routed
    return aligned


def token_aligned(prompts: list[list[int]], rows: list[list[float]], shape: torch.Size) -> torch.Tensor:
    """Per-response-token values as a [b, t] tensor over the rollout batch (`rollout_batch`'s
    columns: prompts left-padded to the widest, responses after it), zero elsewhere."""
    width = max(len(prompt) for prompt in prompts)
    aligned = torch.zeros(shape, dtype=torch.float32)
    for row, values in enumerate(rows):
        aligned[row, width : width + len(values)] = torch.tensor(values, dtype=torch.float32)
    return aligned


def start_rollout_engine(config: RunConfig, plan: Plan, stages: dict[str, ModelStageRuntime]) -> VLLMEngine | None:
    """Under `generation.engine: vllm` (or `auto` resolving to it), start this rank's vLLM
    engine of actor/generation and attach it to the stage (collective over the world: every
    rank is in one engine, `engine_choice.vllm_problem`); None under nereus's own engine.
    Its KV pool: `rollout_kv_bytes`. It sleeps after each rollout where a training model-stage
    shares its GPUs and vLLM has a sleep mode (`engine_sleep_level`; not on CPUs, where its
    pool stays allocated)."""
    on_cuda = device().type == "cuda"
    if generation_engine(config, plan, on_cuda) != "vllm":
        return None
    stage = stages[ACTOR_GENERATION]
    assert stage.engine is not None and plan.weights is not None, "checked before the ranks started"
    entry = stage.plan
    engine = start_engine(
        Path(plan.weights["actor"]),
        entry.tp,
        stage.compute_dtype,
        rollout_kv_bytes(plan, stages),
        max_model_len(plan),
        config.rl.seed,
        stage.engine.groups.tp.group,
        engine_sleep_level(plan, on_cuda and sleep_mode_available()),
        moe=stage.model.moe is not None,
    )
    assert engine.replica == stage.engine.groups.replica, (engine.replica, stage.engine.groups.replica)
    stage.rollout_engine = engine
    return engine


def rollout_kv_bytes(plan: Plan, stages: dict[str, ModelStageRuntime]) -> int:
    """The KV pool of this rank's vLLM engine: the plan's `kv_budget_bytes`, else room for the
    replica's share of the step's samples at the model's longest, within the rank's memory."""
    entry, workload = stages[ACTOR_GENERATION].plan, plan.workload
    if entry.kv_budget_bytes is not None:
        return entry.kv_budget_bytes
    samples = -(-workload.prompts_per_step * workload.samples_per_prompt // entry.dp)
    room = memory_left(kv_budget(plan, stages), device())
    return int(max(one_sequence_kv_bytes(plan), min(samples * one_sequence_kv_bytes(plan), room)))


def kv_budget(plan: Plan, stages: dict[str, ModelStageRuntime]) -> KVBudget:
    """The generation replicas' KV pool on this rank: the plan's `kv_budget_bytes` (None: room
    for every sample), within the rank's memory (CUDA: the device's free memory; CPU: the
    cluster's per-GPU memory less the engine states resident on this rank)."""
    entry = stages[ACTOR_GENERATION].plan
    return KVBudget(entry.kv_budget_bytes, plan.cluster.gpu.memory_bytes, local_state_bytes(stages))

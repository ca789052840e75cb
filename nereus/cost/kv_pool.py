"""The generation engine's KV pool in the cost model's terms (no torch).

`nereus.runtime.generation.kv_cache` sizes a replica's pool per rank: the plan's `kv_budget_bytes`
capped by the memory left after the states resident on the rank times MEMORY_UTILISATION,
in whole blocks of BLOCK_TOKENS tokens of the engine's KV dtype, never more blocks than the
replica's sequences need at their longest. A plan that leaves `kv_budget_bytes` unset is
priced unbounded by the planner, which is right while the batch fits that pool; when it does
not (a plan kept past the lengths it was made for, as the fixed policy keeps it), the engine
runs in waves. `engine_budget` is the budget the continuous-batching term must price then:
the pool's tokens, as bytes at the cost model's bytes per token.

A token's KV bytes on a rank come from `nereus.cost.stage.kv_bytes_per_token`, the one formula
the engine's cache, this pool (at KV_ELEMENT_BYTES) and the cost model (at the workload's dtype) share.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from nereus.cost.calibration import DEFAULT_CALIBRATION
from nereus.cost.stage import kv_bytes_per_token
from nereus.spec.plan import Plan, StagePlan
from nereus.spec.stages import ACTOR_GENERATION

#: Tokens per KV block (vLLM's default block size).
BLOCK_TOKENS = 16
#: Share of a rank's free memory the pool may take (vLLM's gpu_memory_utilization default).
MEMORY_UTILISATION = 0.9
#: Bytes per KV element: the engine's cache is fp32, its compute dtype.
KV_ELEMENT_BYTES = 4


def pool_tokens(budget_bytes: int | None, memory_left_bytes: float, bytes_per_token: int) -> int:
    """Tokens of the pool: whole blocks within the budget (None: none) and the memory left."""
    allowed = min(math.inf if budget_bytes is None else budget_bytes, memory_left_bytes * MEMORY_UTILISATION)
    return int(max(0.0, allowed) // (BLOCK_TOKENS * bytes_per_token)) * BLOCK_TOKENS


def batch_tokens(plan: Plan, entry: StagePlan) -> int:
    """Tokens (whole blocks) a generation replica's batch holds at its longest."""
    w = plan.workload
    per_sequence = -(-(w.prompt_len + w.response_len.max) // BLOCK_TOKENS) * BLOCK_TOKENS
    return -(-w.samples_per_step // entry.dp) * per_sequence


def engine_budget(plan: Plan, engineless: Collection[str] = ()) -> int | None:
    """The KV budget (bytes per GPU at the cost model's bytes per token) that prices the engine's
    pool for actor/generation when it cannot hold the replica's batch; None when it can (or the
    plan generates nothing). The states resident on a GPU are the cost model's (`resident_states`),
    of every model-stage there but those in `engineless` (a rule-scored reward runs no engine);
    the smallest pool over the generation's GPUs binds (the step waits for its slowest replica)."""
    from nereus.cost.plan_cost import stage_cost_model

    entry = next((e for e in plan.stages if e.model_stage == ACTOR_GENERATION), None)
    if entry is None:
        return None
    calibration = DEFAULT_CALIBRATION  # states and bytes per token do not depend on it
    resident: dict[int, float] = {}
    for other in plan.stages:
        if other.model_stage not in engineless:
            states = resident_states(plan, other)
            for gpu in other.gpus:
                resident[gpu] = resident.get(gpu, 0.0) + states
    model = plan.model(plan.workload.model_name(entry.role))
    per_token = kv_bytes_per_token(model, entry.tp, entry.pp, KV_ELEMENT_BYTES)
    left = plan.cluster.gpu.memory_bytes - max(resident.get(gpu, 0.0) for gpu in entry.gpus)
    tokens = pool_tokens(entry.kv_budget_bytes, left, per_token)
    if tokens >= batch_tokens(plan, entry):
        return None
    cost_bytes = stage_cost_model(plan, entry.role, entry.stage, calibration).kv_bytes_per_token(entry.tp, entry.pp)
    return max(1, math.floor(tokens * float(cost_bytes)))


def resident_states(plan: Plan, entry: StagePlan) -> float:
    """Bytes per GPU of a model-stage's states that stay resident (as `evaluate_plan` counts them)."""
    from nereus.cost.plan_cost import split_resident, stage_choices, stage_cost_model

    model = stage_cost_model(plan, entry.role, entry.stage, DEFAULT_CALIBRATION)
    memory = model.memory_terms(
        entry.tp, entry.pp, entry.dp, entry.micro_batches, token_budget=entry.token_budget or 0, **stage_choices(entry)
    )
    return float(split_resident(memory, entry.offload)[0])

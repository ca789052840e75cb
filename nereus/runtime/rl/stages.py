"""The model-stages of a plan on this rank, and the rows their replicas exchange.

Each model-stage of the plan gets its own engine on its EMUs' ranks (GPU id = rank), built
from the same init seed, so actor/generation, actor/inference and actor/training start from
the same weights and the reference stays at them.

Rows move between model-stages through the world (an object all-gather): every rank ends each
phase with the whole batch, so any placement (colocated or split pools) works the same way.
Under async execution each model-stage's exchanges stay inside its pool (`ModelStageRuntime.pool`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nereus.runtime.comm import collectives
from nereus.runtime.generation.vllm_engine import VLLMEngine
from nereus.runtime.hf.names import OPTIONAL
from nereus.runtime.model.adamw import AdamWConfig, stage_precision
from nereus.runtime.model.engine import Engine, EngineConfig
from nereus.runtime.model.moe import ROUTES_FIELD
from nereus.runtime.model.transformer import Batch
from nereus.runtime.state.shard_layout import RankLayout, stage_layout
from nereus.runtime.state.sharded_state import (
    StateMeta,
    shards_across_dp,
    stage_dp_sharded,
    state_dtypes,
    state_meta,
)
from nereus.spec.model import Head, Model
from nereus.spec.plan import Plan, StagePlan
from nereus.spec.run_config import RLConfig
from nereus.spec.stages import ROLE_INFO, Role, head_of


@dataclass
class ModelStageRuntime:
    """One model-stage on this rank: its plan entry, layout and engine (None off its ranks)."""

    plan: StagePlan
    model: Model
    head: Head
    layout: RankLayout
    engine: Engine | None
    dtypes: dict[str, str]
    """The dtype of each state family its engine holds (`sharded_state.state_dtypes`)."""
    dp_sharded: frozenset[str]
    """The families its engine shards across dp (ZeRO-1, full sharding; `sharded_state.stage_dp_sharded`)."""
    rollout_engine: VLLMEngine | None = None
    """actor/generation under `generation.engine: vllm`: this rank's vLLM engine, which samples
    the responses; `engine` then holds the weights the sync fills and pushes into it."""
    pool: tuple[int, ...] | None = None
    """The ranks its rows are exchanged over (`by_replica_of`): None, the world; under async
    execution the ranks of its pool (generation's or training's), so neither pool waits on the
    other's gathers (`nereus.runtime.run.async_loop`)."""

    @property
    def compute_dtype(self) -> str:
        """The dtype its engine computes in (gradients are held in it)."""
        return self.dtypes["grad"]

    def meta(self, families: tuple[str, ...]) -> StateMeta:
        """The shard metadata of this model-stage's state `families`."""
        return state_meta(self.model, self.head, self.layout, families, self.dtypes, self.dp_sharded)


def build_stages(plan: Plan, config: RLConfig) -> dict[str, ModelStageRuntime]:
    """Every model-stage's engine (collective: every rank builds them in plan order). The
    reward stage gets an engine only under `reward: model`; the rule needs no model."""
    stages: dict[str, ModelStageRuntime] = {}
    for entry in plan.stages:
        role: Role = entry.role
        if not config.runs_engine(role):
            continue
        info = ROLE_INFO[role]
        engine_config = EngineConfig(
            optimizer=AdamWConfig(lr=getattr(config, info.lr_field), eps=config.adam_eps),
            init_seed=config.seed + info.seed_offset,
            # Weights a Hugging Face folder provides are read into the engine, not seeded first.
            init_only=OPTIONAL if plan.weights is not None and role in plan.weights else None,
            precision=stage_precision(plan.workload, entry.stage, config.grad_reduce_dtype),
            shard_across_dp=shards_across_dp(plan.workload, entry),
            full_shard=entry.full_shard,
            recompute=entry.recompute,
            token_budget=entry.token_budget,
            offload=entry.offload,
            train_offload=entry.train_offload if entry.stage == "training" else "none",
            cp_method=entry.cp_method,
        )
        model = plan.model(plan.workload.model_name(role))
        head = head_of(role)
        layout = stage_layout(entry)
        engine = Engine.create(model, head, layout, engine_config)
        dtypes = state_dtypes(plan.workload, entry.stage)
        sharded = stage_dp_sharded(plan.workload, entry)
        stages[entry.model_stage] = ModelStageRuntime(entry, model, head, layout, engine, dtypes, sharded)
    return stages


def engine_state(engine: Engine, families: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The engine's live tensors of `families` (keyed `family/name`)."""
    return {key: tensor for key, tensor in engine.local_state().items() if key.split("/")[0] in families}


def local_state_bytes(stages: dict[str, ModelStageRuntime]) -> int:
    """Bytes of engine state this rank holds (16-bit weights and their fp32 masters alike)."""
    return sum(sum(stage.engine.state_bytes().values()) for stage in stages.values() if stage.engine is not None)


def local_host_bytes(stages: dict[str, ModelStageRuntime]) -> int:
    """Bytes of engine state this rank keeps in host memory (offload, training-time offload)."""
    return sum(sum(stage.engine.host_bytes().values()) for stage in stages.values() if stage.engine is not None)


def sleep_offloaded(stages: dict[str, ModelStageRuntime]) -> None:
    """Put every offloaded model-stage's engine on this rank to sleep (its state in host memory)."""
    for stage in stages.values():
        if stage.engine is not None:
            stage.engine.sleep()


# ---- the rows of a step, and moving them between ranks ----


def rollout_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> Batch:
    """Prompts left-padded and responses right-padded into one batch; `loss_mask` marks responses."""
    prompt_width = max(len(p) for p in prompts)
    response_width = max(len(r) for r in responses)
    # Padded as lists and made tensors at once: one tensor per row costs more than the rows.
    rows = [
        [pad_id] * (prompt_width - len(prompt)) + prompt + response + [pad_id] * (response_width - len(response))
        for prompt, response in zip(prompts, responses, strict=True)
    ]
    tokens = torch.tensor(rows, dtype=torch.long).view(len(prompts), prompt_width + response_width)
    columns = torch.arange(prompt_width + response_width)
    starts = torch.tensor([prompt_width - len(prompt) for prompt in prompts]).unsqueeze(1)
    ends = torch.tensor([prompt_width + len(response) for response in responses]).unsqueeze(1)
    attention = (columns >= starts) & (columns < ends)
    loss_mask = ((columns >= prompt_width) & (columns < ends)).to(torch.float32)
    return Batch(tokens, attention, {"loss_mask": loss_mask})


@dataclass(frozen=True)
class Rollout:
    """What generation hands to the later phases: the responses and the batch of their rows."""

    responses: list[list[int]]
    batch: Batch
    """`rollout_batch` of the prompts and the responses."""
    inferred: dict[str, torch.Tensor] | None = None
    """The inference model-stages' rows the fused rollout already computed (None unfused)."""
    greedy: list[list[int]] | None = None
    """ReMax's greedy responses, its baseline (None under the other algorithms)."""
    greedy_batch: Batch | None = None
    """`rollout_batch` of the prompts and the greedy responses."""
    rollout_log_probs: torch.Tensor | None = None
    """[b, t] the generation engine's log-probability of every response token, aligned as the
    trainer's old log-probs (vLLM's raw log-probs; None from nereus's own engine)."""
    routes: torch.Tensor | None = None
    """[b, t, MoE layers, experts_per_token] the experts the generation engine routed each token
    to (`moe.ROUTES_FIELD`; None for a dense model, vLLM or the fused rollout)."""


def without_routes(batch: Batch) -> Batch:
    """`batch` without the rollout's routing (`moe.ROUTES_FIELD`): what the models that do not
    replay it (reference, critic, reward) see."""
    if ROUTES_FIELD not in batch.fields:
        return batch
    fields = {name: tensor for name, tensor in batch.fields.items() if name != ROUTES_FIELD}
    return Batch(batch.tokens, batch.attention_mask, fields, batch.first_column)


def leads(stage: ModelStageRuntime) -> bool:
    """Whether this rank speaks for its replica of `stage` in exchanges (its first rank)."""
    engine = stage.engine
    groups = None if engine is None else engine.groups
    firsts = (groups.pp_rank, groups.tp.rank, groups.cp.rank, groups.ep.rank) if groups is not None else (1,)
    return not any(firsts)


def by_replica(stage: ModelStageRuntime, value: Any) -> list[Any]:
    """Each replica's `value` (from its first rank) on every world rank, in replica order."""
    return by_replica_of({"": stage}, {"": value})[""]


def by_replica_of(stages: Mapping[str, ModelStageRuntime], values: Mapping[str, Any]) -> dict[str, list[Any]]:
    """`by_replica` of every named stage and its value at once: one object gather."""
    mine = {}
    for name, stage in stages.items():
        if leads(stage):
            assert stage.engine is not None
            mine[name] = (stage.engine.groups.replica, values[name])
    pools = {stage.pool for stage in stages.values()}
    assert len(pools) <= 1, f"one exchange spans one pool, got {pools}"
    pool = pools.pop() if pools else None
    size = dist.get_world_size() if pool is None else len(pool)
    gathered: list[Any] = [mine]
    if size > 1:  # alone, the gather (a pickle round trip) would only cost time
        gathered = collectives.all_gathered_objects(mine, None if pool is None else collectives.subgroup(pool))
    out = {}
    for name, stage in stages.items():
        parts = sorted((rank_parts[name] for rank_parts in gathered if name in rank_parts), key=lambda p: p[0])
        assert [replica for replica, _ in parts] == list(range(stage.layout.dp)), (name, parts)
        out[name] = [part for _, part in parts]
    return out

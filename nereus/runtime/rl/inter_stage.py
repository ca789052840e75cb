"""What inter-stage fusion needs from a plan, settled before any rank is spawned (no torch).

`inter_stage_problems` says why the fused rollout cannot run a plan (admission reports each
under `fusion.inter_stage`); `migration_settings` resolves the threshold (the plan's, or the best of
`nereus schedule migrate` for the plan) and the cost model's per-token migration costs,
from which `migration_mechanism` picks KV-cache transfer or prefix recompute.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from nereus.errors import NereusError
from nereus.solver.migration import GenerationProfile, generation_profile, sweep_thresholds
from nereus.spec.plan import Fusion, Plan
from nereus.spec.run_config import RLConfig
from nereus.spec.stages import ACTOR_GENERATION, INFERENCE_STAGES, role_of


def _ranks_by_replica(plan: Plan, model_stage: str) -> list[set[int]]:
    entry = plan.stage_plan(model_stage)
    size = entry.replica_size
    gpus = list(entry.gpus)
    return [set(gpus[d * size : (d + 1) * size]) for d in range(entry.dp)]


def inter_stage_problems(plan: Plan, fusion: Fusion, config: RLConfig) -> list[str]:
    """Why the fused rollout cannot run this plan (empty when it can)."""
    if not fusion.inter_stage:
        return []
    names = {entry.model_stage for entry in plan.stages}
    if ACTOR_GENERATION not in names:
        return ["the plan has no actor/generation stage"]
    generation = plan.stage_plan(ACTOR_GENERATION)
    if generation.dp < 2:
        return [
            f"needs actor/generation dp >= 2 to migrate the long tail to fewer replicas (the plan has dp="
            f"{generation.dp}); give it at least two EMUs or set inter_stage: false"
        ]
    problems = []
    early = [
        name
        for name in INFERENCE_STAGES
        if name in names
        and config.runs_engine(role_of(name))
        # Some replica avoids each generation replica: whichever replica keeps the tail, one can start early.
        and all(
            any(not ranks & busy for ranks in _ranks_by_replica(plan, name))
            for busy in _ranks_by_replica(plan, ACTOR_GENERATION)
        )
    ]
    if not early:
        problems.append(
            "no inference model-stage has a replica clear of every actor/generation EMU's GPUs, so none could "
            "start early; give one an EMU per generation EMU or set inter_stage: false"
        )
    try:
        threshold = migration_settings(plan, fusion).threshold
    except NereusError as error:
        return [*problems, f"the migration simulator cannot model this plan: {error}"]
    if math.floor(threshold * plan.workload.samples_per_step) < 1:
        problems.append(
            f"migration_threshold {threshold:g} x {plan.workload.samples_per_step} samples per step is under one "
            "sample, so the tail never migrates; raise migration_threshold"
        )
    return problems


@dataclass(frozen=True)
class MigrationSettings:
    """When the long tail migrates and what moving it costs, for one plan."""

    threshold: float
    """Fraction of the batch still generating at which it migrates."""
    profile: GenerationProfile
    """The plan's decode and migration costs (the cost model's)."""


def migration_settings(plan: Plan, fusion: Fusion) -> MigrationSettings:
    """The plan's threshold (None: the best of `nereus schedule migrate` with its defaults)."""
    return _settings(plan.model_dump_json(), fusion.migration_threshold)


@functools.lru_cache(maxsize=8)
def _settings(plan_json: str, threshold: float | None) -> MigrationSettings:
    # Keyed by the plan's JSON: every step of a run asks, the sweep takes a fraction of a second.
    plan = Plan.model_validate_json(plan_json)
    profile = generation_profile(plan)
    if threshold is None:
        threshold = sweep_thresholds(profile).best.threshold
    return MigrationSettings(threshold, profile)


def migration_mechanism(profile: GenerationProfile, context_tokens: int, num_transfers: int) -> str:
    """`kv-transfer` or `recompute`, whichever the cost model says moves `context_tokens` of
    cache in `num_transfers` messages faster (the simulator's rule)."""
    transfer = num_transfers * profile.transfer_latency_s
    transfer += context_tokens * profile.kv_bytes_per_token / profile.transfer_bytes_per_s
    recompute = context_tokens * profile.prefill_s_per_token
    return "kv-transfer" if transfer <= recompute else "recompute"

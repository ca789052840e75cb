"""Phases 3 to 5 of a step: advantages, training, weight sync.

3. advantages: PPO (KL-penalised token rewards + GAE), GRPO (group-relative) or ReMax
   (greedy baseline, scored from the rollout's extra greedy generation);
4. training: actor (clipped surrogate) and critic (clipped value loss), by mini-batches, or
   both together in the fused pipeline under intra-stage fusion;
5. weight sync: every `WEIGHT_SYNCS` pair of the plan (actor/training -> actor/generation
   and actor/inference, critic/training -> critic/inference), through the resharder.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nereus.runtime.comm import collectives
from nereus.runtime.hf.names import hf_tensors
from nereus.runtime.model.fused_pipeline import FusedPart, OpTiming
from nereus.runtime.model.fused_schedule import fused_schedule
from nereus.runtime.model.transformer import Batch
from nereus.runtime.rl.algorithms import (
    BehaviourCorrection,
    broadcast_to_tokens,
    gae,
    group_advantages,
    masked_whiten,
    remax_advantages,
    token_rewards,
)
from nereus.runtime.rl.datasets import Prompt
from nereus.runtime.rl.objectives import ClippedValueObjective, PolicyObjective
from nereus.runtime.rl.optimization import UpdateRule, apply_update, fused_update
from nereus.runtime.rl.rewards import Scorer
from nereus.runtime.rl.scoring import Scored, reward_of
from nereus.runtime.rl.stages import ModelStageRuntime, Rollout, by_replica, by_replica_of, without_routes
from nereus.runtime.rl.timing import timed
from nereus.runtime.state.reshard import ReshardResult, execute
from nereus.runtime.state.reshard_plan import ReshardPlan, plan_reshard
from nereus.runtime.state.sharded_state import StateMeta, even_split, state_meta
from nereus.spec.plan import Fusion, Plan
from nereus.spec.run_config import RLConfig
from nereus.spec.stages import ACTOR_INFERENCE, ACTOR_TRAINING, CRITIC_TRAINING, WEIGHT_SYNCS
from nereus.spec.workload import Workload

if TYPE_CHECKING:
    from nereus.spec.schedule import Schedule

#: A weight sync: the source model-stage, the target and the resharding plan between them.
WeightSync = tuple[ModelStageRuntime, ModelStageRuntime, ReshardPlan]


# ---- 3. advantages ----


def advantages_of(
    workload: Workload,
    config: RLConfig,
    stages: dict[str, ModelStageRuntime],
    scorer: Scorer,
    problems: list[Prompt],
    rollout: Rollout,
    scored: Scored,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages, and the critic's returns under PPO (None otherwise); under ReMax
    the greedy responses are scored first (collective where a reward model scores them)."""
    mask = scored.mask
    if workload.algorithm == "ppo":
        assert scored.old_values is not None and scored.old_log_probs is not None
        rewards = token_rewards(scored.scores, mask, scored.old_log_probs, scored.ref_log_probs, config.kl_coef)
        advantages, returns = gae(rewards, scored.old_values, mask, config.gamma, config.lam)
        return masked_whiten(advantages, mask), returns
    if workload.algorithm == "grpo":
        return broadcast_to_tokens(group_advantages(scored.scores, workload.samples_per_prompt), mask), None
    assert workload.algorithm == "remax", workload.algorithm
    assert rollout.greedy is not None and rollout.greedy_batch is not None
    greedy_scores = reward_of(stages, scorer, problems, rollout.greedy_batch, rollout.greedy)
    return broadcast_to_tokens(remax_advantages(scored.scores, greedy_scores), mask), None


# ---- 4. training ----


def run_training(
    plan: Plan,
    config: RLConfig,
    stages: dict[str, ModelStageRuntime],
    rollout: Rollout,
    scored: Scored,
    advantages: torch.Tensor,
    returns: torch.Tensor | None,
    seconds: dict[str, float],
    fusion: Fusion,
    rules: dict[str, UpdateRule],
    schedule: Schedule | None = None,
) -> tuple[tuple[float, float | None], torch.Tensor | None, dict[str, float], list[OpTiming]]:
    """Actor and critic updates on the rollout's batch, each under its model-stage's rule in
    `rules`, then one exchange of their losses and gradient norms (so a critic on its own pool
    trains while the actor does); the mean actor and critic losses, the old log-probs when
    `scored` has none (`old_log_probs_from_training`: the training forward's, on every rank),
    the mean gradient norm (before clipping) of each trained model-stage, and each fused op's
    timing on this rank.

    Under `fusion.intra_stage` both train together in the fused pipeline, mini-batch by
    mini-batch (`fused_training`, under `schedule`); otherwise no op is timed.
    """
    workload, batch = plan.workload, rollout.batch
    norms: dict[str, list[float]] = {}
    fields = {"ref_log_probs": scored.ref_log_probs, "advantages": advantages}
    current_as_old = None
    if scored.old_log_probs is None:
        assert workload.ppo_epochs == workload.mini_batches == 1, "old log-probs from the one update only"
        current_as_old = torch.zeros_like(scored.ref_log_probs)
        fields["row_index"] = torch.arange(batch.num_rows)
    else:
        fields["old_log_probs"] = scored.old_log_probs
    correction = correction_of(config, workload)
    if correction != "none":
        assert rollout.rollout_log_probs is not None, "a correction is refused without the behaviour log-probs"
        fields["rollout_log_probs"] = rollout.rollout_log_probs
    actor = stages[ACTOR_TRAINING]
    kl_loss_coef = 0.0 if workload.algorithm == "ppo" else config.kl_loss_coef
    objective = PolicyObjective(
        config.clip_eps, kl_loss_coef, config.entropy_coef, config.loss_agg_mode, current_as_old, correction,
        config.tis_cap, config.router_aux_loss_coef,
    )  # fmt: skip
    actor_batch = Batch(batch.tokens, batch.attention_mask, {**batch.fields, **fields})
    critic = stages.get(CRITIC_TRAINING)
    critic_losses = None
    op_timings: list[OpTiming] = []
    if critic is not None:
        assert scored.old_values is not None and returns is not None, "a critic is trained under ppo only"
        critic_fields = {**without_routes(batch).fields, "old_values": scored.old_values, "returns": returns}
        critic_batch = Batch(batch.tokens, batch.attention_mask, critic_fields)
        value_objective = ClippedValueObjective(config.value_clip_eps, config.loss_agg_mode)
    if fusion.intra_stage:
        assert critic is not None, "intra-stage fusion needs a critic (refused with the plan otherwise)"
        actor_job = (actor, actor_batch, objective)
        critic_job = (critic, critic_batch, value_objective)
        actor_losses, critic_losses, op_timings = fused_training(
            plan, actor_job, critic_job, seconds, rules, norms, schedule
        )
    else:
        with timed(seconds, ACTOR_TRAINING):
            actor_losses = local_train(
                actor, actor_batch, objective, workload.mini_batches, workload.ppo_epochs, rules[ACTOR_TRAINING], norms
            )
        if critic is not None:
            with timed(seconds, CRITIC_TRAINING):
                critic_losses = local_train(
                    critic, critic_batch, value_objective, workload.mini_batches, workload.ppo_epochs,
                    rules[CRITIC_TRAINING], norms,
                )  # fmt: skip
    with timed(seconds, "exchange"):
        cp = None if actor.engine is None else actor.engine.groups.cp
        if current_as_old is not None and cp is not None and cp.group is not None:
            collectives.all_reduce(current_as_old, cp.group)  # each cp rank wrote its own columns' log-probs
        # Each trained model-stage, its losses and its replica's share of the old log-probs.
        trained: dict[str, tuple[ModelStageRuntime, list[float], torch.Tensor | None]] = {
            ACTOR_TRAINING: (actor, actor_losses, replica_share(actor, current_as_old))
        }
        if critic is not None and critic_losses is not None:
            trained[CRITIC_TRAINING] = (critic, critic_losses, None)
        mine = {
            name: (mean_loss(part), mean_loss(norms.get(name, [])), share) for name, (_, part, share) in trained.items()
        }
        gathered = by_replica_of({name: stage for name, (stage, _, _) in trained.items()}, mine)
        # Every replica reports the global batch's loss and the global norm; take the first.
        means = {name: values[0][:2] for name, values in gathered.items()}
    grad_norms = {name: norm for name, (_, norm) in means.items()}
    old_log_probs = None if current_as_old is None else torch.cat([share for *_, share in gathered[ACTOR_TRAINING]])
    losses = (means[ACTOR_TRAINING][0], means[CRITIC_TRAINING][0] if CRITIC_TRAINING in means else None)
    return losses, old_log_probs, grad_norms, op_timings


def correction_of(config: RLConfig, workload: Workload) -> BehaviourCorrection:
    """How the policy loss weighs each token for the policy that sampled it: both corrections
    weigh by the trainer's log-prob over the rollout's (the behaviour policy's, whichever engine
    generated it), so one suffices. `rl.off_policy_correction` where generation overlaps training
    (`Workload.overlaps`: async with max_staleness >= 1) and it is set; `rl.rollout_correction`
    otherwise (a synchronous run trains on-policy, up to the engine's kernels)."""
    if workload.overlaps and config.off_policy_correction != "none":
        return config.off_policy_correction
    return config.rollout_correction


def replica_share(stage: ModelStageRuntime, rows: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's replica's contiguous share of `rows` (its engine's `replica_rows`), or None."""
    if rows is None or stage.engine is None:
        return None
    start, stop = even_split(rows.shape[0], stage.layout.dp)[stage.engine.groups.replica]
    return rows[start:stop]


def idle_model_stages(plan: Plan, fusion: Fusion) -> tuple[str, ...]:
    """Model-stages with an engine that a step does not run: actor/inference where the
    training forward gives the old log-probs (`old_log_probs_from_training`)."""
    return (ACTOR_INFERENCE,) if old_log_probs_from_training(plan, fusion) else ()


def old_log_probs_from_training(plan: Plan, fusion: Fusion) -> bool:
    """Whether the training forward can give the old log-probs instead of an actor/inference
    pass: a critic-free algorithm (its old log-probs feed the ratio alone) whose batch is one
    update (one epoch of one mini-batch) on the weights that sampled it, so the old log-probs
    are the current ones, as verl and TRL use them; unfused (the fused rollout computes them
    as samples finish) and without pipeline stages in training (every rank of a replica then
    holds its rows' log-probs)."""
    workload = plan.workload
    return (
        workload.algorithm != "ppo"
        and workload.ppo_epochs == workload.mini_batches == 1
        and not fusion.inter_stage
        and plan.stage_plan(ACTOR_TRAINING).pp == 1
    )


def local_train(
    stage: ModelStageRuntime,
    batch: Batch,
    objective: Any,
    num_mini_batches: int,
    num_epochs: int,
    rule: UpdateRule | None = None,
    norms: dict[str, list[float]] | None = None,
) -> list[float]:
    """Epochs of mini-batch updates on the whole batch on this rank; each update's loss (none
    off the stage's ranks). With a `rule`, every update clips and sets its learning rate by
    it, and appends its gradient norm to `norms[model-stage]`."""
    engine = stage.engine
    losses = []
    if engine is not None:
        for _ in range(num_epochs):
            for start, stop in even_split(batch.num_rows, num_mini_batches):
                rows = batch.rows(start, stop)
                if rule is None:
                    losses.append(engine.train_step(rows, objective, stage.plan.micro_batches))
                    continue
                engine.zero_grad()
                losses.append(engine.forward_backward(rows, objective, stage.plan.micro_batches))
                norm = apply_update(engine, rule)
                if norms is not None:
                    norms.setdefault(stage.plan.model_stage, []).append(norm)
    return losses


def mean_loss(losses: list[float]) -> float:
    """The mean loss of a rank's updates (0 on a rank that trained nothing)."""
    return float(sum(losses) / max(len(losses), 1))


def train(stage: ModelStageRuntime, batch: Batch, objective: Any, num_mini_batches: int, num_epochs: int) -> float:
    """`local_train`, then the mean loss on every rank (collective)."""
    losses = local_train(stage, batch, objective, num_mini_batches, num_epochs)
    # Every replica reports the global batch's loss; take the first.
    return float(by_replica(stage, mean_loss(losses))[0])


#: A training model-stage, the batch it trains on and its objective.
TrainingJob = tuple[ModelStageRuntime, Batch, Any]


def fused_training(
    plan: Plan,
    actor_job: TrainingJob,
    critic_job: TrainingJob,
    seconds: dict[str, float],
    rules: dict[str, UpdateRule],
    norms: dict[str, list[float]],
    schedule: Schedule | None = None,
) -> tuple[list[float], list[float], list[OpTiming]]:
    """Epochs of mini-batch updates of actor and critic together, each mini-batch one run of
    the plan's fused `schedule` (searched once when the run was set up; None: `fused_schedule`
    searches it here) under `rules`; each update's losses (none off the training ranks) and
    each fused op's timing on this rank, tagged with its update, and its gradient norms into
    `norms`. Both model-stages ran for the whole phase, so `seconds` gets its wall time under
    actor/training and critic/training alike."""
    workload = plan.workload
    (actor, actor_batch, actor_objective), (critic, critic_batch, critic_objective) = actor_job, critic_job
    actor_losses: list[float] = []
    critic_losses: list[float] = []
    op_timings: list[OpTiming] = []
    # Searched outside the timed phase when not given.
    if actor.engine is None:
        schedule = None
    elif schedule is None:
        schedule = fused_schedule(plan)
    with timed(seconds, ACTOR_TRAINING), timed(seconds, CRITIC_TRAINING):
        if schedule is not None:
            assert actor.engine is not None and critic.engine is not None, "fusion trains both on the same ranks"
            mini_batches = even_split(actor_batch.num_rows, workload.mini_batches)
            for update, (start, stop) in enumerate(mini_batches * workload.ppo_epochs):
                parts = [
                    FusedPart("actor", actor.engine, actor_batch.rows(start, stop), actor_objective),
                    FusedPart("critic", critic.engine, critic_batch.rows(start, stop), critic_objective),
                ]
                part_rules = {"actor": rules[ACTOR_TRAINING], "critic": rules[CRITIC_TRAINING]}
                (actor_loss, critic_loss), timings, (actor_norm, critic_norm) = fused_update(
                    parts, schedule, part_rules
                )
                actor_losses.append(actor_loss)
                critic_losses.append(critic_loss)
                norms.setdefault(ACTOR_TRAINING, []).append(actor_norm)
                norms.setdefault(CRITIC_TRAINING, []).append(critic_norm)
                op_timings.extend(dataclasses.replace(timing, update=update) for timing in timings)
    return actor_losses, critic_losses, op_timings


# ---- 5. weight sync ----


def sync_plans(stages: dict[str, ModelStageRuntime]) -> list[WeightSync]:
    """The resharding plan of every weight sync the plan's stages call for (parameters only)."""
    return [
        weight_sync(stages[source_name], stages[target_name])
        for source_name, target_name in WEIGHT_SYNCS
        if source_name in stages and target_name in stages
    ]


def weight_sync(source: ModelStageRuntime, target: ModelStageRuntime) -> WeightSync:
    """The sync of `source`'s parameters into `target`'s engines, with its resharding plan."""
    return source, target, plan_reshard(weights_meta(source), weights_meta(target))


def weights_meta(stage: ModelStageRuntime) -> StateMeta:
    """The shard metadata of a model-stage's working weights (the compute dtype, never the
    masters: a sync sends what the trainer computes with)."""
    return state_meta(stage.model, stage.head, stage.layout, ("param",), {"param": stage.compute_dtype})


def sync_weights(syncs: list[WeightSync]) -> None:
    """Copy the trained parameters into the generation and inference engines by resharding.

    The pieces land straight in the target engine's live parameter tensors (no fresh
    state, no second copy); `load_local_state` then only takes the step and drops stale
    gradients and moments (copying a tensor onto itself is a no-op).
    """
    rank = dist.get_rank()
    for source, target, plan in syncs:
        tensors, step = {}, None
        if source.engine is not None:
            tensors = source.engine.weights()
            step = source.engine.optimizer_step
        live = target.engine.weights() if target.engine is not None else None
        move = copy_kept if same_shards(source, target) else execute
        result = move(plan, rank, tensors, step, out=live)
        if target.engine is not None:
            assert result.step is not None
            target.engine.load_local_state(result.tensors, result.step)
            if target.rollout_engine is not None:  # vLLM samples with what the sync just filled in
                target.rollout_engine.push_weights(target.engine.weights(), weights_meta(target), rank, hf_tensors)


def copy_kept(
    plan: ReshardPlan,
    rank: int,
    tensors: dict[str, torch.Tensor],
    step: int | None,
    out: dict[str, torch.Tensor] | None = None,
) -> ReshardResult:
    """`execute` of a plan between `same_shards` model-stages, where every rank keeps each of
    its pieces whole: into `out` by one foreach copy when given (else `tensors` as they
    are), with no walk of the plan's transfers and no message (a sync runs every step)."""
    if out is None:
        return ReshardResult(dict(tensors), step, 0, 0)
    assert out.keys() == tensors.keys(), (rank, plan.target.layout)
    torch._foreach_copy_(list(out.values()), [tensors[key] for key in out])
    return ReshardResult(dict(out), step, 0, 0)


def same_shards(source: ModelStageRuntime, target: ModelStageRuntime) -> bool:
    """Whether two model-stages hold the same weight pieces in the same dtype on the same ranks
    (one layout of one model), so a sync between them moves nothing between ranks."""
    return (
        source.layout == target.layout
        and source.model == target.model
        and source.head == target.head
        and source.compute_dtype == target.compute_dtype
    )

"""Phase 2 of a step, inference: the actor's old log-probs, the reference's log-probs, the
critic's values (each model-stage's replicas on their share of the rows) and the reward, the
task's rule or the reward model's score."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from nereus.runtime.model.engine import Engine
from nereus.runtime.model.transformer import Batch
from nereus.runtime.rl.datasets import Prompt
from nereus.runtime.rl.objectives import align_to_tokens, values_to_tokens
from nereus.runtime.rl.rewards import Scorer
from nereus.runtime.rl.stages import ModelStageRuntime, Rollout, by_replica, by_replica_of, without_routes
from nereus.runtime.rl.timing import timed
from nereus.spec.stages import (
    ACTOR_INFERENCE,
    CRITIC_INFERENCE,
    INFERENCE_OUTPUTS,
    REFERENCE_INFERENCE,
    REWARD_INFERENCE,
    InferenceOutput,
)


@dataclass(frozen=True)
class Scored:
    """What inference measured of one step's responses (token-aligned [batch, seq] or [batch])."""

    mask: torch.Tensor
    """[batch, seq] 1 at response tokens."""
    scores: torch.Tensor
    """The rewards: the reward model's scores under `reward: model`, else `rule_scores`."""
    rule_scores: torch.Tensor
    old_log_probs: torch.Tensor | None
    """The actor's log-probs of the rollout; None until training computed them, where the
    training forward gives the same numbers (`update.old_log_probs_from_training`)."""
    ref_log_probs: torch.Tensor
    old_values: torch.Tensor | None
    """Critic values (PPO only)."""


def score(
    stages: dict[str, ModelStageRuntime],
    scorer: Scorer,
    problems: list[Prompt],
    rollout: Rollout,
    seconds: dict[str, float],
    skip: Collection[str] = (),
) -> Scored:
    """Every inference model-stage's rows of the rollout (unless the fused rollout computed
    them already) and the rewards (collective). `skip`: inference model-stages not run (the
    training forward gives actor/inference's log-probs: `update.idle_model_stages`)."""
    batch, mask = rollout.batch, rollout.batch.field("loss_mask")
    inferred = rollout.inferred
    if inferred is None:
        inferred = run_inference({name: stage for name, stage in stages.items() if name not in skip}, batch, seconds)
    with timed(seconds, REWARD_INFERENCE):
        rule_scores = score_all(scorer, problems, rollout.responses)
        reward_values = inferred.get(REWARD_INFERENCE)
        scores = rule_scores if reward_values is None else scores_from_values(reward_values, batch)
    return Scored(
        mask,
        scores,
        rule_scores,
        old_log_probs=inferred[ACTOR_INFERENCE] * mask if ACTOR_INFERENCE in inferred else None,
        ref_log_probs=inferred[REFERENCE_INFERENCE] * mask,
        old_values=inferred[CRITIC_INFERENCE] * mask if CRITIC_INFERENCE in inferred else None,
    )


def run_inference(
    stages: dict[str, ModelStageRuntime], batch: Batch, seconds: dict[str, float]
) -> dict[str, torch.Tensor]:
    """Every inference model-stage on its replicas' rows, then one exchange of the rows: the
    model-stages of disjoint pools compute at the same time."""
    local: dict[str, torch.Tensor | None] = {}
    for name, output in INFERENCE_OUTPUTS.items():
        if name in stages:
            with timed(seconds, name):
                replays = name == ACTOR_INFERENCE  # the rollout's routing is the actor's (rl.routing_replay)
                local[name] = local_infer(stages[name], batch if replays else without_routes(batch), output)
    with timed(seconds, "exchange"):
        shares = by_replica_of({name: stages[name] for name in local}, local)
        return {name: torch.cat(parts) for name, parts in shares.items()}


def local_infer(stage: ModelStageRuntime, batch: Batch, output: InferenceOutput) -> torch.Tensor | None:
    """[rows, t] of this rank's replica (None off the stage's ranks): `replica_infer` of its rows."""
    engine = stage.engine
    if engine is None:
        return None
    return replica_infer(engine, engine.replica_rows(batch), output, stage.plan.micro_batches)


def replica_infer(engine: Engine, rows: Batch, output: InferenceOutput, micro_batches: int) -> torch.Tensor:
    """[rows, t] of `rows` on this replica (collective over its ranks): token-aligned
    `log_probs` or `values` (of emitting each token), or the value head's `position_values`."""
    if output == "log_probs":
        return align_to_tokens(engine.log_probs(rows, micro_batches)).cpu()
    if output == "values":
        return values_to_tokens(engine.values(rows, micro_batches)).cpu()
    assert output == "position_values", output
    return engine.values(rows, micro_batches).cpu()


def infer(stage: ModelStageRuntime, batch: Batch, output: InferenceOutput) -> torch.Tensor:
    """`local_infer` of the whole batch, each replica on its rows (collective)."""
    return torch.cat(by_replica(stage, local_infer(stage, batch, output)))


# ---- rewards ----


def reward_of(
    stages: dict[str, ModelStageRuntime],
    scorer: Scorer,
    problems: list[Prompt],
    batch: Batch,
    responses: list[list[int]],
) -> torch.Tensor:
    """[batch] rewards: the reward model's scores when the run has one, else the scorer's."""
    reward_model = stages.get(REWARD_INFERENCE)
    if reward_model is None:
        return score_all(scorer, problems, responses)
    return scores_from_values(infer(reward_model, batch, "position_values"), batch)


def score_all(scorer: Scorer, problems: list[Prompt], responses: list[list[int]]) -> torch.Tensor:
    """[batch] verifiable rewards (rule, math, exact or the user's function)."""
    return torch.tensor(scorer.score_all(problems, responses))


def scores_from_values(position_values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """[b] a reward model's score of every row: its value at the last response token."""
    return (position_values * last_token_mask(batch)).sum(dim=1)


def last_token_mask(batch: Batch) -> torch.Tensor:
    """[b, t] one-hot at each row's last response token (where the reward model reads its score)."""
    response = batch.field("loss_mask")
    positions = torch.arange(response.shape[1]).expand_as(response)
    last = torch.where(response > 0, positions, -1).max(dim=1).values
    return torch.nn.functional.one_hot(last, response.shape[1]).float()

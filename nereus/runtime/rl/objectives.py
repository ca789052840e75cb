"""Engine objectives for the RL losses, on the engine's per-token log-prob interface.

Per-token fields are aligned with the tokens: column i holds the quantity of token i
(its log-prob given the tokens before it, its advantage, ...), column 0 is unused. The
engine's `log_probs` and `values` give one column per position; `align_to_tokens` and
`values_to_tokens` turn them into this convention, and the objectives do the same with the
model output, so inference and training see identical numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nereus.runtime.model.losses import HeadOps
from nereus.runtime.model.transformer import Batch
from nereus.runtime.rl.algorithms import (
    BehaviourCorrection,
    behaviour_weights,
    clipped_policy_loss,
    clipped_value_loss,
    kl_divergence,
)
from nereus.spec.run_config import LossAggregation


def align_to_tokens(next_token_values: torch.Tensor) -> torch.Tensor:
    """[b, t - 1] values of tokens 1.. (e.g. `Engine.log_probs`) -> [b, t] with a zero column 0."""
    return torch.nn.functional.pad(next_token_values, (1, 0))


def values_to_tokens(position_values: torch.Tensor) -> torch.Tensor:
    """[b, t] value-head outputs per position -> [b, t] value of emitting token i, which the
    critic estimates from the state before it (position i - 1); column 0 is zero."""
    return align_to_tokens(position_values[:, :-1])


def _loss_mask(batch: Batch) -> torch.Tensor:
    return batch.field("loss_mask").to(torch.float32)


def aggregation_weights(batch: Batch, mode: LossAggregation) -> torch.Tensor:
    """[b, t] weight of each response token's loss under `mode`: 1, or 1 / the length of its
    response under `seq-mean-token-mean` (each sequence's mean counts once)."""
    mask = _loss_mask(batch)
    if mode == "seq-mean-token-mean":
        return mask / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return mask


def aggregation_normalizer(batch: Batch, mode: LossAggregation) -> float:
    """What the weighted token losses of a whole mini-batch are divided by under `mode`: its
    response tokens (`token-mean`) or its sequences with a response token (the `seq-mean-*`)."""
    mask = _loss_mask(batch)
    if mode == "token-mean":
        return float(mask.sum())
    return float((mask.sum(dim=1) > 0).sum())


@dataclass(frozen=True)
class PolicyObjective:
    """PPO's clipped surrogate (also GRPO's and ReMax's): needs fields `loss_mask`,
    `old_log_probs` (`row_index` instead under `current_as_old`), `advantages`, and
    `ref_log_probs` when `kl_loss_coef` > 0."""

    clip_eps: float
    """Trust region of the probability ratio: clip to [1 - eps, 1 + eps]."""
    kl_loss_coef: float
    """Weight of the k3 KL(policy || reference) loss term (GRPO style); 0 disables it."""
    entropy_coef: float
    """Weight of the entropy bonus (subtracted from the loss); 0 disables it."""
    loss_agg: LossAggregation
    """How token losses aggregate over a mini-batch (`aggregation_weights`)."""
    current_as_old: torch.Tensor | None = None
    """[rows, t] CPU tensor, when the batch is one update on the weights that sampled it: the
    old log-probs are then the current ones (detached), written here at each row of the
    batch's field `row_index`; None: from the batch's field `old_log_probs`."""
    correction: BehaviourCorrection = "none"
    """How each token's clipped policy loss is weighed for the policy that sampled it
    (`behaviour_weights` of the old log-probs over the batch's field `rollout_log_probs`, the
    generation engine's): `rl.rollout_correction` or `rl.off_policy_correction` (`correction_of`
    in update.py); `none`: no weight."""
    correction_cap: float = 2.0
    """The weight's cap under `tis` and `decoupled` (`rl.tis_cap`)."""
    router_aux_loss_coef: float = 0.0
    """Mixture-of-experts actors: the weight of the router's auxiliary load-balancing loss
    (transformers' `router_aux_loss_coef`), added by the engine to the step loss as coef x the
    mean over the micro-batches of each one's forward's loss (`Engine._router_aux_share`);
    0 disables it (`rl.router_aux_loss_coef`)."""

    def weights(self, batch: Batch) -> torch.Tensor:
        return aggregation_weights(batch, self.loss_agg)

    def normalizer(self, batch: Batch) -> float:
        return aggregation_normalizer(batch, self.loss_agg)

    def token_losses(self, output: torch.Tensor, batch: Batch, head: HeadOps) -> torch.Tensor:
        device = output.device
        predicting, targets = output[:, :-1], batch.tokens[:, 1:].to(device)  # position i predicts token i + 1
        if self.entropy_coef > 0:  # both from one pass over the LM head
            token_log_probs, entropy = head.token_log_probs_and_entropy(predicting, targets)
        else:
            token_log_probs, entropy = head.token_log_probs(predicting, targets), None
        log_probs = align_to_tokens(token_log_probs)
        if self.current_as_old is None:
            old_log_probs = batch.field("old_log_probs").to(device)
        else:  # masked and in fp32, as the actor/inference pass gives them
            old_log_probs = log_probs.detach().float() * batch.field("loss_mask").to(device)
            columns = slice(batch.first_column, batch.first_column + old_log_probs.shape[1])
            self.current_as_old[batch.field("row_index"), columns] = old_log_probs.cpu()
        losses = clipped_policy_loss(log_probs, old_log_probs, batch.field("advantages").to(device), self.clip_eps)
        if self.correction != "none":
            behaviour = batch.field("rollout_log_probs").to(device)
            losses = losses * behaviour_weights(old_log_probs, behaviour, self.correction, self.correction_cap)
        if self.kl_loss_coef > 0:
            ref = batch.field("ref_log_probs").to(device)
            losses = losses + self.kl_loss_coef * kl_divergence(log_probs, ref, "k3")
        if entropy is not None:
            losses = losses - self.entropy_coef * align_to_tokens(entropy)
        return losses


@dataclass(frozen=True)
class ClippedValueObjective:
    """PPO's clipped value loss: needs fields `loss_mask`, `old_values` and `returns`."""

    clip_eps: float
    """How far a value may move from its old estimate before the clipped loss takes over."""
    loss_agg: LossAggregation
    """How token losses aggregate over a mini-batch (`aggregation_weights`)."""

    def weights(self, batch: Batch) -> torch.Tensor:
        return aggregation_weights(batch, self.loss_agg)

    def normalizer(self, batch: Batch) -> float:
        return aggregation_normalizer(batch, self.loss_agg)

    def token_losses(self, output: torch.Tensor, batch: Batch, head: HeadOps) -> torch.Tensor:
        device = output.device
        return clipped_value_loss(
            values_to_tokens(output.float()),
            batch.field("old_values").to(device),
            batch.field("returns").to(device),
            self.clip_eps,
        )

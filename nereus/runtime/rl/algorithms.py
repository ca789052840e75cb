"""RL algorithms as small pure functions on per-token tensors.

Conventions: every per-token tensor is [batch, seq]; `mask` is 1 on the response tokens
that are trained on and 0 elsewhere (prompt, padding). Responses are contiguous runs of
mask ones, so "after the last response token" is where the mask drops to 0. Sequence-level
scores are [batch].
"""

from __future__ import annotations

from typing import Literal

import torch

#: KL estimators of KL(policy || reference) from log-prob samples under the policy
#: (Schulman, "Approximating KL divergence"): k1 = log r, k2 = (log r)^2 / 2,
#: k3 = (r' - 1) - log r' with r' = p_ref / p (unbiased and non-negative).
KlEstimator = Literal["k1", "k2", "k3"]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the tokens `mask` marks (0 when it marks none)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over the marked tokens (population std); unmarked tokens become 0."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(var + eps) * mask.to(values.dtype)


def kl_divergence(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: KlEstimator = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) at tokens sampled from the policy."""
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2 or k3")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """[batch] index of each row's last marked token (rows need at least one)."""
    if bool((mask.sum(dim=-1) == 0).any()):
        raise ValueError("every row needs at least one response token")
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, -1).max(dim=-1).values


def token_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """PPO's per-token reward: -kl_coef * KL (k1) on every response token, plus the sequence
    score on its last token (the KL penalty folded into the reward, as in InstructGPT)."""
    mask_f = mask.to(log_probs.dtype)
    rewards = -kl_coef * kl_divergence(log_probs, ref_log_probs) * mask_f
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last_token_index(mask)] += scores.to(rewards.dtype)
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's response tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t with V = 0 after the last response token;
    A_t = delta_t + gamma * lam * A_{t+1}. Returns (advantages, returns = A + V), both 0
    off the mask.
    """
    mask_f = mask.to(values.dtype)
    values = values * mask_f
    advantages = torch.zeros_like(values)
    next_advantage = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = (delta + gamma * lam * next_advantage) * mask_f[:, t]
        advantages[:, t] = advantage
        # Unmasked columns pass the later token's value and advantage through unchanged
        # (none follow a response, so they carry zeros there).
        next_advantage = torch.where(mask_f[:, t] > 0, advantage, next_advantage)
        next_value = torch.where(mask_f[:, t] > 0, values[:, t], next_value)
    return advantages, (advantages + values) * mask_f


def clipped_policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, clip_eps: float
) -> torch.Tensor:
    """Per-token PPO surrogate loss: -min(r A, clip(r, 1 - eps, 1 + eps) A), r = p / p_old."""
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
    return -torch.minimum(unclipped, clipped)


#: How the policy loss weighs a token for the policy that sampled it (the behaviour policy mu):
#: `rl.rollout_correction` and `rl.off_policy_correction` (nereus/spec/run_config.py) name these.
BehaviourCorrection = Literal["none", "tis", "decoupled"]


def behaviour_weights(
    proximal_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, correction: BehaviourCorrection, cap: float
) -> torch.Tensor:
    """Per-token importance weight w of pi_prox / mu (the trainer's log-probs at training time over
    the behaviour policy's that sampled the token), a constant of the loss (no gradient):

    - `tis`, truncated importance sampling (verl's TIS): w = min(pi_prox / mu, cap);
    - `decoupled`, AReaL's decoupled PPO: w = pi_prox / mu where it is at most `cap`, and 0 on a
      token above it (the token is dropped, as AReaL's `behav_imp_weight_cap` does);
    - `none`: w = 1.

    Where mu = pi_prox (and cap >= 1) every weight is exactly 1. Tokens outside the responses,
    zero in both, get weight 1."""
    ratio = torch.exp(proximal_log_probs.detach().float() - behaviour_log_probs.float())
    if correction == "tis":
        return ratio.clamp(max=cap)
    if correction == "decoupled":
        return torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    assert correction == "none", correction
    return torch.ones_like(ratio)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_eps: float
) -> torch.Tensor:
    """Per-token PPO value loss: 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)."""
    clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def group_advantages(scores: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each score minus the mean of its group (consecutive runs of `group_size`),
    divided by the group's sample std (+ eps) when `scale`. Returns [batch]."""
    if group_size < 1 or scores.shape[0] % group_size:
        raise ValueError(f"{scores.shape[0]} scores do not split into groups of {group_size}")
    groups = scores.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def remax_advantages(scores: torch.Tensor, greedy_scores: torch.Tensor) -> torch.Tensor:
    """ReMax: each sampled response's score minus the score of the greedy response to the same prompt."""
    if scores.shape != greedy_scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and greedy scores {tuple(greedy_scores.shape)} differ")
    return scores.float() - greedy_scores.float()


def broadcast_to_tokens(sequence_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[batch] per-sequence values copied onto every response token ([batch, seq], 0 off the mask)."""
    return sequence_values.float().unsqueeze(1) * mask.float()

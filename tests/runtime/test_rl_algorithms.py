"""RL algorithms against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from rl_reference import entropy_from_logits

from nereus.runtime.rl.algorithms import (
    KlEstimator,
    broadcast_to_tokens,
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    group_advantages,
    kl_divergence,
    last_token_index,
    masked_mean,
    masked_whiten,
    remax_advantages,
    token_rewards,
)

pytestmark = pytest.mark.one_rank


def close(actual: torch.Tensor, expected: list[float] | list[list[float]]) -> None:
    torch.testing.assert_close(actual.float(), torch.tensor(expected), atol=1e-5, rtol=0)


def test_gae_three_step_episode_by_hand() -> None:
    # gamma 0.9, lambda 0.8: delta2 = 1 - 0.7 = 0.3; delta1 = 0.9 * 0.7 - 0.6 = 0.03;
    # delta0 = 0.9 * 0.6 - 0.5 = 0.04; A2 = 0.3, A1 = 0.03 + 0.72 * 0.3 = 0.246,
    # A0 = 0.04 + 0.72 * 0.246 = 0.21712.
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    advantages, returns = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    close(advantages, [[0.21712, 0.246, 0.3]])
    close(returns, [[0.71712, 0.846, 1.0]])


def test_gae_ignores_prompt_and_padding_columns() -> None:
    # The same episode behind a prompt column and before two padding columns whose junk
    # values must not leak in.
    rewards = torch.tensor([[9.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    values = torch.tensor([[5.0, 0.5, 0.6, 0.7, 3.0, 4.0]])
    mask = torch.tensor([[0, 1, 1, 1, 0, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(advantages, [[0.0, 0.21712, 0.246, 0.3, 0.0, 0.0]])
    close(returns, [[0.0, 0.71712, 0.846, 1.0, 0.0, 0.0]])


def test_gae_lambda_one_gamma_one_is_return_minus_value() -> None:
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.1, 0.2, 0.3]])
    advantages, returns = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    close(returns, [[6.0, 5.0, 3.0]])
    close(advantages, [[5.9, 4.8, 2.7]])


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected"),
    [
        (1.5, 1.0, -1.2),  # ratio above 1 + eps, positive advantage: clipped at 1.2
        (1.5, -1.0, 1.5),  # negative advantage: the unclipped (worse) term wins
        (0.5, 1.0, -0.5),  # ratio below 1 - eps, positive advantage: unclipped
        (0.5, -1.0, 0.8),  # negative advantage: clipped at 0.8
        (1.1, 2.0, -2.2),  # inside the trust region
    ],
)
def test_clipped_policy_loss_cases(ratio: float, advantage: float, expected: float) -> None:
    log_probs = torch.tensor([math.log(ratio)])
    old = torch.zeros(1)
    adv = torch.tensor([advantage])
    close(clipped_policy_loss(log_probs, old, adv, clip_eps=0.2), [expected])


def test_clipped_policy_loss_gradient_vanishes_when_clipped() -> None:
    log_probs = torch.tensor([math.log(1.5), math.log(1.1)], requires_grad=True)
    loss = clipped_policy_loss(log_probs, torch.zeros(2), torch.ones(2), clip_eps=0.2).sum()
    loss.backward()
    assert log_probs.grad is not None
    close(log_probs.grad, [0.0, -1.1])  # d(-r)/d(log r) = -r inside the region


def test_clipped_value_loss_cases() -> None:
    # V = 1, V_old = 0.5, eps 0.2 -> clipped V = 0.7. Target 2: max(1, 1.69) / 2; target 0: max(1, 0.49) / 2.
    values = torch.tensor([1.0, 1.0, 0.6])
    old = torch.tensor([0.5, 0.5, 0.5])
    returns = torch.tensor([2.0, 0.0, 1.0])
    close(clipped_value_loss(values, old, returns, clip_eps=0.2), [0.845, 0.5, 0.08])


def test_kl_estimators_by_hand() -> None:
    log_probs = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    close(kl_divergence(log_probs, ref, "k1"), [math.log(2)])
    close(kl_divergence(log_probs, ref, "k2"), [0.5 * math.log(2) ** 2])
    close(kl_divergence(log_probs, ref, "k3"), [0.5 + math.log(2) - 1])
    close(kl_divergence(ref, log_probs, "k3"), [2.0 - math.log(2) - 1])  # k3 stays non-negative
    with pytest.raises(ValueError, match="k4"):
        kl_divergence(log_probs, ref, "k4")  # type: ignore[arg-type]


def test_kl_estimators_agree_in_expectation() -> None:
    # Sample from p, estimate KL(p || q) with the two unbiased estimators; both near the exact value.
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.3, 0.3, 0.4])
    exact = float((p * (p / q).log()).sum())
    samples = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    estimators: tuple[KlEstimator, ...] = ("k1", "k3")
    for estimator in estimators:
        estimate = float(kl_divergence(p.log()[samples], q.log()[samples], estimator).mean())
        assert abs(estimate - exact) < 0.01, (estimator, estimate, exact)


def test_token_rewards_put_the_score_on_the_last_response_token() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]])
    log_probs = torch.tensor([[0.0, -1.0, -1.0, 0.0], [0.0, -1.0, -2.0, -1.0]])
    ref = torch.tensor([[0.0, -1.5, -1.0, 5.0], [0.0, -1.0, -1.0, -1.0]])
    rewards = token_rewards(torch.tensor([1.0, 2.0]), mask, log_probs, ref, kl_coef=0.1)
    close(rewards, [[0.0, -0.05, 1.0, 0.0], [0.0, 0.0, 0.1, 2.0]])
    close(last_token_index(mask), [2.0, 3.0])
    with pytest.raises(ValueError, match="at least one response token"):
        last_token_index(torch.zeros(1, 3))


def test_group_advantages_by_hand() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    # group 1: mean 0.5, sample std sqrt(1/3); group 2: mean 0.75, sample std 0.5
    half = 0.5 / math.sqrt(1 / 3)
    close(group_advantages(scores, 4, eps=0.0), [half, -half, -half, half, 0.5, 0.5, 0.5, -1.5])
    close(group_advantages(scores, 4, scale=False), [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])
    close(group_advantages(torch.ones(4), 2), [0.0, 0.0, 0.0, 0.0])  # equal scores: no signal, no NaN
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(scores, 3)


def test_remax_baseline_and_broadcast() -> None:
    advantages = remax_advantages(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.5, 0.5, 0.5]))
    close(advantages, [0.5, -0.5, 0.0])
    close(
        broadcast_to_tokens(advantages, torch.tensor([[0, 1, 1], [1, 1, 0], [1, 0, 0]])),
        [[0.0, 0.5, 0.5], [-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]],
    )
    with pytest.raises(ValueError, match="differ"):
        remax_advantages(torch.zeros(2), torch.zeros(3))


def test_entropy_and_masked_statistics() -> None:
    close(entropy_from_logits(torch.zeros(2, 4)), [math.log(4), math.log(4)])
    close(entropy_from_logits(torch.tensor([[0.0, -1e9]])), [0.0])
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    close(masked_mean(values, mask), 2.0)  # type: ignore[arg-type]
    whitened = masked_whiten(values, mask, eps=0.0)
    spread = math.sqrt(2 / 3)
    close(whitened, [[-1 / spread, 0.0, 1 / spread, 0.0]])

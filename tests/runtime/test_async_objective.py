"""The policy loss under staleness (`rl.off_policy_correction`, issue 49 item 2): truncated
importance sampling and AReaL's decoupled PPO objective weigh each token's clipped loss by
pi_old / mu; on-policy (mu = pi_old) both are the uncorrected loss bitwise."""

from __future__ import annotations

import math

import pytest
import torch

from nereus.runtime.model.transformer import Batch
from nereus.runtime.rl.algorithms import BehaviourCorrection, behaviour_weights, clipped_policy_loss
from nereus.runtime.rl.objectives import PolicyObjective
from nereus.runtime.rl.update import correction_of
from nereus.spec.presets import workload_preset
from nereus.spec.run_config import RLConfig

pytestmark = pytest.mark.one_rank

CORRECTIONS: tuple[BehaviourCorrection, ...] = ("tis", "decoupled")


class Head:
    """The LM head's ops on whole logits (the engine's chunked head computes the same per token)."""

    def token_log_probs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    def token_log_probs_and_entropy(
        self, logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = logits.float().log_softmax(-1)
        return self.token_log_probs(logits, targets), -(log_probs.exp() * log_probs).sum(-1)


def case(seed: int) -> tuple[torch.Tensor, Batch]:
    """Logits and a batch whose old log-probs are 0.05 off the current ones on response tokens."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 6, 11, generator=generator).requires_grad_(True)
    tokens = torch.randint(0, 11, (3, 6), generator=generator)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0]], dtype=torch.float32)
    current = torch.nn.functional.pad(Head().token_log_probs(logits[:, :-1], tokens[:, 1:]), (1, 0)).detach()
    old = (current - 0.05 * torch.randn(3, 6, generator=generator)) * mask
    fields = {"loss_mask": mask, "old_log_probs": old, "advantages": torch.randn(3, 6, generator=generator) * mask}
    return logits, Batch(tokens, torch.ones(3, 6, dtype=torch.bool), {**fields, "ref_log_probs": old - 0.1})


def losses_and_grad(
    objective: PolicyObjective, logits: torch.Tensor, batch: Batch
) -> tuple[torch.Tensor, torch.Tensor]:
    logits.grad = None
    losses = objective.token_losses(logits, batch, Head())
    (losses * batch.field("loss_mask")).sum().backward()
    assert logits.grad is not None
    return losses.detach(), logits.grad.clone()


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("kl_loss_coef, entropy_coef", [(0.0, 0.0), (0.3, 0.01)])
def test_on_policy_equals_the_uncorrected_loss_bitwise(
    correction: BehaviourCorrection, kl_loss_coef: float, entropy_coef: float
) -> None:
    logits, batch = case(0)
    on_policy = Batch(
        batch.tokens, batch.attention_mask, {**batch.fields, "rollout_log_probs": batch.field("old_log_probs")}
    )
    plain = PolicyObjective(0.2, kl_loss_coef, entropy_coef, "token-mean")
    corrected = PolicyObjective(0.2, kl_loss_coef, entropy_coef, "token-mean", correction=correction)
    expected_losses, expected_grad = losses_and_grad(plain, logits, on_policy)
    losses, grad = losses_and_grad(corrected, logits, on_policy)
    assert torch.equal(losses, expected_losses)
    assert torch.equal(grad, expected_grad)


def test_the_entropy_bonus_is_the_next_token_entropy_weighted() -> None:
    """With entropy_coef c the token losses are those without it less c x the entropy of the
    distribution that predicted each token (column 0, predicted by nothing, gets none)."""
    logits, batch = case(1)
    with torch.no_grad():
        without = PolicyObjective(0.2, 0.0, 0.0, "token-mean").token_losses(logits, batch, Head())
        bonus = PolicyObjective(0.2, 0.0, 0.05, "token-mean").token_losses(logits, batch, Head())
        probs = logits[:, :-1].softmax(-1)
        entropy = -(probs * probs.log()).sum(-1)
    assert torch.equal(bonus[:, 0], without[:, 0])
    assert torch.allclose(bonus[:, 1:], without[:, 1:] - 0.05 * entropy, atol=1e-6)


def test_weights_by_hand() -> None:
    # pi_old / mu per token: 1, 1.5, 3, 0.5, 2 (cap 2).
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0]])
    mu = old - torch.log(torch.tensor([[1.0, 1.5, 3.0, 0.5, 2.0]]))
    tis = behaviour_weights(old, mu, "tis", 2.0)
    decoupled = behaviour_weights(old, mu, "decoupled", 2.0)
    assert torch.allclose(tis, torch.tensor([[1.0, 1.5, 2.0, 0.5, 2.0]]))  # clamped at the cap
    assert torch.allclose(decoupled, torch.tensor([[1.0, 1.5, 0.0, 0.5, 2.0]]))  # dropped above it
    assert torch.equal(behaviour_weights(old, mu, "none", 2.0), torch.ones(1, 5))
    # The weight is a constant of the loss.
    assert not behaviour_weights(old.requires_grad_(True), mu, "tis", 2.0).requires_grad


def test_small_case_by_hand() -> None:
    """One token per formula, computed by hand: pi_old / mu = 1.5, pi / pi_old = 1.5, A = 1, eps 0.2.
    Clipped PPO term: -min(1.5 * 1, 1.2 * 1) = -1.2; both corrections weigh it by 1.5 -> -1.8.
    With pi_old / mu = 2.5 (cap 2): tis weighs by 2 -> -2.4, decoupled drops the token -> 0."""
    advantages = torch.tensor([1.0])
    old = torch.tensor([math.log(0.4)])
    current = torch.tensor([math.log(0.6)])
    ppo = clipped_policy_loss(current, old, advantages, 0.2)
    assert float(ppo) == pytest.approx(-1.2)
    for correction in CORRECTIONS:
        mu = torch.tensor([math.log(0.4 / 1.5)])
        assert float(ppo * behaviour_weights(old, mu, correction, 2.0)) == pytest.approx(-1.8)
    far = torch.tensor([math.log(0.4 / 2.5)])
    assert float(ppo * behaviour_weights(old, far, "tis", 2.0)) == pytest.approx(-2.4)
    assert float(ppo * behaviour_weights(old, far, "decoupled", 2.0)) == 0.0


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_the_objective_weighs_only_the_policy_term(correction: BehaviourCorrection) -> None:
    logits, batch = case(1)
    mask = batch.field("loss_mask")
    shift = torch.tensor([0.2, -0.4, 0.9]).unsqueeze(1) * mask  # log(pi_old / mu) per row
    stale = Batch(
        batch.tokens, batch.attention_mask, {**batch.fields, "rollout_log_probs": batch.field("old_log_probs") - shift}
    )
    plain = PolicyObjective(0.2, 0.3, 0.0, "token-mean").token_losses(logits, stale, Head())
    corrected = PolicyObjective(0.2, 0.3, 0.0, "token-mean", correction=correction).token_losses(logits, stale, Head())
    policy_only = PolicyObjective(0.2, 0.0, 0.0, "token-mean").token_losses(logits, stale, Head())
    ratio = torch.exp(shift)
    weight = ratio.clamp(max=2.0) if correction == "tis" else torch.where(ratio <= 2.0, ratio, 0.0)
    assert torch.allclose(corrected - plain, policy_only * (weight - 1), atol=1e-6)


def test_which_correction_applies() -> None:
    sync = workload_preset("grpo")
    one_off = workload_preset("grpo-async")
    turns = one_off.model_copy(update={"max_staleness": 0})
    assert one_off.overlaps and not turns.overlaps
    both = RLConfig(rollout_correction="tis", off_policy_correction="decoupled")
    assert correction_of(both, one_off) == "decoupled"
    assert correction_of(both, sync) == correction_of(both, turns) == "tis"  # on-policy: the engine's gap only
    assert correction_of(RLConfig(off_policy_correction="tis"), sync) == "none"
    assert correction_of(RLConfig(rollout_correction="tis"), one_off) == "tis"


def test_a_cap_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="tis_cap"):
        RLConfig(tis_cap=0.5)

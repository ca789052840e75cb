"""`rl.rollout_correction: tis` (verl's truncated importance sampling), with no vLLM needed:
each token's clipped policy loss is weighted by min(exp(old - rollout), cap), a constant."""

from __future__ import annotations

import math

import pytest
import torch

from nereus.runtime.model.transformer import Batch
from nereus.runtime.rl.algorithms import behaviour_weights
from nereus.runtime.rl.objectives import PolicyObjective

pytestmark = pytest.mark.one_rank


class Head:
    def token_log_probs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    def token_log_probs_and_entropy(
        self, logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("these objectives have no entropy term")


def test_weights_are_the_ratio_capped() -> None:
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    rollout = torch.tensor([[0.0, -1.0, -2.0 - math.log(1.5), -0.5 - math.log(3.0)]])
    weights = behaviour_weights(old, rollout, "tis", cap=2.0)
    assert torch.allclose(weights, torch.tensor([[1.0, 1.0, 1.5, 2.0]]))
    # Below one is kept: a token the engine found likelier than the trainer weighs less.
    assert float(behaviour_weights(torch.tensor([-1.0]), torch.tensor([-0.5]), "tis", 2.0)) == pytest.approx(
        math.exp(-0.5)
    )


def test_the_objective_weighs_only_the_policy_term() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 0]], dtype=torch.float32)
    old = torch.nn.functional.pad(Head().token_log_probs(logits[:, :-1], tokens[:, 1:]), (1, 0)).detach() * mask
    fields = {"loss_mask": mask, "old_log_probs": old, "advantages": torch.randn(2, 5), "ref_log_probs": old - 0.1}
    shift = 0.3 * mask  # the engine's log-probs, 0.3 below the trainer's on every response token
    batch = Batch(tokens, torch.ones(2, 5, dtype=torch.bool), {**fields, "rollout_log_probs": old - shift})
    plain = PolicyObjective(0.2, 0.0, 0.0, "token-mean")
    corrected = PolicyObjective(0.2, 0.0, 0.0, "token-mean", correction="tis", correction_cap=2.0)
    expected = plain.token_losses(logits, batch, Head()) * torch.exp(shift)
    assert torch.allclose(corrected.token_losses(logits, batch, Head()), expected)
    # With the KL loss on, the KL term is added unweighted.
    with_kl = PolicyObjective(0.2, 0.5, 0.0, "token-mean", correction="tis", correction_cap=2.0)
    kl_only = PolicyObjective(0.2, 0.5, 0.0, "token-mean").token_losses(logits, batch, Head())
    difference = with_kl.token_losses(logits, batch, Head()) - kl_only
    assert torch.allclose(difference, plain.token_losses(logits, batch, Head()) * (torch.exp(shift) - 1), atol=1e-6)

"""Training losses the engine minimises: the objective protocol (per-token weights, losses and
the normaliser that makes micro-batch and replica gradients sum to the single-process one),
next-token cross-entropy and the value head's squared error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from nereus.runtime.model.transformer import Batch


class HeadOps(Protocol):
    """What an objective may ask of the model's last stage, about its `output`: the engine's
    stage reads its final hidden states and computes in chunks of tokens (`chunked_head`); the
    one-process `ReferenceModel` reads its whole logits."""

    def token_log_probs(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[...] fp32 log p(target) at every position of `output` [..., features]."""
        ...

    def token_log_probs_and_entropy(
        self, output: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`token_log_probs` and the fp32 entropy of the next-token distribution at every
        position, from one pass over the head."""
        ...


class Objective(Protocol):
    """A per-token training loss; the step loss is sum(weights * token_losses) / normalizer."""

    def weights(self, batch: Batch) -> torch.Tensor:
        """[batch, seq] non-negative weight of every token's loss."""
        ...

    def normalizer(self, batch: Batch) -> float:
        """What the weighted token losses of the whole `batch` (all replicas and micro-batches)
        are divided by: sum(weights) for a mean over tokens."""
        ...

    def token_losses(self, output: torch.Tensor, batch: Batch, head: HeadOps) -> torch.Tensor:
        """[batch, seq] loss of every token from the last stage's output: what `head` reads
        (an LM head's final hidden states in the engine) or the values of a value head."""
        ...


def _loss_mask(batch: Batch) -> torch.Tensor:
    mask = batch.fields["loss_mask"] if "loss_mask" in batch.fields else batch.mask()
    return mask.to(torch.float32)


def next_token_log_probs(output: torch.Tensor, tokens: torch.Tensor, head: HeadOps) -> torch.Tensor:
    """[b, t - 1]: log p(tokens[:, i + 1]) from the output at position i."""
    return head.token_log_probs(output[:, :-1], tokens[:, 1:])


@dataclass(frozen=True)
class NextTokenLoss:
    """Language-model cross-entropy on the tokens the `loss_mask` field marks (default: every
    real token after the first)."""

    def weights(self, batch: Batch) -> torch.Tensor:
        weights = _loss_mask(batch).clone()
        weights[:, 0] = 0.0  # the first token has no prediction
        return weights

    def normalizer(self, batch: Batch) -> float:
        return float(self.weights(batch).sum())

    def token_losses(self, output: torch.Tensor, batch: Batch, head: HeadOps) -> torch.Tensor:
        losses = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=output.device)
        losses[:, 1:] = -next_token_log_probs(output, batch.tokens.to(output.device), head)
        return losses


@dataclass(frozen=True)
class ValueLoss:
    """Squared error of the value head against the `value_targets` field, on `loss_mask` tokens."""

    def weights(self, batch: Batch) -> torch.Tensor:
        return _loss_mask(batch)

    def normalizer(self, batch: Batch) -> float:
        return float(self.weights(batch).sum())

    def token_losses(self, output: torch.Tensor, batch: Batch, head: HeadOps) -> torch.Tensor:
        return (output.float() - batch.field("value_targets").to(output.device).float()).pow(2)

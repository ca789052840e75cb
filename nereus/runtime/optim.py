"""AdamW with fp32 moments kept per parameter name (the sharding contract's state families).

Keying the state by name, not by position, is what lets a resharder or a checkpoint move
`exp_avg/<name>` and `exp_avg_sq/<name>` alongside `param/<name>`. The update is
torch.optim.AdamW's (decoupled weight decay, bias-corrected moments), computed in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nereus.runtime import arena


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyperparameters (torch.optim.AdamW's defaults except the learning rate)."""

    lr: float = 1e-4
    """Learning rate."""
    beta1: float = 0.9
    """Decay of the first moment."""
    beta2: float = 0.999
    """Decay of the second moment."""
    eps: float = 1e-8
    """Added to the denominator's square root."""
    weight_decay: float = 0.01
    """Decoupled weight decay (multiplies the parameter by 1 - lr * weight_decay each step)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"AdamW lr must be positive, got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"AdamW betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        if not self.eps > 0 or self.weight_decay < 0:
            raise ValueError(
                f"AdamW eps must be positive and weight_decay non-negative, got {self.eps}, {self.weight_decay}"
            )


class AdamW:
    """AdamW over named parameters; `exp_avg` and `exp_avg_sq` are fp32 tensors per name."""

    def __init__(self, params: dict[str, torch.nn.Parameter], config: AdamWConfig):
        self.params = params
        self.config = config
        self.step_count = 0
        self.exp_avg: dict[str, torch.Tensor] = {}
        self.exp_avg_sq: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        c = self.config
        self.step_count += 1
        bias1 = 1 - c.beta1**self.step_count
        bias2_sqrt = math.sqrt(1 - c.beta2**self.step_count)
        for name, param in self.params.items():
            if param.grad is None:
                continue
            grad = param.grad.float()
            if name not in self.exp_avg:
                self.exp_avg[name] = _zeros(param)
                self.exp_avg_sq[name] = _zeros(param)
            exp_avg, exp_avg_sq = self.exp_avg[name], self.exp_avg_sq[name]
            exp_avg.lerp_(grad, 1 - c.beta1)
            exp_avg_sq.mul_(c.beta2).addcmul_(grad, grad, value=1 - c.beta2)
            master = param.float()
            master.mul_(1 - c.lr * c.weight_decay)
            denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(c.eps)
            master.addcdiv_(exp_avg, denom, value=-c.lr / bias1)
            param.copy_(master)

    def zero_grad(self) -> None:
        for param in self.params.values():
            param.grad = None


def _zeros(param: torch.Tensor) -> torch.Tensor:
    """An fp32 moment for `param`, in the process's state arena when it has one (CPU)."""
    return arena.empty(tuple(param.shape), torch.float32, param.device).zero_()

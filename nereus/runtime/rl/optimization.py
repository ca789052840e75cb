"""How the trained models update: learning-rate schedules, gradient clipping, the update.

The learning rate of a step is a pure function of the config and the RL step (never a
stateful scheduler), so a resumed run trains at exactly the rates the uninterrupted run does.
Every update of a step (all its mini-batches and epochs) uses the step's rate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from nereus.runtime.model.engine import Engine
from nereus.runtime.model.fused_pipeline import FusedPart, OpTiming, fused_forward_backward
from nereus.runtime.model.grad_norm import clip_grad_norm
from nereus.spec.run_config import RLConfig
from nereus.spec.schedule import Schedule
from nereus.spec.stages import ROLE_INFO, TRAINED_STAGES, role_of


def learning_rate(config: RLConfig, peak: float, step: int) -> float:
    """The learning rate at RL step `step` (0-based): a linear warm-up over
    `lr_warmup_steps`, then the peak (`constant`) or a half-cosine down to
    peak x `min_lr_ratio` at step `lr_decay_steps` (`cosine`)."""
    warmup = config.lr_warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if config.lr_schedule == "constant":
        return peak
    assert config.lr_decay_steps is not None, "the run sets the decay horizon (`with_decay_horizon`)"
    decay = max(config.lr_decay_steps - warmup, 1)
    progress = min((step - warmup) / decay, 1.0)
    floor = peak * config.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def with_decay_horizon(config: RLConfig, num_steps: int) -> RLConfig:
    """`config` with `lr_decay_steps` set to the run's length where the config leaves it open."""
    if config.lr_decay_steps is not None:
        return config
    return config.model_copy(update={"lr_decay_steps": num_steps})


@dataclass(frozen=True)
class UpdateRule:
    """How one model-stage updates during a step."""

    lr: float
    """The step's learning rate."""
    max_grad_norm: float | None
    """Clip the global gradient norm to this (None: no clipping)."""


def update_rules(config: RLConfig, step: int, model_stages: Sequence[str]) -> dict[str, UpdateRule]:
    """The update rule of every trained model-stage among `model_stages` at RL step `step`."""
    return {
        name: UpdateRule(
            learning_rate(config, getattr(config, ROLE_INFO[role_of(name)].lr_field), step), config.grad_clip
        )
        for name in TRAINED_STAGES
        if name in model_stages
    }


def apply_update(engine: Engine, rule: UpdateRule) -> float:
    """Clip the held gradients, then one AdamW step at the rule's rate; the global gradient
    norm before clipping (collective over the engine's layout)."""
    norm = clip_grad_norm(engine, rule.max_grad_norm)
    engine.optimizer.config = dataclasses.replace(engine.optimizer.config, lr=rule.lr)
    engine.update()
    return norm


def fused_update(
    parts: Sequence[FusedPart], schedule: Schedule, rules: dict[str, UpdateRule]
) -> tuple[list[float], list[OpTiming], list[float]]:
    """`fused_train_step` under each part's rule (`rules` by part name): the losses, the op
    timings and each part's gradient norm before clipping."""
    for part in parts:
        part.engine.zero_grad()
    losses, timings = fused_forward_backward(parts, schedule)
    norms = [apply_update(part.engine, rules[part.name]) for part in parts]
    return losses, timings, norms

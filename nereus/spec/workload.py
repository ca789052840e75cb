"""Workload: the RL algorithm, its models and the shape of one step's data."""

from __future__ import annotations

import math
from collections.abc import Iterator
from statistics import NormalDist
from typing import Literal

from pydantic import Field, model_validator

from nereus.spec.base import Document, StrictModel
from nereus.spec.stages import MODEL_STAGES, ROLES, Role, Stage, role_of, split

Algorithm = Literal["ppo", "grpo", "remax"]
Execution = Literal["sync", "async"]
DType = Literal["bf16", "fp16", "fp32"]

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}

_P99_Z = NormalDist().inv_cdf(0.99)


class ResponseLengths(StrictModel):
    """Log-normal response lengths in tokens, truncated at `max`.

    The tail is given by the 99th percentile; p99 well above the median is the long
    tail that makes a few samples keep generation running.
    """

    median: int = Field(gt=0)
    """Median response length in tokens."""
    p99: int = Field(gt=0)
    """99th-percentile response length in tokens (>= median)."""
    max: int = Field(gt=0)
    """Hard cap on generated tokens (the sampling `max_tokens`); sizes the KV cache."""

    @model_validator(mode="after")
    def _ordered(self) -> ResponseLengths:
        if not self.median <= self.p99 <= self.max:
            raise ValueError(f"need median <= p99 <= max, got {self.median} / {self.p99} / {self.max}")
        return self

    @property
    def sigma(self) -> float:
        """Log-space standard deviation of the log-normal."""
        return math.log(self.p99 / self.median) / _P99_Z

    def quantile(self, q: float) -> float:
        """Response length at quantile `q` in (0, 1), capped at `max`."""
        assert 0.0 < q < 1.0, q
        z = NormalDist().inv_cdf(q)
        return min(float(self.max), self.median * math.exp(self.sigma * z))

    def mean(self) -> float:
        """Mean length (of the uncapped log-normal, then capped at `max`)."""
        return min(float(self.max), self.median * math.exp(self.sigma**2 / 2))

    def expected_longest(self, num_samples: int) -> float:
        """Typical longest response among `num_samples` draws: the long tail of a batch."""
        assert num_samples > 0, num_samples
        return self.quantile(num_samples / (num_samples + 1.0)) if num_samples > 1 else self.mean()


class Optimizer(StrictModel):
    """Optimizer settings that decide memory per parameter."""

    name: Literal["adamw"] = "adamw"
    """Optimizer; AdamW keeps two fp32 moments per parameter."""
    master_weights: bool = True
    """Keep an fp32 copy of bf16/fp16 parameters (mixed precision)."""
    shard_across_dp: bool = False
    """Shard optimizer state and master weights across dp replicas (ZeRO-1)."""


class Workload(Document):
    """One RL post-training job's algorithm and per-step data shape."""

    kind: Literal["Workload"] = "Workload"
    name: str = Field(min_length=1)
    """Name used in reports, e.g. `ppo`."""
    algorithm: Algorithm
    """RL algorithm: ppo (with critic), grpo or remax (no critic)."""
    actor: str = Field(min_length=1)
    """Model name of the policy being trained."""
    critic: str | None = None
    """Model name of the value model; required by ppo, absent for grpo and remax."""
    reference: str | None = None
    """Model name of the frozen reference policy for the KL term; null for no KL."""
    reward: str | None = None
    """Model name of the reward model (priced and run as reward/inference); null for a rule-based
    reward (the default of the grpo and remax presets, as published GRPO runs score)."""
    prompts_per_step: int = Field(gt=0)
    """Prompts drawn per RL step."""
    samples_per_prompt: int = Field(default=1, gt=0)
    """Responses sampled per prompt (the group size of grpo)."""
    prompt_len: int = Field(gt=0)
    """Prompt length in tokens."""
    response_len: ResponseLengths
    """Distribution of generated response lengths."""
    ppo_epochs: int = Field(default=1, gt=0)
    """Passes over each step's samples during training."""
    mini_batches: int = Field(default=1, gt=0)
    """Optimizer updates per epoch; each uses 1/mini_batches of the samples."""
    micro_batch_size: int = Field(default=1, gt=0)
    """Sequences per micro-batch of inference forwards; the planner picks training micro-batches."""
    dtype: DType = "bf16"
    """Parameter and activation dtype."""
    optimizer: Optimizer = Optimizer()
    """Optimizer and its state layout."""
    execution: Execution = Field(default="sync", exclude_if=lambda value: value == "sync")
    """How generation and training share time. `sync`: every step generates its batch, then
    runs inference and training, then syncs the weights (each phase waits for the one before).
    `async`: actor/generation runs on a pool of its own, disjoint from every other model-stage's
    (split placement), and generates the batch of step t + k while step t trains, k being
    `max_staleness`; the step in the steady state is the slower of the two pools (docs/async.md).
    Written to files only when async (and `partial_rollout` only when true), so a synchronous
    workload's file reads the same as before these fields."""
    max_staleness: int | None = Field(default=None, ge=0)
    """`async`: the most policy versions a trained sample may lag the trained weights by (k);
    generation runs at most k batches ahead. 0 is synchronous (the pools take turns); 1 is
    one-step-off (verl's one_step_off_policy). Unset: 1 under `async`, 0 under `sync`."""
    partial_rollout: bool = Field(default=False, exclude_if=lambda value: not value)
    """`async`: a generation interrupted by a weight sync continues under the new weights
    (verl's and OpenRLHF's partial rollout) instead of finishing under the old ones; needs an
    engine that can pause. Only with `execution: async`."""

    @property
    def staleness(self) -> int:
        """The staleness bound k in force: `max_staleness`, or 1 under async and 0 under sync."""
        if self.max_staleness is not None:
            return self.max_staleness
        return 1 if self.execution == "async" else 0

    @property
    def overlaps(self) -> bool:
        """Whether generation overlaps training (async with k >= 1): the step is a steady state."""
        return self.execution == "async" and self.staleness >= 1

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    def role_models(self) -> dict[Role, str | None]:
        """Model name per role; None where the role is unused."""
        return {"actor": self.actor, "critic": self.critic, "reference": self.reference, "reward": self.reward}

    def roles(self) -> tuple[Role, ...]:
        """The roles this workload uses, in canonical order."""
        used = self.role_models()
        return tuple(role for role in ROLES if used[role] is not None)

    def model_name(self, role: Role) -> str:
        """The model name that plays `role`."""
        name = self.role_models()[role]
        if name is None:
            raise KeyError(f"workload {self.name!r} has no {role} model")
        return name


def model_stages(workload: Workload) -> tuple[tuple[Role, Stage], ...]:
    """Every (role, stage) the workload runs each step, in workflow order."""
    roles = workload.roles()
    return tuple(split(name) for name in MODEL_STAGES if role_of(name) in roles)


def with_max_response(workload: Workload, max_tokens: int) -> Workload:
    """The workload with its generation cap (maximum response length) at `max_tokens`.

    The median and p99 scale by the same factor, so the distribution keeps its shape:
    this is the "sequence length" that grows over an RL run. A ValueError for a cap below one token.
    """
    if max_tokens < 1:
        raise ValueError(f"a maximum response length must be a positive number of tokens, got {max_tokens}")
    old = workload.response_len
    scale = max_tokens / old.max
    median = max(1, round(old.median * scale))
    lengths = ResponseLengths(median=median, p99=min(max_tokens, max(median, round(old.p99 * scale))), max=max_tokens)
    return workload.model_copy(update={"response_len": lengths})


def async_problems(workload: Workload) -> Iterator[tuple[str, str]]:
    """(field, message) for each async setting given without `execution: async`."""
    if workload.execution == "async":
        return
    if workload.partial_rollout:
        yield (
            "partial_rollout",
            (
                "a partial rollout continues a generation across weight syncs, which only execution: async has; "
                "set execution: async or drop partial_rollout"
            ),
        )
    if workload.max_staleness:
        yield (
            "max_staleness",
            (
                f"{workload.max_staleness} versions of staleness need execution: async (sync trains every batch "
                "on the weights that generated it); set execution: async or drop max_staleness"
            ),
        )

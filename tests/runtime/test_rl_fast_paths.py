"""The RL step's fast paths compute what the plain code did, bit for bit.

AdamW runs each op once over a bucket of tensors (torch's foreach ops) instead of once per
tensor; `rollout_batch` pads the rows as lists and makes each tensor at once; a phase's
span (`timed` of a name without a `/`) takes no memory reading, a model-stage's does. The
weight sync between model-stages of one layout (`copy_kept`) is held to a fresh reshard by
tests/runtime/test_weight_sync.py.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from nereus.runtime.model import adamw as optim
from nereus.runtime.model.adamw import AdamW, AdamWConfig
from nereus.runtime.rl.stages import rollout_batch
from nereus.runtime.rl.timing import StepSeconds, timed

pytestmark = pytest.mark.logic

CONFIG = AdamWConfig(lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.2)
SHAPES = [(7, 5), (33,), (4, 4, 3), (1,), (50, 2), (3,)]


def one_tensor_at_a_time(
    params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], masters: bool
) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW written out tensor by tensor: the arithmetic the foreach update must reproduce."""
    state = {
        name: {"param": p.clone(), "m1": torch.zeros(p.shape), "m2": torch.zeros(p.shape)} for name, p in params.items()
    }
    if masters:
        for name, p in params.items():
            state[name]["master"] = p.float().clone()
    for step, step_grads in enumerate(grads, start=1):
        bias1, bias2_sqrt = 1 - CONFIG.beta1**step, math.sqrt(1 - CONFIG.beta2**step)
        for name, grad in step_grads.items():
            s, g = state[name], grad.float()
            s["m1"].lerp_(g, 1 - CONFIG.beta1)
            s["m2"].mul_(CONFIG.beta2).addcmul_(g, g, value=1 - CONFIG.beta2)
            master = s["master"] if masters else s["param"].float()
            master.mul_(1 - CONFIG.lr * CONFIG.weight_decay)
            master.addcdiv_(s["m1"], s["m2"].sqrt().div_(bias2_sqrt).add_(CONFIG.eps), value=-CONFIG.lr / bias1)
            s["param"].copy_(master)
    return state


@pytest.mark.parametrize(
    ("dtype", "masters"), [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)]
)
@pytest.mark.parametrize("slice_elements", [1 << 22, 16, 7, 1])
def test_foreach_adamw_is_bitwise_the_update_of_one_tensor_at_a_time(
    dtype: torch.dtype, masters: bool, slice_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small slices split tensors across buckets and buckets across tensors.
    monkeypatch.setattr(optim, "UPDATE_SLICE_ELEMENTS", slice_elements)
    generator = torch.Generator().manual_seed(0)
    start = {f"p{i}": torch.randn(shape, generator=generator).to(dtype) for i, shape in enumerate(SHAPES)}
    # Step 2 leaves one parameter without a gradient: it skips that update.
    grads = [
        {n: torch.randn(p.shape, generator=generator).to(dtype) for n, p in start.items() if (step, n) != (1, "p2")}
        for step in range(4)
    ]
    params = {name: torch.nn.Parameter(tensor.clone()) for name, tensor in start.items()}
    optimizer = AdamW(params, CONFIG, {n: p.detach().float().clone() for n, p in params.items()} if masters else None)
    for step_grads in grads:
        for name, param in params.items():
            param.grad = step_grads.get(name)
        optimizer.step()
    expected = one_tensor_at_a_time(start, grads, masters)
    for name, param in params.items():
        assert torch.equal(param.detach(), expected[name]["param"]), name
        assert torch.equal(optimizer.exp_avg[name], expected[name]["m1"]), name
        assert torch.equal(optimizer.exp_avg_sq[name], expected[name]["m2"]), name
        if masters:
            assert torch.equal(optimizer.masters[name], expected[name]["master"]), name


def row_by_row(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """The batch built one row at a time: prompts right-aligned, responses left-aligned after them."""
    prompt_width = max(len(p) for p in prompts)
    width = prompt_width + max(len(r) for r in responses)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.bool)
    loss_mask = torch.zeros((len(prompts), width), dtype=torch.float32)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        start, end = prompt_width - len(prompt), prompt_width + len(response)
        tokens[row, start:end] = torch.tensor(prompt + response)
        attention[row, start:end] = True
        loss_mask[row, prompt_width:end] = 1.0
    return tokens, attention, loss_mask


def test_rollout_batch_equals_the_batch_built_row_by_row() -> None:
    rng = random.Random(3)
    for case in range(200):
        rows = rng.randint(1, 9)
        prompts = [[rng.randint(0, 30) for _ in range(rng.randint(1, 6))] for _ in range(rows)]
        # Some cases have no response token at all (every sample stopped at once).
        longest = 0 if case % 10 == 0 else 5
        responses = [[rng.randint(0, 30) for _ in range(rng.randint(0, longest))] for _ in range(rows)]
        pad_id = rng.randint(0, 2)
        batch, expected = rollout_batch(prompts, responses, pad_id), row_by_row(prompts, responses, pad_id)
        for got, want in zip((batch.tokens, batch.attention_mask, batch.fields["loss_mask"]), expected, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want), case


class CountingTracker:
    """Stands in for the rank's PeakTracker: records which segments took readings."""

    def __init__(self) -> None:
        self.readings: list[str] = []

    def enter(self, name: str) -> None:
        self.readings.append(f"enter {name}")

    def exit(self, name: str) -> None:
        self.readings.append(f"exit {name}")


def test_only_model_stage_spans_take_memory_readings() -> None:
    tracker: Any = CountingTracker()
    seconds = StepSeconds(tracker)
    with timed(seconds, "actor/training"), timed(seconds, "exchange"):
        pass
    with timed(seconds, "advantages"):
        pass
    assert tracker.readings == ["enter actor/training", "exit actor/training"]
    assert set(seconds) == {"actor/training", "exchange", "advantages"}

"""Learning-rate schedules, loss aggregation modes, demonstrations and TensorBoard scalars."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from nereus.runtime.model.transformer import Batch
from nereus.runtime.rl.objectives import aggregation_normalizer, aggregation_weights
from nereus.runtime.rl.optimization import learning_rate, update_rules, with_decay_horizon
from nereus.runtime.rl.tasks import CharTokenizer, get_task
from nereus.runtime.rl.warm_start import demonstrations
from nereus.spec.run_config import RLConfig
from nereus.spec.run_folder import StepMetrics

pytestmark = pytest.mark.logic


def test_warmup_then_constant():
    config = RLConfig(lr_warmup_steps=4)
    rates = [learning_rate(config, 1.0, step) for step in range(6)]
    assert rates == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_to_the_floor_at_the_horizon():
    config = with_decay_horizon(RLConfig(lr_schedule="cosine", lr_warmup_steps=2, min_lr_ratio=0.1), 12)
    assert config.lr_decay_steps == 12
    rates = [learning_rate(config, 2.0, step) for step in range(14)]
    assert rates[:3] == [1.0, 2.0, 2.0]
    assert rates[7] == pytest.approx(0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))
    assert rates[12] == rates[13] == pytest.approx(0.2)
    assert all(a >= b for a, b in itertools.pairwise(rates[2:]))


def test_update_rules_cover_the_trained_stages_only():
    config = RLConfig(actor_lr=0.1, critic_lr=0.2, grad_clip=None)
    rules = update_rules(config, 0, ["actor/generation", "actor/training", "critic/training"])
    assert {name: (rule.lr, rule.max_grad_norm) for name, rule in rules.items()} == {
        "actor/training": (0.1, None),
        "critic/training": (0.2, None),
    }
    assert RLConfig().grad_clip == 1.0 and RLConfig().loss_agg_mode == "token-mean"


def test_loss_aggregation_modes_weigh_tokens_as_verl_does():
    # Row 0: 3 response tokens with loss 1 each; row 1: 1 response token with loss 5.
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    losses = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 5.0], [0.0, 0.0, 0.0, 0.0]])
    batch = Batch(torch.zeros(3, 4, dtype=torch.long), torch.ones(3, 4, dtype=torch.bool), {"loss_mask": mask})

    def loss(mode: str) -> float:
        weights = aggregation_weights(batch, mode)  # type: ignore[arg-type]
        return float((losses * weights).sum()) / aggregation_normalizer(batch, mode)  # type: ignore[arg-type]

    assert loss("token-mean") == pytest.approx(8 / 4)
    assert loss("seq-mean-token-sum") == pytest.approx((3 + 5) / 2)
    assert loss("seq-mean-token-mean") == pytest.approx((1 + 5) / 2)


def test_demonstrations_mark_the_answer_and_its_end():
    tokenizer = CharTokenizer()
    batch = demonstrations(get_task("sort"), tokenizer, 4, seed=1)
    for row in range(4):
        marked = batch.tokens[row][batch.field("loss_mask")[row] > 0].tolist()
        assert marked[-1] == tokenizer.eos_id
        answer = tokenizer.decode(marked)
        assert answer == "".join(sorted(answer)) and answer


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nereus.runtime.rl.tensorboard import TENSORBOARD_NAME, TensorBoardLog

    log = TensorBoardLog(tmp_path)
    for step in range(3):
        log(
            StepMetrics(
                step, 0.1 * step, 0.1 * step, 0.0, 4.0, 2, 6, 5, 0.5, None, 1.0,
                stage_seconds={"actor/training": 0.2}, grad_norm={"actor/training": 2.0 + step},
                lr={"actor/training": 1e-3},
            )
        )  # fmt: skip
    log.close()
    events = EventAccumulator(str(tmp_path / TENSORBOARD_NAME))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"rl/reward", "grad_norm/actor/training", "lr/actor/training", "seconds/actor/training"} <= set(tags)
    assert "rl/critic_loss" not in tags  # None is not a scalar
    assert [event.value for event in events.Scalars("grad_norm/actor/training")] == [2.0, 3.0, 4.0]

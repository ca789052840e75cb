"""Routing replay: a trainer forced onto the rollout's experts computes the rollout's numbers.

The model is built so that routing hangs on rounding: one expert per token (top-1) and every
sparse layer's router rows in near-tied pairs (r, r + 1e-8 u, -r, -r + 1e-8 v), so each token
sits between two experts whose logits differ by about the rounding of the hidden state. The
rollout engine (tp = 1) samples responses and records, per token and MoE layer, the experts
it routes to (`Engine.routing`) with its log-probs of the sampled tokens; the trainer (the
same weights at tp = 2, whose row-parallel sums round differently) routes a share of the
tokens elsewhere and so disagrees with the rollout's log-probs by far more than rounding.
Given the rollout's routing (`moe.ROUTES_FIELD`), its old log-probs equal the rollout's
within 1e-6, its routing is the rollout's, and its training loss is the one of the rollout's
log-probs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from nereus.runtime.comm import collectives
from nereus.runtime.comm.spawn import spawn
from nereus.runtime.generation.generate import SamplingConfig, generate
from nereus.runtime.model.engine import Engine
from nereus.runtime.model.initialization import init_logical_params
from nereus.runtime.model.losses import NextTokenLoss
from nereus.runtime.model.moe import ROUTES_FIELD, routing_mismatch, sparse_layers
from nereus.runtime.model.transformer import Batch
from nereus.runtime.state.shard_layout import RankLayout
from nereus.spec.model import Model, MoE
from nereus.spec.presets import MODELS

pytestmark = pytest.mark.one_rank

TIED: Model = MODELS["tiny"].model_copy(
    update={
        "name": "tiny-near-tied-moe",
        "tied_embeddings": False,
        "moe": MoE(num_experts=4, experts_per_token=1, expert_ffn_dim=32, dense_layers=[1]),
    }
)
EPS = 1e-8
PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 12, 12


def near_tied_weights() -> dict[str, torch.Tensor]:
    logical = init_logical_params(TIED, "lm", seed=7, randomize_all=True)
    generator = torch.Generator().manual_seed(0)
    for layer in sparse_layers(TIED):
        router = logical[f"layers.{layer}.mlp.router.weight"]
        base = router[0].clone()
        router[1] = base + EPS * torch.randn(base.shape, generator=generator)
        router[2] = -base
        router[3] = -base + EPS * torch.randn(base.shape, generator=generator)
    return logical


def worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    logical = near_tied_weights()
    rollout = Engine.create(TIED, "lm", RankLayout(1, 1, 1, (0,)))
    trainer = Engine.create(TIED, "lm", RankLayout(2, 1, 1, (0, 1)))
    assert trainer is not None
    recorded = None
    if rollout is not None:
        rollout.load_logical_params(logical)
        prompts = torch.randint(3, TIED.vocab_size, (PROMPTS, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
        sampled = generate(rollout, prompts.tolist(), SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0))
        batch = Batch(sampled.tokens, sampled.attention_mask)
        recorded = (sampled.tokens, sampled.attention_mask, rollout.routing(batch), rollout.log_probs(batch))
    tokens, mask, routes, rollout_log_probs = collectives.all_gathered_objects(recorded)[0]
    trainer.load_logical_params(logical)
    plain, replayed = Batch(tokens, mask), Batch(tokens, mask, {ROUTES_FIELD: routes})
    scored = mask[:, 1:]
    loss_mask = mask.clone()
    loss_mask[:, :PROMPT_LEN] = False
    response = loss_mask[:, 1:]
    own_log_probs = trainer.log_probs(plain)
    replay_log_probs = trainer.log_probs(replayed)
    losses = {}
    for name, batch in (("own", plain), ("replayed", replayed)):
        fields = {**batch.fields, "loss_mask": loss_mask}
        losses[name] = trainer.forward_backward(Batch(tokens, mask, fields), NextTokenLoss())
    dist.barrier()
    return {
        "mismatch without replay": routing_mismatch(routes, trainer.routing(plain), mask),
        "mismatch with replay": routing_mismatch(routes, trainer.routing(replayed), mask),
        "old log-probs without replay": float((own_log_probs - rollout_log_probs).abs()[scored].max()),
        "old log-probs with replay": float((replay_log_probs - rollout_log_probs).abs()[scored].max()),
        "rollout loss": float(-(rollout_log_probs * response).sum() / response.sum()),
        "losses": losses,
    }


@pytest.mark.multiprocess
def test_replaying_the_rollouts_routing_gives_the_rollouts_log_probs() -> None:
    for result in spawn(worker, 2):
        # the construction works: without replay the trainer routes differently and disagrees
        assert result["mismatch without replay"] > 0.01, result
        assert result["old log-probs without replay"] > 1e-4, result
        # with replay it routes as the rollout did and computes the rollout's log-probs
        assert result["mismatch with replay"] == 0.0, result
        assert result["old log-probs with replay"] < 1e-6, result
        assert abs(result["losses"]["replayed"] - result["rollout loss"]) < 1e-6, result
        assert abs(result["losses"]["own"] - result["rollout loss"]) > 1e-6, result

"""The chunked LM head (`nereus.runtime.model.chunked_head`): log-probs, entropy and their
gradients equal those of the whole logits within 1e-6 (fp32; relative above 1) on one rank and on two tensor
ranks, its peak memory holds about one chunk of logits (measured by torch's CPU memory
profiler, whose allocation events do not depend on timing or load), and the engine's training
and log-prob passes give the reference model's numbers whatever the chunk."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from rl_reference import entropy_from_logits
from torch.nn import functional as F

from nereus.runtime.comm import collectives
from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model import chunked_head
from nereus.runtime.model.adamw import AdamWConfig
from nereus.runtime.model.engine import Engine, EngineConfig
from nereus.runtime.model.initialization import init_logical_params, shard_params
from nereus.runtime.model.transformer import Batch, ReferenceModel
from nereus.runtime.rl.objectives import PolicyObjective
from nereus.runtime.state.shard_layout import RankLayout
from nereus.spec.presets import MODELS

pytestmark = pytest.mark.one_rank

TOL = 1e-6
TINY = MODELS["tiny"]


def inputs(tokens: int, hidden: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(tokens, hidden, generator=generator),
        torch.randn(vocab, hidden, generator=generator) * 0.3,
        torch.randint(0, vocab, (tokens,), generator=generator),
    )


def whole(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy from the whole logits, plainly."""
    logits = F.linear(hidden, weight)
    log_probs = -F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none").view(targets.shape)
    return log_probs, entropy_from_logits(logits)


def gradients(
    hidden: torch.Tensor, weight: torch.Tensor, compute: Any, coefficients: tuple[float, float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs, entropy, d/d hidden, d/d weight) of sum(c0 * w * lp + c1 * w' * ent)."""
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    log_probs, entropy = compute(hidden, weight)
    ramp = torch.linspace(-1.0, 2.0, log_probs.numel()).view(log_probs.shape)
    loss = (coefficients[0] * ramp * log_probs).sum() + (coefficients[1] * ramp.flip(-1) * entropy).sum()
    loss.backward()
    assert hidden.grad is not None and weight.grad is not None
    return log_probs.detach(), entropy.detach(), hidden.grad, weight.grad


def max_error(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    """The largest |a - b| / (1 + |b|): absolute below 1, relative above (an fp32 log-prob of
    -5 has an ulp of 4.8e-7, so an absolute 1e-6 would be two ulps there)."""
    return max(float(((x - y).abs() / (1 + y.abs())).max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("chunk", [1, 3, 7, 30, 31, 1000])
@pytest.mark.parametrize("coefficients", [(1.0, 0.0), (0.0, 1.0), (0.7, -0.4)])
def test_chunked_equals_whole_logits_on_one_rank(chunk: int, coefficients: tuple[float, float]) -> None:
    hidden, weight, targets = inputs(30, 16, 50)
    hidden, targets = hidden.view(5, 6, 16), targets.view(5, 6)  # leading dims are kept
    shard = chunked_head.HeadShard(weight, 0)

    def chunked(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return chunked_head.token_log_probs_and_entropy(h, targets, chunked_head.HeadShard(w, 0), chunk)

    expected = gradients(hidden, weight, lambda h, w: whole(h, w, targets), coefficients)
    assert max_error(gradients(hidden, weight, chunked, coefficients), expected) < TOL
    # The log-probs-only entry point gives the same numbers.
    with torch.no_grad():
        assert torch.allclose(chunked_head.token_log_probs(hidden, targets, shard, chunk), expected[0], atol=TOL)


def test_log_probs_alone_differentiate_as_whole_logits() -> None:
    hidden, weight, targets = inputs(23, 8, 40, seed=1)

    def chunked(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = chunked_head.token_log_probs(h, targets, chunked_head.HeadShard(w, 0), 4)
        return log_probs, torch.zeros_like(log_probs)

    got = gradients(hidden, weight, chunked, (1.0, 0.0))
    expected = gradients(hidden, weight, lambda h, w: whole(h, w, targets), (1.0, 0.0))
    assert max_error(got[::2] + got[3:], expected[::2] + expected[3:]) < TOL


def test_chunk_must_be_positive() -> None:
    hidden, weight, targets = inputs(4, 8, 10)
    with pytest.raises(ValueError, match="logit_chunk_tokens must be a positive token count, not 0"):
        chunked_head.token_log_probs(hidden, targets, chunked_head.HeadShard(weight, 0), 0)
    with pytest.raises(ValueError, match="logit_chunk_tokens"):
        EngineConfig(logit_chunk_tokens=0)


def peak_bytes(run: Any) -> int:
    """Highest sum of live CPU tensor bytes allocated while `run()` runs, from the allocation
    and free events of torch's memory profiler (in event order: no timing involved)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy", [False, True])
def test_peak_memory_holds_about_one_chunk_of_logits(dtype: torch.dtype, entropy: bool) -> None:
    """4096 tokens of a 4096-token vocabulary (64 MB of fp32 logits) in chunks of 256 tokens
    (4 MB): forward and backward hold one fp32 chunk beside the gradients they return for fp32
    log-probs (what the cost model's logits term prices), at most two with a 16-bit model's
    logits or the entropy, where the whole logits' loss holds several whole copies."""
    tokens, hidden_dim, vocab, chunk = 4096, 64, 4096, 256
    hidden, weight, targets = inputs(tokens, hidden_dim, vocab, seed=2)
    hidden = hidden.to(dtype).requires_grad_(True)
    weight = weight.to(dtype).requires_grad_(True)

    def chunked() -> None:
        shard = chunked_head.HeadShard(weight, 0)
        if entropy:
            log_probs, entropies = chunked_head.token_log_probs_and_entropy(hidden, targets, shard, chunk)
            (log_probs.sum() + entropies.sum()).backward()
        else:
            chunked_head.token_log_probs(hidden, targets, shard, chunk).sum().backward()

    def unchunked() -> None:
        log_probs, entropies = whole(hidden, weight, targets)
        (log_probs.sum() + (entropies.sum() if entropy else 0.0)).backward()

    returned = (hidden.numel() + weight.numel()) * hidden.element_size()  # the two gradients
    chunk_logits = chunk * vocab * 4
    measured = {}
    for name, run in (("chunked", chunked), ("unchunked", unchunked)):
        hidden.grad = weight.grad = None
        measured[name] = peak_bytes(run) - returned
    priced = 1 if dtype == torch.float32 and not entropy else 2
    assert measured["chunked"] <= priced * chunk_logits * 1.1, measured
    # The whole logits alone are 16 chunks; their loss holds more than one copy of them.
    assert measured["unchunked"] >= 16 * chunk_logits
    assert measured["chunked"] * 8 < measured["unchunked"], measured


def tp_worker(rank: int, world: int) -> dict[str, float]:
    """Two tensor ranks, each with half the vocabulary's rows, against the whole logits."""
    torch.set_num_threads(1)
    group = dist.new_group([0, 1])
    hidden, weight, targets = inputs(26, 12, 40, seed=3)
    hidden, targets = hidden.view(2, 13, 12), targets.view(2, 13)
    rows = slice(rank * 20, (rank + 1) * 20)
    errors: dict[str, float] = {}
    for chunk in (1, 5, 26):
        for coefficients in ((1.0, 0.0), (0.0, 1.0), (0.5, 0.3)):
            expected = gradients(hidden, weight, lambda h, w: whole(h, w, targets), coefficients)

            def chunked(h: torch.Tensor, w: torch.Tensor, chunk: int = chunk) -> tuple[torch.Tensor, torch.Tensor]:
                shard = chunked_head.HeadShard(w[rows], rank * 20, group)
                return chunked_head.token_log_probs_and_entropy(h, targets, shard, chunk)

            got = gradients(hidden, weight, chunked, coefficients)
            # Each rank's weight gradient covers its rows; the hidden gradient is summed over both.
            key = f"chunk {chunk} {coefficients}"
            errors[key] = max_error((*got[:3], got[3][rows]), (*expected[:3], expected[3][rows]))
    collectives.barrier(group)
    return errors


@pytest.mark.multiprocess
def test_chunked_equals_whole_logits_on_two_tensor_ranks() -> None:
    for errors in spawn(tp_worker, 2):
        assert max(errors.values()) < TOL, errors


def reference(seed: int = 4) -> ReferenceModel:
    ref = ReferenceModel(TINY, "lm")
    logical = init_logical_params(TINY, "lm", seed, randomize_all=True)
    with torch.no_grad():
        for name, param in ref.named_logical_parameters().items():
            param.copy_(logical[name])
    return ref


def rl_batch() -> Batch:
    generator = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, TINY.vocab_size, (4, 11), generator=generator)
    mask = torch.ones(4, 11, dtype=torch.bool)
    mask[2, :3] = False  # a left-padded row
    loss_mask = torch.zeros(4, 11)
    loss_mask[:, 5:] = 1.0
    fields = {
        "loss_mask": loss_mask,
        "old_log_probs": -torch.rand(4, 11, generator=generator) * 4 * loss_mask,
        "advantages": torch.randn(4, 11, generator=generator),
        "ref_log_probs": -torch.rand(4, 11, generator=generator) * 4 * loss_mask,
    }
    return Batch(tokens, mask, fields)


def engine_worker(rank: int, world: int) -> dict[str, float]:
    """The engine's log-probs and policy-loss gradients (KL and entropy terms on) in chunks of
    3 tokens, against the one-process reference on whole logits: tp=2, and dp=2 under full
    sharding (FSDP2 gathers the head weight around the chunked head inside the forward)."""
    torch.set_num_threads(1)
    ref, batch = reference(), rl_batch()
    objective = PolicyObjective(0.2, 0.1, 0.05, "token-mean")
    logits = ref(batch.tokens, batch.attention_mask)
    weights = objective.weights(batch)
    loss = (objective.token_losses(logits, batch, ref) * weights).sum() / objective.normalizer(batch)
    loss.backward()
    expected_log_probs = ref.token_log_probs(logits[:, :-1], batch.tokens[:, 1:]).detach()
    logical = {name: p.detach() for name, p in ref.named_logical_parameters().items()}
    grads = {name: p.grad for name, p in ref.named_logical_parameters().items()}
    errors: dict[str, float] = {}
    layouts = {"tp2": (RankLayout(2, 1, 1, (0, 1)), False), "dp2-full": (RankLayout(1, 1, 2, (0, 1)), True)}
    for name, (layout, full) in layouts.items():
        config = EngineConfig(AdamWConfig(lr=1e-3), full_shard=full, logit_chunk_tokens=3)
        engine = Engine.create(TINY, "lm", layout, config)
        assert engine is not None
        engine.load_logical_params(logical)
        log_probs = engine.log_probs(batch)
        errors[f"{name} log-probs"] = float((log_probs - expected_log_probs).abs().max())
        engine.zero_grad()
        engine_loss = engine.forward_backward(batch, objective)
        errors[f"{name} loss"] = abs(engine_loss - float(loss.detach()))
        g = engine.groups
        shard = shard_params(grads, TINY, "lm", layout.tp, layout.pp, g.pp_rank, g.tp.rank)  # type: ignore[arg-type]
        state = engine.whole_state(("grad",)) if full else engine.local_state()
        errors[f"{name} grads"] = max(float((state[f"grad/{n}"] - t).abs().max()) for n, t in shard.items())
    return errors


@pytest.mark.multiprocess
def test_engine_chunked_passes_match_the_reference() -> None:
    for errors in spawn(engine_worker, 2):
        assert max(errors.values()) < 1e-5, errors

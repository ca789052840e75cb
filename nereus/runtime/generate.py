"""Batched autoregressive generation with a KV cache under tensor and pipeline parallelism.

Prompts are left-padded so every sequence's next token sits in the last column. Each
step runs the new tokens through the stages (hidden states go forward by send/recv),
the last stage gathers the vocabulary columns over its tensor ranks and picks the next
token (greedy, or temperature + top-p sampling from a seeded generator, so every tensor
rank draws the same token), and broadcasts it to the other stages. A sequence stops at
EOS; generation stops when all have, or after `max_new_tokens`.

`reference_generate` does the same with the single-process reference model, recomputing
the whole prefix each step (no cache): the tests hold the cached, sharded path to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nereus.runtime.engine import Engine
from nereus.runtime.model import ReferenceModel, positions_from_mask
from nereus.runtime.tensor_parallel import gather_last_dim


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen and when generation stops."""

    max_new_tokens: int
    """Most tokens generated per sequence."""
    temperature: float = 0.0
    """0 picks the most likely token (greedy); above 0 samples from softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: draw only from the most likely tokens whose probabilities sum to top_p."""
    eos_token_id: int | None = None
    """A sequence stops after producing this token; None generates max_new_tokens always."""
    pad_token_id: int = 0
    """Fills prompts on the left and responses after they stop."""
    seed: int = 0
    """Seed of the sampling generator (same seed, same logits: same tokens)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class Generation:
    """Prompts (left-padded) followed by the generated tokens."""

    tokens: torch.Tensor
    """[b, prompt_width + generated] token ids; pad_token_id where attention_mask is False."""
    attention_mask: torch.Tensor
    """[b, prompt_width + generated] bool: real prompt and response tokens."""
    prompt_width: int
    """Columns taken by the left-padded prompts."""

    def responses(self) -> list[list[int]]:
        """Each sequence's generated tokens (through EOS when it stopped there)."""
        out = []
        for row, mask in zip(
            self.tokens[:, self.prompt_width :], self.attention_mask[:, self.prompt_width :], strict=True
        ):
            out.append([int(t) for t in row[mask]])
        return out


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generation needs at least one prompt and every prompt at least one token")
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = True
    return tokens, mask


def sample_next(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> torch.Tensor:
    """[b] next tokens from [b, vocab] logits."""
    logits = logits.float()
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / config.temperature, dim=-1)
    if config.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= config.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


#: next_logits(tokens so far [b, n], mask [b, n], step) -> [b, vocab] logits of the next token.
NextLogits = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor | None]


def _decode(
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    next_logits: NextLogits,
    share: Callable[[torch.Tensor], torch.Tensor],
) -> Generation:
    """The loop both paths share; `next_logits` may return None on ranks that do not sample,
    `share` hands the sampler's tokens to every rank."""
    tokens, mask = left_pad(prompts, config.pad_token_id)
    width = tokens.shape[1]
    generator = torch.Generator().manual_seed(config.seed)
    finished = torch.zeros(len(prompts), dtype=torch.bool)
    for step in range(config.max_new_tokens):
        logits = next_logits(tokens, mask, step)
        chosen = (
            torch.zeros(len(prompts), dtype=torch.long)
            if logits is None
            else sample_next(logits.cpu(), config, generator)
        )
        chosen = share(chosen)
        chosen = chosen.masked_fill(finished, config.pad_token_id)
        tokens = torch.cat([tokens, chosen.unsqueeze(1)], dim=1)
        mask = torch.cat([mask, (~finished).unsqueeze(1)], dim=1)
        if config.eos_token_id is not None:
            finished |= chosen == config.eos_token_id
        if bool(finished.all()):
            break
    return Generation(tokens, mask, width)


def generate(engine: Engine, prompts: Sequence[Sequence[int]], config: SamplingConfig) -> Generation:
    """Generate from `prompts` on this engine's replica (collective over its ranks)."""
    engine.require_head("lm")
    stage, link, tp = engine.stage, engine.groups.link, engine.groups.tp
    device = engine.device
    capacity = max(len(p) for p in prompts) + config.max_new_tokens
    caches = stage.new_caches(len(prompts), capacity, torch.float32, device)
    cached = [0]

    def next_logits(tokens: torch.Tensor, mask: torch.Tensor, step: int) -> torch.Tensor | None:
        start = cached[0]
        new = tokens[:, start:].to(device)
        key_mask = mask.to(device)
        positions = positions_from_mask(key_mask)[:, start:]
        if link.is_first:
            stage_input = new
        else:
            stage_input = torch.empty((*new.shape, engine.model.hidden_dim), device=device)
            dist.recv(stage_input, src=link.prev_rank, group=link.group)
        with torch.no_grad():
            output = stage(stage_input, key_mask, positions, caches, start)
        cached[0] = tokens.shape[1]
        if not link.is_last:
            dist.send(output.contiguous(), dst=link.next_rank, group=link.group)
            return None
        return gather_last_dim(output[:, -1], tp)

    def share(chosen: torch.Tensor) -> torch.Tensor:
        return engine.from_last_stage(chosen.to(device)).cpu()

    return _decode(prompts, config, next_logits, share)


def reference_generate(model: ReferenceModel, prompts: Sequence[Sequence[int]], config: SamplingConfig) -> Generation:
    """Generation by the single-process reference model, recomputing the prefix every step."""

    def next_logits(tokens: torch.Tensor, mask: torch.Tensor, step: int) -> torch.Tensor:
        with torch.no_grad():
            return model(tokens, mask)[:, -1]

    return _decode(prompts, config, next_logits, lambda chosen: chosen)

"""Choosing next tokens for a whole batch at once, on the device that holds the logits.

Every sample has its own random stream: the uniform it draws for its k-th generated token is
a hash of (its key, k), where its key comes from (sampling seed, sample id). A counter-based
stream needs no generator object to carry around: a sample drawn on any replica, in any
batch, after any preemption or migration, draws the same uniform for the same token, and a
whole batch's uniforms are a few integer operations on one tensor. A token is then the
inverse CDF of the filtered distribution (temperature, top-k, top-p) at that uniform.

The hash is Chris Wellons' 32-bit `lowbias32` finaliser, computed in int64 with 16-bit limbs
so no product overflows (integer overflow is not defined behaviour for torch kernels).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


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
    """Seed of the per-sample random streams: sample i draws from one keyed by (seed, i)."""
    top_k: int = 0
    """Draw only from the k most likely tokens; 0 keeps every token."""
    stop_token_ids: tuple[int, ...] = ()
    """Further tokens a sequence stops after (besides `eos_token_id`)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no top-k filter), got {self.top_k}")

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        """Every token a sequence stops after."""
        return self.stop_token_ids + (() if self.eos_token_id is None else (self.eos_token_id,))


def sample_seed(seed: int, sample_id: int) -> int:
    """The key of sample `sample_id`'s random stream under sampling seed `seed` (63 bits)."""
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for x < 2^32, from 16-bit limbs (every product below 2^48)."""
    low = (x & 0xFFFF) * constant
    high = ((x >> 16) * constant) & 0xFFFF
    return (low + (high << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[b] float64 uniforms in [0, 1): draw `counters[i]` of the stream keyed `keys[i]` (int64)."""
    low, high = keys & _MASK32, (keys >> 32) & _MASK32
    mixed = _hash32(low ^ _hash32(high ^ _hash32(counters & _MASK32)))
    first, second = _hash32(mixed ^ 0x68E31DA4), _hash32(mixed ^ 0x1B56C4E9)
    bits = ((first >> 6) << 27) | (second >> 5)  # 26 + 27 = 53 bits
    return bits.to(torch.float64) * 2.0**-53


#: Vocabularies at least this wide sort on the CPU by `_sort_by_keys` (a 32 x 1024 stable sort:
#: torch 1.5 ms, the keys 0.43 ms, on one thread); narrower ones by torch (40 wide: 13 us against 35).
KEY_SORT_MIN_VOCAB = 256


def sort_descending(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.sort(dim=-1, descending=True, stable=True)` of [b, vocab] float32: most likely first,
    ties in vocabulary order; the same values and indices by the faster way for the width."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.shape[-1] < KEY_SORT_MIN_VOCAB:
        return x.sort(dim=-1, descending=True, stable=True)
    return _sort_by_keys(x)


def _sort_by_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stable descending sort as an unstable sort of distinct int64 keys (numpy's vectorised
    quicksort, several times torch's stable sort): the high 32 bits order the values (their
    float bits made monotonic, then negated), the low ones are the vocabulary index, so equal
    values come out in index order as a stable sort leaves them."""
    bits = (x + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0, equal to it as floats are
    monotonic = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int order = float order
    keys = (~monotonic).long() * (1 << 32) + torch.arange(x.shape[-1])
    order = torch.from_numpy(np.sort(keys.numpy(), axis=-1)) & _MASK32
    return x.gather(-1, order), order


def sample_at(logits: torch.Tensor, config: SamplingConfig, uniforms: torch.Tensor) -> torch.Tensor:
    """[b] next tokens from [b, vocab] logits: greedy, or the inverse CDF at each row's uniform
    (float64, [b], on the logits' device) of its distribution at `config`'s temperature,
    restricted to its top_k most likely tokens and to the nucleus of mass top_p."""
    if config.temperature == 0:
        return logits.float().argmax(dim=-1)
    # One sort serves both filters and the CDF: most likely first, ties in vocabulary order.
    ordered, order = sort_descending(logits.float() / config.temperature)
    if 0 < config.top_k < ordered.shape[-1]:
        ordered[:, config.top_k :] = float("-inf")
    probs = torch.softmax(ordered, dim=-1)
    if config.top_p < 1:
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= config.top_p, 0.0)
    cdf = probs.double().cumsum(dim=-1)
    target = uniforms.unsqueeze(-1) * cdf[:, -1:]
    # Filtered tokens sit at the end of the order: cdf there equals the total, which stays
    # above u * total, so they are never counted past.
    index = (cdf <= target).sum(dim=-1).clamp(max=ordered.shape[-1] - 1)
    return order.gather(-1, index.unsqueeze(-1)).squeeze(-1)


def sample_streams(
    logits: torch.Tensor, config: SamplingConfig, keys: torch.Tensor, counters: torch.Tensor
) -> torch.Tensor:
    """[b] next tokens: row i's from draw `counters[i]` of the stream keyed `keys[i]`."""
    if config.temperature == 0:
        return logits.float().argmax(dim=-1)
    uniforms = stream_uniforms(keys.to(logits.device), counters.to(logits.device))
    return sample_at(logits, config, uniforms)


def stops(tokens: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """[b] bool: which of these just-chosen tokens end their sequence."""
    if not config.stop_tokens:
        return torch.zeros_like(tokens, dtype=torch.bool)
    return torch.isin(tokens, torch.tensor(config.stop_tokens, dtype=tokens.dtype, device=tokens.device))

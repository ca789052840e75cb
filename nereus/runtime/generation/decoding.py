"""What the decoders share: left-padded prompts, the finished batch, rows handed from one
replica's decoder to another's (nereus's or vLLM's), and one forward through a replica's stages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nereus.runtime.model.attention import KVStore
from nereus.runtime.model.engine import Engine
from nereus.runtime.model.transformer import positions_from_mask


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
        generated = zip(self.tokens[:, self.prompt_width :], self.attention_mask[:, self.prompt_width :], strict=True)
        return [[int(t) for t in row[mask]] for row, mask in generated]


def _padded(rows: Sequence[Sequence[int]], pad_token_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` as one [b, longest] batch, padded on the left or the right, and its mask."""
    width = max(len(row) for row in rows)
    tokens = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for index, row in enumerate(rows):
        columns = slice(width - len(row), width) if left else slice(0, len(row))
        tokens[index, columns] = torch.tensor(list(row), dtype=torch.long)
        mask[index, columns] = True
    return tokens, mask


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generation needs at least one prompt and every prompt at least one token")
    return _padded(prompts, pad_token_id, left=True)


@dataclass(frozen=True)
class HandOff:
    """Rows leaving one replica's decoder for another's, as of between two decode steps."""

    sample_ids: list[int]
    sequences: list[list[int]]
    """Each row's prompt and tokens generated so far (no padding)."""
    prompt_lens: list[int]
    budgets: list[int]
    """Each row's most new tokens."""
    generated: list[int]
    """Tokens each row has generated (its sampling stream's next draw: see `sampling`)."""
    kv: list[torch.Tensor] | None
    """Each row's cache on this rank, [layers, 2 (keys, values), local kv heads, tokens - 1,
    head_dim] (every token but the last, which the next step feeds); None: the receiver
    recomputes it from `sequences`."""


def assemble(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_token_id: int) -> Generation:
    """Left-padded prompts followed by right-padded responses."""
    tokens, mask = left_pad(prompts, pad_token_id)
    generated, generated_mask = _padded(responses, pad_token_id, left=False)
    return Generation(torch.cat([tokens, generated], dim=1), torch.cat([mask, generated_mask], dim=1), tokens.shape[1])


def replica_forward(
    engine: Engine,
    new: torch.Tensor,
    key_mask: torch.Tensor,
    caches: Mapping[int, KVStore],
    start: int,
) -> torch.Tensor | None:
    """Feed `new` tokens (the columns from `start` on) through the replica's stages, their keys
    and values going into `caches`; the last stage's output (None on the other stages)."""
    stage, link = engine.pipeline_stage, engine.groups.link
    device = engine.device
    new, key_mask = new.to(device), key_mask.to(device)
    positions = positions_from_mask(key_mask)[:, start:]
    if link.is_first:
        stage_input = new
    else:
        stage_input = torch.empty((*new.shape, engine.model.hidden_dim), dtype=engine.dtype, device=device)
        dist.recv(stage_input, src=link.prev_rank, group=link.group)
    with torch.no_grad():
        output = stage(stage_input, key_mask, positions, caches, start)
    if not link.is_last:
        dist.send(output.contiguous(), dst=link.next_rank, group=link.group)
        return None
    return output

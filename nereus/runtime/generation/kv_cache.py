"""A paged KV cache: fixed-size blocks of tokens in one pool per rank and model-stage.

The pool is allocated once per generation call, sized by a byte budget: the plan's
`kv_budget_bytes` when it sets one, capped by the rank's memory left after the states resident
on it times a utilisation fraction (vLLM's `gpu_memory_utilization`); a CUDA device reports its
free memory, a CPU rank has the cluster's per-GPU memory as its capacity. A pool never takes
more blocks than the replica's sequences need at their longest. Each sequence owns a block
table (its blocks in token order); token t of it lives in slot `table[t // B] * B + t % B`.

Attention reads through the block table: a step's layer view writes the new tokens' keys and
values to their slots and gathers every row's context, right-aligned into a window as wide as
the longest context (slots before a row's first token point at a scratch block and are masked
out), which is exactly the layout `model.attention_mask_4d` expects. Tensor-parallel ranks
hold only their KV heads, so tp=2 halves a sequence's bytes per rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nereus.cost.kv_pool import BLOCK_TOKENS, MEMORY_UTILISATION
from nereus.runtime.model.transformer import DecoderPipelineStage


@dataclass(frozen=True)
class KVBudget:
    """How big a generation replica's KV pool may be, per rank."""

    budget_bytes: int | None = None
    """KV bytes per rank (the plan's `kv_budget_bytes`); None: room for every sequence of the
    call at its longest, within the rank's memory."""
    rank_memory_bytes: int | None = None
    """A CPU rank's memory capacity (the cluster's per-GPU memory); None: a CUDA device's free
    memory bounds the pool, a CPU rank is unbounded."""
    resident_bytes: int = 0
    """Bytes of states already resident on this rank (CPU; CUDA's free memory excludes them)."""
    utilisation: float = MEMORY_UTILISATION
    """Share of the memory left that the pool may take."""
    block_tokens: int = BLOCK_TOKENS
    """Tokens per block."""

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError(f"a KV budget must be positive, got {self.budget_bytes} bytes")
        if not 0 < self.utilisation <= 1:
            raise ValueError(f"the memory utilisation must be in (0, 1], got {self.utilisation}")
        if self.block_tokens < 1:
            raise ValueError(f"a KV block holds at least one token, got {self.block_tokens}")


def blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


def memory_left(budget: KVBudget, device: torch.device) -> float:
    """Bytes the pool may take on this rank, before the budget and the demand cap it."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free * budget.utilisation
    if budget.rank_memory_bytes is None:
        return math.inf
    return max(0, budget.rank_memory_bytes - budget.resident_bytes) * budget.utilisation


def pool_blocks(budget: KVBudget, block_bytes: int, demand_blocks: int, device: torch.device) -> int:
    """Blocks of this rank's pool: the budget's and the memory's, never more than the demand."""
    allowed = min(math.inf if budget.budget_bytes is None else budget.budget_bytes, memory_left(budget, device))
    return int(min(demand_blocks, allowed // block_bytes))


class BlockAllocator:
    """Which blocks of the pool are free; a sequence's blocks go back as it finishes or is preempted."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        assert count <= len(self._free), f"{count} blocks asked of {len(self._free)} free"
        return [self._free.pop() for _ in range(count)]

    def release(self, blocks: Sequence[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """This rank's pool for its pipeline stage's layers: per layer, keys and values of
    [slots, local kv heads, head_dim]; the last block is scratch (padding writes there)."""

    def __init__(self, stage: DecoderPipelineStage, num_blocks: int, block_tokens: int, device: torch.device):
        model = stage.model
        local_kv = max(1, model.num_kv_heads // stage.tp.size)
        self.block_tokens = block_tokens
        self.scratch = num_blocks * block_tokens
        shape = (self.scratch + block_tokens, local_kv, model.head_dim)
        dtype = next(stage.parameters()).dtype
        self.keys = {i: torch.empty(shape, dtype=dtype, device=device) for i in stage.layer_ids}
        self.values = {i: torch.empty(shape, dtype=dtype, device=device) for i in stage.layer_ids}
        for layer in stage.layer_ids:  # masked reads land here: finite values, so 0 * value is 0
            self.keys[layer][self.scratch :] = 0
            self.values[layer][self.scratch :] = 0
        self.device = device

    def slots(self, table: Sequence[int], start: int, stop: int) -> torch.Tensor:
        """[stop - start] slots of tokens start..stop-1 of the sequence with block table `table`."""
        positions = torch.arange(start, stop)
        blocks = torch.tensor(list(table), dtype=torch.long)[positions // self.block_tokens]
        return blocks * self.block_tokens + positions % self.block_tokens

    def views(self, write: torch.Tensor, read: torch.Tensor | None) -> dict[int, PagedLayerView]:
        """Every layer's view for one forward: new tokens go to `write` slots [b, t]; attention
        reads `read` slots [b, window] (None: only the tokens just written)."""
        write = write.to(self.device)
        read = None if read is None else read.to(self.device)
        return {layer: PagedLayerView(self.keys[layer], self.values[layer], write, read) for layer in self.keys}

    def export(self, slots: torch.Tensor) -> torch.Tensor:
        """[layers, 2, local kv heads, tokens, head_dim] of these slots (a hand-off's cache rows)."""
        slots = slots.to(self.device)
        return torch.stack(
            [torch.stack([self.keys[i][slots], self.values[i][slots]]).transpose(1, 2) for i in self.keys]
        ).cpu()

    def install(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write a hand-off's cache rows (see `export`) into these slots."""
        slots, kv = slots.to(self.device), kv.to(self.device)
        for layer, i in enumerate(self.keys):
            self.keys[i][slots] = kv[layer, 0].transpose(0, 1).to(self.keys[i].dtype)
            self.values[i][slots] = kv[layer, 1].transpose(0, 1).to(self.values[i].dtype)


@dataclass
class PagedLayerView:
    """One layer's pool as the attention of one forward sees it (`model.KVStore`)."""

    keys: torch.Tensor
    values: torch.Tensor
    write: torch.Tensor
    read: torch.Tensor | None

    def extend(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new [b, t, kv heads, d] keys and values, return the context's [b, window, kv heads, d]."""
        b, t, heads, d = keys.shape
        flat = self.write.reshape(-1)
        self.keys.index_copy_(0, flat, keys.reshape(b * t, heads, d))
        self.values.index_copy_(0, flat, values.reshape(b * t, heads, d))
        if self.read is None:
            return keys, values
        window = self.read.shape[1]
        gathered = self.read.reshape(-1)
        k = self.keys.index_select(0, gathered).view(b, window, heads, d)
        v = self.values.index_select(0, gathered).view(b, window, heads, d)
        return k, v

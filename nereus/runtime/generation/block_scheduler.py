"""Continuous batching over a block pool: which sequences run at each decode step.

The rules are those of the cost model's reference engine
(`nereus.cost.continuous_batching.simulate_continuous_batching`), counted in blocks:

- a running sequence with g tokens generated holds the blocks of `prompt + g + 1` tokens
  (its context and the token it writes next);
- before a step, waiting sequences are admitted first come first served while the head of
  the queue fits in the free blocks (no overtaking);
- every running sequence then generates one token; finished ones free their blocks at once;
- if the survivors' growth overflows the pool, the most recently admitted one is preempted
  (its blocks freed, its tokens kept) back to the head of the queue, until the rest fit;
  re-admitted, it recomputes its cache from its tokens (vLLM's recompute preemption).

With blocks of one token and one prompt length, this is the reference engine step for step
(tests/runtime/test_generation_scheduler.py holds it to that). The scheduler knows tokens and
blocks only; the engine (`nereus.runtime.generation.continuous`) runs the forwards.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from nereus.runtime.generation.kv_cache import BlockAllocator, blocks_for


@dataclass
class Request:
    """One sample in the engine (a request): its tokens so far, its blocks, and how much of it is cached."""

    sample_id: int
    tokens: list[int]
    """Prompt then the tokens generated so far."""
    prompt_len: int
    budget: int
    """Most tokens it generates."""
    key: int = 0
    """Key of its sampling stream (`sampling.sample_seed`)."""
    blocks: list[int] = field(default_factory=list)
    """Its block table (empty while waiting)."""
    cached: int = 0
    """Tokens whose keys and values are in its blocks."""
    draws: list[float] = field(default_factory=list)
    """A window of its sampling stream's uniforms (draws `draws_from`, `draws_from` + 1, ...),
    computed ahead for many steps at once (the engine's `sampling.stream_uniforms`)."""
    draws_from: int = 0

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def reserved_tokens(self) -> int:
        """Tokens it holds while running: its context and the token it writes next."""
        return len(self.tokens) + 1


class Scheduler:
    """The waiting queue and the running batch of one replica over one block pool."""

    def __init__(self, num_blocks: int, block_tokens: int):
        self.allocator = BlockAllocator(num_blocks)
        self.block_tokens = block_tokens
        self.waiting: deque[Request] = deque()
        """Head first: preempted sequences go back to the front."""
        self.running: list[Request] = []
        """In admission order: the last is the newest, preempted first."""
        self.preemptions = 0

    def blocks_of(self, seq: Request) -> int:
        return blocks_for(seq.reserved_tokens, self.block_tokens)

    def fits_alone(self, tokens: int) -> bool:
        """Whether a sequence that will hold `tokens` tokens fits in the whole pool."""
        return blocks_for(tokens, self.block_tokens) <= self.allocator.num_blocks

    def submit(self, seqs: Sequence[Request]) -> None:
        """Queue these sequences behind the waiting ones."""
        for seq in seqs:
            assert self.fits_alone(seq.prompt_len + seq.budget), "checked by the engine"
        self.waiting.extend(seqs)

    def admit(self) -> list[Request]:
        """Admit the head of the queue while it fits; the admitted (their cache is to be computed)."""
        admitted = []
        while self.waiting and self.blocks_of(self.waiting[0]) <= self.allocator.num_free:
            seq = self.waiting.popleft()
            seq.blocks = self.allocator.allocate(self.blocks_of(seq))
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def place(self, seq: Request) -> bool:
        """Run a sequence arriving with its cache (a hand-off) when it fits now, as the newest."""
        if self.waiting or self.blocks_of(seq) > self.allocator.num_free:
            return False
        seq.blocks = self.allocator.allocate(self.blocks_of(seq))
        self.running.append(seq)
        return True

    def finish(self, seq: Request) -> None:
        """Drop a running sequence (finished, or handed off): its blocks are free again."""
        self.running.remove(seq)
        self._release(seq)

    def withdraw(self, seq: Request) -> None:
        """Drop a waiting sequence (handed off)."""
        self.waiting.remove(seq)

    def grow(self) -> list[Request]:
        """After a step: preempt the newest until every running sequence's next token fits,
        then give the others the blocks they grew into; the preempted, newest first."""
        preempted = []
        needed = sum(self.blocks_of(seq) for seq in self.running)
        while needed > self.allocator.num_blocks:
            seq = self.running.pop()
            needed -= self.blocks_of(seq)
            self._release(seq)
            self.waiting.appendleft(seq)
            preempted.append(seq)
            self.preemptions += 1
        for seq in self.running:
            extra = self.blocks_of(seq) - len(seq.blocks)
            if extra > 0:
                seq.blocks += self.allocator.allocate(extra)
        return preempted

    def _release(self, seq: Request) -> None:
        self.allocator.release(seq.blocks)
        seq.blocks, seq.cached = [], 0

    @property
    def blocks_in_use(self) -> int:
        return self.allocator.num_blocks - self.allocator.num_free

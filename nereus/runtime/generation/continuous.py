"""The continuous-batching generation engine of one replica, over a paged KV cache.

Every rank of the replica holds the same `Scheduler` (same requests, same decisions) and a
`PagedKVCache` of its own stage's layers and tensor rank's heads. A step admits what the
pool has room for, computes the cache of the admitted requests (a prefill of all their
tokens: a fresh prompt, or a preempted request's prompt and tokens so far), runs one decode
token for every request already cached, chooses every row's next token at once on the last
stage, and broadcasts them. Finished requests free their blocks; growth past the pool
preempts the newest (`scheduler`). A request's tokens come from its own sampling stream,
indexed by how many it has generated, so neither the batch it runs in nor preemption,
re-admission or migration changes them.

`take` and `receive` hand requests between replicas (the fused rollout's long-tail
migration) as `decoding.HandOff`s: a running request's cache rows travel, or the receiver
recomputes them when it admits the request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nereus.cost.stage import kv_bytes_per_token
from nereus.runtime.comm import collectives
from nereus.runtime.generation.block_scheduler import Request, Scheduler
from nereus.runtime.generation.decoding import HandOff, left_pad, replica_forward
from nereus.runtime.generation.kv_cache import KVBudget, PagedKVCache, blocks_for, pool_blocks
from nereus.runtime.generation.sampling import SamplingConfig, sample_at, sample_seed, stops, stream_uniforms
from nereus.runtime.model.engine import Engine
from nereus.runtime.model.tensor_parallel import gather_last_dim
from nereus.units import format_bytes

#: Draws of a sample's stream computed together when it runs out (hashing them costs ~20 tensor
#: ops, whatever the count: per step it was a tenth of a 32-row decode step of a tiny model).
DRAW_WINDOW = 32


class BatchingDecoder:
    """Continuous batching for one replica (collective over its ranks: each calls the same
    methods with the same arguments). `room_for`: the pool holds at most this many sequences
    of this many tokens (default: every started request at its prompt plus budget)."""

    def __init__(
        self, engine: Engine, config: SamplingConfig, budget: KVBudget, room_for: tuple[int, int] | None = None
    ):
        engine.require_head("lm")
        self.engine = engine
        self.config = config
        self.budget = budget
        self.room_for = room_for
        self.scheduler: Scheduler | None = None
        self.cache: PagedKVCache | None = None
        self.requests: dict[int, Request] = {}
        """Unfinished requests by sample id, in submission order."""
        self.responses: dict[int, list[int]] = {}
        """Finished samples' generated tokens (through the stop token when they stopped at one)."""
        self.peak_blocks = 0
        """Most blocks in use after any step."""

    @property
    def num_active(self) -> int:
        return len(self.requests)

    @property
    def sample_ids(self) -> list[int]:
        return list(self.requests)

    def context_lengths(self) -> list[int]:
        """Tokens (prompt and generated) of every unfinished request, in `sample_ids` order."""
        return [len(request.tokens) for request in self.requests.values()]

    def start(self, prompts: Sequence[Sequence[int]], sample_ids: Sequence[int], budgets: Sequence[int]) -> None:
        """Queue `prompts` as samples `sample_ids`, each stopping after its budget."""
        if len(sample_ids) != len(prompts) or len(budgets) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts need as many sample ids and budgets")
        if any(budget < 1 for budget in budgets):
            raise ValueError(f"every length budget must be at least 1, got {min(budgets)}")
        left_pad(prompts, self.config.pad_token_id)  # refuses empty prompts
        caps = [min(budget, self.config.max_new_tokens) for budget in budgets]
        requests = [self._request(sid, p, len(p), cap) for sid, p, cap in zip(sample_ids, prompts, caps, strict=True)]
        self._submit(requests)

    def _request(self, sample_id: int, tokens: Sequence[int], prompt_len: int, budget: int) -> Request:
        return Request(int(sample_id), list(tokens), prompt_len, budget, sample_seed(self.config.seed, sample_id))

    def _submit(self, requests: list[Request]) -> None:
        scheduler = self._scheduler(requests)
        longest = max(r.prompt_len + r.budget for r in requests)
        if not scheduler.fits_alone(longest):
            needed = blocks_for(longest, self._block) * self._block_bytes
            raise ValueError(
                f"a KV budget of {scheduler.allocator.num_blocks} blocks of {self._block} tokens per rank cannot hold "
                f"one sequence of {longest} tokens: it needs {needed} bytes ({format_bytes(needed)}) per rank; raise "
                "the KV budget"
            )
        self.requests.update({r.sample_id: r for r in requests})
        scheduler.submit(requests)

    @property
    def _block(self) -> int:
        return self.budget.block_tokens

    @property
    def _block_bytes(self) -> int:
        """KV bytes of one block on this rank."""
        stage, groups = self.engine.pipeline_stage, self.engine.groups
        element = next(stage.parameters()).element_size()
        return self._block * kv_bytes_per_token(stage.model, groups.tp.size, groups.link.num_stages, element)

    def _scheduler(self, requests: Sequence[Request]) -> Scheduler:
        """The scheduler, its pool allocated on first use, for `requests` at their longest
        unless `room_for` says otherwise (collective over the replica)."""
        if self.scheduler is not None:
            return self.scheduler
        if self.room_for is not None:
            demand = self.room_for[0] * blocks_for(self.room_for[1], self._block)
        else:
            demand = sum(blocks_for(r.prompt_len + r.budget, self._block) for r in requests)
        mine = pool_blocks(self.budget, self._block_bytes, demand, self.engine.device)
        # Every rank of the replica must hold the same requests: the smallest pool binds.
        agreed = torch.tensor([-float(mine)], dtype=torch.float64, device=self.engine.device)
        groups = self.engine.groups
        for group in (groups.tp.group, groups.link.group):
            if group is not None:
                collectives.all_reduce(agreed, group, op="max")
        num_blocks = int(-agreed.item())
        self.cache = PagedKVCache(self.engine.pipeline_stage, num_blocks, self._block, self.engine.device)
        self.scheduler = Scheduler(num_blocks, self._block)
        return self.scheduler

    def step(self) -> list[int]:
        """Admit, then one token for every running request; the samples that finished with it."""
        assert self.scheduler is not None and self.cache is not None
        admitted = self.scheduler.admit()
        decoding = [r for r in self.scheduler.running if r.cached]
        parts = [self._decode(decoding) if decoding else None, self._prefill(admitted) if admitted else None]
        rows = decoding + admitted
        logits = [part for part in parts if part is not None]
        if logits:
            chosen = self._choose(torch.cat(logits) if len(logits) > 1 else logits[0], rows)
        else:
            chosen = torch.zeros(len(rows), dtype=torch.long, device=self.engine.device)
        chosen = self.engine.from_last_stage(chosen.to(self.engine.device)).cpu()
        ended = stops(chosen, self.config).tolist()
        finished = []
        for request, token, stop in zip(rows, chosen.tolist(), ended, strict=True):
            request.tokens.append(token)
            request.cached = len(request.tokens) - 1
            if stop or request.generated >= request.budget:
                self.responses[request.sample_id] = request.tokens[request.prompt_len :]
                self.scheduler.finish(request)
                del self.requests[request.sample_id]
                finished.append(request.sample_id)
        self.scheduler.grow()
        self.peak_blocks = max(self.peak_blocks, self.scheduler.blocks_in_use)
        return finished

    def _choose(self, logits: torch.Tensor, rows: list[Request]) -> torch.Tensor:
        """Every row's next token from its logits (greedy needs no stream keys or counters)."""
        if self.config.temperature == 0:
            return logits.float().argmax(dim=-1)
        return sample_at(logits, self.config, self._uniforms(rows).to(logits.device))

    @staticmethod
    def _uniforms(rows: list[Request]) -> torch.Tensor:
        """[b] float64: each row's draw for its next token (draw `generated` of its stream),
        refilling the windows of every row that ran out together."""
        stale = [r for r in rows if not r.draws_from <= r.generated < r.draws_from + len(r.draws)]
        if stale:
            keys = torch.tensor([[r.key] for r in stale], dtype=torch.long).expand(-1, DRAW_WINDOW)
            counters = torch.tensor([[r.generated] for r in stale], dtype=torch.long) + torch.arange(DRAW_WINDOW)
            for request, window in zip(stale, stream_uniforms(keys, counters).tolist(), strict=True):
                request.draws, request.draws_from = window, request.generated
        return torch.tensor([r.draws[r.generated - r.draws_from] for r in rows], dtype=torch.float64)

    def _logits(self, output: torch.Tensor | None) -> torch.Tensor | None:
        return None if output is None else gather_last_dim(output[:, -1], self.engine.groups.tp)

    def _prefill(self, requests: list[Request]) -> torch.Tensor | None:
        """The cache of every token of `requests` (left-padded into one batch); their next-token logits."""
        assert self.cache is not None
        tokens, mask = left_pad([r.tokens for r in requests], self.config.pad_token_id)
        width = tokens.shape[1]
        write = torch.full((len(requests), width), self.cache.scratch, dtype=torch.long)
        for row, request in enumerate(requests):
            write[row, width - len(request.tokens) :] = self.cache.slots(request.blocks, 0, len(request.tokens))
            request.cached = len(request.tokens)
        return self._logits(replica_forward(self.engine, tokens, mask, self.cache.views(write, None), 0))

    def _decode(self, requests: list[Request]) -> torch.Tensor | None:
        """Each request's last token through the stages, attending to its cached context."""
        assert self.cache is not None
        contexts = torch.tensor([len(r.tokens) for r in requests], dtype=torch.long)
        window = int(contexts.max())
        positions = torch.arange(window) - (window - contexts).unsqueeze(1)  # right-aligned [b, window]
        valid = positions >= 0
        width = max(len(r.blocks) for r in requests)
        tables = torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in requests], dtype=torch.long)
        clamped = positions.clamp(min=0)
        slots = tables.gather(1, clamped // self._block) * self._block + clamped % self._block
        read = torch.where(valid, slots, self.cache.scratch)
        new = torch.tensor([[r.tokens[-1]] for r in requests], dtype=torch.long)
        views = self.cache.views(read[:, -1:], read)
        return self._logits(replica_forward(self.engine, new, valid, views, window - 1))

    def run(self) -> None:
        """Decode until every request has finished."""
        while self.requests:
            self.step()

    def take(self, sample_ids: Sequence[int], with_cache: bool) -> HandOff:
        """Remove these requests (between steps) for another replica's decoder; `with_cache`:
        include this rank's cache rows of the running ones (a waiting one sends none: it is
        recomputed where it lands)."""
        assert self.scheduler is not None and self.cache is not None
        taken = [self.requests.pop(sid) for sid in sample_ids]
        kv = [self.cache.export(self.cache.slots(r.blocks, 0, r.cached if r.blocks else 0)) for r in taken]
        for request in taken:
            if request.blocks:
                self.scheduler.finish(request)
            else:
                self.scheduler.withdraw(request)
        return HandOff(
            sample_ids=[r.sample_id for r in taken],
            sequences=[list(r.tokens) for r in taken],
            prompt_lens=[r.prompt_len for r in taken],
            budgets=[r.budget for r in taken],
            generated=[r.generated for r in taken],
            kv=kv if with_cache else None,
        )

    def receive(self, hand_off: HandOff) -> None:
        """Add requests another replica's decoder handed off: those whose cache came with them
        run at once when the pool has room, the others wait to be recomputed."""
        if not hand_off.sample_ids:
            return
        requests = [
            self._request(sid, tokens, prompt_len, budget)
            for sid, tokens, prompt_len, budget in zip(
                hand_off.sample_ids, hand_off.sequences, hand_off.prompt_lens, hand_off.budgets, strict=True
            )
        ]
        scheduler = self._scheduler(requests)
        for row, request in enumerate(requests):
            rows = None if hand_off.kv is None else hand_off.kv[row]
            if rows is not None and rows.shape[3] == len(request.tokens) - 1 and scheduler.place(request):
                assert self.cache is not None
                self.cache.install(self.cache.slots(request.blocks, 0, rows.shape[3]), rows)
                request.cached = rows.shape[3]
                self.requests[request.sample_id] = request
            else:
                self._submit([request])

    def resume(
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        budgets: Sequence[int],
        sample_ids: Sequence[int],
        keys: Sequence[int],
    ) -> None:
        """Queue samples that continue from their prompt and the tokens they generated so far
        (`sequences[i]`: `prompt_lens[i]` prompt tokens, then those; recomputed when admitted),
        each stopping once it has generated `budgets[i]` tokens in all and drawing its next token
        from stream `keys[i]` at its count (`sampling.sample_seed`): samples of several draws in
        one decoder, as a partial rollout continues them after a weight sync. Their responses
        (`responses`) hold every generated token, the earlier ones included."""
        if not len(sequences) == len(prompt_lens) == len(budgets) == len(sample_ids) == len(keys):
            raise ValueError(f"{len(sequences)} sequences need as many prompt lengths, budgets, sample ids and keys")
        requests = [
            Request(int(sid), list(tokens), int(prompt_len), int(budget), int(key))
            for tokens, prompt_len, budget, sid, key in zip(
                sequences, prompt_lens, budgets, sample_ids, keys, strict=True
            )
        ]
        if any(not (r.prompt_len > 0 and r.generated < r.budget) for r in requests):
            raise ValueError("every resumed sample needs a prompt and a budget above the tokens it generated")
        if requests:
            self._submit(requests)

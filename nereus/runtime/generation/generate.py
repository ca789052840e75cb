"""Generation on a replica's engine: the continuous-batching engine, the static one it
replaced, and the single-process reference.

`generate` runs the continuous-batching engine over a paged KV cache (`batching`) by
default. The static engine (`Decoder` over `CachedForward`) decodes one batch in lock-step:
prompts left-padded so every sequence's next token sits in the last column, a cache
preallocated to the prompt width plus the whole budget, rows dropped (index copies) as they
finish and never refilled. Both run the new tokens through the stages (hidden states go
forward by send/recv), gather the vocabulary columns on the last stage and choose every
row's next token there at once (`sampling`: greedy, or temperature, top-k and top-p from
each sample's own counter-based stream, so every tensor rank, layout and engine draws the
same token), then broadcast the tokens to the other stages. A sequence stops at a stop
token or its budget.

`reference_generate` runs the static decoder on the single-process reference model,
recomputing the whole prefix each step (no cache): the tests hold both engines to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import torch

from nereus.runtime.generation.continuous import BatchingDecoder
from nereus.runtime.generation.decoding import Generation, assemble, left_pad, replica_forward
from nereus.runtime.generation.kv_cache import KVBudget
from nereus.runtime.generation.sampling import SamplingConfig, sample_seed, sample_streams, stops
from nereus.runtime.model.attention import LayerCache
from nereus.runtime.model.engine import Engine
from nereus.runtime.model.tensor_parallel import gather_last_dim
from nereus.runtime.model.transformer import ReferenceModel

#: The generation engines: `continuous` batching over a paged KV cache, or one `static` batch.
Strategy = Literal["continuous", "static"]


class Forward(Protocol):
    """How a decoder gets logits: a replica with a KV cache, or the reference recomputing."""

    def reset(self, num_rows: int, capacity: int) -> None:
        """Start over with `num_rows` rows and room for `capacity` columns."""

    def logits(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """[b, vocab] logits of each row's next token (None on ranks that do not sample)."""

    def share(self, chosen: torch.Tensor) -> torch.Tensor:
        """The sampling ranks' tokens on every rank of the replica."""

    def keep(self, rows: torch.Tensor, drop_columns: int) -> None:
        """Keep only `rows` (indices) and drop the first `drop_columns` columns."""


class Decoder:
    """The rows one replica decodes in lock-step; finished rows leave at once (collective
    over the replica's ranks: every rank holds the same rows and calls the same methods)."""

    def __init__(self, forward: Forward, config: SamplingConfig):
        self.forward = forward
        self.config = config
        self.sample_ids: list[int] = []
        self.tokens = torch.zeros((0, 0), dtype=torch.long)
        self.mask = torch.zeros((0, 0), dtype=torch.bool)
        self.budgets = torch.zeros(0, dtype=torch.long)
        self.generated = torch.zeros(0, dtype=torch.long)
        self.keys = torch.zeros(0, dtype=torch.long)
        """Each row's sampling stream key."""
        self.responses: dict[int, list[int]] = {}
        """Finished samples' generated tokens (through EOS when they stopped there)."""

    @property
    def num_active(self) -> int:
        return len(self.sample_ids)

    def start(self, prompts: Sequence[Sequence[int]], sample_ids: Sequence[int], budgets: Sequence[int]) -> None:
        """Begin decoding `prompts` as samples `sample_ids`, each stopping after its budget."""
        if len(sample_ids) != len(prompts) or len(budgets) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts need as many sample ids and budgets")
        if any(budget < 1 for budget in budgets):
            raise ValueError(f"every length budget must be at least 1, got {min(budgets)}")
        self.tokens, self.mask = left_pad(prompts, self.config.pad_token_id)
        self.sample_ids = list(sample_ids)
        self.budgets = torch.tensor([min(b, self.config.max_new_tokens) for b in budgets], dtype=torch.long)
        self.generated = torch.zeros(len(prompts), dtype=torch.long)
        self.keys = torch.tensor([sample_seed(self.config.seed, int(i)) for i in sample_ids], dtype=torch.long)
        self.forward.reset(len(prompts), self.tokens.shape[1] + int(self.budgets.max()))

    def step(self) -> None:
        """One token for every active row."""
        logits = self.forward.logits(self.tokens, self.mask)
        chosen = (
            torch.zeros(self.num_active, dtype=torch.long)
            if logits is None
            else sample_streams(logits, self.config, self.keys, self.generated)
        )
        chosen = self.forward.share(chosen).cpu()
        self.tokens = torch.cat([self.tokens, chosen.unsqueeze(1)], dim=1)
        self.mask = torch.cat([self.mask, torch.ones((self.num_active, 1), dtype=torch.bool)], dim=1)
        self.generated += 1
        done = (self.generated >= self.budgets) | stops(chosen, self.config)
        for row in done.nonzero().flatten().tolist():
            self.responses[self.sample_ids[row]] = self.tokens[row, -int(self.generated[row]) :].tolist()
        if done.any():
            self._keep(~done)

    def _keep(self, keep: torch.Tensor) -> None:
        """Drop the rows `keep` is False for, then the leading columns no kept row uses."""
        rows = keep.nonzero().flatten()
        self.sample_ids = [self.sample_ids[int(row)] for row in rows]
        self.keys = self.keys[rows]
        self.tokens, self.mask = self.tokens[rows], self.mask[rows]
        self.budgets, self.generated = self.budgets[rows], self.generated[rows]
        lead = int((~self.mask).all(dim=0).long().cumprod(dim=0).sum()) if len(rows) else self.tokens.shape[1]
        self.tokens, self.mask = self.tokens[:, lead:], self.mask[:, lead:]
        self.forward.keep(rows, lead)

    def run(self) -> None:
        """Decode until every row has finished."""
        while self.num_active:
            self.step()


class CachedForward:
    """A replica's stages with a KV cache (collective over the replica's ranks)."""

    def __init__(self, engine: Engine):
        engine.require_head("lm")
        self.engine = engine
        self.caches: dict[int, LayerCache] = {}
        self.cached = 0
        """Columns of the batch already in the cache."""

    def reset(self, num_rows: int, capacity: int) -> None:
        engine = self.engine
        self.caches = engine.pipeline_stage.new_caches(num_rows, capacity, engine.dtype, engine.device)
        self.cached = 0

    def logits(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        output = replica_forward(self.engine, tokens[:, self.cached :], mask, self.caches, self.cached)
        self.cached = tokens.shape[1]
        return None if output is None else gather_last_dim(output[:, -1], self.engine.groups.tp)

    def share(self, chosen: torch.Tensor) -> torch.Tensor:
        return self.engine.from_last_stage(chosen.to(self.engine.device)).cpu()

    def keep(self, rows: torch.Tensor, drop_columns: int) -> None:
        rows = rows.to(self.engine.device)
        for cache in self.caches.values():
            cache.keys = cache.keys[rows, :, drop_columns:]
            cache.values = cache.values[rows, :, drop_columns:]
        self.cached = max(0, self.cached - drop_columns)


class RecomputeForward:
    """The single-process reference model, recomputing the whole prefix every step."""

    def __init__(self, model: ReferenceModel):
        self.model = model

    def reset(self, num_rows: int, capacity: int) -> None:
        pass

    def logits(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(tokens, mask)[:, -1]

    def share(self, chosen: torch.Tensor) -> torch.Tensor:
        return chosen

    def keep(self, rows: torch.Tensor, drop_columns: int) -> None:
        pass


def _generate(
    decoder: Decoder | BatchingDecoder,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    sample_ids: Sequence[int] | None,
    budgets: Sequence[int] | None,
) -> Generation:
    ids = list(range(len(prompts))) if sample_ids is None else list(sample_ids)
    decoder.start(prompts, ids, [config.max_new_tokens] * len(prompts) if budgets is None else budgets)
    decoder.run()
    return assemble(prompts, [decoder.responses[sid] for sid in ids], config.pad_token_id)


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    sample_ids: Sequence[int] | None = None,
    budgets: Sequence[int] | None = None,
    kv_budget: KVBudget | None = None,
    strategy: Strategy = "continuous",
) -> Generation:
    """Generate from `prompts` on this engine's replica (collective over its ranks). Prompt i
    is sample `sample_ids[i]` (default i: it keys its sampling stream) and stops after at most
    `budgets[i]` tokens (default and cap: `config.max_new_tokens`). The continuous engine's
    KV pool follows `kv_budget` (default: room for every sequence, within the rank's memory);
    the static engine has no budget."""
    if strategy == "static":
        decoder: Decoder | BatchingDecoder = Decoder(CachedForward(engine), config)
    else:
        decoder = BatchingDecoder(engine, config, kv_budget or KVBudget())
    return _generate(decoder, prompts, config, sample_ids, budgets)


def reference_generate(
    model: ReferenceModel,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    sample_ids: Sequence[int] | None = None,
    budgets: Sequence[int] | None = None,
) -> Generation:
    """`generate` by the single-process reference model, recomputing the prefix every step."""
    return _generate(Decoder(RecomputeForward(model), config), prompts, config, sample_ids, budgets)


def continue_generate(
    engine: Engine,
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    budgets: Sequence[int],
    sample_ids: Sequence[int],
    keys: Sequence[int],
    config: SamplingConfig,
    kv_budget: KVBudget | None = None,
) -> list[list[int]]:
    """Continue samples from their prompt and tokens so far on this engine's replica
    (collective over its ranks; the continuous engine, `BatchingDecoder.resume`): sample i
    stops at a stop token or once it has generated `budgets[i]` tokens in all, drawing from
    the stream keyed `keys[i]` (its seed is not `config.seed`'s: samples of several draws run
    together). Each sample's generated tokens, the earlier ones included, in order."""
    decoder = BatchingDecoder(engine, config, kv_budget or KVBudget())
    decoder.resume(sequences, prompt_lens, budgets, sample_ids, keys)
    decoder.run()
    return [decoder.responses[int(sid)] for sid in sample_ids]

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
from nereus.runtime.generation.decoding import Generation, HandOff, assemble, left_pad, replica_forward
from nereus.runtime.generation.kv_cache import KVBudget
from nereus.runtime.generation.sampling import SamplingConfig, sample_streams, stops, stream_keys
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

    def export(self, rows: Sequence[int], cached: Sequence[int]) -> list[torch.Tensor] | None:
        """Row `rows[j]`'s last `cached[j]` cache columns (see `HandOff.kv`); None without a cache."""

    def prefill(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor] | None:
        """The cache of every token but the last of each sequence, computed here."""

    def merge(self, shift: int, incoming: Sequence[torch.Tensor] | None, width: int, capacity: int) -> None:
        """Existing rows move `shift` columns right; `incoming` rows follow them, right-aligned
        so the batch is `width` columns wide (every column but the last cached)."""


class Decoder:
    """The rows one replica decodes in lock-step; finished rows leave at once (collective
    over the replica's ranks: every rank holds the same rows and calls the same methods)."""

    def __init__(self, forward: Forward, config: SamplingConfig):
        self.forward = forward
        self.config = config
        self.sample_ids: list[int] = []
        self.tokens = torch.zeros((0, 0), dtype=torch.long)
        self.mask = torch.zeros((0, 0), dtype=torch.bool)
        self.prompt_lens: list[int] = []
        self.budgets = torch.zeros(0, dtype=torch.long)
        self.generated = torch.zeros(0, dtype=torch.long)
        self.keys = torch.zeros(0, dtype=torch.long)
        """Each row's sampling stream key."""
        self.responses: dict[int, list[int]] = {}
        """Finished samples' generated tokens (through EOS when they stopped there)."""

    @property
    def num_active(self) -> int:
        return len(self.sample_ids)

    def context_lengths(self) -> list[int]:
        """Tokens (prompt and generated) of every active row, in `sample_ids` order."""
        return [int(n) for n in self.mask.sum(dim=1)]

    def start(self, prompts: Sequence[Sequence[int]], sample_ids: Sequence[int], budgets: Sequence[int]) -> None:
        """Begin decoding `prompts` as samples `sample_ids`, each stopping after its budget."""
        if len(sample_ids) != len(prompts) or len(budgets) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts need as many sample ids and budgets")
        if any(budget < 1 for budget in budgets):
            raise ValueError(f"every length budget must be at least 1, got {min(budgets)}")
        self.tokens, self.mask = left_pad(prompts, self.config.pad_token_id)
        self.sample_ids = list(sample_ids)
        self.prompt_lens = [len(prompt) for prompt in prompts]
        self.budgets = torch.tensor([min(b, self.config.max_new_tokens) for b in budgets], dtype=torch.long)
        self.generated = torch.zeros(len(prompts), dtype=torch.long)
        self.keys = stream_keys(self.config.seed, sample_ids)
        self.forward.reset(len(prompts), self.tokens.shape[1] + int(self.budgets.max()))

    def step(self) -> list[int]:
        """One token for every active row; the samples that finished with it."""
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
        finished = [int(row) for row in done.nonzero().flatten()]
        for row in finished:
            self.responses[self.sample_ids[row]] = self.tokens[row, -int(self.generated[row]) :].tolist()
        finished_ids = [self.sample_ids[row] for row in finished]
        if finished:
            self._keep(~done)
        return finished_ids

    def _keep(self, keep: torch.Tensor) -> None:
        """Drop the rows `keep` is False for, then the leading columns no kept row uses."""
        rows = keep.nonzero().flatten()
        self.sample_ids = [self.sample_ids[int(row)] for row in rows]
        self.prompt_lens = [self.prompt_lens[int(row)] for row in rows]
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

    def take(self, sample_ids: Sequence[int], with_cache: bool) -> HandOff:
        """Remove these rows (between steps) and describe them for another replica's decoder;
        `with_cache`: include this rank's KV-cache rows, else the receiver recomputes them."""
        index = {sid: row for row, sid in enumerate(self.sample_ids)}
        rows = [index[sid] for sid in sample_ids]
        sequences = [self.tokens[row][self.mask[row]].tolist() for row in rows]
        kv = self.forward.export(rows, [len(seq) - 1 for seq in sequences]) if with_cache else None
        hand_off = HandOff(
            sample_ids=list(sample_ids),
            sequences=sequences,
            prompt_lens=[self.prompt_lens[row] for row in rows],
            budgets=[int(self.budgets[row]) for row in rows],
            generated=[int(self.generated[row]) for row in rows],
            kv=kv,
        )
        keep = torch.ones(self.num_active, dtype=torch.bool)
        keep[rows] = False
        self._keep(keep)
        return hand_off

    def receive(self, hand_off: HandOff) -> None:
        """Append rows another replica's decoder handed off (between steps); their cache comes
        with them or is recomputed here from their tokens."""
        if not hand_off.sample_ids:
            return
        kv = hand_off.kv if hand_off.kv is not None else self.forward.prefill(hand_off.sequences)
        width = max(self.tokens.shape[1], max(len(seq) for seq in hand_off.sequences))
        shift = width - self.tokens.shape[1]
        incoming, incoming_mask = left_pad(hand_off.sequences, self.config.pad_token_id)
        pad = width - incoming.shape[1]
        incoming = torch.nn.functional.pad(incoming, (pad, 0), value=self.config.pad_token_id)
        incoming_mask = torch.nn.functional.pad(incoming_mask, (pad, 0), value=False)
        tokens = torch.nn.functional.pad(self.tokens, (shift, 0), value=self.config.pad_token_id)
        mask = torch.nn.functional.pad(self.mask, (shift, 0), value=False)
        self.tokens, self.mask = torch.cat([tokens, incoming]), torch.cat([mask, incoming_mask])
        self.sample_ids += hand_off.sample_ids
        self.prompt_lens += hand_off.prompt_lens
        self.budgets = torch.cat([self.budgets, torch.tensor(hand_off.budgets, dtype=torch.long)])
        self.generated = torch.cat([self.generated, torch.tensor(hand_off.generated, dtype=torch.long)])
        self.keys = torch.cat([self.keys, stream_keys(self.config.seed, hand_off.sample_ids)])
        left = int((self.budgets - self.generated).max())
        self.forward.merge(shift, kv, width, width + left)

    def generation(self, prompts: Sequence[Sequence[int]], sample_ids: Sequence[int]) -> Generation:
        """The finished samples `sample_ids` (with these prompts) as one left-padded batch."""
        return assemble(prompts, [self.responses[sid] for sid in sample_ids], self.config.pad_token_id)


class CachedForward:
    """A replica's stages with a KV cache (collective over the replica's ranks)."""

    def __init__(self, engine: Engine):
        engine.require_head("lm")
        self.engine = engine
        self.caches: dict[int, LayerCache] = {}
        self.cached = 0
        """Columns of the batch already in the cache."""

    def _new_caches(self, num_rows: int, capacity: int) -> dict[int, LayerCache]:
        return self.engine.pipeline_stage.new_caches(num_rows, capacity, self.engine.dtype, self.engine.device)

    def reset(self, num_rows: int, capacity: int) -> None:
        self.caches, self.cached = self._new_caches(num_rows, capacity), 0

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

    def export(self, rows: Sequence[int], cached: Sequence[int]) -> list[torch.Tensor]:
        end = self.cached
        return [
            torch.stack(
                [
                    torch.stack([c.keys[row, :, end - n : end], c.values[row, :, end - n : end]])
                    for c in self.caches.values()
                ]
            ).cpu()
            for row, n in zip(rows, cached, strict=True)
        ]

    def prefill(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        tokens, mask = left_pad(sequences, 0)
        width = tokens.shape[1]
        caches = self._new_caches(len(sequences), width)
        replica_forward(self.engine, tokens[:, :-1], mask[:, :-1], caches, 0)
        rows = [
            torch.stack(
                [
                    torch.stack(
                        [c.keys[row, :, width - len(seq) : width - 1], c.values[row, :, width - len(seq) : width - 1]]
                    )
                    for c in caches.values()
                ]
            )
            for row, seq in enumerate(sequences)
        ]
        return [row.cpu() for row in rows]

    def merge(self, shift: int, incoming: Sequence[torch.Tensor] | None, width: int, capacity: int) -> None:
        assert incoming is not None, "a cached replica always has the incoming rows' cache"
        existing = next(iter(self.caches.values())).keys.shape[0] if self.caches else 0
        caches = self._new_caches(existing + len(incoming), capacity)
        end = width - 1
        for layer, (layer_id, cache) in enumerate(caches.items()):
            if existing:
                old = self.caches[layer_id]
                cache.keys[:existing, :, shift : shift + self.cached] = old.keys[:, :, : self.cached]
                cache.values[:existing, :, shift : shift + self.cached] = old.values[:, :, : self.cached]
            for row, kv in enumerate(incoming, start=existing):
                n = kv.shape[3]
                cache.keys[row, :, end - n : end] = kv[layer, 0].to(cache.keys.device)
                cache.values[row, :, end - n : end] = kv[layer, 1].to(cache.values.device)
        self.caches, self.cached = caches, end


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

    def export(self, rows: Sequence[int], cached: Sequence[int]) -> None:
        return None

    def prefill(self, sequences: Sequence[Sequence[int]]) -> None:
        return None

    def merge(self, shift: int, incoming: Sequence[torch.Tensor] | None, width: int, capacity: int) -> None:
        pass


class _Decoding(Protocol):
    def start(self, prompts: Sequence[Sequence[int]], sample_ids: Sequence[int], budgets: Sequence[int]) -> None: ...
    def run(self) -> None: ...
    def generation(self, prompts: Sequence[Sequence[int]], sample_ids: Sequence[int]) -> Generation: ...


def _generate(
    decoder: _Decoding,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    sample_ids: Sequence[int] | None,
    budgets: Sequence[int] | None,
) -> Generation:
    ids = list(range(len(prompts))) if sample_ids is None else list(sample_ids)
    decoder.start(prompts, ids, [config.max_new_tokens] * len(prompts) if budgets is None else budgets)
    decoder.run()
    return decoder.generation(prompts, ids)


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
        decoder: _Decoding = Decoder(CachedForward(engine), config)
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

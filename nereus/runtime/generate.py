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

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from nereus.runtime.engine import Engine
from nereus.runtime.model import LayerCache, ReferenceModel, positions_from_mask
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
    """Seed of the per-sample generators: sample i draws from one seeded by (seed, i)."""

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


def sampling_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """[b, vocab] probabilities of sampling at `config`'s temperature (> 0) and top-p; rows independent."""
    probs = torch.softmax(logits.float() / config.temperature, dim=-1)
    if config.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= config.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def sample_next(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> torch.Tensor:
    """[b] next tokens from [b, vocab] logits."""
    if config.temperature == 0:
        return logits.float().argmax(dim=-1)
    return torch.multinomial(sampling_probs(logits, config), 1, generator=generator).squeeze(-1)


def sample_seed(seed: int, sample_id: int) -> int:
    """The seed of sample `sample_id`'s generator under sampling seed `seed`."""
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sample_rows(logits: torch.Tensor, config: SamplingConfig, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """[b] next tokens from [b, vocab] logits, row i drawing from `generators[i]` only."""
    if config.temperature == 0:
        return logits.float().argmax(dim=-1)
    # One softmax for the batch (rows are independent), then each row's draw from its own generator.
    probs = sampling_probs(logits, config)
    return torch.cat([torch.multinomial(probs[row], 1, generator=generators[row]) for row in range(len(generators))])


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
    """Tokens each row has generated."""
    generator_states: list[torch.Tensor]
    """Each row's sampling generator state (`torch.Generator.get_state`)."""
    kv: list[torch.Tensor] | None
    """Each row's cache on this rank, [layers, 2 (keys, values), local kv heads, tokens - 1,
    head_dim] (every token but the last, which the next step feeds); None: the receiver
    recomputes it from `sequences`."""


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
        self.generators: list[torch.Generator] = []
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
        self.prompt_lens = [len(prompt) for prompt in prompts]
        self.budgets = torch.tensor([min(b, self.config.max_new_tokens) for b in budgets], dtype=torch.long)
        self.generated = torch.zeros(len(prompts), dtype=torch.long)
        self.generators = [torch.Generator().manual_seed(sample_seed(self.config.seed, i)) for i in sample_ids]
        self.forward.reset(len(prompts), self.tokens.shape[1] + int(self.budgets.max()))

    def step(self) -> list[int]:
        """One token for every active row; the samples that finished with it."""
        logits = self.forward.logits(self.tokens, self.mask)
        chosen = (
            torch.zeros(self.num_active, dtype=torch.long)
            if logits is None
            else sample_rows(logits.cpu(), self.config, self.generators)
        )
        chosen = self.forward.share(chosen)
        self.tokens = torch.cat([self.tokens, chosen.unsqueeze(1)], dim=1)
        self.mask = torch.cat([self.mask, torch.ones((self.num_active, 1), dtype=torch.bool)], dim=1)
        self.generated += 1
        done = self.generated >= self.budgets
        if self.config.eos_token_id is not None:
            done |= chosen == self.config.eos_token_id
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
        self.generators = [self.generators[int(row)] for row in rows]
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
            generator_states=[self.generators[row].get_state() for row in rows],
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
        for state in hand_off.generator_states:
            generator = torch.Generator()
            generator.set_state(state)
            self.generators.append(generator)
        left = int((self.budgets - self.generated).max())
        self.forward.merge(shift, kv, width, width + left)

    def generation(self, prompts: Sequence[Sequence[int]], sample_ids: Sequence[int]) -> Generation:
        """The finished samples `sample_ids` (with these prompts) as one left-padded batch."""
        return assemble(prompts, [self.responses[sid] for sid in sample_ids], self.config.pad_token_id)


def assemble(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_token_id: int) -> Generation:
    """Left-padded prompts followed by right-padded responses."""
    tokens, mask = left_pad(prompts, pad_token_id)
    width = max(len(response) for response in responses)
    generated = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    generated_mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, response in enumerate(responses):
        generated[row, : len(response)] = torch.tensor(list(response), dtype=torch.long)
        generated_mask[row, : len(response)] = True
    return Generation(torch.cat([tokens, generated], dim=1), torch.cat([mask, generated_mask], dim=1), tokens.shape[1])


def replica_forward(
    engine: Engine,
    new: torch.Tensor,
    key_mask: torch.Tensor,
    caches: dict[int, LayerCache],
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


def _generate(
    forward: Forward,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    sample_ids: Sequence[int] | None,
    budgets: Sequence[int] | None,
) -> Generation:
    ids = list(range(len(prompts))) if sample_ids is None else list(sample_ids)
    decoder = Decoder(forward, config)
    decoder.start(prompts, ids, [config.max_new_tokens] * len(prompts) if budgets is None else budgets)
    decoder.run()
    return decoder.generation(prompts, ids)


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    sample_ids: Sequence[int] | None = None,
    budgets: Sequence[int] | None = None,
) -> Generation:
    """Generate from `prompts` on this engine's replica (collective over its ranks). Prompt i
    is sample `sample_ids[i]` (default i: it seeds its generator) and stops after at most
    `budgets[i]` tokens (default and cap: `config.max_new_tokens`)."""
    return _generate(CachedForward(engine), prompts, config, sample_ids, budgets)


def reference_generate(
    model: ReferenceModel,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    sample_ids: Sequence[int] | None = None,
    budgets: Sequence[int] | None = None,
) -> Generation:
    """`generate` by the single-process reference model, recomputing the prefix every step."""
    return _generate(RecomputeForward(model), prompts, config, sample_ids, budgets)

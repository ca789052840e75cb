"""Generation on a replica's engine: the continuous-batching engine (`batching`) over a paged KV
cache. It runs the new tokens through the stages (hidden states go forward by send/recv),
gathers the vocabulary columns on the last stage and chooses every row's next token there at
once (`sampling`: greedy, or temperature, top-k and top-p from each sample's own
counter-based stream, so every tensor rank and layout draws the same token), then broadcasts
the tokens to the other stages. A sequence stops at a stop token or its budget.
"""

from __future__ import annotations

from collections.abc import Sequence

from nereus.runtime.generation.continuous import BatchingDecoder
from nereus.runtime.generation.decoding import Generation, assemble
from nereus.runtime.generation.kv_cache import KVBudget
from nereus.runtime.generation.sampling import SamplingConfig
from nereus.runtime.model.engine import Engine


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    sample_ids: Sequence[int] | None = None,
    budgets: Sequence[int] | None = None,
    kv_budget: KVBudget | None = None,
) -> Generation:
    """Generate from `prompts` on this engine's replica (collective over its ranks). Prompt i
    is sample `sample_ids[i]` (default i: it keys its sampling stream) and stops after at most
    `budgets[i]` tokens (default and cap: `config.max_new_tokens`). The KV pool follows
    `kv_budget` (default: room for every sequence, within the rank's memory)."""
    ids = list(range(len(prompts))) if sample_ids is None else list(sample_ids)
    decoder = BatchingDecoder(engine, config, kv_budget or KVBudget())
    decoder.start(prompts, ids, [config.max_new_tokens] * len(prompts) if budgets is None else budgets)
    decoder.run()
    return assemble(prompts, [decoder.responses[sid] for sid in ids], config.pad_token_id)


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

"""The generation oracle the engines are held to: the single-process reference model decoding
each sample on its own, recomputing its whole prefix at every step (no KV cache, no padding,
no batch), drawing from the same per-sample streams the engines use."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nereus.runtime.generation.decoding import Generation, assemble
from nereus.runtime.generation.sampling import SamplingConfig, sample_seed, sample_streams, stops
from nereus.runtime.model.transformer import ReferenceModel


@torch.no_grad()
def reference_generate(
    model: ReferenceModel,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig,
    sample_ids: Sequence[int] | None = None,
    budgets: Sequence[int] | None = None,
) -> Generation:
    """What `generate` must give: prompt i is sample `sample_ids[i]` (default i) and stops at a
    stop token or after `budgets[i]` tokens (default and cap: `config.max_new_tokens`)."""
    ids = range(len(prompts)) if sample_ids is None else sample_ids
    limits = [config.max_new_tokens] * len(prompts) if budgets is None else budgets
    responses = []
    for prompt, sample_id, limit in zip(prompts, ids, limits, strict=True):
        key = torch.tensor([sample_seed(config.seed, int(sample_id))])
        sequence, response = list(prompt), []
        for counter in range(min(limit, config.max_new_tokens)):
            logits = model(torch.tensor([sequence]))[:, -1]
            chosen = sample_streams(logits, config, key, torch.tensor([counter]))
            sequence.append(int(chosen[0]))
            response.append(int(chosen[0]))
            if bool(stops(chosen, config)[0]):
                break
        responses.append(response)
    return assemble(prompts, responses, config.pad_token_id)

"""`rl.log_samples`: a few of every step's samples as JSON lines a person can read.

Each record: `step`, `sample` (its index in the step), `prompt` and `response` (text by the
run's tokenizer), `prompt_ids`, `response_ids`, `logprobs` (log-probability of each response
token under the actor/inference model-stage, from the model's unscaled logits: temperature
1, whatever temperature sampled it), `reward` (what the advantages used) and `score` (the
task's rule score). Under a vLLM generation engine also `rollout_logprobs`: each response
token's log-probability as the engine computed it when it sampled the token (raw, temperature 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from nereus.runtime.rl.scoring import Scored
from nereus.runtime.rl.tokenizer import Tokenizer


def sample_records(
    step: int,
    prompts: list[list[int]],
    responses: list[list[int]],
    scored: Scored,
    count: int,
    tokenizer: Tokenizer,
    rollout_log_probs: torch.Tensor | None = None,
) -> list[dict[str, Any]]:
    """The first `count` samples of a step. The log-probs are token-aligned over the rollout
    batch: prompts left-padded to the widest, responses after it."""
    width = max(len(prompt) for prompt in prompts)
    assert scored.old_log_probs is not None, "sampled after training gave them"
    records = []
    for row in range(min(count, len(prompts))):
        response = responses[row]
        records.append(
            {
                "step": step,
                "sample": row,
                "prompt": tokenizer.decode(prompts[row]),
                "response": tokenizer.decode(response),
                "prompt_ids": prompts[row],
                "response_ids": response,
                "logprobs": scored.old_log_probs[row, width : width + len(response)].tolist(),
                "reward": float(scored.scores[row]),
                "score": float(scored.rule_scores[row]),
            }
        )
        if rollout_log_probs is not None:
            records[-1]["rollout_logprobs"] = rollout_log_probs[row, width : width + len(response)].tolist()
    return records


def append_samples(path: Path, records: list[dict[str, Any]]) -> None:
    """Append records to the run's samples file (one line each, flushed)."""
    with path.open("a", encoding="utf-8") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)
        handle.flush()

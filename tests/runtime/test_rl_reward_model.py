"""The reward model's synthetic fitting data and the position it reads a score from (pure logic)."""

from __future__ import annotations

import random

import pytest
import torch

from nereus.runtime.rl.reward_model import synthetic_response
from nereus.runtime.rl.scoring import last_token_mask, scores_from_values
from nereus.runtime.rl.stages import rollout_batch
from nereus.runtime.rl.tasks import CharTokenizer, Problem, score_response

pytestmark = pytest.mark.one_rank


def test_synthetic_responses_cover_every_score_level() -> None:
    tokenizer, rng = CharTokenizer(), random.Random(0)
    problem = Problem("S:3142=", "1234")
    responses = [synthetic_response(rng, tokenizer, problem, 8, 64) for _ in range(400)]
    scores = [score_response(tokenizer, problem, r) for r in responses]
    assert all(1 <= len(r) <= 8 and all(0 <= t < 64 for t in r) for r in responses)
    assert sum(s == 1.0 for s in scores) > 60  # exact answers
    assert sum(0.3 < s < 1.0 for s in scores) > 60  # corrupted answers
    assert sum(s < 0.1 for s in scores) > 60  # junk, as an untrained policy writes


def test_the_score_is_read_at_the_last_response_token() -> None:
    batch = rollout_batch([[1, 5], [1, 5, 6]], [[7, 8, 2], [9]], pad_id=0)
    # Prompts left-padded to width 3, responses right-padded: rows end at columns 5 and 3.
    assert last_token_mask(batch).nonzero().tolist() == [[0, 5], [1, 3]]
    values = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    assert scores_from_values(values, batch).tolist() == [5.0, 9.0]

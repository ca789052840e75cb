"""The reward-model option: a value-head transformer on the plan's reward/inference stage
scores each response by its value at the response's last token.

Nothing is downloaded: before RL starts, the model is fitted on its own ranks, by mean
squared error, to the task's rule scores of synthetic responses (exact answers, answers with
a few characters changed, random digit strings, truncated at `max_new_tokens`). RL then
optimises the learned reward, while the metrics keep reporting the rule score next to it.
"""

from __future__ import annotations

import random

import torch

from nereus.runtime.model.losses import ValueLoss
from nereus.runtime.model.transformer import Batch
from nereus.runtime.rl.scoring import last_token_mask
from nereus.runtime.rl.stages import ModelStageRuntime, rollout_batch
from nereus.runtime.rl.tasks import CharTokenizer, Problem, Task, sample_problems
from nereus.runtime.rl.tasks import score_response as rule_score
from nereus.runtime.rl.update import train
from nereus.spec.run_config import RLConfig

#: Shares of the synthetic responses that are exact answers, answers with a few digits changed
#: and random digit strings; the rest are random tokens of the whole vocabulary, like an
#: untrained policy's. Every score level gets enough rows for the regression to see.
EXACT_SHARE = 0.25
CORRUPTED_SHARE = 0.3
DIGITS_SHARE = 0.15


def synthetic_response(
    rng: random.Random, tokenizer: CharTokenizer, problem: Problem, max_new_tokens: int, vocab_size: int
) -> list[int]:
    """A response of known quality for `problem`, ending in EOS unless cut at `max_new_tokens`."""
    draw = rng.random()
    if draw >= EXACT_SHARE + CORRUPTED_SHARE + DIGITS_SHARE:
        return [rng.randrange(tokenizer.num_special, vocab_size) for _ in range(rng.randint(1, max_new_tokens))]
    if draw < EXACT_SHARE:
        text = problem.answer
    elif draw < EXACT_SHARE + CORRUPTED_SHARE:
        chars = list(problem.answer)
        for _ in range(rng.randint(1, max(1, len(chars) // 2))):
            chars[rng.randrange(len(chars))] = rng.choice("0123456789")
        text = "".join(chars)
    else:
        text = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, max_new_tokens)))
    return [*tokenizer.encode(text), tokenizer.eos_id][:max_new_tokens]


def fit_reward_model(stage: ModelStageRuntime, task: Task, config: RLConfig) -> list[float]:
    """Fit the reward/inference engine to rule scores (collective); the loss of every step."""
    tokenizer = CharTokenizer()
    losses = []
    for step in range(config.reward_model_steps):
        rng = random.Random(config.seed * 7919 + step)
        problems = sample_problems(task, config.reward_model_batch, rng.randrange(2**31))
        vocab_size = stage.model.vocab_size
        responses = [synthetic_response(rng, tokenizer, p, config.max_new_tokens, vocab_size) for p in problems]
        prompts = [tokenizer.prompt_ids(p.prompt) for p in problems]
        batch = rollout_batch(prompts, responses, tokenizer.pad_id)
        last = last_token_mask(batch)
        scores = torch.tensor([rule_score(tokenizer, p, r) for p, r in zip(problems, responses, strict=True)])
        fields = {"loss_mask": last, "value_targets": scores[:, None].expand_as(last)}
        losses.append(train(stage, Batch(batch.tokens, batch.attention_mask, fields), ValueLoss(), 1, 1))
    if stage.engine is not None:  # an inference stage holds weights only: drop gradients and moments
        params = {k: v.clone() for k, v in stage.engine.local_state().items() if k.startswith("param/")}
        stage.engine.load_local_state(params, stage.engine.optimizer_step)
    return losses

"""Evaluation on the held-out prompts of `data.eval`: greedy responses of the current actor,
scored by the run's reward (collective: every rank takes part in generation)."""

from __future__ import annotations

from nereus.runtime.generation.generate import SamplingConfig
from nereus.runtime.rl.rollout import sampled
from nereus.runtime.rl.run_data import StepInputs
from nereus.runtime.rl.stages import ModelStageRuntime
from nereus.spec.run_config import RLConfig
from nereus.spec.stages import ACTOR_GENERATION


def eval_due(inputs: StepInputs, step: int, num_steps: int) -> bool:
    """Whether the run evaluates after step `step` (0-based): every `eval_every` steps and after the last."""
    done = step + 1
    return bool(inputs.data.eval) and (done % inputs.data.eval_every == 0 or done == num_steps)


def evaluate(stages: dict[str, ModelStageRuntime], inputs: StepInputs, config: RLConfig) -> float:
    """Mean reward of the actor's greedy responses to every eval prompt (collective)."""
    prompts = inputs.data.eval
    tokenizer = inputs.tokenizer
    eos = tokenizer.eos_id if config.stop_at_eos else None
    sampling = SamplingConfig(config.max_new_tokens, 0.0, eos_token_id=eos, pad_token_id=tokenizer.pad_id)
    responses = sampled(stages[ACTOR_GENERATION], [list(p.ids) for p in prompts], sampling)[0]
    scores = inputs.scorer.score_all(prompts, responses)
    return sum(scores) / len(scores)

"""The supervised warm-start (`rl.sft_steps`): the actor learns from task demonstrations
before RL, as real post-training starts RL from a supervised (SFT) model.

Each step trains the actor/training engine on a fresh seeded batch of problems with their
right answers (next-token loss on the answer and its end token only). Then RL starts from a
fresh optimizer, and the reference and every engine the actor syncs into get the warmed-up
weights, so the KL terms measure the distance from the SFT model. Everything depends only on
the seed, so a run that restarts from its beginning repeats the warm-start bitwise.
"""

from __future__ import annotations

import zlib

from nereus.runtime.model.losses import NextTokenLoss
from nereus.runtime.model.transformer import Batch
from nereus.runtime.observe import timeline
from nereus.runtime.rl.optimization import UpdateRule, apply_update
from nereus.runtime.rl.stages import ModelStageRuntime, engine_state, rollout_batch
from nereus.runtime.rl.tasks import CharTokenizer, Task, sample_problems
from nereus.runtime.rl.update import WeightSync, sync_weights, weight_sync
from nereus.spec.run_config import RLConfig
from nereus.spec.stages import ACTOR_TRAINING, REFERENCE_INFERENCE


def demonstrations(task: Task, tokenizer: CharTokenizer, num_rows: int, seed: int) -> Batch:
    """`num_rows` seeded problems as prompt + right answer + EOS rows; `loss_mask` marks the answers."""
    problems = sample_problems(task, num_rows, seed)
    prompts = [tokenizer.prompt_ids(problem.prompt) for problem in problems]
    answers = [[*tokenizer.encode(problem.answer), tokenizer.eos_id] for problem in problems]
    return rollout_batch(prompts, answers, tokenizer.pad_id)


def demonstration_seed(seed: int, step: int) -> int:
    """The seed of warm-start step `step`'s problems (apart from every RL step's)."""
    return zlib.crc32(f"{seed}:sft:{step}".encode())


def warm_start(stages: dict[str, ModelStageRuntime], config: RLConfig, task: Task, syncs: list[WeightSync]) -> None:
    """`config.sft_steps` supervised steps of the actor, then its weights into the reference
    and the engines of `syncs` (collective over the world)."""
    actor = stages[ACTOR_TRAINING]
    engine, tokenizer = actor.engine, CharTokenizer()
    rule = UpdateRule(config.sft_lr, config.grad_clip)
    losses = []
    with timeline.span("sft", "warm-start", steps=config.sft_steps) as late:
        if engine is not None:
            for step in range(config.sft_steps):
                batch = demonstrations(task, tokenizer, config.sft_batch, demonstration_seed(config.seed, step))
                engine.zero_grad()
                losses.append(engine.forward_backward(batch, NextTokenLoss(), actor.plan.micro_batches))
                apply_update(engine, rule)
            # RL starts with fresh AdamW moments and step count, as from an SFT checkpoint.
            engine.load_local_state(engine_state(engine, ("param",)), 0)
        late.update(first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None)
        extra = [weight_sync(actor, stages[name]) for name in (REFERENCE_INFERENCE,) if name in stages]
        sync_weights(syncs + extra)

"""One RL step driven by a Plan, on every rank of a spawned world (collective).

A step reads top to bottom, one module per phase:

1. generation (`rollout`): each actor/generation replica samples responses for its share of
   the prompts; under inter-stage fusion the fused rollout overlaps it with 2;
2. inference (`scoring`): actor old log-probs, reference log-probs, critic values and the
   reward, the task's rule or the reward model;
3. advantages (`update`): PPO, GRPO or ReMax;
4. training (`update`): actor and critic, by mini-batches, fused or not;
5. weight sync (`update`): the trained weights into the generation and inference engines.

The model-stages on this rank and the rows they exchange are in `stages`; where the step's
time went, in `timing`. `nereus run` (`nereus.runtime.run.rank_loop.run_rank`) builds the
stages and runs the steps.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nereus.cost.calibration import DEFAULT_CALIBRATION
from nereus.cost.plan_cost import evaluate_plan
from nereus.cost.vllm_engine import ENGINE_PHASES
from nereus.runtime.generation.sampling import SamplingConfig
from nereus.runtime.model.fused_pipeline import OpTiming
from nereus.runtime.model.moe import ROUTES_FIELD, routing_mismatch
from nereus.runtime.model.transformer import Batch
from nereus.runtime.observe.memory import PeakTracker
from nereus.runtime.rl.algorithms import masked_mean
from nereus.runtime.rl.datasets import Prompt
from nereus.runtime.rl.fused_rollout import RolloutEvent
from nereus.runtime.rl.optimization import UpdateRule, update_rules
from nereus.runtime.rl.rollout import replica_routing, rollout
from nereus.runtime.rl.run_data import StepInputs, step_inputs
from nereus.runtime.rl.samples import sample_records
from nereus.runtime.rl.scoring import Scored, score
from nereus.runtime.rl.stages import ModelStageRuntime, Rollout, local_host_bytes, sleep_offloaded, without_routes
from nereus.runtime.rl.timing import StepSeconds, StepTotals, record_fused, step_totals, timed
from nereus.runtime.rl.update import (
    WeightSync,
    advantages_of,
    idle_model_stages,
    run_training,
    sync_weights,
)
from nereus.solver.admission import predicted_peaks
from nereus.spec.plan import Fusion, Plan
from nereus.spec.run_config import RLConfig
from nereus.spec.run_folder import StepMetrics
from nereus.spec.stages import ACTOR_GENERATION, ACTOR_TRAINING
from nereus.spec.workload import Workload

if TYPE_CHECKING:
    from nereus.spec.schedule import Schedule


@dataclass(frozen=True)
class StepResult:
    """What one RL step gives back on this rank."""

    metrics: StepMetrics
    """The step's record, the same on every rank."""
    samples: list[dict[str, Any]]
    """The `config.log_samples` sample records of the step (empty when it logs none)."""
    events: list[RolloutEvent]
    """This rank's rollout events under inter-stage fusion (empty without it)."""


def rl_step(
    plan: Plan,
    config: RLConfig,
    stages: dict[str, ModelStageRuntime],
    syncs: list[WeightSync],
    step: int,
    *,
    fusion: Fusion | None = None,
    idle: Callable[[], None] | None = None,
    inputs: StepInputs | None = None,
    schedule: Schedule | None = None,
    predicted: dict[str, dict[int, int]] | None = None,
    peaks: PeakTracker | None = None,
) -> StepResult:
    """One RL step on this rank (collective over the world). `fusion` replaces the plan's
    fusion block when given. `idle`: work this rank runs while others generate, if it has no
    part in generation (rank 0's deferred calibration). `inputs`: the run's tokenizer, prompts
    and reward (default: the synthetic task's). `schedule`: the plan's fused schedule under
    intra-stage fusion, searched once when the run was set up (`RunSetup.fused_schedule`; None: it
    is searched here). `predicted`: the plan's predicted peaks (`plan_peaks`, priced once per plan
    by the caller; None: priced here). `peaks`: the rank's memory tracker (None: untracked)."""
    start = time.perf_counter()
    seconds = begin_step(stages, peaks)
    in_force = plan.fusion if fusion is None else fusion
    inputs = inputs if inputs is not None else step_inputs(config, None)
    problems, prompts, sampling = draw_prompts(plan.workload, config, inputs, step)
    fused_events: list[RolloutEvent] = []
    # 1. generation (under inter-stage fusion, overlapped with the model inference of 2)
    generated = rollout(plan, stages, prompts, sampling, in_force, seconds, fused_events, idle)
    trained = train_phases(
        plan, config, stages, syncs, step, (problems, prompts, generated), seconds, in_force, inputs, schedule
    )
    record_fused(fused_events, trained.op_timings)
    engine = stages[ACTOR_GENERATION].rollout_engine if ACTOR_GENERATION in stages else None
    if engine is not None:  # its start-up (at the first step, or after a transition), loads, sleeps, wakes
        seconds.update(engine.drain_phases())
    seconds["step"] = time.perf_counter() - start
    predicted = plan_peaks(plan, stages) if predicted is None else predicted
    metrics = trained.metrics(plan, stages, step, seconds, predicted)
    return StepResult(metrics, trained.samples, fused_events)


@dataclass(frozen=True)
class Trained:
    """What phases 2 to 5 of a step leave on a rank: what its record needs."""

    prompts: list[list[int]]
    scored: Scored
    losses: tuple[float, float | None]
    updates: tuple[dict[str, UpdateRule], dict[str, float]]
    ran: list[str]
    """The model-stages that ran (actor/inference does not when training gives the old log-probs)."""
    rollout_log_probs: torch.Tensor | None
    samples: list[dict[str, Any]]
    op_timings: list[OpTiming]
    routing_mismatch: float | None
    """Mixture-of-experts actors: the share of routed (token, layer) pairs the trainer's router
    sends elsewhere than the rollout did (None without a recorded routing)."""

    def metrics(
        self,
        plan: Plan,
        stages: dict[str, ModelStageRuntime],
        step: int,
        seconds: dict[str, float],
        predicted: dict[str, dict[int, int]],
        totals: StepTotals | None = None,
    ) -> StepMetrics:
        """The step's record, the same on every rank: its times are the slowest rank's
        (collective unless `totals` were gathered already). Only the model-stages that ran
        report measured and predicted peaks by model-stage. `predicted`: the plan's predicted
        peaks (`plan_peaks`). `totals`: `step_totals` of `metric_names` (and more), gathered
        already by the caller (names beyond `metric_names` are left out)."""
        rules, grad_norms = self.updates
        scored = self.scored
        assert scored.old_log_probs is not None, "training gave them"
        lengths = scored.mask.sum(dim=1)
        names = metric_names(plan, stages)
        totals = step_totals(seconds, names, stages) if totals is None else totals
        # A vLLM engine phase that did not happen at this step is left out of the record.
        stage_seconds = {
            name: value
            for name, value in totals.seconds.items()
            if name in names and (name not in ENGINE_PHASES or value > 0)
        }
        num_ranks = len(totals.memory_peak)
        predicted_by_stage = {
            name: [by_rank.get(r, 0) for r in range(num_ranks)] for name, by_rank in predicted.items()
        }
        diff_mean = diff_max = None
        if self.rollout_log_probs is not None:
            diff_mean, diff_max = log_prob_mismatch(scored, self.rollout_log_probs)
        actor = stages.get(ACTOR_TRAINING)
        return StepMetrics(
            step=step,
            reward=float(scored.scores.mean()),
            score=float(scored.rule_scores.mean()),
            kl=float(masked_mean(scored.old_log_probs - scored.ref_log_probs, scored.mask)),
            response_len_mean=float(lengths.mean()),
            response_len_min=int(lengths.min()),
            response_len_max=int(lengths.max()),
            prompt_len=max(len(prompt) for prompt in self.prompts),
            actor_loss=self.losses[0],
            critic_loss=self.losses[1],
            step_seconds=stage_seconds.pop("step"),
            stage_seconds=stage_seconds,
            state_bytes_per_rank=totals.state_bytes,
            memory_peak_bytes=totals.memory_peak,
            predicted_memory_peak_bytes=[max(column) for column in zip(*predicted_by_stage.values(), strict=True)],
            memory_peak_bytes_by_stage={n: v for n, v in totals.memory_peak_by_stage.items() if n in self.ran},
            predicted_memory_peak_bytes_by_stage={n: v for n, v in predicted_by_stage.items() if n in self.ran},
            host_memory_bytes=totals.host_peak,
            predicted_host_memory_bytes=predicted_host(plan, stages, num_ranks),
            grad_norm=dict(grad_norms),
            lr={name: rule.lr for name, rule in rules.items()},
            rollout_log_prob_diff_mean=diff_mean,
            rollout_log_prob_diff_max=diff_max,
            routing_mismatch=self.routing_mismatch,
            router_aux_loss=None if actor is None or actor.engine is None else actor.engine.router_aux_loss,
        )


def train_phases(
    plan: Plan,
    config: RLConfig,
    stages: dict[str, ModelStageRuntime],
    syncs: list[WeightSync],
    step: int,
    rollout_of: tuple[list[Prompt], list[list[int]], Rollout],
    seconds: dict[str, float],
    in_force: Fusion,
    inputs: StepInputs,
    schedule: Schedule | None,
) -> Trained:
    """Phases 2 to 5 of step `step` on the rollout `rollout_of` (its problems, their prompt ids
    and the generated rows): inference, advantages, training and the weight sync (collective over
    the ranks the stages exchange over, and the world in the sync). The synchronous step and
    the async run's training pool (`nereus.runtime.run.async_loop`) both run them."""
    problems, prompts, generated = rollout_of
    generated, routing_mismatch = replayed_routing(config, stages, generated, seconds)
    # 2. inference: old and reference log-probs, values, rewards
    not_run = idle_model_stages(plan, in_force)
    scored = score(stages, inputs.scorer, problems, generated, seconds, skip=not_run)
    # 3. advantages
    with timed(seconds, "advantages"):
        advantages, returns = advantages_of(plan.workload, config, stages, inputs.scorer, problems, generated, scored)
    # 4. training
    rules = update_rules(config, step, list(stages))
    losses, old_log_probs, grad_norms, op_timings = run_training(
        plan, config, stages, generated, scored, advantages, returns, seconds, in_force, rules, schedule
    )
    if old_log_probs is not None:
        scored = dataclasses.replace(scored, old_log_probs=old_log_probs)
    samples = sample_records(
        step,
        prompts,
        generated.responses,
        scored,
        config.log_samples,
        inputs.tokenizer,
        generated.rollout_log_probs,
    )
    # 5. weight sync
    with timed(seconds, "weight_sync"):
        sync_weights(syncs)
    ran = [n for n in stages if n not in not_run]
    return Trained(
        prompts,
        scored,
        losses,
        (rules, grad_norms),
        ran,
        generated.rollout_log_probs,
        samples,
        op_timings,
        routing_mismatch,
    )


def begin_step(stages: dict[str, ModelStageRuntime], peaks: PeakTracker | None) -> StepSeconds:
    """A step's start on this rank: offloaded model-stages asleep (a checkpoint may have woken
    one), the memory tracker's step begun; the step's seconds, empty."""
    sleep_offloaded(stages)
    if peaks is not None:
        peaks.host_bytes = lambda: local_host_bytes(stages)
        peaks.start_step()
    return StepSeconds(peaks, stages)


def replayed_routing(
    config: RLConfig, stages: dict[str, ModelStageRuntime], generated: Rollout, seconds: dict[str, float]
) -> tuple[Rollout, float | None]:
    """The rollout with its routing in the batch when `rl.routing_replay` (the actor's old
    log-probs and training then replay it), and the share of tokens the trainer's own router
    sends elsewhere (None without a recorded routing). Positions the rollout routed none of
    (-1: a vLLM engine never feeds a sequence's last token to a forward, and no log-prob
    depends on that token's output) take the trainer's own routing and are not counted.
    Collective."""
    if generated.routes is None:
        if config.routing_replay:
            raise ValueError(
                "rl.routing_replay: this run's rollout has no recorded routing (a dense model, the fused rollout or "
                "async execution); set it to false"
            )
        return generated, None
    batch = generated.batch
    with timed(seconds, ACTOR_TRAINING):
        own = replica_routing(stages[ACTOR_TRAINING], without_routes(batch))
    routed = (generated.routes >= 0).all(dim=-1)  # [b, t, layers]
    routes = torch.where(routed.unsqueeze(-1), generated.routes, own)
    mismatch = routing_mismatch(routes, own, batch.mask().bool() & routed.all(dim=-1))
    if config.routing_replay:
        fields = {**batch.fields, ROUTES_FIELD: routes}
        replayed = Batch(batch.tokens, batch.attention_mask, fields, batch.first_column)
        generated = dataclasses.replace(generated, batch=replayed)
    return generated, mismatch


def draw_prompts(
    workload: Workload, config: RLConfig, inputs: StepInputs, step: int
) -> tuple[list[Prompt], list[list[int]], SamplingConfig]:
    """The step's prompts, each repeated `samples_per_prompt` times in a row (GRPO's groups),
    their token ids, and how to sample their responses."""
    seed = step_seed(config.seed, step)
    drawn = inputs.draw(config.seed, step, workload.prompts_per_step, seed)
    problems = [problem for problem in drawn for _ in range(workload.samples_per_prompt)]
    tokenizer = inputs.tokenizer
    sampling = SamplingConfig(
        config.max_new_tokens,
        config.temperature,
        top_p=config.top_p,
        eos_token_id=tokenizer.eos_id if config.stop_at_eos else None,
        pad_token_id=tokenizer.pad_id,
        seed=seed,
        top_k=config.top_k,
    )
    return problems, [list(problem.ids) for problem in problems], sampling


def step_seed(seed: int, step: int) -> int:
    """A per-step seed that differs across steps and runs with different seeds."""
    return zlib.crc32(f"{seed}:{step}".encode())


def metric_names(plan: Plan, stages: dict[str, ModelStageRuntime]) -> list[str]:
    """The times a step's record gathers from every rank: each model-stage's, the phases',
    the vLLM engine's phases (every rank is in a vLLM engine, or none is) and the step's."""
    names = [entry.model_stage for entry in plan.stages] + ["advantages", "exchange", "weight_sync"]
    vllm = ACTOR_GENERATION in stages and stages[ACTOR_GENERATION].rollout_engine is not None
    return [*names, *(ENGINE_PHASES if vllm else ()), "step"]


def log_prob_mismatch(scored: Scored, rollout_log_probs: torch.Tensor) -> tuple[float, float]:
    """How far the generation engine's log-probs of the sampled tokens are from the trainer's
    old log-probs (NeMo-RL's `token_mult_prob_error`, as absolute log-prob differences): the
    mean and the largest over every response token of the step."""
    assert scored.old_log_probs is not None, "training gave them"
    mask = scored.mask > 0
    diff = (scored.old_log_probs.float() - rollout_log_probs)[mask].abs()
    if diff.numel() == 0:
        return 0.0, 0.0
    return float(diff.mean()), float(diff.max())


def predicted_host(plan: Plan, stages: dict[str, ModelStageRuntime], num_ranks: int) -> list[int]:
    """Per rank, the host bytes the cost model puts there (zeros, unpriced, where nothing
    offloads): for every model-stage of `stages`, its host bytes per GPU (training-time offload's
    terms and, offloaded, its states asleep), once per GPU of the model-stage on the rank."""
    host = [0] * num_ranks
    if not any(entry.offload or entry.train_offload != "none" for entry in plan.stages):
        return host
    predictions = evaluate_plan(plan, DEFAULT_CALIBRATION).predictions.model_stages
    for entry in plan.stages:
        if entry.model_stage in stages:
            per_gpu = int(sum(predictions[entry.model_stage].host_memory_bytes.values()))
            for rank in set(entry.gpus):
                if rank < num_ranks:
                    host[rank] += per_gpu
    return host


def plan_peaks(plan: Plan, stages: dict[str, ModelStageRuntime]) -> dict[str, dict[int, int]]:
    """`predicted_peaks` of the plan the steps run, skipping its model-stages without an
    engine here; the run loop prices it once per plan and hands it to every step."""
    return predicted_peaks(plan, skip=tuple(e.model_stage for e in plan.stages if e.model_stage not in stages))

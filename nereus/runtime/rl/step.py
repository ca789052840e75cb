"""One RL step driven by a Plan, and a loop of steps, run on every rank of a spawned world.

Each model-stage of the plan gets its own engine on its EMUs' ranks (GPU id = rank), built
from the same init seed, so actor/generation, actor/inference and actor/training start from
the same weights and the reference stays at them. A step reads top to bottom:

1. generation: each actor/generation replica samples responses for its share of the prompts;
2. inference: actor old log-probs, reference log-probs, critic values (each stage's replicas
   on their share of the rows) and the reward: the task's rule or the reward model;
3. advantages: PPO (KL-penalised token rewards + GAE), GRPO (group-relative) or ReMax
   (greedy baseline, from an extra greedy generation);
4. training: actor (clipped surrogate) and critic (clipped value loss), by mini-batches;
5. weight sync: actor/training -> actor/generation and actor/inference, critic/training ->
   critic/inference, through the resharder.

Rows move between stages through the world (an object all-gather): every rank ends each
phase with the whole batch, so any placement (colocated or split pools) works the same way.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nereus.cost.plan_cost import head_of
from nereus.runtime import dist as launch
from nereus.runtime import host_collectives, timeline
from nereus.runtime.engine import Engine, EngineConfig, even_split
from nereus.runtime.fused_pipeline import FusedPart, OpTiming, fused_train_step
from nereus.runtime.fused_schedule import fused_schedule
from nereus.runtime.generate import SamplingConfig, generate
from nereus.runtime.model import Batch
from nereus.runtime.optim import AdamWConfig
from nereus.runtime.reshard import ReshardPlan, execute, plan_reshard
from nereus.runtime.rl.algorithms import (
    broadcast_to_tokens,
    gae,
    group_advantages,
    masked_mean,
    masked_whiten,
    remax_advantages,
    token_rewards,
)
from nereus.runtime.rl.config import RLConfig, RunConfig
from nereus.runtime.rl.inter_stage import migration_settings
from nereus.runtime.rl.objectives import ClippedValueObjective, PolicyObjective, align_to_tokens, values_to_tokens
from nereus.runtime.rl.tasks import CharTokenizer, Problem, encode_prompt, get_task, sample_problems
from nereus.runtime.rl.tasks import score_response as rule_score
from nereus.runtime.shard_layout import RankLayout, stage_layout
from nereus.runtime.sharded_state import state_meta
from nereus.runtime.tensor_parallel import TensorParallel
from nereus.spec.model import Head, Model
from nereus.spec.plan import Fusion, Plan, StagePlan
from nereus.spec.run_folder import StepMetrics
from nereus.spec.workload import Role

if TYPE_CHECKING:
    from nereus.runtime.rl.fused_rollout import RolloutEvent

#: Weight syncs after training: (source model-stage, target model-stage).
WEIGHT_SYNCS = (
    ("actor/training", "actor/generation"),
    ("actor/training", "actor/inference"),
    ("critic/training", "critic/inference"),
)


@dataclass
class Stage:
    """One model-stage on this rank: its plan entry, layout and engine (None off its ranks)."""

    plan: StagePlan
    model: Model
    head: Head
    layout: RankLayout
    engine: Engine | None


def build_stages(plan: Plan, config: RLConfig) -> dict[str, Stage]:
    """Every model-stage's engine (collective: every rank builds them in plan order). The
    reward stage gets an engine only under `reward: model`; the rule needs no model."""
    stages: dict[str, Stage] = {}
    for entry in plan.stages:
        role: Role = entry.role
        if not config.runs_engine(role):
            continue
        lr = {"critic": config.critic_lr, "reward": config.reward_model_lr}.get(role, config.actor_lr)
        # The reward model starts from its own weights, not the critic's.
        seed = config.seed + 1 if role == "reward" else config.seed
        engine_config = EngineConfig(AdamWConfig(lr=lr, eps=config.adam_eps), init_seed=seed)
        model = plan.model(plan.workload.model_name(role))
        head = head_of(role)
        layout = stage_layout(entry)
        engine = Engine.create(model, head, layout, engine_config)
        stages[entry.model_stage] = Stage(entry, model, head, layout, engine)
    return stages


# ---- moving rows between ranks ----


def by_replica(stage: Stage, value: Any) -> list[Any]:
    """Each replica's `value` (from its first rank) on every world rank, in replica order."""
    return by_replica_of({"": stage}, {"": value})[""]


def by_replica_of(stages: Mapping[str, Stage], values: Mapping[str, Any]) -> dict[str, list[Any]]:
    """`by_replica` of every named stage and its value at once: one object gather."""
    mine = {}
    for name, stage in stages.items():
        engine = stage.engine
        if engine is not None and engine.groups.stage == 0 and engine.groups.tp.rank == 0:
            mine[name] = (engine.groups.replica, values[name])
    gathered: list[Any] = [None] * dist.get_world_size()
    host_collectives.all_gather_object(gathered, mine)
    out = {}
    for name, stage in stages.items():
        parts = sorted((rank_parts[name] for rank_parts in gathered if name in rank_parts), key=lambda p: p[0])
        assert [replica for replica, _ in parts] == list(range(stage.layout.dp)), (name, parts)
        out[name] = [part for _, part in parts]
    return out


# ---- phases ----


def generate_responses(
    stage: Stage,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    budgets: list[int] | None = None,
    idle: Callable[[], None] | None = None,
) -> list[list[int]]:
    """Every prompt's response, each replica sampling its contiguous share; prompt i is sample
    i (its tokens come from its own generator, whichever replica decodes it) and stops after
    `budgets[i]` tokens when given. A rank with no part in generation first runs `idle`."""
    engine = stage.engine
    mine = None
    if engine is None and idle is not None:
        idle()
    if engine is not None:
        start, stop = even_split(len(prompts), stage.layout.dp)[engine.groups.replica]
        if stop > start:
            share = None if budgets is None else budgets[start:stop]
            mine = generate(engine, prompts[start:stop], sampling, range(start, stop), share).responses()
        else:
            mine = []
    return [response for share in by_replica(stage, mine) for response in share]


def rollout_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> Batch:
    """Prompts left-padded and responses right-padded into one batch; `loss_mask` marks responses."""
    prompt_width = max(len(p) for p in prompts)
    width = prompt_width + max(len(r) for r in responses)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.bool)
    loss_mask = torch.zeros((len(prompts), width), dtype=torch.float32)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        start = prompt_width - len(prompt)
        tokens[row, start : prompt_width + len(response)] = torch.tensor(prompt + response)
        attention[row, start : prompt_width + len(response)] = True
        loss_mask[row, prompt_width : prompt_width + len(response)] = 1.0
    return Batch(tokens, attention, {"loss_mask": loss_mask})


#: Inference model-stages and what each computes for every token of the rollout.
INFERENCE_KINDS = {
    "actor/inference": "log_probs",
    "reference/inference": "log_probs",
    "critic/inference": "values",
    "reward/inference": "position_values",
}


def local_infer(stage: Stage, batch: Batch, kind: str) -> torch.Tensor | None:
    """[rows, t] of this rank's replica (None off the stage's ranks): `replica_infer` of its rows."""
    engine = stage.engine
    if engine is None:
        return None
    return replica_infer(engine, engine.replica_rows(batch), kind, stage.plan.micro_batches)


def replica_infer(engine: Engine, rows: Batch, kind: str, micro_batches: int) -> torch.Tensor:
    """[rows, t] of `rows` on this replica (collective over its ranks): token-aligned
    `log_probs` or `values` (of emitting each token), or the value head's `position_values`."""
    if kind == "log_probs":
        return align_to_tokens(engine.log_probs(rows, micro_batches)).cpu()
    if kind == "values":
        return values_to_tokens(engine.values(rows, micro_batches)).cpu()
    assert kind == "position_values", kind
    return engine.values(rows, micro_batches).cpu()


def gather_rows(stage: Stage, rows: torch.Tensor | None) -> torch.Tensor:
    """The whole batch's rows from every replica's share (collective)."""
    return torch.cat(by_replica(stage, rows))


def infer(stage: Stage, batch: Batch, kind: str) -> torch.Tensor:
    """`local_infer` of the whole batch, each replica on its rows (collective)."""
    return gather_rows(stage, local_infer(stage, batch, kind))


def run_inference(stages: dict[str, Stage], batch: Batch, seconds: dict[str, float]) -> dict[str, torch.Tensor]:
    """Every inference model-stage on its replicas' rows, then one exchange of the rows: the
    model-stages of disjoint pools compute at the same time."""
    local = {}
    for name, kind in INFERENCE_KINDS.items():
        if name in stages:
            with timed(seconds, name):
                local[name] = local_infer(stages[name], batch, kind)
    with timed(seconds, "exchange"):
        shares = by_replica_of({name: stages[name] for name in local}, local)
        return {name: torch.cat(parts) for name, parts in shares.items()}


def last_token_mask(batch: Batch) -> torch.Tensor:
    """[b, t] one-hot at each row's last response token (where the reward model reads its score)."""
    response = batch.field("loss_mask")
    positions = torch.arange(response.shape[1]).expand_as(response)
    last = torch.where(response > 0, positions, -1).max(dim=1).values
    return torch.nn.functional.one_hot(last, response.shape[1]).float()


def model_scores(stage: Stage, batch: Batch) -> torch.Tensor:
    """[b] the reward model's score of every row (collective)."""
    return scores_from_values(infer(stage, batch, "position_values"), batch)


def scores_from_values(position_values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """[b] a reward model's score of every row: its value at the last response token."""
    return (position_values * last_token_mask(batch)).sum(dim=1)


def local_train(stage: Stage, batch: Batch, objective: Any, num_mini_batches: int, num_epochs: int) -> list[float]:
    """Epochs of mini-batch updates on the whole batch on this rank; each update's loss (none
    off the stage's ranks)."""
    engine = stage.engine
    losses = []
    if engine is not None:
        for _ in range(num_epochs):
            for start, stop in even_split(batch.num_rows, num_mini_batches):
                losses.append(engine.train_step(batch.rows(start, stop), objective, stage.plan.micro_batches))
    return losses


def mean_loss(losses: list[float]) -> float:
    """The mean loss of a rank's updates (0 on a rank that trained nothing)."""
    return float(sum(losses) / max(len(losses), 1))


def gather_loss(stage: Stage, losses: list[float]) -> float:
    """The mean loss of the updates, the same on every rank (collective)."""
    # Every replica reports the global batch's loss; take the first.
    return float(by_replica(stage, mean_loss(losses))[0])


def train(stage: Stage, batch: Batch, objective: Any, num_mini_batches: int, num_epochs: int) -> float:
    """`local_train`, then the mean loss on every rank (collective)."""
    return gather_loss(stage, local_train(stage, batch, objective, num_mini_batches, num_epochs))


def sync_plans(stages: dict[str, Stage]) -> list[tuple[Stage, Stage, ReshardPlan]]:
    """The resharding plan of every weight sync the plan's stages call for (parameters only)."""
    plans = []
    for source_name, target_name in WEIGHT_SYNCS:
        if source_name in stages and target_name in stages:
            source, target = stages[source_name], stages[target_name]
            plan = plan_reshard(
                state_meta(source.model, source.head, source.layout, ("param",)),
                state_meta(target.model, target.head, target.layout, ("param",)),
            )
            plans.append((source, target, plan))
    return plans


def engine_state(engine: Engine, families: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The engine's live tensors of `families` (keyed `family/name`)."""
    return {key: tensor for key, tensor in engine.local_state().items() if key.split("/")[0] in families}


def sync_weights(syncs: list[tuple[Stage, Stage, ReshardPlan]]) -> None:
    """Copy the trained parameters into the generation and inference engines by resharding.

    The pieces land straight in the target engine's live parameter tensors (no fresh
    state, no second copy); `load_local_state` then only takes the step and drops stale
    gradients and moments (copying a tensor onto itself is a no-op).
    """
    rank = dist.get_rank()
    for source, target, plan in syncs:
        tensors, step = {}, None
        if source.engine is not None:
            tensors = engine_state(source.engine, ("param",))
            step = source.engine.optimizer_step
        live = engine_state(target.engine, ("param",)) if target.engine is not None else None
        result = execute(plan, rank, tensors, step, out=live)
        if target.engine is not None:
            assert result.step is not None
            target.engine.load_local_state(result.tensors, result.step)


# ---- the step ----


@contextmanager
def timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall time to `seconds[name]` and record it on the run's timeline."""
    start, wall_start = time.perf_counter(), time.time()
    yield
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
    timeline.record("stage" if "/" in name else "phase", name, wall_start, time.time())


def step_seed(seed: int, step: int) -> int:
    """A per-step seed that differs across steps and runs with different seeds."""
    return zlib.crc32(f"{seed}:{step}".encode())


def gather_numbers(values: list[float]) -> torch.Tensor:
    """[world, len(values)] float64 on the CPU: every rank's `values` (collective)."""
    # On the rank's device: NCCL gathers only GPU tensors.
    mine = torch.tensor(values, dtype=torch.float64, device=launch.device())
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    host_collectives.all_gather(rows, mine)
    return torch.stack(rows).cpu()


def slowest_rank(seconds: dict[str, float], names: list[str]) -> dict[str, float]:
    """Every name's time on the slowest rank (ranks that skip a phase report 0)."""
    return step_totals(seconds, names, {})[0]


def step_totals(
    seconds: dict[str, float], names: list[str], stages: dict[str, Stage]
) -> tuple[dict[str, float], list[int]]:
    """`slowest_rank` of `seconds` and the bytes of engine state each rank holds (of `stages`),
    from one all-gather: each collective costs a few ms on gloo."""
    table = gather_numbers([*(seconds.get(name, 0.0) for name in names), float(local_state_bytes(stages))])
    slowest = table[:, :-1].max(dim=0).values.tolist()
    return dict(zip(names, slowest, strict=True)), [int(held) for held in table[:, -1].tolist()]


@dataclass(frozen=True)
class Rollout:
    """What inference measured of one step's responses (token-aligned [batch, seq] or [batch])."""

    mask: torch.Tensor
    scores: torch.Tensor
    old_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    old_values: torch.Tensor | None
    """Critic values (PPO only)."""
    greedy_scores: torch.Tensor | None
    """Scores of the greedy responses (ReMax only)."""


def compute_advantages(
    algorithm: str, config: RLConfig, rollout: Rollout, group_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages, and the critic's returns under PPO (None otherwise)."""
    mask = rollout.mask
    if algorithm == "ppo":
        assert rollout.old_values is not None
        rewards = token_rewards(rollout.scores, mask, rollout.old_log_probs, rollout.ref_log_probs, config.kl_coef)
        advantages, returns = gae(rewards, rollout.old_values, mask, config.gamma, config.lam)
        return masked_whiten(advantages, mask), returns
    if algorithm == "grpo":
        return broadcast_to_tokens(group_advantages(rollout.scores, group_size), mask), None
    assert algorithm == "remax" and rollout.greedy_scores is not None, algorithm
    return broadcast_to_tokens(remax_advantages(rollout.scores, rollout.greedy_scores), mask), None


def rl_step(
    plan: Plan,
    config: RLConfig,
    stages: dict[str, Stage],
    syncs: list[tuple[Stage, Stage, ReshardPlan]],
    step: int,
    *,
    fusion: Fusion | None = None,
    events: list[RolloutEvent] | None = None,
    idle: Callable[[], None] | None = None,
) -> StepMetrics:
    """One RL step on this rank (collective over the world). `fusion` replaces the plan's
    fusion block when given; under inter-stage fusion this rank's rollout events are appended
    to `events` when given. `idle`: work this rank runs while others generate, if it has no
    part in generation (rank 0's deferred calibration)."""
    workload, tokenizer, task = plan.workload, CharTokenizer(), get_task(config.task)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    seed = step_seed(config.seed, step)
    # Each prompt repeated samples_per_prompt times in a row: GRPO's groups.
    drawn = sample_problems(task, workload.prompts_per_step, seed)
    problems = [problem for problem in drawn for _ in range(workload.samples_per_prompt)]
    prompts = [encode_prompt(tokenizer, problem) for problem in problems]
    sampling = SamplingConfig(
        config.max_new_tokens,
        config.temperature,
        eos_token_id=tokenizer.eos_id if config.stop_at_eos else None,
        pad_token_id=tokenizer.pad_id,
        seed=seed,
    )

    in_force = plan.fusion if fusion is None else fusion
    inferred = None
    rollout_events: list[RolloutEvent] = []
    if in_force.inter_stage:
        # Imported here: the fused rollout builds on this module's helpers.
        from nereus.runtime.rl.fused_rollout import fused_rollout

        settings = migration_settings(plan, in_force)
        fused = fused_rollout(stages, prompts, sampling, settings, seconds)
        responses, inferred = fused.responses, fused.inferred
        rollout_events = fused.events
        if events is not None:
            events.extend(fused.events)
    else:
        with timed(seconds, "actor/generation"):
            responses = generate_responses(stages["actor/generation"], prompts, sampling, idle=idle)
    greedy = None
    if workload.algorithm == "remax":
        with timed(seconds, "actor/generation"):
            greedy_sampling = dataclasses.replace(sampling, temperature=0.0)
            greedy = generate_responses(stages["actor/generation"], prompts, greedy_sampling)
    batch = rollout_batch(prompts, responses, tokenizer.pad_id)
    mask = batch.field("loss_mask")

    if inferred is None:
        inferred = run_inference(stages, batch, seconds)
    with timed(seconds, "reward/inference"):
        rule_scores = score_all(tokenizer, problems, responses)
        reward_values = inferred.get("reward/inference")
        scores = rule_scores if reward_values is None else scores_from_values(reward_values, batch)
    old_log_probs = inferred["actor/inference"] * mask
    ref_log_probs = inferred["reference/inference"] * mask
    old_values = inferred["critic/inference"] * mask if "critic/inference" in inferred else None

    with timed(seconds, "advantages"):
        greedy_scores = None
        if greedy is not None:
            greedy_batch = rollout_batch(prompts, greedy, tokenizer.pad_id)
            greedy_scores = reward_of(stages, tokenizer, problems, greedy_batch, greedy)
        rollout = Rollout(mask, scores, old_log_probs, ref_log_probs, old_values, greedy_scores)
        advantages, returns = compute_advantages(workload.algorithm, config, rollout, workload.samples_per_prompt)
    op_timings: list[OpTiming] = []
    actor_loss, critic_loss = run_training(
        plan, config, stages, batch, rollout, advantages, returns, seconds, fusion=in_force, op_timings=op_timings
    )
    record_fused(rollout_events, op_timings)

    with timed(seconds, "weight_sync"):
        sync_weights(syncs)

    lengths = mask.sum(dim=1)
    seconds["step"] = time.perf_counter() - start
    names = [entry.model_stage for entry in plan.stages] + ["advantages", "exchange", "weight_sync"]
    stage_seconds, held = step_totals(seconds, [*names, "step"], stages)
    return StepMetrics(
        step=step,
        reward=float(scores.mean()),
        score=float(rule_scores.mean()),
        kl=float(masked_mean(old_log_probs - ref_log_probs, mask)),
        response_len_mean=float(lengths.mean()),
        response_len_min=int(lengths.min()),
        response_len_max=int(lengths.max()),
        prompt_len=max(len(prompt) for prompt in prompts),
        actor_loss=actor_loss,
        critic_loss=critic_loss,
        step_seconds=stage_seconds.pop("step"),
        stage_seconds=stage_seconds,
        state_bytes_per_rank=held,
    )


def record_fused(events: list[RolloutEvent], op_timings: list[OpTiming]) -> None:
    """Put the fused rollout's and the fused pipeline's moments on the run's timeline (their
    clocks are perf_counter readings of this rank: shifted onto the timeline's wall clock)."""
    offset = time.time() - time.perf_counter()
    opened: dict[tuple[str, str | None], float] = {}
    for event in events:
        what, edge = event.kind.rsplit("_", 1)
        if edge == "start":
            opened[(what, event.model_stage)] = event.time_s
        elif edge == "end" and (what, event.model_stage) in opened:
            start = opened.pop((what, event.model_stage))
            name = what if event.model_stage is None else f"{event.model_stage} ({what})"
            timeline.record("fused", name, start + offset, event.time_s + offset, samples=len(event.samples))
        else:  # a moment, e.g. a sample finished
            moment = event.time_s + offset
            timeline.record("fused", event.kind, moment, moment, samples=list(event.samples))
    for op in op_timings:
        timeline.record(
            "fused",
            f"{op.model} {op.kind}{op.microbatch}",
            op.ready + offset,
            op.end + offset,
            stage=op.stage,
            update=op.update,
            wait_s=op.ready - op.start,
        )


def run_training(
    plan: Plan,
    config: RLConfig,
    stages: dict[str, Stage],
    batch: Batch,
    rollout: Rollout,
    advantages: torch.Tensor,
    returns: torch.Tensor | None,
    seconds: dict[str, float],
    *,
    fusion: Fusion | None = None,
    op_timings: list[OpTiming] | None = None,
) -> tuple[float, float | None]:
    """Actor and critic updates, then one exchange of their losses (so a critic on its own pool
    trains while the actor does); the mean actor and critic losses.

    Under `intra_stage` fusion (`fusion`, or the plan's block when None) both train together in
    the fused pipeline, mini-batch by mini-batch (`fused_training`), and each fused op's timing
    on this rank is appended to `op_timings` when given.
    """
    workload = plan.workload
    fields = {"old_log_probs": rollout.old_log_probs, "ref_log_probs": rollout.ref_log_probs, "advantages": advantages}
    actor = stages["actor/training"]
    kl_loss_coef = 0.0 if workload.algorithm == "ppo" else config.kl_loss_coef
    tp = actor.engine.groups.tp if actor.engine is not None else TensorParallel.single()
    objective = PolicyObjective(config.clip_eps, kl_loss_coef, config.entropy_coef, tp)
    actor_batch = Batch(batch.tokens, batch.attention_mask, {**batch.fields, **fields})
    critic = stages.get("critic/training")
    critic_losses = None
    if critic is not None:
        assert rollout.old_values is not None and returns is not None, "a critic is trained under ppo only"
        critic_fields = {**batch.fields, "old_values": rollout.old_values, "returns": returns}
        critic_batch = Batch(batch.tokens, batch.attention_mask, critic_fields)
        value_objective = ClippedValueObjective(config.value_clip_eps)
    if (plan.fusion if fusion is None else fusion).intra_stage:
        assert critic is not None, "intra-stage fusion needs a critic (refused with the plan otherwise)"
        actor_job = (actor, actor_batch, objective)
        critic_job = (critic, critic_batch, value_objective)
        actor_losses, critic_losses = fused_training(plan, actor_job, critic_job, seconds, op_timings)
    else:
        with timed(seconds, "actor/training"):
            actor_losses = local_train(actor, actor_batch, objective, workload.mini_batches, workload.ppo_epochs)
        if critic is not None:
            with timed(seconds, "critic/training"):
                critic_losses = local_train(
                    critic, critic_batch, value_objective, workload.mini_batches, workload.ppo_epochs
                )
    with timed(seconds, "exchange"):
        trained, losses = {"actor": actor}, {"actor": mean_loss(actor_losses)}
        if critic is not None and critic_losses is not None:
            trained["critic"], losses["critic"] = critic, mean_loss(critic_losses)
        # Every replica reports the global batch's loss; take the first.
        means = by_replica_of(trained, losses)
    return means["actor"][0], means["critic"][0] if "critic" in means else None


#: A training model-stage, the batch it trains on and its objective.
TrainingJob = tuple[Stage, Batch, Any]


def fused_training(
    plan: Plan,
    actor_job: TrainingJob,
    critic_job: TrainingJob,
    seconds: dict[str, float],
    op_timings: list[OpTiming] | None,
) -> tuple[list[float], list[float]]:
    """Epochs of mini-batch updates of actor and critic together, each mini-batch one run of
    the plan's fused schedule (`fused_schedule`, cached per plan); each update's losses (none
    off the training ranks). Both model-stages ran for the whole phase, so `seconds` gets its
    wall time under actor/training and critic/training alike."""
    workload = plan.workload
    (actor, actor_batch, actor_objective), (critic, critic_batch, critic_objective) = actor_job, critic_job
    actor_losses: list[float] = []
    critic_losses: list[float] = []
    # Searched once per plan (cached), outside the timed phase.
    schedule = fused_schedule(plan) if actor.engine is not None else None
    with timed(seconds, "actor/training"), timed(seconds, "critic/training"):
        if schedule is not None:
            assert actor.engine is not None and critic.engine is not None, "fusion trains both on the same ranks"
            mini_batches = even_split(actor_batch.num_rows, workload.mini_batches)
            for update, (start, stop) in enumerate(mini_batches * workload.ppo_epochs):
                parts = [
                    FusedPart("actor", actor.engine, actor_batch.rows(start, stop), actor_objective),
                    FusedPart("critic", critic.engine, critic_batch.rows(start, stop), critic_objective),
                ]
                (actor_loss, critic_loss), timings = fused_train_step(parts, schedule)
                actor_losses.append(actor_loss)
                critic_losses.append(critic_loss)
                if op_timings is not None:
                    op_timings.extend(dataclasses.replace(timing, update=update) for timing in timings)
    return actor_losses, critic_losses


def local_state_bytes(stages: dict[str, Stage]) -> int:
    """Bytes of engine state this rank holds."""
    return sum(
        tensor.numel() * tensor.element_size()
        for stage in stages.values()
        if stage.engine is not None
        for tensor in stage.engine.local_state().values()
    )


def reward_of(
    stages: dict[str, Stage],
    tokenizer: CharTokenizer,
    problems: list[Problem],
    batch: Batch,
    responses: list[list[int]],
) -> torch.Tensor:
    """[batch] rewards: the reward model's scores when the run has one, else the task's rule."""
    reward_model = stages.get("reward/inference")
    return score_all(tokenizer, problems, responses) if reward_model is None else model_scores(reward_model, batch)


def score_all(tokenizer: CharTokenizer, problems: list[Problem], responses: list[list[int]]) -> torch.Tensor:
    """[batch] rule-based scores."""
    return torch.tensor([rule_score(tokenizer, p, r) for p, r in zip(problems, responses, strict=True)])


def run_steps(
    rank: int,
    world_size: int,
    plan: Plan,
    run: RunConfig,
    on_step: Callable[[StepMetrics], None] | None = None,
) -> list[StepMetrics]:
    """`run.num_steps` RL steps on this rank of a spawned world; every rank returns the same
    metrics, and rank 0 hands each step's to `on_step` as it finishes."""
    config = run.rl
    torch.manual_seed(config.seed)
    stages = build_stages(plan, config)
    syncs = sync_plans(stages)
    metrics = []
    for step in range(run.num_steps):
        metrics.append(rl_step(plan, config, stages, syncs, step))
        if on_step is not None and rank == 0:
            on_step(metrics[-1])
    return metrics

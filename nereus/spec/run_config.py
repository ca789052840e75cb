"""The RL run configuration: a strict `RunConfig` document (kind: RunConfig).

It holds what the plan does not: the task, the seeds, the algorithm's hyperparameters and
the number of steps; the plan gives the models, the batch shapes and every model-stage's
layout. It lives in the spec layer (no torch, no runtime import), so a bad config is refused
before ranks are spawned and `nereus report` reads one without the runtime.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from nereus.spec.base import Document, StrictModel
from nereus.spec.data_config import DataConfig, FormatReward, PythonReward
from nereus.spec.plan import Fusion

#: The synthetic tasks a run can train on; `nereus.runtime.rl.tasks` implements each.
TASK_NAMES: tuple[str, ...] = ("sort", "add")

#: How token losses become a mini-batch's loss (verl's `loss_agg_mode` names):
#: `token-mean` averages over every response token of the mini-batch, `seq-mean-token-sum`
#: sums each sequence's tokens and averages over sequences, `seq-mean-token-mean` averages
#: each sequence's tokens first (every sequence weighs the same).
LossAggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


class RLConfig(StrictModel):
    """Hyperparameters of the RL loop (the plan's workload gives batch shapes and algorithm)."""

    task: str = "sort"
    """Synthetic task the prompts come from: `sort` or `add`."""
    seed: int = Field(default=0, ge=0)
    """Seed of the initial weights, the prompts and the sampling."""
    actor_lr: float = Field(default=1e-2, gt=0)
    """AdamW learning rate of the actor (high: the tiny models start from random weights)."""
    critic_lr: float = Field(default=1e-2, gt=0)
    """AdamW learning rate of the critic."""
    adam_eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon of both models."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of generation (above 0: RL needs exploration)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling: draw only from the most likely tokens whose probabilities sum to top_p (1: all)."""
    top_k: int = Field(default=0, ge=0)
    """Draw only from the top_k most likely tokens (0: no top-k filter)."""
    max_new_tokens: int = Field(default=12, ge=1)
    """Most tokens per response (responses stop earlier at EOS unless `stop_at_eos` is off)."""
    stop_at_eos: bool = True
    """False: every response runs to its length limit, EOS or not (vLLM's `ignore_eos`): for
    benchmarks whose response lengths must follow a trace exactly."""
    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """PPO ratio clip: the ratio is kept in [1 - clip_eps, 1 + clip_eps]."""
    value_clip_eps: float = Field(default=0.2, gt=0)
    """PPO value clip: how far a value may move from its old estimate."""
    gamma: float = Field(default=1.0, gt=0, le=1)
    """GAE discount."""
    lam: float = Field(default=0.95, ge=0, le=1)
    """GAE lambda."""
    kl_coef: float = Field(default=0.001, ge=0)
    """PPO: weight of the k1 KL penalty in the token rewards (small: a random policy scores
    about 0.02 per response, and a larger penalty summed over its tokens swamps that signal)."""
    kl_loss_coef: float = Field(default=0.02, ge=0)
    """GRPO and ReMax: weight of the k3 KL loss in the policy objective."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus in the policy objective."""
    log_samples: int = Field(default=0, ge=0)
    """Samples per step written to samples.jsonl in the run folder (0: none): text, token
    ids, the actor's log-probability of every response token (temperature 1) and reward."""
    reward: Literal["rule", "model", "math", "exact"] | PythonReward = "rule"
    """`rule`: the task's partial-credit score. `math`: 1 when the response's final number
    (`#### 42`, `\\boxed{42}` or its last number) equals the answer's. `exact`: 1 when the
    normalised texts are equal. `{python: module:function}`: a user function (prompt,
    response, answer) -> float. `model`: a value-head transformer on the plan's
    reward/inference stage scores it (from `reward_model:`, or fitted to rule scores of
    synthetic responses first)."""
    format_reward: FormatReward | None = None
    """A bonus added to the reward of responses in the expected form (None: no bonus)."""
    reward_model_steps: int = Field(default=150, ge=1)
    """Reward model: AdamW steps of its fit before RL starts."""
    reward_model_batch: int = Field(default=32, ge=1)
    """Reward model: synthetic responses per fitting step."""
    reward_model_lr: float = Field(default=3e-3, gt=0)
    """Reward model: AdamW learning rate of its fit."""
    rank_memory_bytes: int | None = Field(default=None, gt=0)
    """Bytes one rank may use; None: the plan cluster's per-GPU memory. A plan whose predicted
    peak on some rank exceeds it is refused before ranks are spawned, and the controller never
    moves to one (on CPU, set it to what each rank process may take)."""
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype a bf16 workload's gradients are summed in across dp replicas: fp32 (upcast per
    bucket for the sum, then rounded back to the bf16 gradient) or bf16 (half the bytes on
    the wire, rounding at every partial sum). fp32 workloads reduce in fp32 either way."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Largest global gradient norm (over every shard of a model, all tp/pp/dp ranks) of an
    update: a larger gradient is scaled down to it (torch's `clip_grad_norm_`); None: no
    clipping. Every trained model; the norm before clipping goes to metrics.jsonl."""
    lr_warmup_steps: int = Field(default=0, ge=0)
    """RL steps over which every trained model's learning rate rises linearly to its peak
    (`actor_lr`, `critic_lr`): step s < lr_warmup_steps trains at peak x (s + 1) / lr_warmup_steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After the warm-up: `constant` keeps the peak; `cosine` decays it along half a cosine to
    peak x `min_lr_ratio` at the run's last step (`lr_decay_steps`)."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """`cosine`: the final learning rate as a share of the peak."""
    lr_decay_steps: int | None = Field(default=None, gt=0)
    """`cosine`: the step count the decay ends at; None: the run's `num_steps`."""
    loss_agg_mode: LossAggregation = "token-mean"
    """How the policy and value losses aggregate token losses over a mini-batch (verl's
    names): `token-mean`, `seq-mean-token-sum` or `seq-mean-token-mean`."""
    sft_steps: int = Field(default=0, ge=0)
    """Supervised warm-start: AdamW steps of the actor on task demonstrations (prompt and right
    answer) before the first RL step; the reference starts from the warmed-up actor, and RL
    from a fresh optimizer (0: start RL from the initial weights)."""
    sft_lr: float = Field(default=3e-3, gt=0)
    """Learning rate of the supervised warm-start."""
    sft_batch: int = Field(default=16, ge=1)
    """Demonstrations per supervised warm-start step."""
    rollout_correction: Literal["none", "tis"] = "none"
    """Correction for the gap between the generation engine's and the trainer's log-probs
    (a vLLM engine computes them with other kernels): `tis`, truncated importance sampling
    (verl's TIS), weighs every response token's policy loss by min(exp(old - rollout), tis_cap),
    old the trainer's log-prob and rollout the engine's (docs/rl_step.md); `none`: no weight.
    Needs an engine that returns log-probs (`generation.engine: vllm`)."""
    routing_replay: bool = False
    """Mixture-of-experts actors: the trainer's forward (old log-probs and training) routes
    every response token to the experts the rollout routed it to, per MoE layer, instead of its
    own router's top-k (rollout routing replay; the weights stay the router's probabilities at
    those experts; docs/runtime.md, "Running MoE"). The rollout's routing is nereus's own
    generation engine's over the sampled sequences, or the experts a vLLM engine's decoding
    chose (docs/moe.md); the fused rollout and async execution record none. Either way a MoE
    run records the share of tokens the trainer would route elsewhere (`routing_mismatch` in
    metrics.jsonl)."""
    router_aux_loss_coef: float = Field(default=0.0, ge=0)
    """Mixture-of-experts actors: the weight of the router's auxiliary load-balancing loss
    (Switch Transformer's; transformers' `router_aux_loss_coef` with `output_router_logits`)
    in the actor's training loss: coef x the loss of each training forward (pooled over the
    MoE layers as transformers pools them), the mean over micro-batches and data-parallel
    ranks; recorded per step (`router_aux_loss` in metrics.jsonl). 0: off. Refused above 0 on
    a dense model and with pp or cp above 1 in actor training."""
    tis_cap: float = Field(default=2.0, ge=1)
    """`tis`: the largest importance weight a token gets (verl's `tis_imp_ratio_cap`);
    `off_policy_correction: decoupled`: the largest weight a token keeps (AReaL's
    `behav_imp_weight_cap`). At least 1, so that an on-policy token keeps weight 1."""
    off_policy_correction: Literal["none", "tis", "decoupled"] = "none"
    """Under `execution: async` (the workload's), how the policy loss corrects for a batch
    generated by a policy up to `max_staleness` versions old, the behaviour policy mu, whose
    per-token log-probs the rollout keeps. With r = exp(logp_theta - logp_old) the clipped PPO
    ratio against the proximal policy pi_old (the trainer's log-probs at the start of the step),
    A the advantage and eps `clip_eps`:
    `none`: the synchronous PPO loss, -min(r A, clip(r, 1 - eps, 1 + eps) A) (mu taken as pi_old);
    `tis`: truncated importance sampling, that loss times w = min(exp(logp_old - logp_mu), tis_cap)
    per token (w not differentiated);
    `decoupled`: AReaL's decoupled PPO objective, -w min(r A, clip(r, 1 - eps, 1 + eps) A) with
    w = exp(logp_old - logp_mu) where it is at most `tis_cap` and w = 0 above (the token is
    dropped, AReaL's `behav_imp_weight_cap`), not clamped: the clip trusts the region around
    pi_old, the weight corrects the sampling distribution mu. With max_staleness 0, mu = pi_old,
    w = 1 and all three are the synchronous loss. `tis` here and `rollout_correction: tis` weigh
    by the same ratio (the rollout's log-probs are the behaviour policy's, from whichever engine
    generated them), so one of them suffices: where generation overlaps training this field,
    when set, decides; otherwise `rollout_correction` (`runtime/rl/update.correction_of`,
    `runtime/rl/algorithms.behaviour_weights`). A synchronous run trains on-policy and ignores it.
    Needs the rollout's per-token log-probs."""

    def runs_engine(self, role: str) -> bool:
        """Whether a model-stage of `role` runs an engine: all do, except a rule-scored reward."""
        return role != "reward" or self.reward == "model"

    @field_validator("task")
    @classmethod
    def _known_task(cls, task: str) -> str:
        if task not in TASK_NAMES:
            raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASK_NAMES)}")
        return task


class LogConfig(StrictModel):
    """Where a run's per-step metrics go besides metrics.jsonl."""

    tensorboard: bool = False
    """Also write every step's scalars (reward, losses, KL, grad norms, learning rates, seconds)
    as TensorBoard events under the run folder's `tensorboard/` (needs the `tensorboard`
    package: the `tensorboard` extra)."""


#: The generation engines a run can sample with (`GenerationConfig.engine`).
GenerationEngine = Literal["nereus", "vllm", "auto"]


class GenerationConfig(StrictModel):
    """Which engine samples the responses of actor/generation (docs/generation.md)."""

    engine: GenerationEngine = "auto"
    """`nereus`: nereus's own engine (paged KV cache, continuous batching; the reference).
    `vllm`: one vLLM engine per actor/generation replica over its tp ranks, inside the rank
    processes (needs the `vllm` package and the actor from a Hugging Face folder, `model:`).
    `auto`: vLLM when it is installed, the actor comes from a folder and the ranks are on
    CUDA; nereus's own engine otherwise (always on CPU)."""


class PlanSwitch(StrictModel):
    """A plan change at a step boundary, carried out live by the EMU executor: every
    model-stage's state moves through the transition DAG, no restart, no checkpoint."""

    step: int = Field(gt=0)
    """The new plan runs from this step on (0-based; the first step trains under the first plan)."""
    plan: str
    """Plan YAML to switch to, relative to the config file: the same models and workload, any
    layouts on any of the run's ranks."""


class RunConfig(Document):
    """One RL run: hyperparameters, length and checkpointing (the layouts come from a plan)."""

    kind: Literal["RunConfig"] = "RunConfig"
    rl: RLConfig = Field(default_factory=RLConfig)
    """The RL loop's hyperparameters."""
    plan: str | None = None
    """Plan YAML the run uses (models, workload, every model-stage's layout), relative to this
    file; `nereus run --plan` overrides it. One of the two is required unless `model` is set."""
    model: str | None = None
    """Hugging Face model folder (relative to this file): every role's architecture and the
    actor's, reference's and critic's (new value head) initial weights. Without a plan the
    run plans itself from `workload` for its ranks."""
    critic_model: str | None = None
    """Hugging Face folder the critic starts from instead (relative to this file): a
    sequence-classification checkpoint (one label) of the same architecture, or a causal LM
    (a new value head)."""
    reward_model: str | None = None
    """Hugging Face sequence-classification folder (one label, same architecture; relative to
    this file) the reward model (`rl.reward: model`) is read from instead of being fitted."""
    workload: str = "tiny-ppo"
    """Workload preset or YAML (relative to this file) a run with `model` and no plan is
    planned for; its model names are replaced by the folder's model."""
    cluster: str = "h100-sxm"
    """Cluster preset or YAML (relative to this file) whose GPU kind a self-planned run is
    laid out for (one node with as many GPUs as the run has ranks)."""
    num_steps: int = Field(default=50, gt=0)
    """RL steps to run (the total, counting steps done before a resume)."""
    checkpoint_every: int = Field(default=10, gt=0)
    """Save a checkpoint after every this many steps (and after the last step)."""
    collective_timeout_s: float = Field(default=120.0, gt=0)
    """Seconds a collective waits for the other ranks before the run stops, naming the rank
    that did not arrive (a hung or stopped rank)."""
    memory_baseline: Literal["idle", "step"] = "idle"
    """What a CPU rank's measured memory peaks are counted above (CUDA ranks count allocated
    tensors either way): `idle`, the rank's private memory before its engines exist, read once;
    `step`, re-read at every step's start as the private memory that holds no tensor then (the
    engines' Python objects, what kernels and collectives made on first use), which no GPU
    allocator counts. `step` walks every Python object at each step's start (~0.2 s a step on a
    loaded 2-core machine); benchmarks/memory_parity.py sets it."""
    keep_checkpoints: int = Field(default=2, gt=0)
    """Newest checkpoints kept; older ones are deleted once a newer one is complete."""
    plan_switches: list[PlanSwitch] = Field(default_factory=list)
    """Plan changes during the run, in increasing step order."""
    trace: str | None = None
    """Trace YAML (relative to this file) of GPU-pool events: with it, the online controller
    decides every step whether to change the plan (`nereus run --trace`)."""
    policy: str = "nereus"
    """Adaptation policy of the controller: nereus, fixed, dynarl or periodic:K."""
    lengths_from_trace: bool = False
    """With a trace: each step's responses stop at the trace's `response_len.max` in force at
    that step (or earlier at EOS) in place of `rl.max_new_tokens`, so the run's sequences grow
    or shrink as the trace says (the untrained tiny models rarely stop early)."""
    calibration: str | None = None
    """Calibration YAML (`nereus fit`, relative to this file) the run's predictions and the
    controller's cost model start from; None: the default calibration."""
    verify_transitions: bool = False
    """Check every live transition: gather each model-stage's logical state (parameters and
    optimizer moments) on rank 0 before and after, and stop the run unless they are equal
    bitwise; the digests go to the timeline. For tests and audits: it costs a full gather."""
    online_calibration: bool = True
    """Refit the cost model's efficiencies after every step from what the step measured
    (recursive least squares with forgetting); the predictions and the controller use it."""
    fusion: Fusion | None = None
    """Stage fusions for this run; None keeps the plan's `fusion:` block, a block given here
    replaces it whole."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Extra per-step logging (TensorBoard)."""
    data: DataConfig | None = None
    """Prompts and answers from a dataset file in place of `rl.task`'s generator (the model
    folder's tokenizer encodes them)."""
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    """The engine that generates the responses."""

    @field_validator("plan_switches")
    @classmethod
    def _increasing(cls, switches: list[PlanSwitch]) -> list[PlanSwitch]:
        steps = [switch.step for switch in switches]
        if steps != sorted(set(steps)):
            raise ValueError(f"steps must increase strictly, got {steps}")
        return switches

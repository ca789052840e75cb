"""Plan: every model-stage's layout, its EMUs' GPUs, and what it was made for."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, model_validator

from nereus.spec.base import Document, StrictModel
from nereus.spec.cluster import Cluster
from nereus.spec.model import Model
from nereus.spec.stages import ModelStageName, Role, Stage, role_of, stage_of
from nereus.spec.workload import Workload

#: What a training model-stage recomputes in its backward; a level's index is its code in the
#: cost model's arrays (`nereus.cost.stage`: 0 none, 1 full, 2 selective).
Recompute = Literal["none", "full", "selective"]

#: How a context-parallel replica's attention sees the whole sequence (`StagePlan.cp_method`).
CpMethod = Literal["ulysses", "allgather"]
RECOMPUTE_LEVELS: tuple[Recompute, ...] = ("none", "full", "selective")


class Pool(StrictModel):
    """A set of GPUs whose model-stages share memory and run one after another."""

    name: str = Field(min_length=1)
    """Name the model-stages refer to, e.g. `pool0`."""
    gpus: list[NonNegativeInt] = Field(min_length=1)
    """GPU ids in this pool; pools are disjoint."""


class StagePlan(StrictModel):
    """The layout and EMUs of one model-stage."""

    model_stage: ModelStageName
    """Which model in which stage, e.g. `actor/generation`."""
    pool: str = Field(min_length=1)
    """Name of the pool whose GPUs this model-stage's EMUs use."""
    tp: int = Field(gt=0)
    """Tensor-parallel degree of one replica (GPUs inside one node)."""
    pp: int = Field(gt=0)
    """Pipeline-parallel degree of one replica (divides the layers)."""
    cp: int = Field(default=1, gt=0)
    """Context-parallel degree of one replica (training and inference only): each sequence is cut
    along its tokens into cp parts, one per cp rank, which hold the same weights; 1: no cut."""
    cp_method: CpMethod = Field(default="ulysses", exclude_if=lambda method: method == "ulysses")
    """How attention sees the whole sequence when cp > 1 (docs/context-parallel.md): `ulysses`
    trades sequence for heads by all-to-alls (cp must divide a tensor rank's query heads),
    `allgather` all-gathers every column's keys and values on each cp rank (Llama 3's context
    parallelism; any cp up to the sequence length). Left out of written plans when `ulysses`."""
    ep: int = Field(default=1, gt=0, exclude_if=lambda ep: ep == 1)
    """Expert-parallel degree of one replica (mixture-of-experts models only; docs/moe.md): per
    pipeline stage, the ep ranks hold the same non-expert weights and take 1/ep of the replica's
    sequences each, while the experts of every sparse layer are split over them in contiguous
    blocks (ep rank e holds experts [e E / ep, (e + 1) E / ep)), tokens reaching their experts by
    an all-to-all; each expert is tp-split like a dense MLP. 1: every rank holds every expert (and
    the field is left out of written plans, so plans without experts read and write as before)."""
    dp: int = Field(gt=0)
    """Number of replicas (EMUs); equals the length of `emus`."""
    emus: list[list[NonNegativeInt]] = Field(min_length=1)
    """Each EMU's ordered GPU ids: GPU of (pp stage s, ep rank e, cp rank c, tp rank r) is entry
    ((s * ep + e) * cp + c) * tp + r (with cp = ep = 1: s * tp + r)."""
    micro_batches: int = Field(default=1, gt=0)
    """Micro-batches per replica: per mini-batch in training, per step in inference; 1 in generation."""
    recompute: Recompute = "none"
    """Training only, per layer: `full` keeps each layer's input and reruns its whole forward in
    the backward (gradient checkpointing); `selective` keeps every linear layer's input and
    output and every norm's activations, and reruns only the attention core (the scores, their
    softmax and the weighted sum of the values, from the kept q, k, v: Megatron's selective
    recompute) and the MLP's gate activation (from the kept gate projection), so the
    activation's output is not kept; `none` keeps every activation."""
    token_budget: int | None = Field(default=None, gt=0)
    """Training only: tokens per micro-batch when micro-batches are packed to a token budget;
    None: micro-batches of equal row counts, sized for rows of the maximum length."""
    zero1: bool | None = None
    """Training only: AdamW state sharded across dp (ZeRO-1); None: as the workload's optimizer says
    (full sharding and training-time offload shard it whatever this says)."""
    full_shard: bool = False
    """Training and inference only: parameters (and in training gradients and AdamW state) sharded
    across dp, each layer all-gathered before its forward and again before its backward and its
    gradients reduce-scattered (ZeRO-3, FSDP's FULL_SHARD), the optimizer state whatever `zero1`
    says; False: every replica holds them whole."""
    train_offload: Literal["none", "optimizer", "params"] = "none"
    """Training only: `optimizer` keeps AdamW state and fp32 master weights (and the gradients as they
    arrive) in host memory and runs the optimizer step on the host (DeepSpeed's ZeRO-Offload); `params`
    also keeps the parameter shards there, copied in per layer for forward and backward (FSDP2's
    CPUOffloadPolicy); `none`: everything on the GPU."""
    offload: bool = False
    """Between its runs, this model-stage's resident states sleep in host memory (moved out
    and back over the cluster's host link every step)."""
    kv_budget_bytes: int | None = Field(default=None, gt=0)
    """Generation only: KV-cache bytes per GPU the engine batches continuously into; None:
    room for every sample of a replica at the maximum length at once."""

    @model_validator(mode="after")
    def _choices_fit_the_stage(self) -> StagePlan:
        stage = stage_of(self.model_stage)
        if stage != "training":
            for name in ("token_budget", "zero1"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies to training model-stages only; drop it from {self.model_stage}")
            for name in ("recompute", "train_offload"):
                if getattr(self, name) != "none":
                    raise ValueError(f"{name} applies to training model-stages only; drop it from {self.model_stage}")
        if self.train_offload == "params" and not self.full_shard:
            raise ValueError(
                f"train_offload params keeps parameter shards in host memory, so it needs full_shard: true "
                f"(as FSDP2's CPU offload does); set it or use train_offload optimizer in {self.model_stage}"
            )
        if stage != "generation" and self.kv_budget_bytes is not None:
            raise ValueError(f"kv_budget_bytes applies to generation only; drop it from {self.model_stage}")
        if self.cp_method != "ulysses" and self.cp == 1:
            raise ValueError(f"cp_method {self.cp_method} needs cp > 1; drop cp_method from {self.model_stage}")
        if self.cp > 1 and stage == "generation":
            raise ValueError(f"cp applies to training and inference only; set cp: 1 in {self.model_stage}")
        if self.full_shard and stage == "generation":
            raise ValueError(f"full_shard applies to training and inference only; drop it from {self.model_stage}")
        return self

    @property
    def role(self) -> Role:
        return role_of(self.model_stage)

    @property
    def stage(self) -> Stage:
        return stage_of(self.model_stage)

    @property
    def cp_label(self) -> str:
        """The cp degree as shown: `4`, or `4 allgather` by the all-gather method (Ulysses: the default)."""
        return f"{self.cp} {self.cp_method}" if self.cp > 1 and self.cp_method != "ulysses" else str(self.cp)

    @property
    def replica_size(self) -> int:
        """GPUs of one replica (EMU): tp x cp x ep x pp."""
        return self.tp * self.cp * self.ep * self.pp

    @property
    def gpus(self) -> list[int]:
        """All GPUs of this model-stage, EMU by EMU."""
        return [gpu for emu in self.emus for gpu in emu]


class StagePrediction(StrictModel):
    """What the cost model predicts for one model-stage."""

    time_s: float = Field(ge=0)
    """Predicted wall time of this model-stage per RL step."""
    peak_memory_bytes: int = Field(ge=0)
    """Predicted peak memory on the busiest GPU, with co-resident model-stages."""
    time_breakdown_s: dict[str, NonNegativeFloat] = Field(default_factory=dict)
    """Seconds per latency term (compute, bubbles, collectives, ...)."""
    memory_breakdown_bytes: dict[str, NonNegativeInt] = Field(default_factory=dict)
    """Bytes per memory term (parameters, optimizer, activations, KV cache, ...)."""
    host_memory_bytes: dict[str, NonNegativeInt] = Field(default_factory=dict)
    """Host-memory bytes per GPU by term: what training-time offload keeps there (parameters,
    gradients, optimizer) and, for an offloaded model-stage, its states asleep between runs
    (`asleep`); empty: nothing in host memory."""


class SteadyState(StrictModel):
    """An async step's steady state: the generation pool and the training pool overlap, each
    busy for its own time per step; the slower bounds the step."""

    generation_s: NonNegativeFloat
    """Seconds the generation pool is busy per step (actor/generation)."""
    training_s: NonNegativeFloat
    """Seconds the training pool is busy per step: every inference and training model-stage,
    then the weight sync to the generation pool."""
    bound: Literal["generation", "training"]
    """The pool whose time is the step's (the other waits for it)."""
    max_staleness: int = Field(ge=1)
    """How many batches generation may run ahead of training (the workload's k)."""


class Predictions(StrictModel):
    """The cost model's predictions for a plan, as computed when it was written."""

    step_time_s: float = Field(ge=0)
    """Predicted wall time of one RL step (critical path of the workflow)."""
    model_stages: dict[str, StagePrediction] = Field(default_factory=dict)
    """Per model-stage predictions keyed by `role/stage`."""
    step_breakdown_s: dict[str, NonNegativeFloat] = Field(default_factory=dict)
    """Seconds per phase. Synchronous: the step's critical path, phase after phase (they add up
    to the step). Async with overlap: each phase's time on its pool; `steady_state` composes them."""
    steady_state: SteadyState | None = None
    """Async execution with max_staleness >= 1: the two pools' times and which bounds the step;
    None for a synchronous step (async with max_staleness 0 is one)."""


class Fusion(StrictModel):
    """RLHFuse's stage fusions: both off by default, so a plan runs stage by stage."""

    inter_stage: bool = False
    """Generation and inference fuse at sample level: once few samples still generate, they
    migrate to the fewest generation replicas that fit them and the freed ranks start the
    inference model-stages on the finished samples."""
    migration_threshold: float | None = Field(default=None, gt=0, lt=1)
    """Fraction of the batch still generating at which the long tail migrates; None uses the
    best threshold of `nereus schedule migrate` for this plan. Only with `inter_stage`."""
    intra_stage: bool = False
    """Actor and critic training share their ranks in one fused bidirectional pipeline
    (`nereus schedule fuse`): the actor's stages run forward over the ranks, the critic's in
    the reverse order, interleaved. Needs both trained with the same pp on the same ranks."""

    @model_validator(mode="after")
    def _threshold_needs_inter_stage(self) -> Fusion:
        if self.migration_threshold is not None and not self.inter_stage:
            raise ValueError("migration_threshold is set but inter_stage is false; set inter_stage: true or drop it")
        return self


class Plan(Document):
    """A complete, self-contained execution plan for one RL job."""

    kind: Literal["Plan"] = "Plan"
    cluster: Cluster
    """The cluster the plan was made for."""
    models: list[Model] = Field(min_length=1)
    """Every model the workload names (unique names)."""
    workload: Workload
    """The RL workload the plan was made for."""
    pools: list[Pool] = Field(min_length=1)
    """Disjoint GPU pools; model-stages in one pool share its GPUs."""
    stages: list[StagePlan] = Field(min_length=1)
    """One entry per model-stage the workload runs."""
    predictions: Predictions | None = None
    """Filled by `nereus plan`; checked for staleness by `nereus check`."""
    fusion: Fusion = Field(default_factory=Fusion)
    """Stage fusions the runtime applies (off by default)."""
    weights: dict[Role, str] | None = None
    """Hugging Face folder each role's initial weights are read from (absolute paths; a
    critic read from a causal LM gets a new value head); a role not named, or None: the
    model starts from the run's seed."""

    def model(self, name: str) -> Model:
        """The embedded model called `name`."""
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(name)

    def stage_plan(self, model_stage: str) -> StagePlan:
        """The entry for `model_stage`, e.g. `critic/training`."""
        for entry in self.stages:
            if entry.model_stage == model_stage:
                return entry
        raise KeyError(model_stage)

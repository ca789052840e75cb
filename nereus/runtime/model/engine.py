"""The training engine of one model on one RankLayout: TP x PP x DP on torch.distributed.

Every rank of the world calls `Engine.create` (process groups are created collectively);
ranks outside the layout get None. A rank at (replica d, stage s, tensor rank r) holds
exactly the parameters `shard_layout.holds` assigns to stage s, each the box
`local_box(..., r)` of the whole tensor, so `local_state()` / `load_local_state()` speak
the sharding contract the resharder and the checkpointer use.

Under full sharding (`EngineConfig.full_shard`, dp x cp > 1) torch's FSDP2 holds the parameters:
`fully_shard` per Block and on the stage over the dp x cp mesh (the cp ranks of a replica hold
the same weights, so they shard them with the replicas, as torchtitan's dp_shard x cp mesh
does), every family (working weights, gradients, fp32 masters, moments) split along its first
dimension as the DTensors' `Shard(0)` places it, which is `sharded_state.dp_rows`. ZeRO-1 and
training-time offload split their rows over the same dp x cp ranks.

Offload (`nereus.runtime.model.offload`): an engine with `EngineConfig.offload` sleeps between
its runs, its state in host memory. Training-time offload (`EngineConfig.train_offload`)
keeps this replica's rows of the fp32 masters, AdamW moments and gradients in host memory and
steps AdamW there (DeepSpeed's ZeRO-Offload, on ZeRO-2's sharding): each parameter's gradient
is reduce-scattered over the replicas as its backward produces it and its rows added into the
host's, so the device holds one parameter's gradient at a time; `params` also keeps the
parameters' shards there, by FSDP2's `CPUOffloadPolicy` (full sharding only).

A training step: the global batch is split as evenly as possible over the replicas and each replica's
rows into micro-batches (equal runs, or packed to a token budget: `micro_batches`); the pipeline
executor runs them (1F1B or a given schedule); the
loss is normalised by the global batch's loss weight so that summing gradients over
micro-batches and replicas gives the single-process gradient; tied embeddings sum their
gradient between the first and last stage; then AdamW updates every shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist

from nereus.cost.stage import LOGIT_CHUNK_TOKENS
from nereus.runtime.comm import arena, collectives
from nereus.runtime.comm.world import device as rank_device
from nereus.runtime.model import context_parallel
from nereus.runtime.model.adamw import AdamW, AdamWConfig, Precision, host_empty
from nereus.runtime.model.data_parallel import (
    Piece,
    all_gather_rows,
    all_reduce_bucket,
    buckets,
    reduce_scatter_bucket,
    row_pieces,
)
from nereus.runtime.model.grad_norm import counted_params
from nereus.runtime.model.initialization import box_slice, init_logical_param, shard_params
from nereus.runtime.model.losses import Objective, next_token_log_probs
from nereus.runtime.model.micro_batches import split_micro_batches
from nereus.runtime.model.moe import ROUTES_FIELD, Dispatch, Routes, load_balancing_loss, sparse_layers
from nereus.runtime.model.offload import Parking, Slot
from nereus.runtime.model.parallel_groups import ParallelGroups, build_groups
from nereus.runtime.model.pipeline import (
    ForwardStep,
    Op,
    PipelineExecutor,
    check_op_lists,
    forward_only,
    one_f_one_b,
    parse_op_lists,
)
from nereus.runtime.model.tensor_parallel import gather_last_dim
from nereus.runtime.model.transformer import Batch, DecoderPipelineStage, Recompute, positions_from_mask
from nereus.runtime.state.shard_layout import (
    STATE_FAMILIES,
    RankLayout,
    box_shape,
    ep_problem,
    holds,
    local_box,
    param_infos,
    state_key,
)
from nereus.runtime.state.sharded_state import dp_rows, even_split
from nereus.spec.check import layout_problem
from nereus.spec.model import Head, Model
from nereus.spec.plan import CpMethod


@dataclass(frozen=True)
class EngineConfig:
    """How the engine initialises and updates its parameters."""

    optimizer: AdamWConfig = field(default_factory=AdamWConfig)
    """AdamW hyperparameters."""
    init_seed: int = 0
    """Seed of the initial weights (each parameter's value depends only on it and the name)."""
    init_only: frozenset[str] | None = None
    """Names of the parameters initialised from the seed; None: all. The others are left
    for a loader to fill (weights read from a Hugging Face folder): a whole seeded tensor
    is never built for them."""
    precision: Precision = field(default_factory=Precision)
    """Parameter, activation and gradient dtype, master weights, gradient-reduction dtype."""
    shard_across_dp: bool = False
    """ZeRO-1: each of the dp x cp ranks of a (stage, tensor rank) position keeps only its rows
    (`sharded_state.dp_rows`) of the fp32 masters and AdamW moments; gradients are
    reduce-scattered over them, each steps its rows, and the updated weights are all-gathered."""
    full_shard: bool = False
    """Full sharding (ZeRO-3) on FSDP2: parameters, gradients and optimizer state each held in
    this rank's rows (of its position's dp x cp ranks), the parameters all-gathered per Block
    for its forward and backward and freed after (`reshard_after_forward`). Supersedes
    `shard_across_dp`."""
    recompute: Recompute = "none"
    """What a training forward recomputes in its backward (`StagePlan.recompute`)."""
    token_budget: int | None = None
    """Training micro-batches packed to at most this many tokens (`StagePlan.token_budget`);
    None: equal row counts."""
    offload: bool = False
    """Sleep between runs (`StagePlan.offload`): `Engine.sleep` moves every state tensor into
    host memory, `Engine.wake` (or any computation) brings it back."""
    train_offload: TrainOffload = "none"
    """Training-time offload (`StagePlan.train_offload`): `optimizer` keeps this replica's rows of
    the gradients, fp32 masters and AdamW moments in host memory and steps there (ZeRO-1's
    sharding across dp x cp is implied); `params` also the parameters' shards (FSDP2's CPU
    offload: needs `full_shard` over dp x cp > 1)."""
    cp_method: CpMethod = "ulysses"
    """How attention sees the whole sequence when cp > 1 (`StagePlan.cp_method`,
    `ContextParallel.method`)."""
    logit_chunk_tokens: int = LOGIT_CHUNK_TOKENS
    """Tokens per chunk of the LM head's log-probs and entropy in training and log-prob
    inference (`chunked_head`): at most one chunk's logits exist at a time."""

    def __post_init__(self) -> None:
        if self.logit_chunk_tokens < 1:
            raise ValueError(f"logit_chunk_tokens must be a positive token count, not {self.logit_chunk_tokens}")


#: Training-time offload levels (`StagePlan.train_offload`).
TrainOffload = Literal["none", "optimizer", "params"]


@dataclass(frozen=True)
class TrainingJob:
    """One stage's share of a started `forward_backward` (see `Engine.begin_forward_backward`)."""

    ops: list[Op]
    """This stage's ops, in the order the schedule runs them."""
    forward_step: ForwardStep
    """Micro-batch forward (on the last stage: its share of the normalised loss)."""
    input_shape: Callable[[int], tuple[int, ...]]
    """Shape of the hidden state a micro-batch's forward receives from the previous stage."""
    earlier_grads: dict[str, torch.Tensor | None]
    """The gradients held before the call, added back after this call's are reduced."""


def _check_expert_parallel(model: Model, layout: RankLayout, config: EngineConfig) -> None:
    """Refuse, in one line, an ep > 1 layout the runtime does not execute."""
    problem = ep_problem(model, layout.ep)
    if problem:
        raise ValueError(f"layout ep={layout.ep}: {problem}")
    refused = {
        "cp > 1": layout.cp > 1,
        "full_shard": config.full_shard,
        f"train_offload {config.train_offload}": config.train_offload != "none",
        "token_budget (the ep ranks must run the same micro-batch count)": config.token_budget is not None,
    }
    named = [name for name, on in refused.items() if on]
    if named:
        raise ValueError(f"layout ep={layout.ep}: expert parallelism runs without {named[0]} for now; set ep to 1")


class Engine:
    """One rank's shard of a model in a RankLayout: forward, backward, AdamW, state."""

    def __init__(self, model: Model, head: Head, groups: ParallelGroups, config: EngineConfig):
        self.model = model
        self.head = head
        self.groups = groups
        self.config = config
        self.router_aux_losses: list[float] = []
        """This rank's router auxiliary loss of each micro-batch of the last `forward_backward`
        (unweighted; empty unless the objective has a `router_aux_loss_coef`)."""
        self.router_aux_loss: float | None = None
        """The mean of those over every data-parallel rank (dp x ep; None without the term)."""
        self.device = rank_device()
        layout = groups.layout
        self.pipeline_stage = DecoderPipelineStage(
            model, head, groups.tp, layout.pp, groups.pp_rank, config.recompute, config.logit_chunk_tokens, groups.ep
        ).to(self.device)
        self.params: dict[str, torch.nn.Parameter] = dict(self.pipeline_stage.named_parameters())
        boxes = {  # the sharding contract: this stage's parameters, each its box of the whole tensor
            info: local_box(info, model, layout.tp, groups.tp.rank, groups.ep.size, groups.ep.rank)
            for info in param_infos(model, head)
            if holds(info, model, layout.pp, groups.pp_rank)
        }
        actual = {name: tuple(p.shape) for name, p in self.params.items()}
        expected = {info.name: box_shape(box) for info, box in boxes.items()}
        assert actual == expected, (actual, expected)
        self.counted_params = counted_params(model, head, groups, self.params)
        """The parameters whose gradient this rank counts in the global norm (`grad_norm`)."""
        self.expert_params = frozenset(info.name for info in param_infos(model, head) if info.expert)
        """The expert stacks (split over the ep ranks, their gradients summed over dp only)."""
        self.dtype = config.precision.torch_dtype
        # Rows split over the dp x cp ranks of this position (the cp ranks hold the same weights).
        self.full_shard = config.full_shard and layout.shards > 1
        self.train_offload = config.train_offload
        offloaded = self.train_offload != "none"
        self.zero1 = (config.shard_across_dp or offloaded) and layout.shards > 1 and not self.full_shard
        self.parking = Parking()
        """The host buffers of this engine's state while it sleeps (`EngineConfig.offload`)."""
        with torch.no_grad():
            for info, box in boxes.items():
                if config.init_only is None or info.name in config.init_only:
                    self.params[info.name].copy_(box_slice(init_logical_param(info, config.init_seed), box))
            # fp32 masters take the initial values before the parameters are rounded to 16 bits.
            masters = {}
            if config.precision.has_masters:
                masters = {n: self._fp32_copy(self.mine(p)) for n, p in self.params.items()}
            if self.full_shard:
                self._shard_fully()
            else:
                for param in self.params.values():
                    # peers reshard straight out of the arena (CPU, with an arena)
                    param.data = arena.adopt(param.data.to(self.dtype))
        self.optimizer = AdamW(self.params, config.optimizer, masters, host=offloaded)
        self.host_grads: dict[str, torch.Tensor] = {}
        """Under `train_offload: optimizer`, this replica's rows of each gradient in host memory
        (summed over micro-batches and replicas); FSDP2 holds them itself under `params`."""
        self._grads_held = False
        """Whether `host_grads` hold a gradient (False after `zero_grad`)."""
        if self.train_offload == "optimizer":
            for name, param in self.params.items():
                self.host_grads[name] = host_empty(tuple(self.mine(param).shape), self.dtype).zero_()
                if not self.full_shard:  # FSDP2 reduce-scatters into its own shards: moved after the backward
                    param.register_post_accumulate_grad_hook(self._grad_to_host_hook(name))
        self.executor = PipelineExecutor(groups.link, self.dtype, self.device)

    @classmethod
    def create(cls, model: Model, head: Head, layout: RankLayout, config: EngineConfig | None = None) -> Engine | None:
        """Collective over the world: this rank's engine, or None when it is outside `layout`."""
        problem = layout_problem(model, layout.tp, layout.pp)
        if problem:
            raise ValueError(f"layout tp={layout.tp} pp={layout.pp}: {problem}")
        if layout.cp > 1 and layout.pp > 1:
            raise ValueError(
                f"layout cp={layout.cp} pp={layout.pp}: context parallelism runs with pp 1; set cp or pp to 1"
            )
        config = config or EngineConfig()
        if layout.ep > 1:
            _check_expert_parallel(model, layout, config)
        if layout.cp > 1 and config.cp_method == "ulysses":
            context_parallel.check_heads(model.num_heads, layout.tp, layout.cp)
        if config.train_offload == "params" and not (config.full_shard and layout.shards > 1):
            raise ValueError(
                f"train_offload params keeps the parameters' shards in host memory (FSDP2's CPU offload): it needs "
                f"full_shard over dp x cp > 1 ranks, this layout has dp={layout.dp} cp={layout.cp}; use "
                "train_offload optimizer"
            )
        splits_rows = config.full_shard or config.shard_across_dp or config.train_offload != "none"
        if splits_rows and layout.shards > 1 and not layout.shards_in_group_order:
            raise ValueError(
                f"layout ranks {layout.ranks}: the replicas interleave, so the data-parallel (dp x cp) groups "
                "cannot split rows in replica order (ZeRO-1, full sharding, training-time offload); list each "
                "replica's ranks above the previous replica's at every position"
            )
        world = dist.get_world_size()
        if not all(0 <= rank < world for rank in layout.ranks):
            raise ValueError(f"layout ranks {layout.ranks} are not all ranks of this {world}-rank world")
        groups = build_groups(model, head, layout, config.cp_method)
        return None if groups is None else cls(model, head, groups, config)

    def _shard_fully(self) -> None:
        """Hand the stage to FSDP2 over this rank's dp x cp mesh (`ParallelGroups.shard_group`;
        torchtitan's dp_shard x cp): each Block its own unit (gathered
        for its forward and backward, resharded after), the stage's other parameters the root's.
        FSDP2 holds the working weights (the engine's dtype; the fp32 masters of this replica's
        rows stay with AdamW, as under ZeRO-1); gradients are summed over the replicas (the
        loss is normalised globally) in the precision's reduction dtype and held in the
        engine's, by a plain SUM: gloo has no PREMUL_SUM, so no divide factor is passed."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        g = self.groups
        for param in self.params.values():
            param.data = param.data.to(self.dtype)
        mixed = MixedPrecisionPolicy(reduce_dtype=self.config.precision.reduce_dtype)
        mesh = DeviceMesh.from_group(g.shard_group, self.device.type)
        units = [*self.pipeline_stage.layers.values(), self.pipeline_stage]
        # train_offload params: the shards, their gradients and the step in host memory
        offload = CPUOffloadPolicy(torch.cuda.is_available()) if self.train_offload == "params" else OffloadPolicy()
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=True, mp_policy=mixed, offload_policy=offload)
        for block in self.pipeline_stage.layers.values():
            register_fsdp_forward_method(block, "forward")  # the stage calls `block.forward`, not the module
        for unit in units:
            unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
            unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        self.params = dict(self.pipeline_stage.named_parameters())
        placed_params: dict[str, Any] = self.params  # DTensors now
        for name, param in placed_params.items():
            # The rows FSDP2 gave this rank, read off the DTensor's placement (what DCP reads them
            # by), are the contract's.
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            placed = (offset[0] if shape[0] else min(offset[0], param.shape[0])), shape[0]
            assert placed == dp_rows(param.shape[0], g.shards, g.shard_index), name

    # ---- state (the sharding contract) ----

    def rows(self, tensor: torch.Tensor, shard: int) -> torch.Tensor:
        """Shard `shard`'s rows (`dp_rows` over the dp x cp ranks of this position, shard
        `replica * cp + cp rank`) of a tensor shaped like a parameter of this rank (all of it
        when the engine splits nothing)."""
        if not (self.zero1 or self.full_shard):
            return tensor
        offset, count = dp_rows(tensor.shape[0], self.groups.shards, shard)
        return tensor[offset : offset + count]

    def mine(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `tensor` (`rows`; with cp = 1 its replica's): a DTensor's local rows
        (full sharding: FSDP2 placed them as `rows` would cut them)."""
        held = local(tensor)
        return self.rows(tensor, self.groups.shard_index) if held is tensor else held

    def split_family(self, family: str) -> bool:
        """Whether each replica holds only its rows of `family` (`sharded_state.dp_sharded_families`;
        training-time offload's gradients live in host memory as this replica's rows)."""
        if self.full_shard:
            return True
        if family == "grad":
            return bool(self.host_grads)
        moments = family in ("exp_avg", "exp_avg_sq")
        return self.zero1 and (moments or (family == "param" and bool(self.optimizer.masters)))

    @property
    def optimizer_step(self) -> int:
        """AdamW steps taken so far."""
        return self.optimizer.step_count

    def local_state(self) -> dict[str, torch.Tensor]:
        """Every family present, keyed `family/name`; the tensors are the live ones (no copy).
        `param` is the fp32 master where the engine keeps one (the 16-bit weight is its rounding)."""
        self._awake_for_state()
        state: dict[str, torch.Tensor] = {}
        masters = self.optimizer.masters
        for name, param in self.params.items():
            state[state_key("param", name)] = masters[name] if name in masters else local(param.detach())
            grad = self._held_grad(name)
            if grad is not None:
                state[state_key("grad", name)] = grad
            if name in self.optimizer.exp_avg:
                state[state_key("exp_avg", name)] = self.optimizer.exp_avg[name]
                state[state_key("exp_avg_sq", name)] = self.optimizer.exp_avg_sq[name]
        return state

    def load_local_state(self, state: Mapping[str, torch.Tensor], step: int) -> None:
        """Install a `local_state()`-shaped dict in place; parameters are required, the other
        families optional (moments for every parameter or for none)."""
        by_family: dict[str, dict[str, torch.Tensor]] = {family: {} for family in STATE_FAMILIES}
        for key, tensor in state.items():
            family, _, name = key.partition("/")
            if family not in by_family or name not in self.params:
                raise ValueError(f"state key {key!r} is not a {'/'.join(STATE_FAMILIES)} tensor of this rank's shard")
            param = self.params[name]
            whole = tuple(param.shape)
            shape = tuple((self.mine(param) if self.split_family(family) else param).shape)  # rows if split
            if shape != whole and tuple(tensor.shape) == whole:
                tensor = self.mine(tensor)  # a whole replica's state: keep this replica's rows
            elif tuple(tensor.shape) != shape:
                raise ValueError(f"state {key!r} has shape {tuple(tensor.shape)}, this shard holds {shape}")
            by_family[family][name] = tensor
        missing = sorted(set(self.params) - set(by_family["param"]))
        if missing:
            raise ValueError(f"state lacks parameters {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        for family in ("exp_avg", "exp_avg_sq"):
            if by_family[family] and set(by_family[family]) != set(self.params):
                raise ValueError(f"state has {family} for some parameters but not all")
        if step < 0:
            raise ValueError(f"optimizer step must be >= 0, got {step}")
        self.wake()  # the loaded state replaces what sleeps: it arrives awake
        self._grads_held = bool(self.host_grads) and bool(by_family["grad"])
        with torch.no_grad():
            for name, param in self.params.items():
                self.set_param(name, by_family["param"][name])
                grad = by_family["grad"].get(name)
                param.grad = None
                if name in self.host_grads:
                    self.host_grads[name].zero_()
                    if grad is not None:
                        self.host_grads[name].copy_(grad)
                elif grad is not None:
                    param.grad = torch.zeros_like(param)  # a DTensor placed as the parameter, under full sharding
                    local(param.grad).copy_(grad)
        self.optimizer.exp_avg = {n: self._fp32_copy(t) for n, t in by_family["exp_avg"].items()}
        self.optimizer.exp_avg_sq = {n: self._fp32_copy(t) for n, t in by_family["exp_avg_sq"].items()}
        self.optimizer.step_count = step
        if self.zero1 and self.optimizer.masters:  # each replica set only its rows from its master shard
            self._all_gather_rows({n: p.data for n, p in self.params.items()})

    def _fp32_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """An fp32 copy for the optimizer: in host memory under training-time offload."""
        shape = tuple(tensor.shape)
        offloaded = self.train_offload != "none"
        copy = host_empty(shape, torch.float32) if offloaded else arena.empty(shape, torch.float32, self.device)
        return copy.copy_(tensor.detach())

    @torch.no_grad()
    def set_param(self, name: str, value: torch.Tensor) -> None:
        """Set one parameter of this shard from its whole box, or under ZeRO-1 with masters
        from this replica's master rows (then collective: `load_local_state` all-gathers)."""
        self._awake_for_state()
        master = self.optimizer.masters.get(name)
        param = self.params[name]
        if self.full_shard:
            held = local(param)
            rows = value if value.shape == held.shape else self.mine(value)
            if master is not None:
                master.copy_(rows)
            held.copy_(rows)
        elif master is None:
            param.copy_(value)
        elif value.shape == master.shape and master.shape != param.shape:
            master.copy_(value)
            self.mine(param).copy_(master)
        else:
            master.copy_(self.mine(value))
            param.copy_(value)

    def weights(self) -> dict[str, torch.Tensor]:
        """The live working parameters (in the engine's dtype), keyed `param/name`: what a
        weight sync sends (the masters stay with the trainer). Under full sharding each is
        all-gathered whole (a copy; collective over dp)."""
        self._awake_for_state()
        weights: dict[str, Any] = {state_key("param", name): param.detach() for name, param in self.params.items()}
        return {key: param.full_tensor() for key, param in weights.items()} if self.full_shard else weights

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds, by the cost model's terms: parameters,
        gradients and optimizer (fp32 masters and AdamW moments)."""
        on_host = {t.data_ptr() for tensors in self._host_state().values() for t in tensors if t.numel()}

        def nbytes(tensors: Iterable[torch.Tensor]) -> int:
            return _nbytes(t for t in tensors if t.data_ptr() not in on_host)

        if self.parking.asleep:  # the engine's state tensors are the host buffers (or freed shards)
            return {"parameters": 0, "gradients": 0, "optimizer": 0}
        return {term: nbytes(tensors) for term, tensors in self._state().items()}

    def host_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank keeps in host memory, by the cost model's terms
        (`StageCostModel.host_terms`, and `asleep` for an offloaded model-stage's host buffers,
        which are kept while it is awake too): what the memory tracker counts apart from the
        device's (`nereus.runtime.observe.memory`)."""
        out = {term: _nbytes(tensors) for term, tensors in self._host_state().items()}
        if self.parking.buffers:
            out["asleep"] = self.parking.nbytes
        return out

    def _state(self) -> dict[str, list[torch.Tensor]]:
        """This rank's state tensors by the cost model's terms (a DTensor's local rows), live:
        parameters, gradients and optimizer (fp32 masters and AdamW moments)."""
        return {
            "parameters": [local(p) for p in self.params.values()],
            "gradients": [local(p.grad) for p in self.params.values() if p.grad is not None],
            "optimizer": [t for family in self.optimizer.state_tensors().values() for t in family.values()],
        }

    def _host_state(self) -> dict[str, list[torch.Tensor]]:
        """Training-time offload's state tensors by term, kept in host memory whether asleep or
        not (`state_bytes` tells them apart by address): all of it under `params` (FSDP2's CPU
        offload), the optimizer's and the host gradients under `optimizer`."""
        if self.train_offload != "optimizer":
            return self._state() if self.train_offload == "params" else {}
        host = {"optimizer": self._state()["optimizer"]}
        if self.host_grads:
            host["gradients"] = list(self.host_grads.values())
        return host

    # ---- offload: asleep in host memory between runs ----

    def sleep(self) -> None:
        """Move every device-resident state tensor into host memory (`nereus.runtime.model.offload`);
        nothing when the engine is not offloaded or already asleep. Local: no collective."""
        if not self.config.offload or self.parking.asleep:
            return
        storages = {}
        if self.full_shard and self.train_offload != "params":  # FSDP2's shards: their storage is freed
            storages = {("param", name): local(param.detach()) for name, param in self.params.items()}
        self.parking.sleep(self._device_slots(), storages)

    def wake(self) -> None:
        """Bring the state back from host memory (nothing when awake). Local: no collective."""
        if self.parking.asleep:
            self.parking.wake(self._device_slots(), self.device)

    def _awake_for_state(self) -> None:
        """Under full sharding FSDP2's freed shards are read only awake: wake first (the
        replicated engine's state is readable asleep, in its host buffers)."""
        if self.full_shard:
            self.wake()

    def _device_slots(self) -> list[Slot]:
        """The device-resident state tensors `sleep` moves: working weights (FSDP2's shards go by
        storage instead), gradients and the optimizer's masters and moments (already on the host
        under training-time offload)."""
        slots: list[Slot] = []
        for name, param in self.params.items():
            if not self.full_shard:
                slots.append(Slot(("param", name), partial(getattr, param, "data"), partial(setattr, param, "data")))
            if name in self.host_grads or self.train_offload == "params":
                continue
            slots.append(Slot(("grad", name), partial(self._held_grad, name), partial(self._put_grad, name)))
        if self.train_offload == "none":
            for family, tensors in self.optimizer.state_tensors().items():
                for name in tensors:
                    slots.append(Slot((family, name), partial(tensors.get, name), partial(tensors.__setitem__, name)))
        return slots

    def _put_grad(self, name: str, rows: torch.Tensor | None) -> None:
        """Parameter `name`'s gradient from this rank's `rows` (None: none); under full sharding
        a DTensor placed as the parameter is."""
        from torch.distributed.tensor import DTensor

        param: Any = self.params[name]
        if rows is not None and self.full_shard:
            rows = DTensor.from_local(
                rows, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
            )
        param.grad = rows

    def load_logical_params(self, logical: Mapping[str, torch.Tensor]) -> None:
        """Set this shard's parameters from whole (unsharded) tensors by name; keeps the optimizer state."""
        g, layout = self.groups, self.groups.layout
        shard = shard_params(
            logical, self.model, self.head, layout.tp, layout.pp, g.pp_rank, g.tp.rank, layout.ep, g.ep.rank
        )
        for name in self.params:
            self.set_param(name, shard[name])

    # ---- training ----

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        self._grads_held = False  # the host rows are zeroed when the next backward starts

    def _held_grad(self, name: str) -> torch.Tensor | None:
        """The gradient of parameter `name` this rank holds: its host rows under training-time
        offload of the optimizer, else the parameter's (a DTensor's local rows); None: none."""
        if name in self.host_grads:
            return self.host_grads[name] if self._grads_held else None
        grad = self.params[name].grad
        return None if grad is None else local(grad)

    def _grad_to_host_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        """A post-accumulate hook (`train_offload: optimizer`, replicated parameters): as the
        backward finishes parameter `name`'s gradient, sum it over the replicas into this
        replica's rows (a reduce-scatter, in the precision's reduction dtype), add those rows
        into the host's and free the device gradient."""

        @torch.no_grad()
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            assert grad is not None
            param.grad = None
            if self.groups.shard_group is not None:
                self._reduce_scatter({name: grad})
            self.host_grads[name].add_(self.mine(grad).to(self.host_grads[name].device))

        return hook

    def replica_rows(self, batch: Batch) -> Batch:
        """This replica's share of a global batch: a contiguous run of rows, shares differing by
        at most one row (the loss is normalised globally, so uneven shares stay exact)."""
        dp = self.groups.layout.dp
        if batch.num_rows < dp:
            raise ValueError(f"batch of {batch.num_rows} rows cannot give each of dp={dp} replicas a row")
        start, stop = even_split(batch.num_rows, dp)[self.groups.replica]
        return batch.rows(start, stop)

    def ep_rows(self, rows: Batch) -> Batch:
        """This ep rank's share of its replica's rows (all of them without expert parallelism):
        the ep ranks split a replica's sequences as the replicas split the batch."""
        ep = self.groups.ep
        if ep.size == 1:
            return rows
        if rows.num_rows < ep.size:
            raise ValueError(f"{rows.num_rows} rows per replica cannot give each of ep={ep.size} ranks a row")
        start, stop = even_split(rows.num_rows, ep.size)[ep.rank]
        return rows.rows(start, stop)

    def forward_backward(
        self,
        batch: Batch,
        objective: Objective,
        num_microbatches: int = 1,
        schedule: Sequence[Sequence[Any]] | None = None,
    ) -> float:
        """Add the gradient of the global batch's loss to the held gradients (summed over
        micro-batches, replicas and tied copies); return that loss on every rank.

        `schedule`: per pipeline stage, the ordered ops ({kind: F|B, microbatch}); 1F1B if None.
        Under a token budget `num_microbatches` is the least count (a schedule's, exactly).
        """
        job = self.begin_forward_backward(batch, objective, num_microbatches, schedule)
        outputs = self.executor.run(job.ops, job.forward_step, job.input_shape, train=True)
        return self.finish_forward_backward(job, outputs)

    def begin_forward_backward(
        self,
        batch: Batch,
        objective: Objective,
        num_microbatches: int = 1,
        schedule: Sequence[Sequence[Any]] | None = None,
    ) -> TrainingJob:
        """The first half of `forward_backward`: check the schedule, set the held gradients
        aside and zero them, and return this stage's ops and forward step. Run the ops (this
        engine's executor, or a fused one sharing the ranks), then `finish_forward_backward`."""
        normalizer = float(objective.normalizer(batch))
        if normalizer <= 0:
            raise ValueError("the batch has no token with a positive loss weight")
        parts = split_micro_batches(self.ep_rows(self.replica_rows(batch)), num_microbatches, self.config.token_budget)
        if schedule is not None and len(parts) != num_microbatches:
            raise ValueError(
                f"token_budget {self.config.token_budget} packs this replica's rows into {len(parts)} "
                f"micro-batches, the schedule runs {num_microbatches}; raise token_budget or micro_batches"
            )
        pp = self.groups.layout.pp
        op_lists = one_f_one_b(pp, len(parts)) if schedule is None else parse_op_lists(schedule)
        if len(op_lists) != pp:
            raise ValueError(f"schedule has {len(op_lists)} stage op lists, the layout has pp={pp}")
        check_op_lists(op_lists, len(parts), backward=True)

        aux_share = self._router_aux_share(objective, len(parts))
        self.router_aux_losses = []

        def step(mb: int, stage_input: torch.Tensor | None) -> torch.Tensor:
            part = parts[mb]
            routes = None if aux_share == 0 else Routes(keep_logits=True)

            def loss(output: torch.Tensor) -> torch.Tensor:
                weights = objective.weights(part).to(self.device)
                if self.groups.cp.size > 1:  # this rank's columns' share of the loss
                    cp, stage = self.groups.cp, self.pipeline_stage
                    return context_parallel.chunk_loss(cp, objective, output, part, weights, normalizer, stage)
                value = (objective.token_losses(output, part, self.pipeline_stage) * weights).sum() / normalizer
                if routes is None:
                    return value
                aux = self._router_aux_loss(routes, part)
                self.router_aux_losses.append(float(aux.detach()))
                return value + aux_share * aux

            return self._stage_forward(part, stage_input, loss, routes=routes)

        # Reduce only this call's gradient: gradients already held were reduced by earlier calls.
        self.wake()
        earlier: dict[str, torch.Tensor | None] = {name: param.grad for name, param in self.params.items()}
        if self.host_grads:  # the host rows: set aside (a copy) where held, then zeroed for this call
            earlier = {n: g.clone() if self._grads_held else None for n, g in self.host_grads.items()}
            for grad in self.host_grads.values():
                grad.zero_()
        self.zero_grad()
        return TrainingJob(op_lists[self.groups.pp_rank], step, self._hidden_shape(parts), earlier)

    def _router_aux_share(self, objective: Objective, num_parts: int) -> float:
        """The weight of each micro-batch's router auxiliary loss in the step loss: the
        objective's `router_aux_loss_coef` over the micro-batches of every data-parallel rank
        (dp x ep), so the step adds coef x their mean; 0 without one."""
        coef = float(getattr(objective, "router_aux_loss_coef", 0.0))
        if coef == 0:
            return 0.0
        if self.model.moe is None:
            raise ValueError(
                f"rl.router_aux_loss_coef is {coef}: model {self.model.name} is dense (no router); set it to 0"
            )
        if self.groups.layout.pp > 1 or self.groups.cp.size > 1:
            raise ValueError(
                "rl.router_aux_loss_coef > 0 runs with pp = 1 and cp = 1 (the loss pools every MoE layer's "
                f"tokens), the actor's training layout has pp={self.groups.layout.pp} cp={self.groups.cp.size}"
            )
        return coef / (num_parts * self.groups.layout.dp * self.groups.ep.size)

    def _router_aux_loss(self, routes: Routes, part: Batch) -> torch.Tensor:
        """transformers' load-balancing loss of one micro-batch's forward (`moe.load_balancing_loss`
        over every MoE layer's router logits, real tokens only, as `Qwen3MoeForCausalLM` with
        `output_router_logits` computes it)."""
        moe = self.model.moe
        assert moe is not None
        logits = [routes.router_logits[layer] for layer in sparse_layers(self.model)]
        flat = [layer.reshape(-1, layer.shape[-1]) for layer in logits]
        mask = part.mask().to(self.device).reshape(-1).bool()
        return load_balancing_loss(flat, moe.num_experts, moe.experts_per_token, mask)

    def finish_forward_backward(self, job: TrainingJob, outputs: Mapping[int, torch.Tensor]) -> float:
        """The second half of `forward_backward` once `job`'s ops ran (collective over the
        layout): reduce the gradients, add back the ones set aside, return the loss."""
        self._sync_grads()  # over dp x cp: each cp rank's gradient holds its columns' share
        self._grads_held = bool(self.host_grads)
        if self.groups.ep.size > 1:  # the ep ranks are data-parallel for every weight but their experts
            shared = [grad for name, grad in self._named_grads() if name not in self.expert_params]
            self._all_reduce(shared, self.groups.ep.group)
        for name, grad in job.earlier_grads.items():
            if grad is not None:
                held = self._held_grad(name)
                assert held is not None
                held.add_(local(grad))
        self.router_aux_loss = None
        if self.router_aux_losses:  # pp = 1 and cp = 1 (`_router_aux_share`): every rank has its own
            aux = torch.tensor(sum(self.router_aux_losses) / len(self.router_aux_losses), device=self.device)
            self._sum_over_data_parallel(aux)
            self.router_aux_loss = float(aux) / (self.groups.layout.dp * self.groups.ep.size)
        loss = torch.zeros((), device=self.device)
        if self.pipeline_stage.is_last:
            loss = torch.stack(list(outputs.values())).sum()
            self._sum_over_data_parallel(loss)
        return float(self.from_last_stage(loss))

    def _sum_over_data_parallel(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` in place over the replicas, then the cp ranks, then the ep ranks."""
        for group in (self.groups.dp_group, self.groups.cp.group, self.groups.ep.group):
            if group is not None:
                collectives.all_reduce(tensor, group)

    def update(self) -> None:
        """One AdamW step on every shard (after forward_backward); under ZeRO-1 each replica
        steps its rows and the updated weights are all-gathered; under full sharding each
        steps its rows (the masters', rounded into FSDP2's), which FSDP2 gathers at the next forward.
        Under training-time offload the step runs in host memory on the host gradients' rows."""
        self.wake()
        if self.host_grads and not self._grads_held:
            return
        held = ((n, self.counted_grad(n), p) for n, p in self.params.items())
        self.optimizer.step((n, grad, self.mine(p.data)) for n, grad, p in held if grad is not None)
        if self.zero1:  # every shard's updated rows onto every rank
            self._all_gather_rows({n: p.data for n, p in self.params.items()})

    @torch.no_grad()
    def _all_gather_rows(self, whole: Mapping[str, torch.Tensor]) -> None:
        """Fill the other shards' rows of parameter-shaped tensors whose own rows are set
        (collective over dp x cp; one dtype per call, buckets of GRAD_BUCKET_ELEMENTS). Under
        training-time offload one parameter's rows at a time, as its gradients left the device:
        the staging (the send buffer, the gathered rows and the backend's flat copy of them, dp +
        1 + dp of a replica's rows) stays within one parameter's instead of a whole bucket's, which
        in fp32 at dp=2 is 2^22 x 4 B x 5 = 84 MB, more than the backward's transient it follows."""
        pieces = self._replica_pieces(whole)
        runs = [[piece] for piece in pieces] if self.train_offload != "none" else buckets(pieces)
        for bucket in runs:
            all_gather_rows(bucket, self.groups.shard_group, self.groups.shard_index, self.device)

    def _replica_pieces(self, tensors: Mapping[str, torch.Tensor]) -> list[Piece]:
        """The row blocks (`row_pieces`) of `tensors`, each shard's rows of each tensor."""
        shards = range(self.groups.shards)
        return [piece for tensor in tensors.values() for piece in row_pieces([self.rows(tensor, i) for i in shards])]

    def whole_state(self, families: Sequence[str]) -> dict[str, torch.Tensor]:
        """`local_state()`'s `families` with every tensor split across dp assembled whole (a
        copy, in the state arena, so a live transition's peers read it directly; collective over
        dp x cp): the state of a self-contained replica, which a live transition moves replica by
        replica. Each rank's rows are `dp_rows` over dp x cp, as ZeRO-1 splits them and as FSDP2's
        placements put them (checked when it shards). Without a split, the live tensors."""
        state = {k: t for k, t in self.local_state().items() if k.split("/")[0] in families}
        if not self.dp_split_grads:
            return state
        for family in families:
            whole: dict[str, torch.Tensor] = {}
            for name, param in self.params.items():
                key = state_key(family, name)
                # by family, not by shape: a replica may hold all rows of a small tensor, and
                # every replica must take part in the same gathers
                if key in state and self.split_family(family):
                    whole[name] = arena.empty(tuple(param.shape), state[key].dtype, self.device)
                    self.mine(whole[name]).copy_(state[key])
            self._all_gather_rows(whole)
            state.update({state_key(family, name): tensor for name, tensor in whole.items()})
        return state

    def counted_grad(self, name: str) -> torch.Tensor | None:
        """The piece of parameter `name`'s gradient this replica counts in the global norm:
        its rows where the gradient is reduced only in them (ZeRO-1, full sharding), else all."""
        if name in self.host_grads:
            return self._held_grad(name)  # this replica's rows, in host memory
        grad = self.params[name].grad
        return None if grad is None else self.mine(grad)

    @property
    def dp_split_grads(self) -> bool:
        """Whether each replica holds the reduced gradient in its rows only (a norm sums over dp)."""
        return self.zero1 or self.full_shard

    def _named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """(name, gradient) of every gradient this rank holds (`grads`), live."""
        held = ((name, self._held_grad(name)) for name in self.params)
        return [(name, grad) for name, grad in held if grad is not None]

    def grads(self) -> list[torch.Tensor]:
        """Every gradient this rank holds (its rows under full sharding or training-time offload), live."""
        return [grad for _, grad in self._named_grads()]

    def train_step(
        self,
        batch: Batch,
        objective: Objective,
        num_microbatches: int = 1,
        schedule: Sequence[Sequence[Any]] | None = None,
    ) -> float:
        """zero_grad, forward_backward, update; returns the loss before the update."""
        self.zero_grad()
        loss = self.forward_backward(batch, objective, num_microbatches, schedule)
        self.update()
        return loss

    def _hidden_shape(self, parts: Sequence[Batch]) -> Callable[[int], tuple[int, ...]]:
        return lambda mb: (*parts[mb].tokens.shape, self.model.hidden_dim)

    def _stage_forward(
        self,
        part: Batch,
        stage_input: torch.Tensor | None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        dispatch: Dispatch = "all_to_all",
        routes: Routes | None = None,
    ) -> torch.Tensor:
        """This stage's output for `part`; on the last stage `reduce` of it, run inside the
        forward (an LM head's final hidden states: `DecoderPipelineStage.forward`). `dispatch`:
        how the MoE layers reach the other ep ranks' experts (`moe`). A part with the
        `ROUTES_FIELD` replays its routing (`moe.Routes`); `routes` records this stage's."""
        if (routes is not None or ROUTES_FIELD in part.fields) and self.groups.cp.size > 1:
            raise ValueError("routing replay and recording run without context parallelism; set cp to 1")
        if ROUTES_FIELD in part.fields:
            routes = routes or Routes()
            given = part.fields[ROUTES_FIELD].to(self.device)
            moe_layers = sparse_layers(self.model)
            for layer in self.pipeline_stage.layer_ids:
                if layer in moe_layers:
                    routes.replay[layer] = given[:, :, moe_layers.index(layer)]
        if self.groups.cp.size > 1:  # this rank's columns (pp is 1)
            return context_parallel.stage_forward(self.pipeline_stage, self.groups.cp, part, self.device, reduce)
        mask = part.mask().to(self.device)
        inputs = part.tokens.to(self.device) if stage_input is None else stage_input
        positions = positions_from_mask(mask)
        return self.pipeline_stage(inputs, mask, positions, reduce=reduce, dispatch=dispatch, routes=routes)

    @torch.no_grad()
    def _sync_grads(self) -> None:
        """Sum the gradients over tied copies, replicas and cp ranks (FSDP2 reduce-scattered them already
        under full sharding; a tied embedding's rows are summed between its two stages). Under
        `train_offload: optimizer` FSDP2's reduced shards are then added into the host rows and freed
        (the replicated engine's hooks did that as the backward went, and its tied embedding's host
        rows are summed through the device: the collective backend's memory)."""
        embed_group = self.groups.embed_group
        if self.host_grads and not self.full_shard:
            if embed_group is not None:
                held = self.host_grads["embed.weight"]
                summed = held.to(self.device, copy=True)
                collectives.all_reduce(summed, embed_group)
                held.copy_(summed)
            return
        grads: dict[str, torch.Tensor] = {}
        for name, param in self.params.items():
            assert param.grad is not None, "every shard parameter takes part in the loss"
            grads[name] = param.grad
        if embed_group is not None:
            collectives.all_reduce(local(grads["embed.weight"]), embed_group)
        if self.host_grads:
            for name, param in self.params.items():
                self.host_grads[name].add_(local(grads[name]).to(self.host_grads[name].device))
                param.grad = None
            return
        group = self.groups.shard_group  # dp x cp: the replicas and the cp ranks of each
        if group is None or self.full_shard:
            return
        if self.zero1:
            self._reduce_scatter(grads)
        else:
            self._all_reduce(list(grads.values()), group)

    def _reduce_scatter(self, grads: Mapping[str, torch.Tensor]) -> None:
        """ZeRO-1: sum gradients over the dp x cp ranks into this rank's rows, in buckets, in the
        precision's reduction dtype."""
        dtype = self.config.precision.reduce_dtype
        for bucket in buckets(self._replica_pieces(grads)):
            reduce_scatter_bucket(bucket, self.groups.shard_group, self.groups.shard_index, dtype, self.device)

    def _all_reduce(self, grads: list[torch.Tensor], group: Any) -> None:
        """Sum whole gradients over `group` in buckets, in the precision's reduction dtype."""
        whole = [piece for grad in grads for piece in row_pieces([grad])]
        for bucket in buckets(whole):
            all_reduce_bucket([piece[0] for piece in bucket], group, self.config.precision.reduce_dtype)

    def from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's `tensor` on every stage of this replica (same shape everywhere)."""
        g, link = self.groups, self.groups.link
        if link.num_stages == 1:
            return tensor
        tensor = tensor.contiguous()
        last = g.layout.rank_at(g.replica, link.num_stages - 1, g.tp.rank, g.cp.rank, g.ep.rank)
        collectives.broadcast(tensor, last, link.group)
        return tensor

    # ---- inference ----

    def _forward_outputs(
        self,
        batch: Batch,
        num_microbatches: int,
        reduce: Callable[[torch.Tensor, Batch], torch.Tensor],
        out_shape: tuple[int, ...],
        from_hidden: bool = False,
    ) -> torch.Tensor:
        """Run this replica's forward over `batch`; `reduce(output, part)` turns each last-stage
        output (the head's, or with `from_hidden` an LM head's final hidden states) into the rows
        of the result, which every rank of the replica receives. Under expert parallelism every
        ep rank runs the replica's whole batch, each computing its own experts' share of every
        token (`replicated` dispatch): the result is the replica's on each without a gather."""
        parts = split_micro_batches(batch, num_microbatches)

        def step(mb: int, stage_input: torch.Tensor | None) -> torch.Tensor:
            part = parts[mb]
            if from_hidden:
                return self._stage_forward(part, stage_input, lambda hidden: reduce(hidden, part), "replicated")
            output = self._stage_forward(part, stage_input, dispatch="replicated")
            return reduce(output, part) if self.pipeline_stage.is_last else output

        outputs = self._run_forward(parts, step)
        result = torch.zeros(out_shape, device=self.device)
        if self.pipeline_stage.is_last:  # fp32 results whatever the compute dtype
            result = torch.cat([outputs[mb] for mb in range(num_microbatches)]).float()
        return self.from_last_stage(result)

    def _run_forward(self, parts: Sequence[Batch], step: ForwardStep) -> dict[int, torch.Tensor]:
        """Run `step` over the micro-batches `parts` without gradients (this stage's forward-only
        ops, awake); returns the last stage's outputs by micro-batch."""
        self.wake()
        ops = forward_only(self.groups.layout.pp, len(parts))[self.groups.pp_rank]
        with torch.no_grad():
            return self.executor.run(ops, step, self._hidden_shape(parts), train=False)

    def logits(self, batch: Batch, num_microbatches: int = 1) -> torch.Tensor:
        """Full-vocabulary logits [b, t, vocab] of this replica's `batch`, on every rank of it."""
        self.require_head("lm")
        shape = (*batch.tokens.shape, self.model.vocab_size)
        return self._forward_outputs(
            batch, num_microbatches, lambda out, part: self._whole(gather_last_dim(out, self.groups.tp), part), shape
        )

    def log_probs(self, batch: Batch, num_microbatches: int = 1) -> torch.Tensor:
        """[b, t - 1]: log p(tokens[:, i + 1] | tokens[:, : i + 1]) (actor and reference inference)."""
        self.require_head("lm")
        rows, seq = batch.tokens.shape

        def reduce(hidden: torch.Tensor, part: Batch) -> torch.Tensor:
            tokens, cp = part.tokens.to(self.device), self.groups.cp
            if cp.size > 1:
                return context_parallel.next_token_log_probs(cp, hidden, tokens, self.pipeline_stage)
            return next_token_log_probs(hidden, tokens, self.pipeline_stage)

        return self._forward_outputs(batch, num_microbatches, reduce, (rows, seq - 1), from_hidden=True)

    def values(self, batch: Batch, num_microbatches: int = 1) -> torch.Tensor:
        """[b, t] value-head outputs (critic and reward inference)."""
        self.require_head("value")
        shape = tuple(batch.tokens.shape)
        return self._forward_outputs(batch, num_microbatches, lambda out, part: self._whole(out.float(), part), shape)

    def _whole(self, output: torch.Tensor, part: Batch) -> torch.Tensor:
        """A per-column result of `part` on every column: under context parallelism this
        rank's columns gathered with the other cp ranks'; else `output` itself."""
        cp = self.groups.cp
        return output if cp.size == 1 else context_parallel.whole_columns(cp, output, int(part.tokens.shape[1]))

    def routing(self, batch: Batch, num_microbatches: int = 1) -> torch.Tensor:
        """[rows, seq, MoE layers, experts_per_token]: the experts each token of this replica's
        `batch` goes to in every sparse layer (`moe.ROUTES_FIELD`'s layout; a batch carrying
        that field replays it), on every rank of the replica (collective over it)."""
        moe = self.model.moe
        if moe is None:
            raise ValueError(f"model {self.model.name} has no experts to route to")
        parts = split_micro_batches(batch, num_microbatches)
        recorded: dict[int, dict[int, torch.Tensor]] = {}

        def step(mb: int, stage_input: torch.Tensor | None) -> torch.Tensor:
            routes = Routes()
            output = self._stage_forward(parts[mb], stage_input, dispatch="replicated", routes=routes)
            recorded[mb] = {layer: chosen.cpu() for layer, chosen in routes.chosen.items()}
            return output

        self._run_forward(parts, step)
        mine = {layer: torch.cat([recorded[mb][layer] for mb in range(len(parts))]) for layer in recorded[0]}
        link = self.groups.link.group
        stages = [mine] if link is None else collectives.all_gathered_objects(mine, link)
        by_layer = {layer: chosen for stage in stages for layer, chosen in stage.items()}
        return torch.stack([by_layer[layer] for layer in sparse_layers(self.model)], dim=2)

    def require_head(self, head: Head) -> None:
        if self.head != head:
            raise ValueError(f"this engine has a {self.head} head; the call needs a {head} head")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's or gradient's tensor on this rank: a DTensor's local rows (a view of what
    FSDP2 holds), a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of `tensors`' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)

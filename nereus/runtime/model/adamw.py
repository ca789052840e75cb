"""AdamW with fp32 moments kept per parameter name (the sharding contract's state families).

Keying the state by name, not by position, is what lets a resharder or a checkpoint move
`exp_avg/<name>` and `exp_avg_sq/<name>` alongside `param/<name>`. The update is
torch.optim.AdamW's (decoupled weight decay, bias-corrected moments), computed in fp32.

Mixed precision (`Precision`): bf16 parameters with fp32 master weights. The optimizer
steps the fp32 master and the bf16 weight is refreshed from it (rounded to nearest); the
master is what checkpoints and transitions carry, so the bf16 weight is always a function
of it and a resume is bitwise.

Training-time offload (`AdamW(host=True)`): the moments are made in host memory
(`host_empty`) and every piece is stepped there, beside its host gradient and master; a
target elsewhere (the device's parameter rows) is stepped through an fp32 host copy and
written back, the same arithmetic as stepping it in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from nereus.runtime.comm import arena
from nereus.runtime.model.data_parallel import bucketed
from nereus.runtime.state.sharded_state import keeps_masters
from nereus.spec.capabilities import RUNTIME_DTYPES
from nereus.spec.stages import Stage
from nereus.spec.workload import Workload


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyperparameters (torch.optim.AdamW's defaults except the learning rate)."""

    lr: float = 1e-4
    """Learning rate."""
    beta1: float = 0.9
    """Decay of the first moment."""
    beta2: float = 0.999
    """Decay of the second moment."""
    eps: float = 1e-8
    """Added to the denominator's square root."""
    weight_decay: float = 0.01
    """Decoupled weight decay (multiplies the parameter by 1 - lr * weight_decay each step)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"AdamW lr must be positive, got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"AdamW betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        if not self.eps > 0 or self.weight_decay < 0:
            raise ValueError(
                f"AdamW eps must be positive and weight_decay non-negative, got {self.eps}, {self.weight_decay}"
            )


ReduceDType = Literal["fp32", "bf16"]

#: Elements of one tensor AdamW updates at a time (its fp32 temporaries: 16 MiB each).
UPDATE_SLICE_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Precision:
    """The dtypes one engine holds and computes in."""

    dtype: str = "float32"
    """torch name of the parameters, activations, gradients and KV cache: float32 or bfloat16."""
    master_weights: bool = False
    """Keep an fp32 master copy of each parameter that AdamW steps (bfloat16 only)."""
    grad_reduce: ReduceDType = "fp32"
    """Dtype gradients are summed in across dp: fp32 (each bucket upcast for the sum, then
    rounded back to the gradient dtype) or bf16 (summed as held: half the bytes)."""

    def __post_init__(self) -> None:
        if self.dtype not in RUNTIME_DTYPES.values():
            raise ValueError(f"precision dtype {self.dtype!r} is not one of {', '.join(RUNTIME_DTYPES.values())}")

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def has_masters(self) -> bool:
        """Whether the engine keeps fp32 masters (a 16-bit dtype with master weights)."""
        return self.master_weights and self.dtype != "float32"

    @property
    def reduce_dtype(self) -> torch.dtype:
        return torch.float32 if self.grad_reduce == "fp32" else self.torch_dtype


def stage_precision(workload: Workload, stage: Stage, grad_reduce: ReduceDType = "fp32") -> Precision:
    """The precision a model-stage's engine runs in: the workload's dtype, with fp32 masters
    where `keeps_masters` says."""
    if workload.dtype not in RUNTIME_DTYPES:
        raise ValueError(f"workload dtype {workload.dtype} is not run (no loss scaling); use bf16 or fp32")
    return Precision(RUNTIME_DTYPES[workload.dtype], keeps_masters(workload, stage), grad_reduce)


class AdamW:
    """AdamW over named parameters; `exp_avg` and `exp_avg_sq` are fp32 tensors per name, and
    `masters` the fp32 master weights of 16-bit parameters (empty: the parameters are
    stepped themselves, through an fp32 copy when they are 16-bit)."""

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        config: AdamWConfig,
        masters: dict[str, torch.Tensor] | None = None,
        host: bool = False,
    ):
        self.params = params
        self.config = config
        self.host = host
        """Whether the moments live in host memory and the step runs there (training-time offload)."""
        self.step_count = 0
        self.exp_avg: dict[str, torch.Tensor] = {}
        self.exp_avg_sq: dict[str, torch.Tensor] = {}
        self.masters: dict[str, torch.Tensor] = masters if masters is not None else {}

    @torch.no_grad()
    def step(self, pieces: Iterable[tuple[str, torch.Tensor, torch.Tensor]] | None = None) -> None:
        """One update of every parameter that has a gradient, or of `pieces`: (name, its
        gradient, the tensor the result goes to), each the same shape as the name's moments
        and master (a ZeRO-1 shard passes its rows of the parameter)."""
        self.step_count += 1
        if pieces is None:
            pieces = ((name, p.grad, p) for name, p in self.params.items() if p.grad is not None)
        # in buckets of slices, so the fp32 temporaries of one bucket's update stay within UPDATE_SLICE_ELEMENTS
        for bucket in bucketed(self._slices(pieces), lambda piece: piece[0].numel(), UPDATE_SLICE_ELEMENTS):
            self._update_bucket(*(list(column) for column in zip(*bucket, strict=True)))

    def _slices(self, pieces: Iterable[tuple[str, torch.Tensor, torch.Tensor]]) -> Iterator[_Slice]:
        """Each piece's (gradient, target, exp_avg, exp_avg_sq, master or None) as flat
        slices of at most UPDATE_SLICE_ELEMENTS (its moments made on its first update)."""
        for name, grad, target in pieces:
            if name not in self.exp_avg:
                self.exp_avg[name] = self._zeros(target)
                self.exp_avg_sq[name] = self._zeros(target)
            master = self.masters.get(name)
            tensors = [grad, target, self.exp_avg[name], self.exp_avg_sq[name]]
            flats = [t.view(-1) for t in tensors]
            flat_master = master.view(-1) if master is not None else None
            for start in range(0, flats[0].numel(), UPDATE_SLICE_ELEMENTS):
                g, t, m1, m2 = (f[start : start + UPDATE_SLICE_ELEMENTS] for f in flats)
                yield g, t, m1, m2, None if flat_master is None else flat_master[start : start + UPDATE_SLICE_ELEMENTS]

    def _update_bucket(
        self,
        grads: list[torch.Tensor],
        targets: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        masters: list[torch.Tensor | None],
    ) -> None:
        """AdamW on a bucket of slices, each op once over the bucket (torch's foreach ops: the
        same elementwise arithmetic as one tensor at a time, so the same bits)."""
        c = self.config
        bias1 = 1 - c.beta1**self.step_count
        bias2_sqrt = math.sqrt(1 - c.beta2**self.step_count)
        where = exp_avgs[0].device  # the host under training-time offload: each piece is stepped there
        grads = [grad.to(where, torch.float32) for grad in grads]
        torch._foreach_lerp_(exp_avgs, grads, 1 - c.beta1)
        torch._foreach_mul_(exp_avg_sqs, c.beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - c.beta2)
        # An fp32 parameter is its own master (`to` returns it); a 16-bit one without a master,
        # or one on another device than the moments, is stepped through a temporary fp32 copy.
        stepped = [
            target.to(where, torch.float32) if master is None else master
            for target, master in zip(targets, masters, strict=True)
        ]
        torch._foreach_mul_(stepped, 1 - c.lr * c.weight_decay)
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, bias2_sqrt)
        torch._foreach_add_(denoms, c.eps)
        torch._foreach_addcdiv_(stepped, exp_avgs, denoms, value=-c.lr / bias1)
        for target, master in zip(targets, stepped, strict=True):
            if master is not target:
                target.copy_(master)

    def _zeros(self, target: torch.Tensor) -> torch.Tensor:
        """An fp32 moment shaped as `target`: in host memory under offload, else beside the
        target (in the process's state arena when it has one: CPU)."""
        if self.host:
            return host_empty(tuple(target.shape), torch.float32).zero_()
        return arena.empty(tuple(target.shape), torch.float32, target.device).zero_()

    def state_tensors(self) -> Mapping[str, dict[str, torch.Tensor]]:
        """The optimizer's tensors by family: master weights (if any) and the two moments."""
        return {"master": self.masters, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def zero_grad(self) -> None:
        for param in self.params.values():
            param.grad = None


#: One slice of an update: gradient, target, exp_avg, exp_avg_sq and master (None: none).
_Slice = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in host memory for offloaded state: pinned where a GPU copies
    to and from it (so the copies run at the link's speed), never in the state arena (the
    memory tracker counts host bytes apart from the device's: `Engine.host_bytes`)."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())

"""Model state in host memory: a model-stage asleep between its runs (`StagePlan.offload`) and
the host-side gradients of training-time offload (`StagePlan.train_offload`).

Asleep, every device-resident state tensor of an engine (working weights, gradients, fp32
masters, AdamW moments) is copied into a host buffer of its own and the engine's references
point at that buffer, so the device copy is freed; the state stays readable and writable
asleep (a checkpoint, a weight sync or a transition reads and writes the host buffers),
and waking copies each back into fresh device memory. The host buffers are made at the first
sleep and kept (pinned where a GPU copies them): an offloaded model-stage's host bytes are
its resident states whether it is awake or not, which is what the cost model prices
(`nereus.cost.plan_cost.host_bytes`, the `asleep` term).

Under full sharding FSDP2 owns the parameters' storage: asleep, each shard's storage is
copied out and resized to nothing (FSDP2's own way of freeing unsharded parameters) and
waking restores it; the engine wakes before reading them (`Engine.wake`).

On CPU ranks host and device memory are the same RAM: the copies are made all the same, so
the memory tracker (`nereus.runtime.observe.memory`) sees the device bytes leave and counts
the host buffers apart (`Engine.host_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nereus.runtime.comm import arena
from nereus.runtime.model.adamw import host_empty


@dataclass
class Slot:
    """One state tensor an engine can put to sleep: how to read it and how to point the engine
    at another tensor in its place."""

    key: tuple[str, str]
    """(family, name): the host buffer's key (families as `AdamW.state_tensors` names them)."""
    get: Callable[[], torch.Tensor | None]
    """The tensor the engine holds now (None: the engine holds none, e.g. no gradient yet)."""
    put: Callable[[torch.Tensor | None], None]
    """Point the engine at a tensor of the same shape and dtype (None: hold none)."""


class Parking:
    """The host buffers of one engine's state while it sleeps, kept across sleeps."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, str], torch.Tensor] = {}
        self.asleep = False
        #: Keys of the slots that held a tensor when put to sleep (the others stay None).
        self._held: set[tuple[str, str]] = set()
        #: Storages resized to nothing (FSDP2's shards), with their byte size, by key.
        self._freed: dict[tuple[str, str], tuple[torch.UntypedStorage, int, torch.Tensor]] = {}

    def _park(self, key: tuple[str, str], tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` copied into its host buffer (made, or remade for another shape or dtype)."""
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.buffers[key] = host_empty(tuple(tensor.shape), tensor.dtype)
        return buffer.copy_(tensor)

    @torch.no_grad()
    def sleep(self, slots: list[Slot], storages: dict[tuple[str, str], torch.Tensor]) -> None:
        """Copy every slot's tensor into its host buffer and point the engine at the buffer;
        copy each of `storages` (views whose storage someone else owns: FSDP2's shards) out and
        free its storage."""
        assert not self.asleep, "already asleep"
        self._held = set()
        for slot in slots:
            tensor = slot.get()
            if tensor is None:
                continue
            self._held.add(slot.key)
            slot.put(self._park(slot.key, tensor))
        for key, view in storages.items():
            self._park(key, view)
            storage = view.untyped_storage()
            self._freed[key] = (storage, storage.nbytes(), view)
            storage.resize_(0)
        self.asleep = True

    @torch.no_grad()
    def wake(self, slots: list[Slot], device: torch.device) -> None:
        """Each slot's state back in fresh device memory (in the state arena on CPU), the
        freed storages restored; the host buffers stay for the next sleep. A slot the engine
        pointed elsewhere while asleep keeps what it points at."""
        assert self.asleep, "not asleep"
        for slot in slots:
            buffer, held = self.buffers.get(slot.key), slot.get()
            if slot.key not in self._held or buffer is None or held is None or held.data_ptr() != buffer.data_ptr():
                continue  # held nothing, or the engine replaced it asleep (gradients zeroed: None)
            tensor = arena.empty(tuple(buffer.shape), buffer.dtype, device)
            tensor.copy_(buffer)
            slot.put(tensor)
        for key, (storage, nbytes, view) in self._freed.items():
            storage.resize_(nbytes)
            view.copy_(self.buffers[key])
        self._freed = {}
        self.asleep = False

    @property
    def nbytes(self) -> int:
        """Host bytes the buffers hold (whether asleep or not: they are kept)."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers.values())

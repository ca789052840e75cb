"""The vocabulary of a transition: EMUs, shard boxes and the four primitives.

A model-stage's state (parameters; in training also gradients and optimizer state) is
a unit square: pipeline stages cut it along layers, tensor ranks along columns. A
layout (tp, pp) cuts it into tp * pp boxes; GPU `s * tp + r` of an EMU holds box
(s, r). Layers are treated as equally sized, so a box holds state_bytes / (tp * pp).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, NamedTuple

PrimitiveKind = Literal["split", "destroy", "extend", "merge"]
Layout = tuple[int, int]  # (tp, pp)


class Emu(NamedTuple):
    """One replica of a model-stage: its layout and ordered GPUs (stage-major).

    A named tuple rather than a frozen dataclass: a large transition makes thousands of
    them, and a tuple is built, hashed and compared in C.
    """

    model_stage: str
    tp: int
    pp: int
    gpus: tuple[int, ...]

    @property
    def layout(self) -> Layout:
        return (self.tp, self.pp)

    def position(self, index: int) -> tuple[int, int]:
        """(pipeline stage, tensor rank) of the GPU at `index`."""
        return divmod(index, self.tp)


def box_fraction(layout: Layout) -> float:
    """Share of the state one GPU of this layout holds."""
    return 1.0 / (layout[0] * layout[1])


@dataclass
class Primitive:
    """One step of a transition on one model-stage.

    Memory is allocated on `alloc` GPUs when it starts and released from `free` GPUs
    when it ends; it occupies every GPU in `gpus` for its whole duration. `removes`
    are replicas that stop being complete copies when it starts; `retires` stop being
    replicas when it ends (their data lives on in `adds`); `adds` become complete
    copies when it ends; `copies_from` are read and must stay complete while it runs.
    """

    id: int
    kind: PrimitiveKind
    model_stage: str
    source_layout: Layout
    target_layout: Layout
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    alloc: dict[int, float]
    free: dict[int, float]
    transfers: tuple[tuple[int, int, float], ...]  # (source GPU, destination GPU, bytes)
    removes: tuple[Emu, ...] = ()
    retires: tuple[Emu, ...] = ()
    adds: tuple[Emu, ...] = ()
    copies_from: tuple[Emu, ...] = ()  # replicas it reads: complete copies for its whole run
    deps: list[int] = field(default_factory=list)
    new_groups: int = 0  # communicators this primitive creates
    # Filled by the scheduler; `scheduled` stays False for primitives a deadlock left unrun.
    scheduled: bool = False
    duration_s: float = 0.0
    start_s: float = 0.0
    end_s: float = 0.0
    ownership_deps: list[int] = field(default_factory=list)

    @cached_property
    def gpus(self) -> tuple[int, ...]:
        """Every GPU the primitive occupies (its GPU sets never change once built)."""
        return tuple(sorted(set(self.reads) | set(self.writes) | set(self.alloc) | set(self.free)))

    @property
    def releases(self) -> bool:
        return self.kind in ("destroy", "merge")

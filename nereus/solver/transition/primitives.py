"""The vocabulary of a transition: EMUs, shard boxes, the four primitives and schedules.

A model-stage's state (parameters; in training also gradients and optimizer state) is
a unit square: pipeline stages cut it along layers, tensor ranks along columns. A
layout (tp, pp) cuts it into tp * pp boxes; GPU `s * tp + r` of an EMU holds box
(s, r). Layers are treated as equally sized, so a box holds state_bytes / (tp * pp).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

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


class _PrimitiveFields(NamedTuple):
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
    removes: tuple[Emu, ...]
    retires: tuple[Emu, ...]
    adds: tuple[Emu, ...]
    copies_from: tuple[Emu, ...]  # replicas it reads: complete copies for its whole run
    deps: list[int]
    new_groups: int  # communicators this primitive creates
    duration_s: float  # 0 until priced (`priced`)
    gpus: tuple[int, ...]  # every GPU it occupies, sorted


class Primitive(_PrimitiveFields):
    """One step of a transition on one model-stage: an immutable value (when it runs is a
    `Schedule`'s business; pricing makes new primitives, see `priced`).

    Memory is allocated on `alloc` GPUs when it starts and released from `free` GPUs
    when it ends; it occupies every GPU in `gpus` (its reads, writes, allocations and
    frees) for its whole duration. `removes` are replicas that stop being complete
    copies when it starts; `retires` stop being replicas when it ends (their data lives
    on in `adds`); `adds` become complete copies when it ends; `copies_from` are read and
    must stay complete while it runs. Nothing here changes once built (the dicts and the
    dependency list included).

    A named tuple, like `Emu`: a 1024-GPU transition builds thousands, and the builders
    make them with `tuple.__new__` (`local._Builder.add`), which costs a seventh of a
    frozen dataclass's constructor. This constructor fills the defaults and `gpus`.
    """

    __slots__ = ()

    def __new__(
        cls,
        id: int,
        kind: PrimitiveKind,
        model_stage: str,
        source_layout: Layout,
        target_layout: Layout,
        reads: tuple[int, ...],
        writes: tuple[int, ...],
        alloc: dict[int, float],
        free: dict[int, float],
        transfers: tuple[tuple[int, int, float], ...],
        removes: tuple[Emu, ...] = (),
        retires: tuple[Emu, ...] = (),
        adds: tuple[Emu, ...] = (),
        copies_from: tuple[Emu, ...] = (),
        deps: list[int] | None = None,
        new_groups: int = 0,
        duration_s: float = 0.0,
        gpus: tuple[int, ...] | None = None,
    ) -> Primitive:
        if gpus is None:
            gpus = tuple(sorted(set(reads) | set(writes) | set(alloc) | set(free)))
        fields = (reads, writes, alloc, free, transfers, removes, retires, adds, copies_from)
        return tuple.__new__(
            cls,
            (
                id,
                kind,
                model_stage,
                source_layout,
                target_layout,
                *fields,
                [] if deps is None else deps,
                new_groups,
                duration_s,
                gpus,
            ),
        )

    def _replace(self, **changes: Any) -> Primitive:
        """A copy with `changes`; `gpus` follows changed reads, writes, allocations or frees."""
        if "gpus" not in changes and not changes.keys().isdisjoint(("reads", "writes", "alloc", "free")):
            changes["gpus"] = None
        return Primitive(**{**self._asdict(), **changes})

    @property
    def releases(self) -> bool:
        return self.kind in ("destroy", "merge")


def priced(primitives: list[Primitive], durations: Iterable[float]) -> list[Primitive]:
    """The primitives with these durations (new values, in order; ids, edges and GPUs shared)."""
    return [
        tuple.__new__(Primitive, (*p[:_DURATION], duration, p.gpus))
        for p, duration in zip(primitives, durations, strict=True)
    ]


_DURATION = _PrimitiveFields._fields.index("duration_s")


@dataclass(frozen=True, slots=True)
class Schedule:
    """When each primitive of a transition DAG runs: a value separate from the (immutable) DAG.

    `start` and `end` map primitive ids to seconds; a primitive a deadlock left unrun has
    neither (`scheduled` is False; it reads as starting and ending at 0). `ownership` maps
    an id to its GPU-ownership dependencies: releases by other model-stages its
    allocations waited for (or barriers ordering whole model-stages); absent: none.
    Built by a scheduler (`replay.Replay`, `serial.serial_schedule`) and never changed after.
    """

    start: dict[int, float] = field(default_factory=dict)
    """Primitive id -> when it starts (seconds)."""
    end: dict[int, float] = field(default_factory=dict)
    """Primitive id -> when it ends (seconds)."""
    ownership: dict[int, list[int]] = field(default_factory=dict)
    """Primitive id -> its GPU-ownership dependencies, in the order found (absent: none)."""

    def start_s(self, primitive: Primitive) -> float:
        return self.start.get(primitive.id, 0.0)

    def end_s(self, primitive: Primitive) -> float:
        return self.end.get(primitive.id, 0.0)

    def scheduled(self, primitive: Primitive) -> bool:
        """False for a primitive a deadlock left unrun."""
        return primitive.id in self.start

    def ownership_deps(self, primitive: Primitive) -> list[int]:
        return self.ownership.get(primitive.id, [])

    @property
    def makespan_s(self) -> float:
        return max(self.end.values(), default=0.0)

    def complete(self, primitives: Iterable[Primitive]) -> bool:
        """Every one of `primitives` has a start and an end."""
        return all(p.id in self.start for p in primitives)

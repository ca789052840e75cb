"""The local DAG of one model-stage: Split -> Destroy -> Extend -> Merge.

Both layouts are reached through the largest common intermediate layout
I = (gcd(tp_a, tp_b), gcd(pp_a, pp_b)): every A EMU splits into I-replicas (each GPU
keeps its A box and gathers the rest of its larger I box), replicas B does not need are
destroyed, B's missing I-replicas are copied in (Extend), and groups of I-replicas
merge into B's EMUs (each GPU keeps the part of its I box that B assigns it: no data
moves). Replicas are matched to B's slots by how many GPUs already hold the right box.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from math import gcd

from nereus.solver.transition.primitives import Emu, Layout, Primitive, box_fraction


def intermediate_layout(a: Layout, b: Layout) -> Layout:
    """The largest layout both A and B reach by Split and Merge alone."""
    return (gcd(a[0], b[0]), gcd(a[1], b[1]))


def sub_replicas(emu: Emu, inter: Layout) -> list[Emu]:
    """The I-replicas an EMU splits into (or is merged from), in I-position order.

    GPU at I position (si, ri) of replica (js, jr) sits at the EMU's position
    (si * fs + js, ri * ft + jr): its I box contains its EMU box.
    """
    if emu.layout == inter:  # nothing to split: the EMU is its only I-replica
        return [emu]
    ft, fs = emu.tp // inter[0], emu.pp // inter[1]
    replicas = []
    for js, jr in itertools.product(range(fs), range(ft)):
        gpus = tuple(
            emu.gpus[(si * fs + js) * emu.tp + ri * ft + jr]
            for si, ri in itertools.product(range(inter[1]), range(inter[0]))
        )
        replicas.append(Emu(emu.model_stage, inter[0], inter[1], gpus))
    return replicas


@dataclass
class _Builder:
    """Accumulates primitives with consecutive ids."""

    model_stage: str
    state_bytes: float
    next_id: int
    primitives: list[Primitive]

    def add(self, **fields: object) -> Primitive:
        primitive = Primitive(id=self.next_id, model_stage=self.model_stage, **fields)  # type: ignore[arg-type]
        self.next_id += 1
        self.primitives.append(primitive)
        return primitive


def _split(build: _Builder, emu: Emu, inter: Layout) -> tuple[Primitive | None, list[Emu]]:
    """Split one A EMU into I-replicas; None when A already is the intermediate layout."""
    if emu.layout == inter:
        return None, [emu]
    replicas = sub_replicas(emu, inter)
    piece = build.state_bytes * box_fraction(emu.layout)
    grow = build.state_bytes * box_fraction(inter) - piece
    holders: dict[tuple[int, int], list[int]] = {}  # I position -> GPUs holding a piece of it
    for replica in replicas:
        for index, gpu in enumerate(replica.gpus):
            holders.setdefault(divmod(index, inter[0]), []).append(gpu)
    transfers = tuple((src, dst, piece) for group in holders.values() for dst in group for src in group if src != dst)
    primitive = build.add(
        kind="split",
        source_layout=emu.layout,
        target_layout=inter,
        reads=emu.gpus,
        writes=emu.gpus,
        alloc=dict.fromkeys(emu.gpus, grow),
        free={},
        transfers=transfers,
        retires=(emu,),
        adds=tuple(replicas),
        new_groups=len(replicas),
    )
    return primitive, replicas


def match_replicas(replicas: list[Emu], slots: list[Emu]) -> dict[int, Emu]:
    """Slot index -> replica, greedily by GPUs already holding the right box.

    A GPU holds at most one replica of a model-stage, so overlaps are counted through a
    (position, GPU) index instead of comparing every pair.
    """
    owner = {(i, gpu): replica for replica in replicas for i, gpu in enumerate(replica.gpus)}
    order = {replica: n for n, replica in enumerate(replicas)}
    pairs = []
    for k, slot in enumerate(slots):
        counts: dict[Emu, int] = {}
        for i, gpu in enumerate(slot.gpus):
            replica = owner.get((i, gpu))
            if replica is not None:
                counts[replica] = counts.get(replica, 0) + 1
        pairs += [(-count, k, order[r], r) for r, count in counts.items()]
    assignment: dict[int, Emu] = {}
    used: set[Emu] = set()
    for _, k, _, replica in sorted(pairs, key=lambda p: p[:3]):
        if k not in assignment and replica not in used:
            assignment[k] = replica
            used.add(replica)
    return assignment


def _extend(build: _Builder, source: Emu, slot: Emu, positions: list[int], deps: list[int]) -> Primitive:
    box = build.state_bytes * box_fraction(slot.layout)
    targets = tuple(slot.gpus[i] for i in positions)
    return build.add(
        kind="extend",
        source_layout=source.layout,
        target_layout=slot.layout,
        reads=tuple(source.gpus[i] for i in positions),
        writes=targets,
        alloc=dict.fromkeys(targets, box),
        free={},
        transfers=tuple((source.gpus[i], slot.gpus[i], box) for i in positions),
        adds=(slot,),
        copies_from=(source,),
        deps=[d for d in deps if d >= 0],
        new_groups=1,
    )


def _destroy(build: _Builder, replica: Emu, gpus: tuple[int, ...], deps: list[int]) -> Primitive:
    box = build.state_bytes * box_fraction(replica.layout)
    return build.add(
        kind="destroy",
        source_layout=replica.layout,
        target_layout=replica.layout,
        reads=(),
        writes=(),
        alloc={},
        free=dict.fromkeys(gpus, box),
        transfers=(),
        removes=(replica,),
        deps=sorted({d for d in deps if d >= 0}),
    )


def _merge(build: _Builder, target: Emu, parts: list[Emu], deps: list[int]) -> Primitive:
    shrink = build.state_bytes * (box_fraction(parts[0].layout) - box_fraction(target.layout))
    return build.add(
        kind="merge",
        source_layout=parts[0].layout,
        target_layout=target.layout,
        reads=(),
        writes=target.gpus,
        alloc={},
        free=dict.fromkeys(target.gpus, shrink),
        transfers=(),
        retires=tuple(parts),
        adds=(target,),
        deps=sorted({d for d in deps if d >= 0}),
        new_groups=1,
    )


#: Copies per source replica above which new replicas are copied as a doubling tree.
STAR_ROUNDS = 4


def _fan_out(
    build: _Builder,
    pending: list[int],
    slots: list[Emu],
    sources: list[Emu],
    origin: dict[Emu, int],
    readers: dict[Emu, list[int]],
    ready: list[list[int]],
    star_rounds: int | None,
) -> None:
    """Copy a complete replica into every slot in `pending`.

    Few copies per source (at most `star_rounds` each; any number when it is None) all read the sources: the copies stay
    independent, so the scheduler may order them freely around other model-stages. More
    than that fan out as a doubling tree: round by round every complete copy (a source or
    a slot filled in an earlier round) feeds one empty slot, so n new replicas take about
    log2(n / sources) rounds instead of n / sources copies queued on the sources' GPUs.
    """
    tree = star_rounds is not None and len(pending) > star_rounds * len(sources)
    available = [(source, origin[source]) for source in sources]
    queue = list(pending)
    while queue:
        filled = []
        for source, source_ready in available:
            if not queue:
                break
            k = queue.pop(0)
            extend = _extend(build, source, slots[k], list(range(len(slots[k].gpus))), [source_ready])
            readers.setdefault(source, []).append(extend.id)
            ready[k] = [extend.id]
            filled.append((slots[k], extend.id))
        if tree:
            available += filled


def local_dag(
    model_stage: str,
    state_bytes: float,
    emus_a: list[Emu],
    emus_b: list[Emu],
    next_id: int = 0,
    star_rounds: int | None = STAR_ROUNDS,
) -> list[Primitive]:
    """Primitives that turn one model-stage's EMUs A into B, with their data edges
    (`star_rounds`: see `_fan_out`)."""
    if set(emus_a) == set(emus_b):
        return []
    inter = intermediate_layout(emus_a[0].layout, emus_b[0].layout)
    build = _Builder(model_stage, state_bytes, next_id, [])
    origin: dict[Emu, int] = {}  # I-replica -> id of the split that made it (-1: none)
    for emu in emus_a:
        split, replicas = _split(build, emu, inter)
        origin.update(dict.fromkeys(replicas, split.id if split else -1))
    replicas = list(origin)
    slots_of = [(emu, sub_replicas(emu, inter)) for emu in emus_b]
    slots = [slot for _, subs in slots_of for slot in subs]
    assignment = match_replicas(replicas, slots)
    kept = set(assignment.values())
    spare = [r for r in replicas if r not in kept]
    sources = [r for r in replicas if r in kept] or spare[:1]  # always copy from a complete replica
    readers: dict[Emu, list[int]] = {r: [] for r in replicas}
    source_set = set(sources)
    for replica in spare:  # release first: spares no slot needs go before any copy
        if replica not in source_set:
            _destroy(build, replica, replica.gpus, [origin[replica]])
    ready: list[list[int]] = [[] for _ in slots]  # per slot: the ids its data waits for
    leftovers: list[tuple[Emu, tuple[int, ...], int]] = []
    for k, slot in enumerate(slots):
        matched = assignment.get(k)
        if matched is None:
            continue
        moved = [i for i, (g, h) in enumerate(zip(matched.gpus, slot.gpus, strict=True)) if g != h]
        if not moved:
            ready[k] = [origin[matched]]
            continue
        extend = _extend(build, matched, slot, moved, [origin[matched]])
        readers[matched].append(extend.id)
        leftovers.append((matched, tuple(matched.gpus[i] for i in moved), extend.id))
        ready[k] = [extend.id]
    pending = [k for k in range(len(slots)) if k not in assignment]
    _fan_out(build, pending, slots, sources, origin, readers, ready, star_rounds)
    for replica, gpus, extend_id in leftovers:  # a moved replica's old GPUs, once copied
        _destroy(build, replica, gpus, [extend_id, *readers[replica]])
    spare_set = set(spare)
    for source in sources:
        if source in spare_set:  # the only copy B does not keep: destroyed after every copy
            _destroy(build, source, source.gpus, [origin[source], *readers[source]])
    k = 0
    for emu, subs in slots_of:
        # A slot that served as a copy source is merged only after those copies read it.
        deps = [d for slot_deps in ready[k : k + len(subs)] for d in slot_deps]
        deps += [d for slot in subs for d in readers.get(slot, [])]
        if len(subs) > 1:
            _merge(build, emu, subs, deps)
        k += len(subs)
    return build.primitives

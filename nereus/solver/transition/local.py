"""The local DAG of one model-stage: Split -> Destroy -> Extend -> Merge.

Both layouts are reached through the largest common intermediate layout
I = (gcd(tp_a, tp_b), gcd(pp_a, pp_b)): every A EMU splits into I-replicas (each GPU
keeps its A box and gathers the rest of its larger I box), replicas B does not need are
destroyed, B's missing I-replicas are copied in (Extend), and groups of I-replicas
merge into B's EMUs (each GPU keeps the part of its I box that B assigns it: no data
moves). Replicas are matched to B's slots by how many GPUs already hold the right box.
Spare replicas that become free together (those of one split, or all of them when A is
the intermediate layout) go in one Destroy. Matched replicas that would trade GPUs with
each other can instead be copied afresh (`unswap`, tried when the DAG deadlocks).
Large rounds of alike copies share one Extend (`_batches`), and a model-stage whose EMUs
match one already built in both plans gets that DAG renamed (`stamp`).
Planning time matters (benchmarks/transition_time.py aims at 2 ms for 1024 GPUs): the
builders make primitives without **kwargs, and the per-GPU work over many replicas
(splitting, B's I-replicas, partial overlaps) runs as one array pass.
"""

from __future__ import annotations

import collections
import itertools
import operator
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import repeat
from math import gcd
from typing import cast

import numpy as np

from nereus.solver.transition.primitives import Emu, Layout, Primitive, PrimitiveKind, box_fraction

Gpus = tuple[int, ...]  # a replica's GPUs, stage-major


def intermediate_layout(a: Layout, b: Layout) -> Layout:
    """The largest layout both A and B reach by Split and Merge alone."""
    return (gcd(a[0], b[0]), gcd(a[1], b[1]))


def sub_gpus(gpus: Gpus, layout: Layout, inter: Layout) -> list[Gpus]:
    """The GPU tuples of the I-replicas a replica of `layout` on `gpus` splits into (or is
    merged from), in I-position order.

    GPU at I position (si, ri) of replica (js, jr) sits at the replica's position
    (si * fs + js, ri * ft + jr): its I box contains its box.
    """
    if layout == inter:  # nothing to split: the replica is its only I-replica
        return [gpus]
    tp, ft, fs = layout[0], layout[0] // inter[0], layout[1] // inter[1]
    rows = [gpus[stage * tp : (stage + 1) * tp] for stage in range(layout[1])]
    # Replica (js, jr) takes every fs-th pipeline stage from js and every ft-th rank from jr.
    return [
        tuple(itertools.chain.from_iterable(row[jr::ft] for row in rows[js::fs]))
        for js, jr in itertools.product(range(fs), range(ft))
    ]


def sub_replicas(emu: Emu, inter: Layout) -> list[Emu]:
    """The I-replicas an EMU splits into (or is merged from), in I-position order."""
    return [_NEW_TUPLE(Emu, (emu.model_stage, *inter, gpus)) for gpus in sub_gpus(emu.gpus, emu.layout, inter)]


def _sub_array(replicas: list[Gpus], layout: Layout, inter: Layout) -> np.ndarray:
    """`sub_gpus` of every replica at once: array [replica, I-replica, I position]."""
    tp, pp = inter
    ft, fs = layout[0] // tp, layout[1] // pp
    gpus = np.fromiter(itertools.chain.from_iterable(replicas), np.int64, len(replicas) * layout[0] * layout[1])
    # Axes (replica, si, js, ri, jr) -> (replica, js, jr, si, ri): see `sub_gpus`.
    return gpus.reshape(len(replicas), pp, fs, tp, ft).transpose(0, 2, 4, 1, 3).reshape(len(replicas), fs * ft, -1)


def _all_sub_gpus(replicas: list[Gpus], layout: Layout, inter: Layout) -> list[Gpus]:
    """`sub_gpus` of each replica, concatenated (one array pass: B may have hundreds)."""
    if layout == inter:
        return list(replicas)
    return list(map(tuple, _sub_array(replicas, layout, inter).reshape(-1, inter[0] * inter[1]).tolist()))


_NEW_TUPLE = tuple.__new__  # _NEW_TUPLE(Emu, 4-tuple): an Emu without the Python-level Emu.__new__
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


#: Primitive's fields in order: the builders make primitives with `tuple.__new__`.
_FIELDS = (
    "id",
    "kind",
    "model_stage",
    "source_layout",
    "target_layout",
    "reads",
    "writes",
    "alloc",
    "free",
    "transfers",
    "removes",
    "retires",
    "adds",
    "copies_from",
    "deps",
    "new_groups",
    "duration_s",
    "gpus",
)
assert Primitive._fields == _FIELDS, "Primitive's fields moved: update _FIELDS and _Builder.add"


@dataclass
class _Builder:
    """Accumulates primitives with consecutive ids; makes EMUs only for the replicas they name."""

    model_stage: str
    state_bytes: float
    next_id: int
    primitives: list[Primitive]
    node_size: int | None = None
    """GPUs per node when independent copies are batched (see `_batches`); None: one Extend per copy."""

    def add(
        self,
        occupied: Iterable[int],
        *,
        kind: PrimitiveKind,
        source_layout: Layout,
        target_layout: Layout,
        reads: Gpus,
        writes: Gpus,
        alloc: dict[int, float],
        free: dict[int, float],
        transfers: tuple[tuple[int, int, float], ...],
        removes: tuple[Emu, ...] = (),
        retires: tuple[Emu, ...] = (),
        adds: tuple[Emu, ...] = (),
        copies_from: tuple[Emu, ...] = (),
        deps: list[int] | None = None,
        new_groups: int = 0,
    ) -> Primitive:
        """A primitive on the `occupied` GPUs (its reads, writes, allocations and frees).
        Fields are passed on by name: through **kwargs they cost more than the rest of it."""
        # By position, without Primitive's Python-level constructor (see `_FIELDS`): the
        # builder knows the GPU set, and the generic union costs more. Unpriced: duration 0.
        primitive = _NEW_TUPLE(
            Primitive,
            (
                self.next_id,
                kind,
                self.model_stage,
                source_layout,
                target_layout,
                reads,
                writes,
                alloc,
                free,
                transfers,
                removes,
                retires,
                adds,
                copies_from,
                [] if deps is None else deps,
                new_groups,
                0.0,
                tuple(sorted(occupied)),
            ),
        )
        self.next_id += 1
        self.primitives.append(primitive)
        return primitive

    def emu(self, layout: Layout, gpus: Gpus) -> Emu:
        return _NEW_TUPLE(Emu, (self.model_stage, layout[0], layout[1], gpus))

    def emus(self, layout: Layout, replicas: Iterable[Gpus]) -> list[Emu]:
        """`emu` of each, in C."""
        fields = zip(repeat(self.model_stage), repeat(layout[0]), repeat(layout[1]), replicas)
        return list(map(_NEW_TUPLE, repeat(Emu), fields))


def _splits(build: _Builder, replicas_a: list[Gpus], layout: Layout, inter: Layout) -> tuple[list[Gpus], list[int]]:
    """Split every A replica into I-replicas (A is not the intermediate layout): the
    I-replicas in order, and per I-replica the id of the split that made it."""
    replicas, senders, receivers = _split_transfers(replicas_a, layout, inter)
    num_subs = len(replicas) // len(replicas_a)
    piece = build.state_bytes * box_fraction(layout)
    grow = build.state_bytes * box_fraction(inter) - piece
    origin = []
    for i, gpus in enumerate(replicas_a):
        made = replicas[i * num_subs : (i + 1) * num_subs]
        split = build.add(
            gpus,
            kind="split",
            source_layout=layout,
            target_layout=inter,
            reads=gpus,
            writes=gpus,
            alloc=dict.fromkeys(gpus, grow),
            free={},
            transfers=tuple(zip(senders[i], receivers[i], repeat(piece))),
            retires=(build.emu(layout, gpus),),
            adds=tuple(build.emus(inter, made)),
            new_groups=num_subs,
        )
        origin += [split.id] * num_subs
    return replicas, origin


def _split_transfers(
    replicas_a: list[Gpus], layout: Layout, inter: Layout
) -> tuple[list[Gpus], list[list[int]], list[list[int]]]:
    """The I-replicas of every A replica (concatenated), and per A replica the senders and
    receivers of its split's transfers: per I position, the GPUs holding a piece of it
    each send it to the others, destination-major (the order of itertools.permutations).
    Many replicas go through one array pass; for a few, its fixed cost is more than a
    pass per replica."""
    if len(replicas_a) < ARRAY_MIN_REPLICAS:
        subs_of = [sub_gpus(gpus, layout, inter) for gpus in replicas_a]
        pairs_of = [
            list(itertools.chain.from_iterable(map(itertools.permutations, zip(*subs, strict=True), repeat(2))))
            for subs in subs_of
        ]
        senders = [list(map(_SECOND, pairs)) for pairs in pairs_of]
        return [sub for subs in subs_of for sub in subs], senders, [list(map(_FIRST, pairs)) for pairs in pairs_of]
    subs = _sub_array(replicas_a, layout, inter)
    destination, source = np.array(list(itertools.permutations(range(subs.shape[1]), 2)), np.int64).reshape(-1, 2).T
    senders = subs[:, source, :].transpose(0, 2, 1).reshape(len(replicas_a), -1).tolist()
    receivers = subs[:, destination, :].transpose(0, 2, 1).reshape(len(replicas_a), -1).tolist()
    return list(map(tuple, subs.reshape(-1, subs.shape[2]).tolist())), senders, receivers


def match_replicas(replicas: list[Emu], slots: list[Emu]) -> dict[int, Emu]:
    """Slot index -> replica, greedily by GPUs already holding the right box."""
    exact, partial = _match([replica.gpus for replica in replicas], [slot.gpus for slot in slots])
    return {k: replicas[r] for k, r in sorted({**exact, **partial}.items())}


def _match(replicas: list[Gpus], slots: list[Gpus]) -> tuple[dict[int, int], dict[int, int]]:
    """`match_replicas` on GPU tuples, as slot index -> replica index: the slots a replica
    fills where it is, and those a replica fills by moving some of its boxes.

    A GPU holds at most one replica of a model-stage, so overlaps are counted through a
    GPU -> (replica, position) index instead of comparing every pair; ties go to the
    lower slot, then the lower replica.
    """
    # A slot on exactly a replica's GPUs is the best pair for both (every GPU holds its box,
    # and GPUs hold one replica each): the greedy takes those first, so take them here.
    # Every pass over all replicas or slots runs in C: large plans have hundreds of them.
    found: list[int | None] = list(map(dict(zip(replicas, itertools.count())).get, slots))
    hit = list(map(operator.is_not, found, repeat(None)))
    matched = cast("Iterator[int]", itertools.compress(found, hit))  # the slots a replica is found for
    exact = dict(zip(itertools.compress(itertools.count(), hit), matched, strict=True))
    partial: dict[int, int] = {}
    if len(exact) == len(slots) or len(exact) == len(replicas):
        return exact, partial
    used = set(exact.values())
    unused = sorted(set(range(len(replicas))).difference(used))
    open_slots = list(itertools.compress(itertools.count(), map(operator.not_, hit)))
    slot_gpus = set(itertools.chain.from_iterable(map(slots.__getitem__, open_slots)))
    if slot_gpus.isdisjoint(itertools.chain.from_iterable(map(replicas.__getitem__, unused))):
        return exact, partial  # no replica left holds a box on a slot's GPUs
    for k, r in _overlaps(list(map(replicas.__getitem__, unused)), list(map(slots.__getitem__, open_slots))):
        if open_slots[k] not in partial and unused[r] not in used:
            partial[open_slots[k]] = unused[r]
            used.add(unused[r])
    return exact, partial


def _overlaps(replicas: list[Gpus], slots: list[Gpus]) -> list[tuple[int, int]]:
    """(slot, replica) index pairs with at least one GPU holding the slot's box there, by
    most such GPUs, then slot, then replica (replicas share one layout)."""
    if len(replicas) + len(slots) < 2 * ARRAY_MIN_REPLICAS:  # (position, GPU) -> replica, in a dict
        holder = {box: r for r, replica in enumerate(replicas) for box in enumerate(replica)}
        overlaps = collections.Counter(
            (k, holder[box]) for k, slot in enumerate(slots) for box in enumerate(slot) if box in holder
        )
    else:
        overlaps = _overlap_counts(replicas, slots)
    return sorted(overlaps, key=lambda pair: (-overlaps[pair], pair))


def _overlap_counts(replicas: list[Gpus], slots: list[Gpus]) -> collections.Counter[tuple[int, int]]:
    """(slot, replica) -> GPUs holding the slot's box there, in one array pass."""
    num_positions = len(replicas[0])
    held = np.fromiter(itertools.chain.from_iterable(replicas), np.int64, len(replicas) * num_positions)
    wanted = np.fromiter(itertools.chain.from_iterable(slots), np.int64, len(slots) * num_positions)
    positions = np.arange(num_positions)
    # [position, GPU] -> the replica holding that box on that GPU (-1: none).
    holder = np.full((num_positions, max(held.max(), wanted.max()) + 1), -1)
    holder[positions, held.reshape(-1, num_positions)] = np.arange(len(replicas))[:, None]
    found = holder[positions, wanted.reshape(-1, num_positions)]
    slot_index, position = np.nonzero(found >= 0)
    return collections.Counter(zip(slot_index.tolist(), found[slot_index, position].tolist(), strict=True))


def _extend(build: _Builder, inter: Layout, source: Gpus, slot: Gpus, dep: int) -> Primitive:
    """Copy the boxes `source` holds elsewhere than `slot` onto `slot`'s GPUs (a matched
    I-replica that moves; `dep`: the id its data waits for, -1: none)."""
    moved = list(map(operator.ne, source, slot))
    reads, targets = tuple(itertools.compress(source, moved)), tuple(itertools.compress(slot, moved))
    return _extend_op(build, inter, reads, targets, (build.emu(inter, source),), (build.emu(inter, slot),), dep)


def _copy(build: _Builder, sources: list[Emu], slots: list[Emu], ready: int) -> Primitive:
    """Whole replicas `sources[i]` copied onto `slots[i]`'s GPUs, side by side in one Extend
    (no GPU in two of the copies; each copy has its own communicator)."""
    reads = tuple(itertools.chain.from_iterable(map(_GPUS, sources)))
    targets = tuple(itertools.chain.from_iterable(map(_GPUS, slots)))
    return _extend_op(build, slots[0].layout, reads, targets, tuple(sources), tuple(slots), ready)


def _extend_op(
    build: _Builder,
    layout: Layout,
    reads: Gpus,
    targets: Gpus,
    sources: tuple[Emu, ...],
    slots: tuple[Emu, ...],
    dep: int,
) -> Primitive:
    """An Extend of replicas in `layout`: `reads[i]` sends its box to `targets[i]`, and
    `slots` become complete copies of `sources`, one communicator each (`dep`: the id the
    sources' data waits for, -1: none)."""
    box = build.state_bytes * box_fraction(layout)
    return build.add(
        {*reads, *targets},
        kind="extend",
        source_layout=layout,
        target_layout=layout,
        reads=reads,
        writes=targets,
        alloc=dict.fromkeys(targets, box),
        free={},
        transfers=tuple(zip(reads, targets, repeat(box))),
        adds=slots,
        copies_from=sources,
        deps=[dep] if dep >= 0 else [],
        new_groups=len(slots),
    )


def _destroy(build: _Builder, replicas: list[Emu], gpus: Gpus, deps: list[int]) -> Primitive:
    """Drop `replicas` (all of one layout) from `gpus`: one release, however many replicas."""
    layout = replicas[0].layout
    box = build.state_bytes * box_fraction(layout)
    return build.add(
        set(gpus),
        kind="destroy",
        source_layout=layout,
        target_layout=layout,
        reads=(),
        writes=(),
        alloc={},
        free=dict.fromkeys(gpus, box),
        transfers=(),
        removes=tuple(replicas),
        deps=sorted({d for d in deps if d >= 0}),
    )


def _merges(build: _Builder, layout: Layout, gpus_b: list[Gpus], parts: list[Emu], waits: dict[int, list[int]]) -> None:
    """Merge each B replica from its I-replicas (`parts`, consecutive per replica), once
    the ids each part waits for (`waits`, by part; -1: none) are done: no data moves,
    each GPU frees what B drops."""
    per_replica = len(parts) // len(gpus_b)
    free = build.state_bytes * (box_fraction(parts[0].layout) - box_fraction(layout))
    for start, target in zip(range(0, len(parts), per_replica), build.emus(layout, gpus_b), strict=True):
        deps = set(itertools.chain.from_iterable(map(waits.get, range(start, start + per_replica), repeat(()))))
        deps.discard(-1)
        build.add(
            target.gpus,
            kind="merge",
            source_layout=parts[0].layout,
            target_layout=layout,
            reads=(),
            writes=target.gpus,
            alloc={},
            free=dict.fromkeys(target.gpus, free),
            transfers=(),
            retires=tuple(parts[start : start + per_replica]),
            adds=(target,),
            deps=sorted(deps),
            new_groups=1,
        )


#: Replicas from which one array pass over all of them costs less than a pass per replica.
ARRAY_MIN_REPLICAS = 4
#: Copies per source replica above which new replicas are copied as a doubling tree.
STAR_ROUNDS = 4
#: Copies in one round of `_fan_out` from which alike copies are batched into one Extend.
BATCH_MIN_COPIES = 16


#: A copy source: a complete replica, the id its data waits for, and the ids that read it.
_Source = tuple[Emu, int, list[int]]
_GPUS = operator.attrgetter("gpus")  # an Emu's GPU tuple, as a C-level getter
_TP, _PP = operator.attrgetter("tp"), operator.attrgetter("pp")


def _fan_out(
    build: _Builder,
    pending: list[int],
    slots: list[Gpus],
    sources: list[_Source],
    star_rounds: int | None,
    disjoint: bool = False,
) -> dict[int, _Source]:
    """Copy a complete replica into every slot in `pending`; slot index -> its new replica.

    Few copies per source (at most `star_rounds` each; any number when it is None) all read the sources: the copies stay
    independent, so the scheduler may order them freely around other model-stages. More
    than that fan out as a doubling tree: round by round every complete copy (a source or
    a slot filled in an earlier round) feeds one empty slot, so n new replicas take about
    log2(n / sources) rounds instead of n / sources copies queued on the sources' GPUs.
    With `disjoint`, a slot is copied from a source on none of its GPUs where one is left
    this round (a source moving off those GPUs would need both boxes there at once).
    The copies of a round go into Extends as `_batches` groups them.
    """
    tree = star_rounds is not None and len(pending) > star_rounds * len(sources)
    available = list(sources)
    filled: dict[int, _Source] = {}
    queue = pending[::-1]  # popped from the end: slots in order
    inter = sources[0][0].layout
    while queue:
        if disjoint:
            pairs = _disjoint_pairs(available, queue, slots)
        else:  # each source in order serves the next slot
            pairs = list(zip(available, queue[: -len(available) - 1 : -1], strict=False))
            del queue[-len(pairs) :]
        copies = list(
            zip(map(_FIRST, pairs), build.emus(inter, map(slots.__getitem__, map(_SECOND, pairs))), strict=True)
        )
        round_filled = []
        for ((_, _, readers), k), (_, slot), copy_id in zip(pairs, copies, _emit(build, copies), strict=True):
            readers.append(copy_id)
            filled[k] = (slot, copy_id, [])
            round_filled.append(filled[k])
        if tree:
            available += round_filled
    return filled


def _disjoint_pairs(available: list[_Source], queue: list[int], slots: list[Gpus]) -> list[tuple[_Source, int]]:
    """One round of `_fan_out`: each source serves the next slot (popped from `queue`), but
    trades places with a later source when only that one is on none of the slot's GPUs."""
    pairs = []
    for n in range(len(available)):
        if not queue:
            break
        k = queue.pop()
        if not set(available[n][0].gpus).isdisjoint(slots[k]):
            swap = next(
                (m for m in range(n + 1, len(available)) if set(available[m][0].gpus).isdisjoint(slots[k])),
                None,
            )
            if swap is not None:  # trade places: this source serves the next slot
                available[n], available[swap] = available[swap], available[n]
        pairs.append((available[n], k))
    return pairs


def _emit(build: _Builder, copies: list[tuple[_Source, Emu]]) -> list[int]:
    """One Extend per batch of copies (see `_batches`); the Extend id of each copy."""
    ids = [0] * len(copies)
    for batch in _batches(copies, build.node_size):
        chosen = list(map(copies.__getitem__, batch))
        primitive = _copy(build, list(map(_FIRST, map(_FIRST, chosen))), list(map(_SECOND, chosen)), chosen[0][0][1])
        for i in batch:
            ids[i] = primitive.id
    return ids


def _batches(copies: list[tuple[_Source, Emu]], node_size: int | None) -> list[list[int]]:
    """Copies of one round (indices) that go side by side into one Extend.

    Batched copies start and end together, so only copies that are alike share one:
    their sources are ready at the same moment (same id), and either all or none of them
    send over the inter-node link (one copy's duration, the slowest link it uses, is
    then the batch's). No GPU may be in two copies of a batch: each GPU sends or
    receives one box, as when the copies run alone. Only rounds of at least
    `BATCH_MIN_COPIES` copies are batched, and only with `node_size`: a batch waits until
    all its GPUs are idle, which can delay a copy that would have started alone, so
    batching is kept for the transitions that re-create many replicas, where hundreds of
    Extends would dominate planning time.
    """
    if node_size is None or len(copies) < BATCH_MIN_COPIES:
        return [[i] for i in range(len(copies))]
    sources = list(map(_FIRST, copies))
    read = tuple(itertools.chain.from_iterable(map(_GPUS, map(_FIRST, sources))))
    written = tuple(itertools.chain.from_iterable(map(_GPUS, map(_SECOND, copies))))
    nodes_apart = (
        np.fromiter(read, np.int64, len(read)) // node_size != np.fromiter(written, np.int64, len(read)) // node_size
    )
    crosses = nodes_apart.reshape(len(copies), -1).any(axis=1).tolist()
    keys = list(zip(map(_SECOND, sources), crosses, strict=True))
    groups: dict[tuple[int, bool], list[list[int]]] = {}
    if set(read).isdisjoint(written):  # sources and slots are disjoint among themselves
        if len(set(keys)) == 1:  # the common case: all alike
            return [list(range(len(copies)))]
        for i, key in enumerate(keys):
            groups.setdefault(key, [[]])[0].append(i)
        return [batch for batches in groups.values() for batch in batches]
    used: dict[int, set[int]] = {}  # id(batch) -> its GPUs
    order: list[list[int]] = []
    for i, key in enumerate(keys):
        gpus = {*copies[i][0][0].gpus, *copies[i][1].gpus}
        batch = next((b for b in groups.get(key, []) if used[id(b)].isdisjoint(gpus)), None)
        if batch is None:
            batch = []
            groups.setdefault(key, []).append(batch)
            order.append(batch)
            used[id(batch)] = set()
        batch.append(i)
        used[id(batch)] |= gpus
    return order


def local_dag(
    model_stage: str,
    state_bytes: float,
    emus_a: list[Emu],
    emus_b: list[Emu],
    next_id: int = 0,
    star_rounds: int | None = STAR_ROUNDS,
    unswap: bool = False,
    node_size: int | None = None,
) -> list[Primitive]:
    """Primitives that turn one model-stage's EMUs A into B, with their data edges
    (`star_rounds`: see `_fan_out`; `unswap`: see `_drop_swap_cycles`; `node_size`: see `_batches`)."""
    return replica_dag(
        model_stage,
        state_bytes,
        (emus_a[0].layout, [emu.gpus for emu in emus_a]),
        (emus_b[0].layout, [emu.gpus for emu in emus_b]),
        next_id,
        star_rounds,
        unswap,
        node_size,
    )


#: One model-stage in one plan: its layout and its EMUs' GPU tuples.
Replicas = tuple[Layout, list[Gpus]]


def replica_dag(
    model_stage: str,
    state_bytes: float,
    side_a: Replicas,
    side_b: Replicas,
    next_id: int = 0,
    star_rounds: int | None = STAR_ROUNDS,
    unswap: bool = False,
    node_size: int | None = None,
    through: Layout | None = None,
) -> list[Primitive]:
    """`local_dag` from GPU tuples: EMUs are made only for the replicas primitives name
    (most replicas of a large plan stay where they are and need none). `through`: the
    intermediate layout to pass through instead of `intermediate_layout` (dividing both
    layouts): a change of expert parallelism goes through one without it, even where the two
    grids look alike (`schedule.ep_intermediate`)."""
    (layout_a, gpus_a), (layout_b, gpus_b) = side_a, side_b
    if through is None and layout_a == layout_b and len(gpus_a) == len(gpus_b) and set(gpus_a) == set(gpus_b):
        return []
    inter = intermediate_layout(layout_a, layout_b) if through is None else through
    assert layout_a[0] % inter[0] == layout_a[1] % inter[1] == layout_b[0] % inter[0] == layout_b[1] % inter[1] == 0
    build = _Builder(model_stage, state_bytes, next_id, [], node_size)
    replicas, origin = gpus_a, [-1] * len(gpus_a)  # per I-replica: id of the split that made it (-1: none)
    if layout_a != inter:
        replicas, origin = _splits(build, gpus_a, layout_a, inter)
    slots = _all_sub_gpus(gpus_b, layout_b, inter)
    in_place, moving = _match(replicas, slots)  # slot index -> replica, kept where it is / moved
    if unswap:
        _drop_swap_cycles(replicas, slots, moving)
    kept = {*in_place.values(), *moving.values()}
    spare = sorted(set(range(len(replicas))).difference(kept)) if len(kept) < len(replicas) else []
    readers: dict[int, list[int]] = {}  # I-replica -> ids of the copies that read it
    _destroy_unneeded(build, inter, replicas, origin, spare if kept else spare[1:])
    ready: dict[int, list[int]] = {}  # slot index (moved or copied) -> the ids its data waits for
    slot_readers: dict[int, list[int]] = {}  # slot index -> copies that read it
    leftovers: list[tuple[int, Gpus, int]] = []
    source_of: dict[int, _Source] = {}  # kept replica -> where copies read it from
    for k, r in moving.items():
        extend = _extend(build, inter, replicas[r], slots[k], origin[r])
        readers.setdefault(r, []).append(extend.id)
        leftovers.append((r, extend.reads, extend.id))
        ready[k] = [extend.id]
        if unswap:  # copy from where it lands, so no copy holds its old GPUs
            source_of[r] = (extend.adds[0], extend.id, slot_readers.setdefault(k, []))
    if len(in_place) + len(moving) < len(slots):  # slots no replica fills: copied
        pending = sorted(set(range(len(slots))).difference(in_place, moving))
        source_ids = sorted(kept) or spare[:1]  # always copy from a complete replica
        # Without `unswap` a round pairs sources with slots in order: at most len(pending) are read.
        used = source_ids if unswap else source_ids[: len(pending)]
        emus = build.emus(inter, [replicas[r] for r in used])
        sources = [
            source_of.get(r) or (emu, origin[r], readers.setdefault(r, [])) for r, emu in zip(used, emus, strict=True)
        ]
        filled = _fan_out(build, pending, slots, sources, star_rounds, unswap)
        for k, (_, extend_id, copy_readers) in filled.items() if layout_b != inter else ():  # read by merges only
            ready[k] = [extend_id]
            slot_readers[k] = copy_readers
    for r, gpus, extend_id in leftovers:  # a moved replica's old GPUs, once copied
        _destroy(build, [build.emu(inter, replicas[r])], gpus, [extend_id, *readers.get(r, ())])
    if not kept and spare:  # the only copy B does not keep: destroyed after every copy
        r = spare[0]
        _destroy(build, [build.emu(inter, replicas[r])], replicas[r], [origin[r], *readers.get(r, ())])
    if layout_b != inter:
        # A slot that served as a copy source is merged only after those copies read it.
        waits = {k: [*ids, *slot_readers.get(k, ())] for k, ids in ready.items()}
        for k, r in in_place.items():
            if origin[r] >= 0 or r in readers:  # most kept replicas wait for nothing
                waits[k] = [origin[r], *readers.get(r, ())]
        _merges(build, layout_b, gpus_b, build.emus(inter, slots), waits)
    return build.primitives


def stamp(template: list[Primitive], model_stage: str, state_bytes: float, next_id: int = 0) -> list[Primitive]:
    """`template` (one model-stage's local DAG, ids from its first) for another model-stage
    whose EMUs sit on the very same GPUs in both plans: the same primitives with its name,
    ids and bytes (computed as the builders compute them). Inference model-stages sharing
    a pool have identical EMUs, and this skips the matching and copy planning for them.
    GPU tuples are immutable and shared with the template; only names and bytes are new."""
    shift = next_id - template[0].id if template else 0
    bytes_of: dict[tuple[str, Layout, Layout], tuple[float, float]] = {}  # alike primitives, alike bytes
    build = _Builder(model_stage, state_bytes, next_id, [])
    for p in template:
        key = (p.kind, p.source_layout, p.target_layout)
        if key not in bytes_of:
            bytes_of[key] = _stamped_bytes(p, state_bytes)
        moved, kept = bytes_of[key]
        build.add(
            p.gpus,  # sorted already: sorting it again costs one pass
            kind=p.kind,
            source_layout=p.source_layout,
            target_layout=p.target_layout,
            reads=p.reads,
            writes=p.writes,
            alloc=dict.fromkeys(p.alloc, kept) if p.alloc else {},
            free=dict.fromkeys(p.free, kept) if p.free else {},
            transfers=tuple(zip(map(_FIRST, p.transfers), map(_SECOND, p.transfers), repeat(moved)))
            if p.transfers
            else (),
            removes=_renamed(p.removes, model_stage),
            retires=_renamed(p.retires, model_stage),
            adds=_renamed(p.adds, model_stage),
            copies_from=_renamed(p.copies_from, model_stage),
            deps=list(map(shift.__add__, p.deps)),
            new_groups=p.new_groups,
        )
    return build.primitives


def _stamped_bytes(p: Primitive, state_bytes: float) -> tuple[float, float]:
    """(bytes per transfer, bytes allocated or freed per GPU) of `p` for a state of `state_bytes`."""
    source, target = state_bytes * box_fraction(p.source_layout), state_bytes * box_fraction(p.target_layout)
    if p.kind == "split":
        return source, target - source
    if p.kind == "merge":
        return 0.0, state_bytes * (box_fraction(p.source_layout) - box_fraction(p.target_layout))
    return (target, target) if p.kind == "extend" else (0.0, source)


def _renamed(emus: tuple[Emu, ...], model_stage: str) -> tuple[Emu, ...]:
    """`emus` for `model_stage`. Most primitives name none, one or two: the cheapest way
    differs by length (a Python-level loop pays off only for few)."""
    if not emus:
        return emus
    if len(emus) == 1:
        _, tp, pp, gpus = emus[0]
        return (_NEW_TUPLE(Emu, (model_stage, tp, pp, gpus)),)
    if len(emus) < 8:
        return tuple([_NEW_TUPLE(Emu, (model_stage, tp, pp, gpus)) for _, tp, pp, gpus in emus])
    return tuple(
        map(_NEW_TUPLE, repeat(Emu), zip(repeat(model_stage), map(_TP, emus), map(_PP, emus), map(_GPUS, emus)))
    )


def _destroy_unneeded(
    build: _Builder, inter: Layout, replicas: list[Gpus], origin: list[int], unneeded: list[int]
) -> None:
    """Release first: spares no slot needs go before any copy. Spares made by one split
    (or, without splits, all of them) become ready together and free at once: one Destroy each."""
    groups: dict[int, list[Gpus]] = {}
    if unneeded and origin[unneeded[0]] == origin[unneeded[-1]] == -1:  # no splits: one group (in C)
        groups[-1] = [replicas[r] for r in unneeded]
    else:
        for r in unneeded:
            groups.setdefault(origin[r], []).append(replicas[r])
    for split_id, group in groups.items():
        _destroy(build, build.emus(inter, group), tuple(itertools.chain.from_iterable(group)), [split_id])


def _drop_swap_cycles(replicas: list[Gpus], slots: list[Gpus], assignment: dict[int, int]) -> None:
    """Unmatch replicas until no moved replicas wait on each other in a cycle.

    A matched replica that moves some positions copies them onto GPUs that may still hold
    another moved replica's box, which leaves those GPUs only after its own copy: a
    cycle of such waits (two replicas of one EMU trading GPUs, say) needs room for two
    boxes on every GPU in it. Unmatching one replica per cycle breaks it: that replica is
    destroyed up front and its slot is copied from a complete replica, at the price of
    the bytes it kept in place.
    """
    owner = {gpu: r for r, replica in enumerate(replicas) for gpu in replica}
    while True:
        moving = {
            r: [replicas[r][i] for i, h in enumerate(slots[k]) if h != replicas[r][i]] for k, r in assignment.items()
        }
        moving = {r: gpus for r, gpus in moving.items() if gpus}
        targets = {
            r: {owner[h] for h in slots[k] if h in owner and owner[h] in moving and owner[h] != r}
            for k, r in assignment.items()
            if r in moving
        }
        cycle = _find_cycle(targets)
        if not cycle:
            return
        # The replica keeping fewest GPUs in place loses least when it is copied afresh.
        drop = min(cycle, key=lambda r: (len(replicas[r]) - len(moving[r]), r))
        del assignment[next(k for k, r in assignment.items() if r == drop)]


def _find_cycle(edges: dict[int, set[int]]) -> list[int]:
    """Nodes of one directed cycle, or [] (iterative depth-first search)."""
    state: dict[int, int] = {}  # 1: on the current path, 2: done
    for root in edges:
        if root in state:
            continue
        path, stack = [root], [iter(sorted(edges[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges.get(nxt, ()))))
    return []

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
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from itertools import repeat
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
    rows = [emu.gpus[stage * emu.tp : (stage + 1) * emu.tp] for stage in range(emu.pp)]
    # Replica (js, jr) takes every fs-th pipeline stage from js and every ft-th rank from jr.
    return [
        Emu(
            emu.model_stage,
            inter[0],
            inter[1],
            tuple(itertools.chain.from_iterable(row[jr::ft] for row in rows[js::fs])),
        )
        for js, jr in itertools.product(range(fs), range(ft))
    ]


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
    holders: dict[int, list[int]] = {}  # I position (index in a replica) -> GPUs holding a piece of it
    for replica in replicas:
        for index, gpu in enumerate(replica.gpus):
            holders.setdefault(index, []).append(gpu)
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
    """Slot index -> replica, greedily by GPUs already holding the right box."""
    return {k: replicas[r] for k, r in _match(replicas, slots).items()}


_GPUS = operator.attrgetter("gpus")  # an Emu's GPU tuple, as a C-level getter


def _match(replicas: list[Emu], slots: list[Emu]) -> dict[int, int]:
    """`match_replicas` as slot index -> replica index.

    A GPU holds at most one replica of a model-stage, so overlaps are counted through a
    GPU -> (replica, position) index instead of comparing every pair; ties go to the
    lower slot, then the lower replica.
    """
    # A slot on exactly a replica's GPUs is the best pair for both (every GPU holds its box,
    # and GPUs hold one replica each): the greedy takes those first, so take them here.
    exact = dict(zip(map(_GPUS, replicas), itertools.count()))  # (in C: large plans have many replicas)
    found = map(exact.get, map(_GPUS, slots))
    assignment = {k: r for k, r in enumerate(found) if r is not None}
    if len(assignment) == len(slots) or len(assignment) == len(replicas):
        return assignment
    used = set(assignment.values())
    owner = {gpu: (r, i) for r, replica in enumerate(replicas) if r not in used for i, gpu in enumerate(replica.gpus)}
    pairs = []
    for k, slot in enumerate(slots):
        if k in assignment:
            continue
        counts: dict[int, int] = {}
        for i, gpu in enumerate(slot.gpus):
            held = owner.get(gpu)
            if held is not None and held[1] == i:
                counts[held[0]] = counts.get(held[0], 0) + 1
        pairs += [(-count, k, r) for r, count in counts.items()]
    pairs.sort()
    for _, k, r in pairs:
        if k not in assignment and r not in used:
            assignment[k] = r
            used.add(r)
    return assignment


def _extend(build: _Builder, source: Emu, slot: Emu, positions: list[int] | None, deps: list[int]) -> Primitive:
    """Copy the boxes at `positions` (None: every position) of `source` onto `slot`'s GPUs."""
    box = build.state_bytes * box_fraction(slot.layout)
    if positions is None:  # a whole replica: the GPU tuples as they are
        reads, targets = source.gpus, slot.gpus
    else:
        reads, targets = tuple(source.gpus[i] for i in positions), tuple(slot.gpus[i] for i in positions)
    return build.add(
        kind="extend",
        source_layout=source.layout,
        target_layout=slot.layout,
        reads=reads,
        writes=targets,
        alloc=dict.fromkeys(targets, box),
        free={},
        transfers=tuple(zip(reads, targets, repeat(box))),
        adds=(slot,),
        copies_from=(source,),
        deps=[d for d in deps if d >= 0],
        new_groups=1,
    )


def _destroy(build: _Builder, replicas: list[Emu], gpus: tuple[int, ...], deps: list[int]) -> Primitive:
    """Drop `replicas` (all of one layout) from `gpus`: one release, however many replicas."""
    layout = replicas[0].layout
    box = build.state_bytes * box_fraction(layout)
    return build.add(
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


#: A copy source: a complete replica, the id its data waits for, and the ids that read it.
_Source = tuple[Emu, int, list[int]]


def _fan_out(
    build: _Builder,
    pending: list[int],
    slots: list[Emu],
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
    """
    tree = star_rounds is not None and len(pending) > star_rounds * len(sources)
    available = list(sources)
    filled: dict[int, _Source] = {}
    queue = pending[::-1]  # popped from the end: slots in order
    while queue:
        round_filled = []
        for n, (source, source_ready, readers) in enumerate(available):
            if not queue:
                break
            k = queue.pop()
            if disjoint and not set(source.gpus).isdisjoint(slots[k].gpus):
                swap = next(
                    (m for m in range(n + 1, len(available)) if set(available[m][0].gpus).isdisjoint(slots[k].gpus)),
                    None,
                )
                if swap is not None:  # trade places: this source serves the next slot
                    available[n], available[swap] = available[swap], available[n]
                    source, source_ready, readers = available[n]
            extend = _extend(build, source, slots[k], None, [source_ready])
            readers.append(extend.id)
            filled[k] = (slots[k], extend.id, [])
            round_filled.append(filled[k])
        if tree:
            available += round_filled
    return filled


def _same_replicas(emus_a: list[Emu], emus_b: list[Emu]) -> bool:
    """Both lists hold the same replicas (one model-stage, one layout per list)."""
    if len(emus_a) != len(emus_b) or emus_a[0].layout != emus_b[0].layout:
        return False
    return {e.gpus for e in emus_a} == {e.gpus for e in emus_b}


def local_dag(
    model_stage: str,
    state_bytes: float,
    emus_a: list[Emu],
    emus_b: list[Emu],
    next_id: int = 0,
    star_rounds: int | None = STAR_ROUNDS,
    unswap: bool = False,
) -> list[Primitive]:
    """Primitives that turn one model-stage's EMUs A into B, with their data edges
    (`star_rounds`: see `_fan_out`; `unswap`: see `_drop_swap_cycles`)."""
    if _same_replicas(emus_a, emus_b):
        return []
    inter = intermediate_layout(emus_a[0].layout, emus_b[0].layout)
    build = _Builder(model_stage, state_bytes, next_id, [])
    replicas: list[Emu] = list(emus_a)
    origin: list[int] = [-1] * len(replicas)  # per I-replica: id of the split that made it (-1: none)
    if emus_a[0].layout != inter:
        replicas, origin = [], []
        for emu in emus_a:
            split, subs = _split(build, emu, inter)
            assert split is not None
            replicas += subs
            origin += [split.id] * len(subs)
    slots_of = [sub_replicas(emu, inter) for emu in emus_b] if emus_b[0].layout != inter else []
    slots = [slot for subs in slots_of for slot in subs] if slots_of else list(emus_b)
    assignment = _match(replicas, slots)
    if unswap:
        _drop_swap_cycles(replicas, slots, assignment)
    kept = [False] * len(replicas)
    for r in assignment.values():
        kept[r] = True
    spare = [r for r, keep in enumerate(kept) if not keep]
    source_ids = [r for r, keep in enumerate(kept) if keep] or spare[:1]  # always copy from a complete replica
    readers: list[list[int]] = [[] for _ in replicas]  # per I-replica: ids of the copies that read it
    _destroy_unneeded(build, replicas, origin, spare, set(source_ids))
    ready: list[list[int]] = [[] for _ in slots]  # per slot: the ids its data waits for
    slot_readers: dict[int, list[int]] = {}  # slot index -> copies that read it
    leftovers: list[tuple[int, tuple[int, ...], int]] = []
    source_of: dict[int, _Source] = {}  # kept replica -> where copies read it from
    for k, r in assignment.items():
        matched, slot = replicas[r], slots[k]
        if matched.gpus == slot.gpus:  # in place: the slot is the replica, copies from it included
            ready[k] = [origin[r]]
            slot_readers[k] = readers[r]
            continue
        moved = [i for i, (g, h) in enumerate(zip(matched.gpus, slot.gpus, strict=True)) if g != h]
        extend = _extend(build, matched, slot, moved, [origin[r]])
        readers[r].append(extend.id)
        leftovers.append((r, tuple(matched.gpus[i] for i in moved), extend.id))
        ready[k] = [extend.id]
        if unswap:  # copy from where it lands, so no copy holds its old GPUs
            source_of[r] = (slot, extend.id, slot_readers.setdefault(k, []))
    pending = [k for k in range(len(slots)) if k not in assignment]
    sources = [source_of.get(r) or (replicas[r], origin[r], readers[r]) for r in source_ids]
    for k, (_, extend_id, copy_readers) in _fan_out(build, pending, slots, sources, star_rounds, unswap).items():
        ready[k] = [extend_id]
        slot_readers[k] = copy_readers
    for r, gpus, extend_id in leftovers:  # a moved replica's old GPUs, once copied
        _destroy(build, [replicas[r]], gpus, [extend_id, *readers[r]])
    for r in source_ids:
        if not kept[r]:  # the only copy B does not keep: destroyed after every copy
            _destroy(build, [replicas[r]], replicas[r].gpus, [origin[r], *readers[r]])
    k = 0
    for emu, subs in zip(emus_b, slots_of, strict=False):  # no slots_of: B is the intermediate layout
        if len(subs) > 1:
            # A slot that served as a copy source is merged only after those copies read it.
            deps = [d for j in range(k, k + len(subs)) for d in (*ready[j], *slot_readers.get(j, ()))]
            _merge(build, emu, subs, deps)
        k += len(subs)
    return build.primitives


def _destroy_unneeded(
    build: _Builder, replicas: list[Emu], origin: list[int], spare: list[int], sources: set[int]
) -> None:
    """Release first: spares no slot needs go before any copy. Spares made by one split
    (or, without splits, all of them) become ready together and free at once: one Destroy each."""
    unneeded: dict[int, list[Emu]] = {}
    for r in spare:
        if r not in sources:
            unneeded.setdefault(origin[r], []).append(replicas[r])
    for split_id, group in unneeded.items():
        _destroy(build, group, tuple(gpu for replica in group for gpu in replica.gpus), [split_id])


def _drop_swap_cycles(replicas: list[Emu], slots: list[Emu], assignment: dict[int, int]) -> None:
    """Unmatch replicas until no moved replicas wait on each other in a cycle.

    A matched replica that moves some positions copies them onto GPUs that may still hold
    another moved replica's box, which leaves those GPUs only after its own copy: a
    cycle of such waits (two replicas of one EMU trading GPUs, say) needs room for two
    boxes on every GPU in it. Unmatching one replica per cycle breaks it: that replica is
    destroyed up front and its slot is copied from a complete replica, at the price of
    the bytes it kept in place.
    """
    owner = {gpu: r for r, replica in enumerate(replicas) for gpu in replica.gpus}
    while True:
        moving = {
            r: [replicas[r].gpus[i] for i, h in enumerate(slots[k].gpus) if h != replicas[r].gpus[i]]
            for k, r in assignment.items()
        }
        moving = {r: gpus for r, gpus in moving.items() if gpus}
        targets = {
            r: {owner[h] for h in slots[k].gpus if h in owner and owner[h] in moving and owner[h] != r}
            for k, r in assignment.items()
            if r in moving
        }
        cycle = _find_cycle(targets)
        if not cycle:
            return
        # The replica keeping fewest GPUs in place loses least when it is copied afresh.
        drop = min(cycle, key=lambda r: (len(replicas[r].gpus) - len(moving[r]), r))
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

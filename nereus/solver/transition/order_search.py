"""Exhaustive search for a memory-safe order of a transition's primitives.

The list scheduler and the serial generator try a few dozen priority orders; when every
one deadlocks, this search decides whether some order of the same primitives, run one
at a time, fits in memory at all. An order it finds is handed to the serial generator,
which packs it in time; when it proves that none exists, the plan pair is infeasible
with these primitives.
"""

from __future__ import annotations

import random
from typing import Literal

from nereus.solver.transition.primitives import Primitive

#: Random greedy orders tried before the depth-first search, and its budget in states.
GREEDY_TRIES = 100
SEARCH_BUDGET = 3000


class OrderSearch:
    """Is there an order of the primitives, run one at a time, that fits in memory?

    One at a time is no loss: running any valid schedule's primitives serially in order
    of start time never holds more on a GPU. Primitives that allocate nothing (Destroy,
    Merge) run as soon as they are ready, which only lowers memory. The search tries
    random greedy orders first, then a depth-first search over the sets of done
    primitives, pruned by a bound: before a primitive P runs, a GPU holds at least what
    it holds now, plus P's undone ancestors' net bytes, less the most any other
    model-stage can free there (the best dependency-closed set of its primitives: local
    DAGs share no edges) and less every free of P's own model-stage not ordered with P.
    """

    def __init__(self, primitives: list[Primitive], initial: dict[int, float], capacity: float) -> None:
        self.prims, self.initial, self.limit = primitives, initial, capacity * (1 + 1e-9)
        n = len(primitives)
        index = {p.id: i for i, p in enumerate(primitives)}
        self.needs = [sum(1 << index[d] for d in p.deps) for p in primitives]
        self.anc = [0] * n
        for i in sorted(range(n), key=lambda i: primitives[i].id):  # local DAG ids are topological
            for d in primitives[i].deps:
                self.anc[i] |= 1 << index[d] | self.anc[index[d]]
        self.desc = [sum(1 << j for j in range(n) if self.anc[j] >> i & 1) for i in range(n)]
        self.stages = sorted({p.model_stage for p in primitives})
        self.stage_mask = {m: sum(1 << i for i, p in enumerate(primitives) if p.model_stage == m) for m in self.stages}
        assert all(self.anc[i] & ~self.stage_mask[p.model_stage] == 0 for i, p in enumerate(primitives))
        self.net = [{g: p.alloc.get(g, 0.0) - p.free.get(g, 0.0) for g in {*p.alloc, *p.free}} for p in primitives]
        self.gains: dict[tuple[str, int, int], float] = {}
        self.seen: set[int] = set()

    @staticmethod
    def bits(mask: int) -> list[int]:
        out = []
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out

    def gain(self, stage: str, gpu: int, done: int) -> float:
        """The most bytes `stage`'s undone primitives can free on `gpu` (a best closed set)."""
        key = (stage, gpu, done & self.stage_mask[stage])
        if key not in self.gains:
            todo = self.stage_mask[stage] & ~done
            releases = [i for i in self.bits(todo) if gpu in self.prims[i].free]
            best = 0.0
            for subset in range(1, 1 << min(len(releases), 12)):
                closed = 0
                for k, i in enumerate(releases[:12]):
                    if subset >> k & 1:
                        closed |= (1 << i | self.anc[i]) & todo
                best = max(best, -sum(self.net[i].get(gpu, 0.0) for i in self.bits(closed)))
            if len(releases) > 12:  # too many to enumerate: every free counts
                best = sum(self.prims[i].free[gpu] for i in releases)
            self.gains[key] = best
        return self.gains[key]

    def dead(self, done: int, usage: dict[int, float]) -> bool:
        todo = (1 << len(self.prims)) - 1 & ~done
        freeable: dict[int, tuple[dict[str, float], float]] = {}  # gpu -> each stage's gain, their sum
        for p in self.bits(todo):
            prim = self.prims[p]
            if not prim.alloc:
                continue
            before = self.bits(self.anc[p] & todo)
            loose = self.bits(self.stage_mask[prim.model_stage] & todo & ~self.anc[p] & ~self.desc[p] & ~(1 << p))
            for gpu, nbytes in prim.alloc.items():
                if gpu not in freeable:
                    gains = {m: self.gain(m, gpu, done) for m in self.stages}
                    freeable[gpu] = gains, sum(gains.values())
                gains, total = freeable[gpu]
                low = usage.get(gpu, 0.0) + nbytes + sum(self.net[i].get(gpu, 0.0) for i in before)
                low -= total - gains[prim.model_stage]  # what the other stages can free there
                low -= sum(self.prims[i].free.get(gpu, 0.0) for i in loose)
                if low > self.limit:
                    return True
        return False

    def ready(self, done: int) -> list[int]:
        return [i for i in range(len(self.prims)) if not done >> i & 1 and self.needs[i] & done == self.needs[i]]

    def fits(self, i: int, usage: dict[int, float]) -> bool:
        return all(usage.get(g, 0.0) + b <= self.limit for g, b in self.prims[i].alloc.items())

    def apply(self, i: int, usage: dict[int, float], sign: float = 1.0) -> None:
        for gpu, nbytes in self.net[i].items():
            usage[gpu] = usage.get(gpu, 0.0) + sign * nbytes

    def greedy(self, rng: random.Random, sticky: float) -> list[int] | None:
        """One random order: releases first, else an allocation that fits (same model-stage with odds `sticky`)."""
        done, usage, order, last = 0, dict(self.initial), [], ""
        while done != (1 << len(self.prims)) - 1:
            ready = self.ready(done)
            batch = [i for i in ready if not self.prims[i].alloc]
            if not batch:
                fitting = [i for i in ready if self.fits(i, usage)]
                same = [i for i in fitting if self.prims[i].model_stage == last]
                if not fitting:
                    return None
                batch = [rng.choice(same if same and rng.random() < sticky else fitting)]
                last = self.prims[batch[0]].model_stage
            for i in batch:
                self.apply(i, usage)
                done |= 1 << i
                order.append(i)
        return order

    def dfs(self, done: int, usage: dict[int, float], order: list[int], budget: int) -> bool:
        released = []
        while releases := [i for i in self.ready(done) if not self.prims[i].alloc]:
            for i in releases:
                self.apply(i, usage)
                done |= 1 << i
            released += releases
        order.extend(released)
        if done == (1 << len(self.prims)) - 1:
            return True
        if done not in self.seen and len(self.seen) < budget:
            self.seen.add(done)
            if not self.dead(done, usage):
                for i in (i for i in self.ready(done) if self.fits(i, usage)):
                    self.apply(i, usage)
                    order.append(i)
                    if self.dfs(done | 1 << i, usage, order, budget):
                        return True
                    order.pop()
                    self.apply(i, usage, -1.0)
        for i in released:
            self.apply(i, usage, -1.0)
        del order[len(order) - len(released) :]
        return False

    def search(self, budget: int) -> list[int] | None:
        """Depth first from scratch: an order, or None (`self.seen` tells exhausted from out of budget)."""
        order: list[int] = []
        self.seen = set()
        return order if self.dfs(0, dict(self.initial), order, budget) else None

    def run(self, tries: int, budget: int) -> list[int] | Literal["infeasible", "undecided"]:
        """An order of primitive ids that fits one at a time; else "infeasible" or "undecided".

        A short search first (the bound often proves infeasibility at once), then `tries`
        random greedy orders, then the full search.
        """
        quick = min(200, budget)
        order = self.search(quick)
        if order is None and len(self.seen) < quick:
            return "infeasible"
        rng = random.Random(0)
        for k in range(tries if order is None else 0):
            order = self.greedy(rng, sticky=0.8 * (k % 2))
            if order is not None:
                break
        order = order or self.search(budget)
        if order is None:
            return "undecided" if len(self.seen) >= budget else "infeasible"
        return [self.prims[i].id for i in order]

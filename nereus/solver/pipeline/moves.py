"""The annealing's neighbourhood: short moves and swaps, critical-arc moves, peak moves.

Each move returns (node, its new order, first position that changed); the caller re-times
the schedule from that position (`evaluate.resimulate`). `span` is how far (positions on a
node) a move reaches, `nearest` how many ops near a high moment a peak move picks from
(`SearchPolicy.move_span`, `SearchPolicy.nearest_ops`).
"""

from __future__ import annotations

import random

from nereus.solver.pipeline.model import Instance
from nereus.solver.pipeline.policy import RELATIVE_EPS

Orders = list[list[int]]
Move = tuple[int, list[int], int]


def neighbour(rng: random.Random, orders: Orders, movable: list[int], span: int) -> Move:
    """A swap of two nearby ops on one node, or a short move of one op."""
    node = movable[rng.randrange(len(movable))]
    order = list(orders[node])
    i = rng.randrange(len(order))
    j = min(len(order) - 1, max(0, i + rng.randint(-span, span)))
    if i == j:
        j = i + 1 if i + 1 < len(order) else i - 1
    if rng.random() < 0.5:
        order[i], order[j] = order[j], order[i]
    else:
        order.insert(j, order.pop(i))
    return node, order, min(i, j)


def critical_node_arcs(inst: Instance, orders: Orders, start: list[float], end: list[float]) -> list[tuple[int, int]]:
    """(node, position) of every op on one critical path that waits for the op before it on its node.

    The path is walked back from the op that ends last, following at each op the constraint
    that fixes its start (a dependency, else its node predecessor). Only reordering such
    node arcs can shorten this path.
    """
    position = {}
    for node, order in enumerate(orders):
        for i, op in enumerate(order):
            position[op] = (node, i)
    makespan = max(end, default=0.0)
    tol = RELATIVE_EPS * max(1.0, makespan)
    op = max(range(inst.num_ops), key=end.__getitem__)
    arcs = []
    while start[op] > tol:
        node, i = position[op]
        pred = next((p for p, lat in inst.preds[op] if abs(end[p] + lat - start[op]) <= tol), -1)
        if pred < 0 and i and abs(end[orders[node][i - 1]] - start[op]) <= tol:
            arcs.append((node, i))
            pred = orders[node][i - 1]
        if pred < 0:
            break
        op = pred
    return arcs


def critical_move(rng: random.Random, orders: Orders, arcs: list[tuple[int, int]], span: int) -> Move:
    """Break a critical node arc: move its later op ahead of the earlier one, or the earlier op
    behind the later one (each by a random few places more)."""
    node, i = arcs[rng.randrange(len(arcs))]
    order = list(orders[node])
    if rng.random() < 0.5:
        j = max(0, i - 1 - rng.randint(0, span))
        order.insert(j, order.pop(i))
        return node, order, j
    j = min(len(order) - 1, i + rng.randint(0, span))
    order.insert(j, order.pop(i - 1))
    return node, order, i - 1


def memory_profile(delta: list[float], order: list[int], level: float) -> tuple[float, float]:
    """(peak, excess) of one node's order: its highest held activation, and the sum over its
    positions of how far the held activation stands above `level` (zero when the node never
    exceeds it; it shrinks with every moment that stops being high, so it guides the memory
    walk across plateaus of the peak the way the lateness guides the latency walk)."""
    held = peak = excess = 0.0
    for op in order:
        held += delta[op]
        if held > peak:
            peak = held
        if held > level:
            excess += held - level
    return peak, excess


def peak_move(
    inst: Instance, rng: random.Random, orders: Orders, excess: list[float], level: float, span: int, nearest: int
) -> Move:
    """Lower a high moment: on a node above `level` (picked in proportion to its excess), at a
    position where it holds more than `level`, move one of the last `nearest` forwards before
    that moment to a few places after it, or one of the next `nearest` backwards after it to a
    few places before it. The ops nearest the moment move, so the rest of the schedule barely
    changes."""
    pick, node = rng.random() * sum(excess), 0
    while node < len(excess) - 1 and (excess[node] <= 0 or pick > excess[node]):
        pick -= excess[node]
        node += 1
    order = list(orders[node])
    delta = inst.memory_delta
    high, held = [], 0.0
    for i, op in enumerate(order):
        held += delta[op]
        if held > level:
            high.append(i)
    if not high:
        return node, order, len(order) - 1  # nothing above the level: an unchanged order
    at = high[rng.randrange(len(high))]
    if rng.random() < 0.5:
        forwards = [i for i in range(at, -1, -1) if delta[order[i]] > 0][:nearest]
        if forwards:
            i = forwards[rng.randrange(len(forwards))]
            j = min(len(order) - 1, at + rng.randint(0, span))
            order.insert(j, order.pop(i))
            return node, order, i
    backwards = [i for i in range(at + 1, len(order)) if delta[order[i]] < 0][:nearest]
    if not backwards:
        return node, order, len(order) - 1
    i = backwards[rng.randrange(len(backwards))]
    j = max(0, at - rng.randint(0, span))
    order.insert(j, order.pop(i))
    return node, order, j

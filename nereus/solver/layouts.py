"""The layout space of one model-stage on a pool of GPUs, priced in one numpy call."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from nereus.cost.plan_cost import RESIDENT_TERMS
from nereus.cost.stage import StageCostModel
from nereus.spec.check import kv_heads_rule, pp_rule


@dataclass(frozen=True)
class OptionTable:
    """Every candidate layout of one model-stage on one pool size, as plain tuples.

    Each option is (time_s, resident_bytes, transient_bytes, tp, pp, dp, micro_batches).
    `terms` keeps the per-term memory (bytes) of each option for error reports.
    """

    options: list[tuple[float, float, float, int, int, int, int]]
    terms: list[dict[str, float]]


def micro_batch_choices(cost: StageCostModel, dp: int) -> list[int]:
    """Training: micro-batch sizes 1, 2, 4, ... of a replica's mini-batch share."""
    w = cost.workload
    if cost.stage == "generation":
        return [1]
    if cost.stage == "inference":
        return [-(-int(cost.samples_per_replica(dp)) // w.micro_batch_size)]
    share = -(-w.samples_per_step // w.mini_batches // dp)
    sizes = {share} | {1 << i for i in range(share.bit_length()) if 1 << i <= share}
    return sorted({-(-share // size) for size in sizes})


@lru_cache(maxsize=4096)
def emu_spans_nodes(emu_size: int, dp: int, gpus_per_node: int) -> bool:
    """Whether some EMU, packed contiguously from a node boundary, straddles two nodes."""
    return any((k * emu_size) % gpus_per_node + emu_size > gpus_per_node for k in range(dp))


def candidate_layouts(cost: StageCostModel, pool_size: int) -> list[tuple[int, int, int, int]]:
    """(tp, pp, dp, micro_batches): power-of-two tp in a node, pp dividing the layers."""
    model, per_node = cost.model, cost.cluster.gpus_per_node
    out = []
    tp = 1
    while tp <= min(per_node, pool_size):
        if kv_heads_rule(model, tp) is None:
            for pp in range(1, model.num_layers + 1):
                if tp * pp > pool_size:
                    break
                if pp_rule(model, pp) is None:
                    dp = pool_size // (tp * pp)
                    out += [(tp, pp, dp, m) for m in micro_batch_choices(cost, dp)]
        tp *= 2
    return out


def price_layouts(cost: StageCostModel, pool_sizes: list[int]) -> dict[int, OptionTable]:
    """Price every candidate layout on every pool size in one vectorised call."""
    rows = [(size, *layout) for size in pool_sizes for layout in candidate_layouts(cost, size)]
    if not rows:
        return {size: OptionTable([], []) for size in pool_sizes}
    size, tp, pp, dp, m = (np.array(col, dtype=float) for col in zip(*rows, strict=True))
    per_node = cost.cluster.gpus_per_node
    pp_inter = np.array([emu_spans_nodes(int(a * b), int(c), per_node) for a, b, c in zip(tp, pp, dp, strict=True)])
    dp_inter = tp * pp * dp > per_node
    times = cost.time_terms(tp, pp, dp, m, pp_inter, dp_inter)
    memory = cost.memory_terms(tp, pp, dp, m)
    total = sum(np.broadcast_to(v, size.shape) for v in times.values())
    memory = {k: np.broadcast_to(v, size.shape) for k, v in memory.items()}
    resident = sum(v for k, v in memory.items() if k in RESIDENT_TERMS)
    transient = sum((v for k, v in memory.items() if k not in RESIDENT_TERMS), np.zeros(size.shape))
    tables: dict[int, OptionTable] = {s: OptionTable([], []) for s in pool_sizes}
    for i, row in enumerate(rows):
        table = tables[row[0]]
        table.options.append((float(total[i]), float(resident[i]), float(transient[i]), *row[1:]))
        table.terms.append({k: float(v[i]) for k, v in memory.items()})
    return tables

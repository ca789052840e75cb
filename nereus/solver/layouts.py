"""The layout space of one model-stage on a pool of GPUs, priced in one numpy call."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from nereus.cost.plan_cost import RESIDENT_TERMS
from nereus.cost.stage import StageCostModel
from nereus.spec.check import kv_heads_rule, pp_rule


@dataclass
class OptionTable:
    """Every candidate layout of one model-stage on one pool size.

    Columns are numpy arrays; `options` turns them, on first use, into the plain tuples
    (time_s, resident_bytes, transient_bytes, tp, pp, dp, micro_batches) the search
    loops over. `memory` keeps the per-term bytes behind each option for reports.
    """

    columns: tuple[np.ndarray, ...]
    memory: dict[str, np.ndarray]

    @cached_property
    def options(self) -> list[tuple[float, float, float, int, int, int, int]]:
        time, resident, transient, *layout = (c.tolist() for c in self.columns)
        layout = [[int(x) for x in col] for col in layout]
        return list(zip(time, resident, transient, *layout, strict=True))

    def fastest_time(self, budget: float) -> float:
        """The fastest option that fits alone, or inf."""
        fits = self.columns[1] + self.columns[2] <= budget
        return float(self.columns[0][fits].min()) if fits.any() else math.inf

    def terms(self, i: int) -> dict[str, float]:
        """Bytes per memory term of option `i`."""
        return {k: float(v[i]) for k, v in self.memory.items()}


def _valid_tp_pp(cost: StageCostModel) -> list[tuple[int, int]]:
    """(tp, pp) pairs the model allows: power-of-two tp in a node, pp dividing the layers."""
    model = cost.model
    tps = [
        1 << i
        for i in range(cost.cluster.gpus_per_node.bit_length())
        if 1 << i <= cost.cluster.gpus_per_node and kv_heads_rule(model, 1 << i) is None
    ]
    pps = [pp for pp in range(1, model.num_layers + 1) if pp_rule(model, pp) is None]
    return [(tp, pp) for tp in tps for pp in pps]


def _ceil_div(a: Any, b: Any) -> Any:
    return -(-a // b)


def candidate_grid(cost: StageCostModel, pool_sizes: list[int]) -> tuple[np.ndarray, ...]:
    """(size, tp, pp, dp, micro_batches) columns of every candidate on every pool size.

    tp is a power of two inside a node, pp divides the layers, dp fills the pool
    (up to one replica per sample);
    training tries micro-batch sizes 1, 2, 4, ... and the whole share of a replica.
    """
    pairs = np.array(_valid_tp_pp(cost), dtype=np.int64).reshape(-1, 2)
    size, tp, pp = np.broadcast_arrays(
        np.array(pool_sizes, dtype=np.int64)[:, None], pairs[None, :, 0], pairs[None, :, 1]
    )
    w = cost.workload
    samples = w.samples_per_step // w.mini_batches if cost.stage == "training" else w.samples_per_step
    keep = tp * pp <= size
    size, tp, pp = size[keep], tp[keep], pp[keep]
    dp = np.minimum(size // (tp * pp), samples)  # a replica without samples would idle: leave its GPUs free
    if cost.stage != "training":
        if cost.stage == "generation":
            return size, tp, pp, dp, np.ones_like(dp)
        per_replica = _ceil_div(w.samples_per_step, dp)
        return size, tp, pp, dp, _ceil_div(per_replica, w.micro_batch_size)
    share = _ceil_div(w.samples_per_step // w.mini_batches, dp)
    columns: list[list[np.ndarray]] = [[], [], [], [], []]
    largest = int(share.max()) if share.size else 0
    for b in [*(1 << i for i in range(largest.bit_length())), 0]:
        pick = share > b if b else np.ones_like(share, dtype=bool)  # b = 0 stands for "the whole share"
        m = _ceil_div(share[pick], b) if b else np.ones(int(pick.sum()), dtype=np.int64)
        for out, col in zip(columns, (size[pick], tp[pick], pp[pick], dp[pick], m), strict=True):
            out.append(col)
    return tuple(np.concatenate(col) for col in columns)


def price_layouts(cost: StageCostModel, pool_sizes: list[int]) -> dict[int, OptionTable]:
    """Price every candidate layout on every pool size in one vectorised call."""
    size, tp, pp, dp, m = candidate_grid(cost, pool_sizes)
    order = np.argsort(size, kind="stable")
    size, tp, pp, dp, m = size[order], tp[order], pp[order], dp[order], m[order]
    per_node = cost.cluster.gpus_per_node
    emu = tp * pp
    # An EMU straddles nodes when it is larger than a node, or packs unevenly into one.
    pp_inter = (emu > per_node) | ((per_node % emu != 0) & (emu * dp > per_node))
    dp_inter = emu * dp > per_node
    tp_f, pp_f, dp_f, m_f = (x.astype(float) for x in (tp, pp, dp, m))
    times = cost.time_terms(tp_f, pp_f, dp_f, m_f, pp_inter, dp_inter)
    memory = {
        k: np.broadcast_to(v, size.shape).astype(float) for k, v in cost.memory_terms(tp_f, pp_f, dp_f, m_f).items()
    }
    zeros = np.zeros(size.shape)
    total: np.ndarray = sum((np.broadcast_to(v, size.shape) for v in times.values()), zeros)
    resident: np.ndarray = sum((v for k, v in memory.items() if k in RESIDENT_TERMS), zeros)
    transient: np.ndarray = sum((v for k, v in memory.items() if k not in RESIDENT_TERMS), zeros)
    bounds = np.searchsorted(size, [*pool_sizes, np.iinfo(np.int64).max])
    tables = {}
    for s, lo, hi in zip(pool_sizes, bounds[:-1], bounds[1:], strict=True):
        piece = slice(lo, hi)
        tables[s] = OptionTable(
            (total[piece], resident[piece], transient[piece], tp[piece], pp[piece], dp[piece], m[piece]),
            {k: v[piece] for k, v in memory.items()},
        )
    return tables

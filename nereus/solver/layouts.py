"""The layout space of one model-stage on a pool of GPUs, priced in one numpy call."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from nereus.cost.plan_cost import RESIDENT_TERMS, split_resident, usable_memory
from nereus.cost.stage import StageCostModel
from nereus.spec.check import kv_heads_rule, pp_rule

#: Bounded KV budgets tried, as fractions of a GPU's usable memory (plus one maximum-length
#: sequence, the least that runs, and the unbounded budget).
KV_BUDGET_FRACTIONS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.7)

#: (kv_budget_bytes or 0, recompute, token_budget or 0, zero1, offload) of one option.
Choice = tuple[int, int, int, int, int]
Option = tuple[float, float, float, int, int, int, int, Choice]  # time, resident, transient, tp, pp, dp, m, choice


@dataclass(frozen=True)
class MemoryChoices:
    """Which memory-saving choices the planner may use (one value pins the choice)."""

    recompute: tuple[str, ...] = ("none", "full")
    """Activation recomputation of training model-stages: `none`, `full`."""
    token_budget: tuple[bool, ...] = (False, True)
    """Training micro-batches of equal rows (False) or packed to a token budget (True)."""
    zero1: tuple[bool, ...] = (False, True)
    """AdamW state sharded across dp (True) or replicated (False)."""
    offload: tuple[bool, ...] = (False, True)
    """Idle model-stages' states sleep in host memory (True) or stay on the GPUs (False)."""
    kv_budget: tuple[bool, ...] = (False, True)
    """Generation batches continuously into a bounded KV budget (True) or holds every sample (False)."""


#: What `nereus run` executes today: every state resident, every activation kept, fixed rows,
#: the whole batch's KV cache.
RUNTIME_CHOICES = MemoryChoices(("none",), (False,), (False,), (False,), (False,))


@dataclass
class OptionTable:
    """Every candidate layout of one model-stage on one pool size.

    Columns are numpy arrays; `options` turns them, on first use, into the plain tuples
    (time_s, resident_bytes, transient_bytes, tp, pp, dp, micro_batches) the search
    loops over. `memory` keeps the per-term bytes behind each option for reports.
    """

    columns: tuple[np.ndarray, ...]
    memory: dict[str, np.ndarray]

    choices: tuple[np.ndarray, ...] = ()
    """(kv_budget_bytes, recompute, token_budget, zero1, offload) columns, integers (0: off)."""

    @cached_property
    def options(self) -> list[Option]:
        time, resident, transient, *layout = (c.tolist() for c in self.columns)
        layout = [[int(x) for x in col] for col in layout]
        picks = list(zip(*(c.astype(np.int64).tolist() for c in self.choices), strict=True))
        return list(zip(time, resident, transient, *layout, picks, strict=True))

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


def _expand(columns: list[np.ndarray], values: list[float]) -> list[np.ndarray]:
    """Every row of `columns` once per value of a new trailing column."""
    reps = len(values)
    out = [np.repeat(c, reps) for c in columns]
    return [*out, np.tile(np.array(values, dtype=float), len(columns[0]))]


def choice_grid(
    cost: StageCostModel, base: tuple[np.ndarray, ...], allowed: MemoryChoices
) -> tuple[list[np.ndarray], tuple[np.ndarray, ...]]:
    """The base (size, tp, pp, dp, m) rows times every allowed choice of this model-stage,
    and its (kv_budget, recompute, token, zero1, offload) columns (kv_budget in bytes, inf: none)."""
    columns = list(base)
    if cost.stage == "training":
        zero1_pinned = cost.workload.optimizer.shard_across_dp
        for values in (
            [float(r == "full") for r in allowed.recompute],
            [float(t) for t in allowed.token_budget],
            [1.0] if zero1_pinned else [float(z) for z in allowed.zero1],
        ):
            columns = _expand(columns, values)
        keep = (columns[7] == 0) | (columns[3] > 1) | bool(zero1_pinned)  # ZeRO-1 over one replica is no change
        columns = [c[keep] for c in columns]
        kv = np.full(columns[0].shape, np.inf)
        columns = [*columns[:5], kv, *columns[5:]]
    else:
        if cost.stage == "generation" and True in allowed.kv_budget:
            columns, kv = _kv_levels(cost, columns, allowed)
        else:
            kv = np.full(columns[0].shape, np.inf)
        zeros = np.zeros(columns[0].shape)
        columns = [*columns, kv, zeros, zeros, zeros]
    columns = _expand(columns, [float(o) for o in allowed.offload])
    return columns[:5], tuple(columns[5:])


def _kv_levels(
    cost: StageCostModel, columns: list[np.ndarray], allowed: MemoryChoices
) -> tuple[list[np.ndarray], np.ndarray]:
    """Generation rows per KV budget: unbounded (if allowed), the fractions of usable memory
    below the whole batch's need, and one maximum-length sequence."""
    usable = usable_memory(cost.cluster, cost.calibration)
    tp, pp, dp = (c.astype(float) for c in columns[1:4])
    full = cost.full_kv_bytes(tp, pp, dp)
    one = np.ceil((cost.workload.prompt_len + cost.workload.response_len.max) * cost.kv_bytes_per_token(tp, pp))
    rows, levels = [], []
    candidates = [np.floor(usable * f) * np.ones_like(full) for f in KV_BUDGET_FRACTIONS] + [one]
    for level in candidates:
        pick = (level >= one) & (level < full)
        rows.append(pick)
        levels.append(np.where(pick, level, 0.0))
    if False in allowed.kv_budget:
        rows.append(np.ones(full.shape, dtype=bool))
        levels.append(np.full(full.shape, np.inf))
    out = [np.concatenate([c[r] for r in rows]) for c in columns]
    return out, np.concatenate([lv[r] for lv, r in zip(levels, rows, strict=True)])


def price_layouts(
    cost: StageCostModel, pool_sizes: list[int], allowed: MemoryChoices | None = None
) -> dict[int, OptionTable]:
    """Price every candidate layout and choice on every pool size in one vectorised call."""
    base = candidate_grid(cost, pool_sizes)
    (size, tp, pp, dp, m), (kv, recompute, token, zero1, offload) = choice_grid(cost, base, allowed or MemoryChoices())
    order = np.argsort(size, kind="stable")
    size, tp, pp, dp, m = (c[order].astype(np.int64) for c in (size, tp, pp, dp, m))
    kv, recompute, token, zero1, offload = (c[order] for c in (kv, recompute, token, zero1, offload))
    per_node = cost.cluster.gpus_per_node
    emu = tp * pp
    # An EMU straddles nodes when it is larger than a node, or packs unevenly into one.
    pp_inter = (emu > per_node) | ((per_node % emu != 0) & (emu * dp > per_node))
    dp_inter = emu * dp > per_node
    tp_f, pp_f, dp_f, m_f = (x.astype(float) for x in (tp, pp, dp, m))
    budget = np.where(token > 0, cost.packed_token_budget(dp_f, m_f), 0.0) if cost.stage == "training" else 0.0
    choices = {"recompute": recompute, "zero1": zero1 > 0, "kv_budget": kv}
    times = cost.time_terms(tp_f, pp_f, dp_f, m_f, pp_inter, dp_inter, **choices)
    memory = {
        k: np.broadcast_to(v, size.shape).astype(float)
        for k, v in cost.memory_terms(tp_f, pp_f, dp_f, m_f, token_budget=budget, **choices).items()
    }
    zeros = np.zeros(size.shape)
    resident, transient = (np.broadcast_to(x, size.shape) for x in split_resident(memory, offload > 0))
    states = sum((v for k, v in memory.items() if k in RESIDENT_TERMS), zeros)
    times["offload"] = np.where(offload > 0, cost.offload_time(states), 0.0)
    total: np.ndarray = sum((np.broadcast_to(v, size.shape) for v in times.values()), zeros)
    picks = (np.where(np.isinf(kv), 0.0, kv), recompute, np.broadcast_to(budget, size.shape), zero1, offload)
    bounds = np.searchsorted(size, [*pool_sizes, np.iinfo(np.int64).max])
    tables = {}
    for s, lo, hi in zip(pool_sizes, bounds[:-1], bounds[1:], strict=True):
        piece = slice(lo, hi)
        tables[s] = OptionTable(
            (total[piece], resident[piece], transient[piece], tp[piece], pp[piece], dp[piece], m[piece]),
            {k: v[piece] for k, v in memory.items()},
            tuple(c[piece] for c in picks),
        )
    return tables

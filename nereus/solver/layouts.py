"""The layout space of one model-stage on a pool of GPUs, priced in one numpy call."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Final

import numpy as np

from nereus.cost.plan_cost import RESIDENT_TERMS, split_resident, stage_room
from nereus.cost.stage import TRAIN_OFFLOADS, StageCostModel
from nereus.spec.check import cp_rule, ep_rule, kv_heads_rule, pp_rule
from nereus.spec.plan import RECOMPUTE_LEVELS, CpMethod, Fusion, Recompute

#: Bounded KV budgets tried, as fractions of the room a GPU leaves the model-stages (its usable
#: capacity less the workspace, `stage_room`), plus one maximum-length sequence, the least that
#: runs, and the unbounded budget.
KV_BUDGET_FRACTIONS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.7)

#: (kv_budget_bytes or 0, recompute, token_budget or 0, zero1, offload, full_shard, train_offload level:
#: `TRAIN_OFFLOADS`' index) of one option.
Choice = tuple[int, int, int, int, int, int, int]
#: time, resident, transient, tp, pp, dp, m, choice, host bytes per GPU, cp, ep, cp method (1:
#: all-gather KV, 0: Ulysses; last, so that the fields before them keep their places)
Option = tuple[float, float, float, int, int, int, int, Choice, float, int, int, int]
#: Where an `Option` keeps its context-parallel degree.
CP: Final = 9
#: Where an `Option` keeps its expert-parallel degree.
EP: Final = 10
#: Where an `Option` keeps its context-parallel method: 1 all-gather KV, 0 Ulysses (`CP_METHODS`).
CP_METHOD: Final = 11
#: The cp methods by their `CP_METHOD` code.
CP_METHODS: Final[tuple[CpMethod, ...]] = ("ulysses", "allgather")


@dataclass(frozen=True)
class MemoryChoices:
    """Which memory-saving choices the planner may use (one value pins the choice)."""

    recompute: tuple[Recompute, ...] = RECOMPUTE_LEVELS
    """Activation recomputation of training model-stages: `none`, `full`, `selective`."""
    token_budget: tuple[bool, ...] = (False, True)
    """Training micro-batches of equal rows (False) or packed to a token budget (True)."""
    zero1: tuple[bool, ...] = (False, True)
    """AdamW state sharded across dp x cp (True) or replicated (False)."""
    offload: tuple[bool, ...] = (False, True)
    """Idle model-stages' states sleep in host memory (True) or stay on the GPUs (False)."""
    kv_budget: tuple[bool, ...] = (False, True)
    """Generation batches continuously into a bounded KV budget (True) or holds every sample (False)."""
    full_shard: tuple[bool, ...] = (False, True)
    """Training and inference shard parameters (and gradients, optimizer state) across dp x cp
    (True; searched where dp x cp > 1 and pp = 1; it shards the optimizer whatever `zero1` says)
    or hold them whole (False)."""
    train_offload: tuple[str, ...] = TRAIN_OFFLOADS
    """Training-time offload (`StagePlan.train_offload`): `none`, `optimizer` (AdamW state and
    gradients in host memory, the step on the host; it shards them whatever `zero1` says) or
    `params` (the parameters too; searched only with full sharding)."""
    context_parallel: tuple[bool, ...] = (False, True)
    """Training and inference replicas may cut sequences over cp > 1 ranks (True; Ulysses, without
    pipeline stages: `candidate_grid`) or keep cp = 1 (False). A layout dimension, not a memory
    choice, but pinned the same way."""
    expert_parallel: tuple[bool, ...] = (False, True)
    """Every model-stage of a mixture-of-experts model may split its experts over ep > 1 ranks
    (True; ep dividing the experts, docs/moe.md) or keep ep = 1 (False); a dense model has ep = 1
    whatever this says. A layout dimension, pinned like `context_parallel`."""


def runtime_choices(fusion: Fusion | None = None) -> MemoryChoices:
    """What `nereus run` plans for itself (a run planning itself, its resume replanner, its
    controller): every memory choice searched as by default, since the runtime executes them all.
    Under `fusion`'s intra-stage fusion, whose schedule fixes the training micro-batch counts,
    token budgets are pinned off (the runtime refuses that combination:
    `nereus.solver.admission.token_budget_problems`). Context parallelism (Ulysses,
    docs/context-parallel.md) is searched as by default: the runtime executes it. Expert
    parallelism is pinned to ep = 1: the runtime executes it (docs/moe.md) but not
    beside ZeRO-1, full sharding, training-time offload or token budgets, which this search pairs
    with it freely; a plan given to `nereus run` may carry ep > 1 without them."""
    pinned: dict[str, Any] = {"expert_parallel": (False,)}
    if fusion is not None and fusion.intra_stage:
        pinned["token_budget"] = (False,)
    return MemoryChoices(**pinned)


#: What `nereus run` plans for itself without intra-stage fusion (`runtime_choices`).
RUNTIME_CHOICES = runtime_choices()


@dataclass(frozen=True)
class ListedOptions:
    """Every choice of every distinct layout of one model-stage (shared by its pool sizes),
    and the rows of them worth listing. A row is a timed row (see `_Timed`) kept or put to
    sleep: what the two share stays per timed row."""

    columns: tuple[np.ndarray, ...]
    """(time_s, resident_bytes, transient_bytes) per row."""
    host: np.ndarray
    """Host-memory bytes per GPU per row (training-time offload's, and the states asleep)."""
    timed_row: np.ndarray
    """The timed row behind each row."""
    offloads: np.ndarray
    """Each block of `timed_row`'s length: its offload flag (1: the states sleep)."""
    layout: tuple[np.ndarray, ...]
    """(tp, pp, dp, micro_batches, cp, ep, cp method code) per timed row."""
    memory: dict[str, np.ndarray]
    """Bytes per memory term, per timed row."""
    choices: tuple[np.ndarray, ...]
    """(kv_budget_bytes, recompute, token_budget, zero1, full_shard, train_offload) per timed row (0: off)."""
    by_layout: np.ndarray
    """The listed rows grouped by distinct layout (in row order within one)."""
    starts: np.ndarray
    """Where each distinct layout's rows start in `by_layout`."""
    counts: np.ndarray
    """How many listed rows each distinct layout has."""

    def rows_of(self, layouts: np.ndarray) -> np.ndarray:
        """The listed rows of `layouts` (distinct-layout indices): each layout's rows in turn."""
        per = self.counts[layouts]
        layout_of = np.repeat(np.arange(layouts.size), per)
        within = np.arange(layout_of.size) - np.repeat(np.cumsum(per) - per, per)
        return self.by_layout[self.starts[layouts][layout_of] + within]


@dataclass
class OptionTable:
    """Every candidate layout of one model-stage on one pool size: rows of a `ListedOptions`.

    `options` turns them, on first use, into the plain tuples (time_s, resident_bytes,
    transient_bytes, tp, pp, dp, micro_batches, choice, host_bytes, cp, ep) the search loops over;
    `memory` keeps the per-term bytes behind each option for reports.
    """

    listed: ListedOptions
    layouts: np.ndarray
    """The distinct layouts (indices) of this pool size; the rows follow on first use, as the
    search reads the tables of few pool sizes."""
    fastest: float
    """The fastest option that fits alone in the GPUs' usable memory, or inf."""

    @cached_property
    def rows(self) -> np.ndarray:
        return self.listed.rows_of(self.layouts)

    @cached_property
    def timed(self) -> np.ndarray:
        return self.listed.timed_row[self.rows]

    @cached_property
    def columns(self) -> tuple[np.ndarray, ...]:
        """(time_s, resident_bytes, transient_bytes, tp, pp, dp, micro_batches)."""
        own = tuple(c[self.rows] for c in self.listed.columns)
        return own + tuple(c[self.timed] for c in self.listed.layout[:4])

    @cached_property
    def cp(self) -> np.ndarray:
        """The context-parallel degree."""
        return self.listed.layout[4][self.timed]

    @cached_property
    def ep(self) -> np.ndarray:
        """The expert-parallel degree."""
        return self.listed.layout[5][self.timed]

    @cached_property
    def cp_method(self) -> np.ndarray:
        """The context-parallel method's code (`CP_METHODS`)."""
        return self.listed.layout[6][self.timed]

    @cached_property
    def memory(self) -> dict[str, np.ndarray]:
        """Bytes per memory term."""
        return {k: v[self.timed] for k, v in self.listed.memory.items()}

    @cached_property
    def host(self) -> np.ndarray:
        """Host-memory bytes per GPU."""
        return self.listed.host[self.rows]

    @cached_property
    def choices(self) -> tuple[np.ndarray, ...]:
        """(kv_budget_bytes, recompute, token_budget, zero1, offload, full_shard, train_offload),
        integers (0: off)."""
        kv, recompute, token_budget, zero1, full_shard, train_offload = (c[self.timed] for c in self.listed.choices)
        offload = self.listed.offloads[self.rows // self.listed.choices[0].size]
        return (kv, recompute, token_budget, zero1, offload, full_shard, train_offload)

    @cached_property
    def options(self) -> list[Option]:
        time, resident, transient, *layout = (c.tolist() for c in self.columns)
        picks = list(zip(*(c.astype(np.int64).tolist() for c in self.choices), strict=True))
        host, cp, ep, method = self.host.tolist(), self.cp.tolist(), self.ep.tolist(), self.cp_method.tolist()
        return list(zip(time, resident, transient, *layout, picks, host, cp, ep, method, strict=True))

    def terms(self, i: int) -> dict[str, float]:
        """Bytes per memory term of option `i`."""
        return {k: float(v[i]) for k, v in self.memory.items()}


def _valid_degrees(cost: StageCostModel, allowed: MemoryChoices) -> list[tuple[int, int, int, int, int]]:
    """(tp, pp, cp, ep, cp method code) the model allows: power-of-two tp in a node, pp dividing
    the layers (at most the cluster's GPUs), in training and inference (where allowed) a
    power-of-two cp > 1 without pipeline stages, by Ulysses where it can split the heads
    (`cp_rule`) and by all-gather KV where it cannot, with cp up to a node's GPUs (no head
    bound), and for a mixture of experts (where allowed) every ep > 1 dividing the experts
    (`ep_rule`), with cp = 1."""
    model = cost.model
    tps = [
        1 << i
        for i in range(cost.cluster.gpus_per_node.bit_length())
        if 1 << i <= cost.cluster.gpus_per_node and kv_heads_rule(model, 1 << i) is None
    ]
    # pp stages take pp GPUs: more than the cluster has place nowhere (and a model file's absurd
    # layer count would make this loop endless)
    pps = [pp for pp in range(1, min(model.num_layers, cost.cluster.num_gpus) + 1) if pp_rule(model, pp) is None]
    plain = [(tp, pp, 1, 1, 0) for tp in tps for pp in pps]
    out = list(plain)
    if cost.stage != "generation" and True in allowed.context_parallel:
        cps = [1 << i for i in range(1, model.num_heads.bit_length())]  # `cp_rule` keeps those that divide
        out += [(tp, 1, cp, 1, 0) for tp in tps for cp in cps if cp_rule(model, tp, cp) is None]
        node = cost.cluster.gpus_per_node
        gathered = [1 << i for i in range(1, node.bit_length()) if 1 << i <= node]
        code = CP_METHODS.index("allgather")
        # All-gather KV where Ulysses cannot split the heads (search time: beside every Ulysses
        # layout it roughly doubles the grid; docs/context-parallel.md says what that leaves out).
        out += [
            (tp, 1, cp, 1, code)
            for tp in tps
            for cp in gathered
            if cp_rule(model, tp, cp) is not None and cp_rule(model, tp, cp, "allgather") is None
        ]
    if False not in allowed.context_parallel and cost.stage != "generation":  # pinned on
        out = [d for d in out if d[2] > 1]
    if model.moe is not None and True in allowed.expert_parallel:
        eps = [ep for ep in range(2, model.moe.num_experts + 1) if ep_rule(model, ep) is None]
        experts = [(tp, pp, 1, ep, 0) for tp, pp, _, _, _ in plain for ep in eps]
        out = experts if False not in allowed.expert_parallel else out + experts  # pinned on: ep > 1 only
    return out


def _ceil_div(a: Any, b: Any) -> Any:
    return -(-a // b)


def candidate_grid(
    cost: StageCostModel, pool_sizes: list[int], allowed: MemoryChoices | None = None
) -> tuple[np.ndarray, ...]:
    """(size, tp, pp, dp, micro_batches, cp, ep, cp method code) columns of every candidate on
    every pool size.

    tp is a power of two inside a node, pp divides the layers, cp (training and inference) is
    a power of two the heads allow, ep (mixture of experts) divides the experts
    (`_valid_degrees`), dp fills the pool with replicas of tp x cp x ep x pp GPUs (up to one
    replica per sample, an ep rank taking 1/ep of a replica's);
    training tries micro-batch sizes 1, 2, 4, ... and the whole share of a replica.
    """
    degrees = np.array(_valid_degrees(cost, allowed or MemoryChoices()), dtype=np.int64).reshape(-1, 5)
    size, tp, pp, cp, ep, method = np.broadcast_arrays(
        np.array(pool_sizes, dtype=np.int64)[:, None], *(degrees[None, :, k] for k in range(5))
    )
    w = cost.workload
    samples = w.samples_per_step // w.mini_batches if cost.stage == "training" else w.samples_per_step
    # Every ep rank needs a sample of its replica's share: ep above the samples would idle ranks.
    keep = (tp * cp * ep * pp <= size) & (ep <= samples)
    size, tp, pp, cp, ep, method = size[keep], tp[keep], pp[keep], cp[keep], ep[keep], method[keep]
    # A replica (each of its ep ranks) without samples would idle: leave its GPUs free.
    dp = np.minimum(size // (tp * cp * ep * pp), samples // ep)
    if cost.stage != "training":
        if cost.stage == "generation":
            return size, tp, pp, dp, np.ones_like(dp), cp, ep, method
        per_replica = _ceil_div(w.samples_per_step, dp)
        return size, tp, pp, dp, _ceil_div(per_replica, w.micro_batch_size * ep), cp, ep, method
    share = _ceil_div(w.samples_per_step // w.mini_batches, dp)
    columns: list[list[np.ndarray]] = [[], [], [], [], [], [], [], []]
    largest = int(share.max()) if share.size else 0
    for b in [*(1 << i for i in range(largest.bit_length())), 0]:
        # b: rows of a replica's micro-batch (an ep rank takes 1/ep of them); 0: the whole share
        pick = (share > b) & (ep <= b) if b else np.ones_like(share, dtype=bool)
        m = _ceil_div(share[pick], b) if b else np.ones(int(pick.sum()), dtype=np.int64)
        picked = (size[pick], tp[pick], pp[pick], dp[pick], m, cp[pick], ep[pick], method[pick])
        for out, col in zip(columns, picked, strict=True):
            out.append(col)
    return tuple(np.concatenate(col) for col in columns)


def _expand(columns: list[np.ndarray], values: list[float]) -> list[np.ndarray]:
    """Every row of `columns` once per value of a new trailing column."""
    reps = len(values)
    out = [np.repeat(c, reps) for c in columns]
    return [*out, np.tile(np.array(values, dtype=float), len(columns[0]))]


def _kv_levels(
    cost: StageCostModel, columns: list[np.ndarray], allowed: MemoryChoices
) -> tuple[list[np.ndarray], np.ndarray]:
    """Generation rows per KV budget: unbounded (if allowed), the fractions of the model-stages'
    room below the whole batch's need, and one maximum-length sequence.

    A budget that does not bind decodes as the unbounded cache does, at the same time with less
    memory: of those, only the smallest (the first of equal ones) is priced, and the unbounded
    row only where every budget binds (the others would be dominated and not listed)."""
    room = stage_room(cost.cluster, cost.calibration)
    tp, pp, dp = (c.astype(float) for c in columns[1:4])  # generation: cp = 1
    ep = columns[6].astype(float)
    full = cost.full_kv_bytes(tp, pp, dp, ep)
    one = np.ceil((cost.workload.prompt_len + cost.workload.response_len.max) * cost.kv_bytes_per_token(tp, pp))
    candidates = [np.floor(room * f) * np.ones_like(full) for f in KV_BUDGET_FRACTIONS] + [one]
    picks = [(level >= one) & (level < full) for level in candidates]
    stacked = np.stack(candidates)
    loose = np.where(np.stack(picks) & ~cost.kv_budget_binds(tp, pp, dp, stacked, ep), stacked, np.inf)
    smallest, some_loose = loose.argmin(axis=0), np.isfinite(loose).any(axis=0)
    rows, levels = [], []
    for i, (pick, level) in enumerate(zip(picks, candidates, strict=True)):
        rows.append(pick & (np.isinf(loose[i]) | (smallest == i)))
        levels.append(np.where(rows[-1], level, 0.0))
    if False in allowed.kv_budget:
        rows.append(~some_loose)
        levels.append(np.full(full.shape, np.inf))
    out = [np.concatenate([c[r] for r in rows]) for c in columns]
    return out, np.concatenate([lv[r] for lv, r in zip(levels, rows, strict=True)])


@dataclass
class _Timed:
    """Distinct layouts times the choices that change the time's formulas (recompute, KV
    budget), each priced once; the other choices follow by arithmetic (`_expand_choices`)."""

    layout: list[np.ndarray]  # index of the distinct layout, tp, pp, dp, micro-batches, cp, ep, cp method
    kv: np.ndarray  # KV budget in bytes (inf: none)
    recompute: np.ndarray
    full_shard: np.ndarray  # parameters sharded across dp x cp (the optimizer with them)
    train_offload: np.ndarray  # training-time offload level (`TRAIN_OFFLOADS`' index)
    host: np.ndarray  # host-memory bytes per GPU of training-time offload
    time: np.ndarray  # seconds (inf where no choice of the row fits alone)
    optimizer_time: np.ndarray  # the share of `time` ZeRO-1 divides by dp x cp
    memory: dict[str, np.ndarray]  # without ZeRO-1 (unless pinned or fully sharded) and token budgets
    token_budget: np.ndarray  # the packed budget's tokens (training), 0 elsewhere
    budget_memory: dict[str, np.ndarray]  # `TOKEN_TERMS` under the packed budget (training; else `memory`'s)


def _blocks(cost: StageCostModel, distinct: list[np.ndarray], allowed: MemoryChoices) -> list[_Block]:
    """The blocks of timed rows of a training or inference model-stage, in order: (which distinct
    layouts, full sharding, training-time offload level). Full sharding is searched where it
    shards something (dp x cp > 1: the cp ranks shard with the replicas) and as FSDP and ZeRO-3
    run it, without pipeline stages (Megatron pipelines shard the optimizer only: ZeRO-1);
    offloading the parameters needs it."""
    every = np.ones(distinct[0].shape, dtype=bool)
    if False not in allowed.full_shard:  # pinned on
        shards = [(every, 1.0)]
    else:
        shards = [(every, 0.0)]
        if True in allowed.full_shard:
            shards.append(((distinct[3] * distinct[5] > 1) & (distinct[2] == 1), 1.0))
    levels = [TRAIN_OFFLOADS.index(t) for t in allowed.train_offload] if cost.stage == "training" else [0]
    return [(rows, shard, float(level)) for rows, shard in shards for level in levels if level < 2 or shard]


#: Rows of the distinct layouts, full sharding (0, 1) and training-time offload level of one block.
_Block = tuple[np.ndarray, float, float]


def _timed_grid(
    cost: StageCostModel, distinct: list[np.ndarray], allowed: MemoryChoices
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(columns, kv budget, recompute, full shard, train offload) of the timed rows: distinct
    (index, tp, pp, dp, m, cp, ep, cp method) rows once per block (`_blocks`) and, in a training block, per recompute
    choice; or per KV budget (generation)."""
    if cost.stage == "generation":
        columns = list(distinct)
        if True in allowed.kv_budget:
            columns, kv = _kv_levels(cost, columns, allowed)
        else:
            kv = np.full(columns[0].shape, np.inf)
        zeros = np.zeros(columns[0].shape)
        return columns, kv, zeros, zeros, zeros
    parts: list[list[np.ndarray]] = []
    for rows, shard, level in _blocks(cost, distinct, allowed):
        block = [c[rows] for c in distinct]
        recompute = np.zeros(len(block[0]))
        if cost.stage == "training":
            *block, recompute = _expand(block, [float(RECOMPUTE_LEVELS.index(r)) for r in allowed.recompute])
        n = len(block[0])
        parts.append([*block, recompute, np.full(n, shard), np.full(n, level)])
    if not parts:  # every block ruled out by the pinned choices
        parts.append([c[:0] for c in distinct] + [np.zeros(0)] * 3)
    *columns, recompute, full_shard, train_offload = (np.concatenate(c) for c in zip(*parts, strict=True))
    return columns, np.full(len(columns[0]), np.inf), recompute, full_shard, train_offload


def _price_timed(cost: StageCostModel, distinct: list[np.ndarray], allowed: MemoryChoices) -> _Timed:
    """Memory of every timed row, and its time where some choice of it fits alone."""
    layout, kv, recompute, full_shard, train_offload = _timed_grid(cost, distinct, allowed)
    tp, pp, dp, m, cp, ep, method = (c.astype(float) for c in layout[1:])
    pinned = cost.stage == "training" and cost.workload.optimizer.shard_across_dp
    zero1 = np.full(tp.shape, pinned) | (full_shard > 0) | (train_offload > 0)
    shard: Any = full_shard if cost.stage != "generation" else 0
    choices: dict[str, Any] = dict(
        recompute=recompute, zero1=zero1, full_shard=shard, train_offload=train_offload, cp=cp
    )
    if cost.model.moe is not None:  # a dense model's ep is 1: its pricing is unchanged
        choices["ep"] = ep
    if method.any():  # all-gather KV rows: their cp terms
        choices["cp_allgather"] = method
    memory = cost.memory_terms(tp, pp, dp, m, kv_budget=kv, **choices)
    memory = {k: np.broadcast_to(v, tp.shape).astype(float) for k, v in memory.items()}
    token_budget, budget_memory = np.zeros(tp.shape), memory
    if cost.stage == "training":
        token_budget = cost.packed_token_budget(dp, m)
        # Priced at the budget, not scaled by its tokens over the rows': the logits term is one chunk of the
        # chunked head whatever the tokens past it, and full recompute's rerun reuses its room.
        at_budget = cost.memory_terms(tp, pp, dp, m, token_budget=token_budget, **choices)
        budget_memory = {k: np.broadcast_to(at_budget[k], tp.shape).astype(float) for k in TOKEN_TERMS if k in memory}
    least = _least_memory(memory, budget_memory, dp * cp, allowed, zero1)
    fits = least <= stage_room(cost.cluster, cost.calibration)
    if cost.stage == "training":
        times = _pipeline_times(cost, distinct, allowed)
    else:
        layout_columns = (tp, pp, dp, m, cp, ep, method)
        times = _fitting_times(cost, layout_columns, fits, kv_budget=kv, full_shard=full_shard, zero1=zero1)
    time = np.where(fits, sum(times.values(), np.zeros(tp.shape)), np.inf)
    optimizer_time = np.where(fits, times["optimizer"], 0.0) if cost.stage == "training" else np.zeros(tp.shape)
    host = sum(cost.host_terms(tp, pp, dp, train_offload, cp, choices.get("ep", 1)).values(), np.zeros(tp.shape))
    return _Timed(
        layout,
        kv,
        recompute,
        full_shard,
        train_offload,
        host,
        time,
        optimizer_time,
        memory,
        token_budget,
        budget_memory,
    )


def _inter(
    cost: StageCostModel, tp: np.ndarray, pp: np.ndarray, dp: np.ndarray, cp: np.ndarray, ep: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Whether a layout's pipeline, its dp group, its tp x cp groups and its tp x ep groups cross
    nodes: a block of contiguous GPUs (an EMU; one pipeline stage's tp x cp x ep ranks) straddles
    nodes when it is larger than a node, or packs unevenly into one."""
    per_node = cost.cluster.gpus_per_node

    def straddles(block: np.ndarray, count: np.ndarray) -> np.ndarray:
        return (block > per_node) | ((per_node % block != 0) & (block * count > per_node))

    emu = tp * cp * ep * pp
    inner = straddles(tp * cp * ep, pp * dp)
    return straddles(emu, dp), emu * dp > per_node, (cp > 1) & inner, (ep > 1) & inner


def _fitting_times(
    cost: StageCostModel, layout: tuple[np.ndarray, ...], fits: np.ndarray, **choices: np.ndarray
) -> dict[str, np.ndarray]:
    """Time terms of the timed rows that fit (zero elsewhere), priced row by row."""
    tp, pp, dp, m, cp, ep, method = (c[fits] for c in layout)
    pp_inter, dp_inter, cp_inter, ep_inter = _inter(cost, tp, pp, dp, cp, ep)
    if cost.stage == "generation":
        del choices["full_shard"]  # generation holds whole parameters (and cp = 1)
    picked: dict[str, np.ndarray] = {k: v[fits] for k, v in choices.items()}
    if cost.model.moe is not None:
        picked.update(ep=ep, ep_inter=ep_inter)
    if cost.stage != "generation":
        picked.update(cp=cp, cp_inter=cp_inter)
        if method.any():
            picked.update(cp_allgather=method)
    out = {}
    for name, value in cost.time_terms(tp, pp, dp, m, pp_inter, dp_inter, **picked).items():
        out[name] = np.zeros(fits.shape)
        out[name][fits] = value
    return out


def _pipeline_times(cost: StageCostModel, distinct: list[np.ndarray], allowed: MemoryChoices) -> dict[str, np.ndarray]:
    """Time terms of every timed row of a training model-stage, in `_timed_grid`'s order: each
    block's distinct layouts once per recompute choice. The recompute choices broadcast over a
    trailing axis, so what does not depend on them is priced once per layout; the rows that do
    not fit are priced too (their time is dropped)."""
    tp, pp, dp, m, cp, ep, method = (c.astype(float)[:, None] for c in distinct[1:])
    recompute = np.array([float(RECOMPUTE_LEVELS.index(r)) for r in allowed.recompute])
    pinned = cost.workload.optimizer.shard_across_dp
    blocks: list[dict[str, np.ndarray]] = []
    for rows, shard, level in _blocks(cost, distinct, allowed):
        pp_inter, dp_inter, cp_inter, ep_inter = _inter(cost, tp[rows], pp[rows], dp[rows], cp[rows], ep[rows])
        sharded, offloaded = np.full(pp_inter.shape, shard), np.full(pp_inter.shape, level)
        zero1 = np.full(pp_inter.shape, pinned) | (sharded > 0) | (offloaded > 0)
        args = (tp[rows], pp[rows], dp[rows], m[rows], pp_inter, dp_inter)
        experts = {"ep": ep[rows], "ep_inter": ep_inter} if cost.model.moe is not None else {}
        if method[rows].any():
            experts["cp_allgather"] = method[rows]
        terms = cost.time_terms(
            *args,
            recompute=recompute[None, :],
            zero1=zero1,
            full_shard=sharded,
            train_offload=offloaded,
            cp=cp[rows],
            cp_inter=cp_inter,
            **experts,
        )
        shape = (pp_inter.shape[0], recompute.size)
        blocks.append({name: np.broadcast_to(value, shape).ravel() for name, value in terms.items()})
    names = list(dict.fromkeys(name for terms in blocks for name in terms))
    sizes = [next(iter(terms.values())).size for terms in blocks]
    return {
        name: np.concatenate([terms.get(name, np.zeros(size)) for terms, size in zip(blocks, sizes, strict=True)])
        if blocks
        else np.zeros(0)
        for name in names or ["optimizer"]
    }


def _least_memory(
    memory: dict[str, np.ndarray],
    budget_memory: dict[str, np.ndarray],
    shards: np.ndarray,
    allowed: MemoryChoices,
    sharded: np.ndarray,
) -> np.ndarray:
    """The smallest footprint any expansion of a row can have (offload moves bytes, not removes
    them); `budget_memory`: the token terms under the packed budget; `shards`: dp x cp, what
    ZeRO-1 divides the optimizer state by; `sharded`: rows whose optimizer state is already divided."""
    total = np.zeros(shards.shape)
    for name, value in memory.items():
        if name == "optimizer" and True in allowed.zero1:
            value = np.where(sharded, value, value / shards)
        if name in budget_memory and True in allowed.token_budget:
            value = np.minimum(value, budget_memory[name])
        total = total + value
    return total


#: Memory terms of a training model-stage that change under a token budget: those that grow
#: with the tokens of a micro-batch (the all-gather method's keys and values among them), and
#: the tied copies, which a rank running its rows as one micro-batch holds only where its
#: backward's end is its peak (`StageCostModel._one_pass_terms`; a budget's packs add up).
TOKEN_TERMS = ("activations", "logits", "cp_kv", "tied_gradients")


def _expand_choices(
    cost: StageCostModel, g: _Timed, allowed: MemoryChoices
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray], tuple[np.ndarray, ...]]:
    """(timed row, time, host bytes) of every allowed choice worth pricing: each timed row once
    per offload choice, in blocks; and the memory terms and other choices (`ListedOptions.choices`) per timed
    row (offload moves bytes, so the terms hold for both).

    Two choices are decided per row before pricing, as one option always dominates the
    other: a token budget has the same time as the fixed rows, so it is taken where its terms
    hold less (fewer tokens, unless the rows run as one micro-batch, whose gradients are not
    held beside its activations: `StageCostModel._one_pass_terms`), and ZeRO-1 over dp x cp > 1 has less optimizer
    memory and a faster update at the same communication (over one rank it is no change).
    A pinned choice is kept as pinned.
    """
    training = cost.stage == "training"
    n = g.time.shape[0]
    token = np.zeros(n, dtype=bool)
    if training:  # the same time either way: the budget where its terms hold less
        held = sum((v for k, v in g.memory.items() if k in g.budget_memory), np.zeros(n))
        token = _decided(allowed.token_budget, sum(g.budget_memory.values(), np.zeros(n)) < held)
    pinned = training and cost.workload.optimizer.shard_across_dp
    zero1 = np.zeros(n, dtype=bool)
    shards = (g.layout[3] * g.layout[5]).astype(float)  # dp x cp: the ranks holding the same weights
    if training and not pinned:  # a fully sharded or offloading row's optimizer is sharded already
        zero1 = _decided(allowed.zero1, shards > 1) & (shards > 1) & (g.full_shard == 0)
        zero1 &= g.train_offload == 0
    terms = {k: np.where(token, g.budget_memory[k], v) if k in g.budget_memory else v for k, v in g.memory.items()}
    time = g.time
    if training and not pinned:
        terms["optimizer"] = np.where(zero1, terms["optimizer"] / shards, terms["optimizer"])
        time = time - np.where(zero1, g.optimizer_time * (1 - 1 / shards), 0.0)
    states = sum((v for k, v in terms.items() if k in RESIDENT_TERMS), np.zeros(n))
    kv = np.where(np.isinf(g.kv), 0.0, g.kv)
    token_budget = np.where(token, g.token_budget, 0.0)
    sharded = (g.full_shard > 0) | (g.train_offload > 0)
    zero1_flag = np.full(n, 1.0) if pinned else np.where(training & sharded, 1.0, zero1.astype(float))
    offloads = [float(o) for o in allowed.offload]
    return (
        np.tile(np.arange(n), len(offloads)),
        np.concatenate([time + (cost.offload_time(states) if o else 0.0) for o in offloads]),
        np.concatenate([g.host + (states if o else 0.0) for o in offloads]),
        terms,
        (kv, g.recompute, token_budget, zero1_flag, g.full_shard, g.train_offload),
    )


def _decided(allowed: tuple[bool, ...], better: np.ndarray) -> np.ndarray:
    """Per row, the choice: the one pinned, or where both are allowed, on where it is `better`."""
    if len(set(allowed)) == 1:
        return np.full(better.shape, allowed[0])
    return better


@dataclass(frozen=True)
class LayoutGrid:
    """The candidate layouts of one model and stage on some pool sizes (`candidate_grid`),
    sorted by pool size, and the distinct ones among them."""

    size: np.ndarray
    """The pool size of each candidate, ascending."""
    distinct: list[np.ndarray]
    """(index, tp, pp, dp, micro_batches, cp, ep, cp method code) of each distinct layout."""
    of_candidate: np.ndarray
    """The distinct layout of each candidate."""


def layout_grid(cost: StageCostModel, pool_sizes: list[int], allowed: MemoryChoices | None = None) -> LayoutGrid:
    """The grid depends on the model's shape and the stage, not on its head: model-stages that
    differ only in their head share it (`allowed`: whether cp is searched)."""
    base = candidate_grid(cost, pool_sizes, allowed)
    order = np.argsort(base[0], kind="stable")
    size, *layout = (c[order].astype(np.int64) for c in base)
    key = np.zeros(size.shape, dtype=np.int64)
    for column in layout:  # one integer per (tp, pp, dp, m, cp, ep, cp method)
        key = key * (int(column.max(initial=0)) + 1) + column
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    return LayoutGrid(size, [np.arange(first.size), *(c[first] for c in layout)], inverse.reshape(-1))


def price_layouts(
    cost: StageCostModel, pool_sizes: list[int], allowed: MemoryChoices | None = None, grid: LayoutGrid | None = None
) -> dict[int, OptionTable]:
    """Price every candidate layout and choice on every pool size, vectorised.

    Time and memory depend on (tp, pp, dp, micro-batches, cp, ep) and the choices, not on the pool
    size: each distinct layout is priced once, and every pool size's table lists its rows.
    `grid`: `layout_grid(cost, pool_sizes, allowed)`, if already made.
    """
    allowed = allowed or MemoryChoices()
    grid = grid or layout_grid(cost, pool_sizes, allowed)
    timed = _price_timed(cost, grid.distinct, allowed)
    rows, total, host, memory, picks = _expand_choices(cost, timed, allowed)
    # Resident and transient bytes of each row, kept or put to sleep (the offload column's blocks).
    split = [(np.broadcast_to(x, timed.time.shape) for x in split_resident(memory, o)) for o in allowed.offload]
    resident, transient = (np.concatenate(c) for c in zip(*split, strict=True))
    of_layout = timed.layout[0][rows].astype(np.int64)
    budget = stage_room(cost.cluster, cost.calibration)
    keep = _worth_listing(of_layout, total, resident, transient, host, budget)
    listed_rows = np.nonzero(keep)[0]
    by_layout = listed_rows[np.argsort(of_layout[listed_rows], kind="stable")]
    counts = np.bincount(of_layout[listed_rows], minlength=grid.distinct[0].size)
    starts = np.cumsum(counts) - counts
    listed = ListedOptions(
        (total, resident, transient),
        host,
        rows,
        np.array([float(o) for o in allowed.offload]),
        tuple(c.astype(np.int64) for c in timed.layout[1:]),
        memory,
        picks,
        by_layout,
        starts,
        counts,
    )
    of_base = grid.of_candidate
    bounds = np.searchsorted(grid.size, [*pool_sizes, np.iinfo(np.int64).max])
    fitting = np.where(resident + transient <= budget, total, np.inf)
    fastest = _fastest_per_size(listed, fitting, of_base, bounds)
    return {
        s: OptionTable(listed, of_base[lo:hi], float(f))
        for s, lo, hi, f in zip(pool_sizes, bounds[:-1], bounds[1:], fastest.tolist(), strict=True)
    }


def _fastest_per_size(
    listed: ListedOptions, fitting: np.ndarray, of_base: np.ndarray, bounds: np.ndarray
) -> np.ndarray:
    """Each pool size's fastest fitting option: the least of its layouts' fastest, its layouts
    (`of_base`, sorted by pool size) being the slice between two of `bounds`."""
    layout_fastest = np.full(listed.counts.size, np.inf)
    if listed.by_layout.size:
        some = listed.counts > 0
        layout_fastest[some] = np.minimum.reduceat(fitting[listed.by_layout], listed.starts[some])
    fastest = np.full(bounds.size - 1, np.inf)
    filled = bounds[1:] > bounds[:-1]
    if filled.any():
        fastest[filled] = np.minimum.reduceat(layout_fastest[of_base], bounds[:-1][filled])
    return fastest


def _worth_listing(
    layout: np.ndarray, time: np.ndarray, resident: np.ndarray, transient: np.ndarray, host: np.ndarray, budget: float
) -> np.ndarray:
    """The choices of one layout worth listing: those that fit alone and that no other choice
    of the same layout beats or equals in time, resident, transient and host bytes at once (so the
    search loses nothing: tp, pp and dp, hence the weight sync, are the same; of equal ones
    the first is kept); for a layout where no choice fits, its smallest footprint only (the
    rejection report's row)."""
    fits = resident + transient <= budget
    keep = np.zeros(layout.size, dtype=bool)
    rows = np.nonzero(fits)[0]
    # Grouped by layout, in row order (the sort is stable): each pair of a layout's rows is
    # compared once, at its distance, and of two equal rows the later one is beaten.
    order = rows[np.argsort(layout[rows], kind="stable")]
    group, t, r, s, h = layout[order], time[order], resident[order], transient[order], host[order]
    beaten = np.zeros(order.size, dtype=bool)
    longest = int(np.bincount(group).max(initial=0))  # the most choices a layout has
    for d in range(1, longest):  # a few choices per layout: a loop over distances
        same = group[d:] == group[:-d]
        t0, t1, r0, r1, s0, s1, h0, h1 = t[:-d], t[d:], r[:-d], r[d:], s[:-d], s[d:], h[:-d], h[d:]
        first_no_worse = same & (t0 <= t1) & (r0 <= r1) & (s0 <= s1) & (h0 <= h1)
        beaten[d:] |= first_no_worse
        second_no_worse = same & (t1 <= t0) & (r1 <= r0) & (s1 <= s0) & (h1 <= h0)
        beaten[:-d] |= second_no_worse & ~first_no_worse  # strictly better somewhere
    keep[order[~beaten]] = True
    lone = np.nonzero(~np.isin(layout, layout[rows]))[0]  # layouts where no choice fits
    total = resident[lone] + transient[lone]
    smallest = lone[np.lexsort((lone, total, layout[lone]))]
    first = np.ones(smallest.size, dtype=bool)
    first[1:] = layout[smallest[1:]] != layout[smallest[:-1]]
    keep[smallest[first]] = True
    return keep

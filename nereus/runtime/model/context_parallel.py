"""Context parallelism: each sequence cut along its tokens over the cp ranks of a replica, which
hold the same weights; attention by one of two methods (`ContextParallel.method`): Ulysses
(all-to-all of heads, bounded by the heads of a tensor rank) or all-gathered keys and values
(Llama 3's context parallelism, bounded by nothing but the sequence length).

A replica of tp x cp ranks (pp = 1) gives cp rank c its runs of columns of every row
(`ContextParallel.runs`, runs differing by at most one column; `sharded_state.even_split`):
under Ulysses the contiguous run `spans(seq)[c]`, under the all-gather method the zigzag of
2 cp runs, runs c and 2 cp - 1 - c. Everything but attention works token by token, so it
runs on those columns alone (tokens and positions taken at them): the embedding, the norms,
the projections, the MLP and the head. Attention needs every key: around its core
(scores, softmax, weighted values) an all-to-all turns q, k and v from [b, columns of this
rank, heads, d] into [b, every column, heads / cp, d] (`_sequence_to_heads`), the core runs
on whole sequences with this rank's share of the heads, and the reverse all-to-all
(`_heads_to_sequence`) brings the output back to this rank's columns with every head. Each is
the other's backward, so the autograd graph is exact. When the KV heads (after tp) do not
split over cp, each query head's KV head is repeated first (GQA run as multi-head attention
inside the core: same numbers, more bytes moved).

All-gather KV (`method` "allgather"): each rank keeps its own columns' queries, all-gathers
the keys and values of every column (`_GatherColumns`; with GQA a tp rank's few KV heads,
so few bytes) and runs attention of its queries against every key under a mask built from
the columns' global order (the packed order when padding needs `Packing`, so each query sees
exactly the keys it sees unsplit), whatever order the ranks hold them in. The backward sums
every rank's gradient of the gathered keys and values and keeps this rank's columns (a
reduce-scatter; on gloo, which has none, an all-reduce and a slice). The zigzag balances
the causal work: contiguous columns would leave the last cp rank (2 cp - 1) / cp^2 of a
sequence's attention, where runs c and 2 cp - 1 - c give every rank 1 / cp
(`StageCostModel.cp_attention_share`).

Whole-sequence facts come from the whole mask, which every cp rank has (the batch is the
replica's): RoPE positions count the real tokens before each column (`positions_from_mask`
over the whole row, then this rank's columns), and padding is handled as the unsplit model
does, by `Packing` (real tokens first, causal attention), applied inside the core to the
whole-sequence q, k and v and undone on its output. The causal mask is therefore global.

Scoring: a token's loss at column i reads the head's output at columns i - 1 and i (the
next-token log-prob of token i comes from position i - 1; the critic's value of token i too).
Each cp rank scores its own runs: the last output column of the run before each one is passed
along (`_PreviousColumns`, an all-gather of each rank's runs' last columns whose backward
returns their gradients to their owners), so the objective sees each run's columns
[start - 1, stop) with the borrowed column's own loss weighted 0.
Per-row quantities (a sequence-mean loss's weights, the normaliser) come from the whole row.
Inference gathers each rank's columns of the result (logits, values or next-token log-probs,
whose targets every rank has) and puts them back in column order on every rank.

Gradients: every cp rank's weight gradient holds its columns' share; the engine sums them over
the dp x cp ranks of each (stage, tensor rank) position in one reduction (`Engine._sync_grads`
over `ParallelGroups.shard_group`), so the sum is the single-process gradient; ZeRO-1 and full
sharding split their rows over those same dp x cp ranks (torchtitan's dp_shard x cp mesh).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nereus.runtime.comm import collectives
from nereus.runtime.model.attention import Packing, grouped_attention
from nereus.runtime.model.tensor_parallel import GroupPlace
from nereus.runtime.model.transformer import Batch, positions_from_mask
from nereus.runtime.state.sharded_state import even_split
from nereus.spec.plan import CpMethod

if TYPE_CHECKING:
    from nereus.runtime.model.losses import HeadOps, Objective
    from nereus.runtime.model.transformer import DecoderPipelineStage


@dataclass(frozen=True)
class ContextParallel(GroupPlace):
    """This rank's place among the cp ranks of its (replica, stage, tensor rank), which split
    each sequence: it holds the rank-th run of columns."""

    method: CpMethod = "ulysses"
    """How attention sees the whole sequence (`StagePlan.cp_method`): `ulysses` (all-to-all of
    heads) or `allgather` (every rank gathers the keys and values of every column)."""

    def spans(self, seq: int) -> list[tuple[int, int]]:
        """(start, stop) of every cp rank's columns of a `seq`-column batch."""
        if seq < self.size:
            raise ValueError(
                f"a batch of {seq} columns cannot be cut over cp={self.size} ranks; use cp <= {seq} or longer sequences"
            )
        return even_split(seq, self.size)

    def runs(self, seq: int) -> list[tuple[tuple[int, int], ...]]:
        """Every cp rank's runs of columns, (start, stop) each, in the order the rank holds them:
        Ulysses one contiguous run per rank (`spans`); all-gather the zigzag of 2 cp runs, rank c
        holding runs c and 2 cp - 1 - c, so under the causal mask each rank does 1 / cp of the
        attention work."""
        if self.method != "allgather" or self.size == 1:
            return [(span,) for span in self.spans(seq)]
        if seq < 2 * self.size:
            raise ValueError(
                f"a batch of {seq} columns cannot be cut into the 2 x cp={self.size} runs of the allgather "
                f"cp method; use cp <= {seq // 2} or longer sequences"
            )
        cut = even_split(seq, 2 * self.size)
        return [(cut[rank], cut[2 * self.size - 1 - rank]) for rank in range(self.size)]

    def columns(self, seq: int) -> list[list[int]]:
        """Every cp rank's columns of a `seq`-column batch, in the order the rank holds them."""
        return [[col for start, stop in runs for col in range(start, stop)] for runs in self.runs(seq)]

    def split(self, mask: torch.Tensor) -> SequenceSplit:
        """The cut of a batch whose whole mask is `mask` [b, seq] (True: real token)."""
        runs = tuple(self.runs(int(mask.shape[1])))
        lengths = tuple(sum(stop - start for start, stop in mine) for mine in runs)
        every = self.columns(int(mask.shape[1]))
        held = torch.tensor(every[self.rank], device=mask.device)
        gathered = torch.tensor([col for columns in every for col in columns], device=mask.device)
        return SequenceSplit(self, lengths, runs, Packing.of(mask), held, gathered)


def check_heads(num_heads: int, tp: int, cp: int) -> None:
    """Ulysses splits the query heads of a tensor rank over the cp ranks: refuse what does not
    divide (KV heads that do not split are repeated per query head, `SequenceSplit.attention`)."""
    local = num_heads // tp
    if local % cp:
        raise ValueError(
            f"cp={cp} must divide the {local} attention heads of a tensor rank ({num_heads} heads over tp={tp}); "
            "choose a cp that divides them"
        )


@dataclass(frozen=True)
class SequenceSplit:
    """One forward's cut of a batch over the cp ranks (`ContextParallel.split`)."""

    cp: ContextParallel
    """The cp ranks the batch is cut over."""
    lengths: tuple[int, ...]
    """Columns of every cp rank, in rank order."""
    runs: tuple[tuple[tuple[int, int], ...], ...]
    """Every cp rank's runs of columns (`ContextParallel.runs`), in rank order."""
    packing: Packing | None
    """The whole rows' packing (`Packing.of` the whole mask); None: none needed."""
    held: torch.Tensor
    """[cols] the columns this rank holds, in its order."""
    gathered: torch.Tensor
    """[seq] every rank's held columns in rank order: the column of each gathered place."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's columns: q [b, cols, heads, d], k/v [b, cols,
        kv heads, d] (RoPE applied) -> [b, cols, heads * d], over every column of the rows."""
        if self.cp.method == "allgather":
            return self._allgather_attention(q, k, v)
        heads, kv_heads = q.shape[2], k.shape[2]
        if kv_heads % self.cp.size:  # whole KV heads cannot be dealt out: one per query head
            k, v = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
        q, k, v = (_AllToAllHeads.apply(t, self, True) for t in (q, k, v))
        if self.packing is not None:
            q, k, v = self.packing.pack(q), self.packing.pack(k), self.packing.pack(v)
        out = grouped_attention(q, k, v, None)
        if self.packing is not None:
            out = self.packing.unpack(out)
        out = out.view(*out.shape[:2], heads // self.cp.size, -1)
        return _AllToAllHeads.apply(out, self, False).flatten(2)

    def _allgather_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This rank's queries against every column's keys and values (all-gathered), masked by
        the columns' global order: the packed order when padding is packed, else the columns'."""
        k, v = (_GatherColumns.apply(t, self) for t in (k, v))
        seq = int(k.shape[1])
        if self.packing is not None:
            order = self.packing.restore.to(q.device)  # [b, seq] packed place of every column
        else:
            order = torch.arange(seq, device=q.device).unsqueeze(0)
        queries = order[:, self.held.to(q.device)]
        keys = order[:, self.gathered.to(q.device)]
        mask = queries[:, None, :, None] >= keys[:, None, None, :]  # [b | 1, 1, cols, seq]
        return grouped_attention(q, k, v, mask)


def _sequence_to_heads(x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """[b, this rank's columns, H, d] -> [b, every column, H / cp, d] (this rank's heads)."""
    cp = split.cp
    batch, cols, heads, dim = x.shape
    share = heads // cp.size
    send = x.reshape(batch, cols, cp.size, share, dim).permute(2, 0, 1, 3, 4).contiguous()
    sizes = [batch * length * share * dim for length in split.lengths]
    received = torch.empty(sum(sizes), dtype=x.dtype, device=x.device)
    collectives.all_to_all(received, send.view(-1), sizes, [send[0].numel()] * cp.size, cp.group)
    parts = received.split(sizes)
    pieces = [part.view(batch, length, share, dim) for part, length in zip(parts, split.lengths, strict=True)]
    return torch.cat(pieces, dim=1)


def _heads_to_sequence(y: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """[b, every column, H / cp, d] -> [b, this rank's columns, H, d] (the inverse)."""
    cp = split.cp
    batch, _, share, dim = y.shape
    cols = split.lengths[cp.rank]
    send = torch.cat([piece.reshape(-1) for piece in y.split(list(split.lengths), dim=1)])
    sizes = [batch * length * share * dim for length in split.lengths]
    received = torch.empty(cp.size * batch * cols * share * dim, dtype=y.dtype, device=y.device)
    collectives.all_to_all(received, send, [batch * cols * share * dim] * cp.size, sizes, cp.group)
    return received.view(cp.size, batch, cols, share, dim).permute(1, 2, 0, 3, 4).reshape(batch, cols, -1, dim)


class _AllToAllHeads(torch.autograd.Function):
    """`_sequence_to_heads` forward and `_heads_to_sequence` backward (`to_heads`), or the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: SequenceSplit, to_heads: bool) -> torch.Tensor:
        ctx.split, ctx.to_heads = split, to_heads
        return _sequence_to_heads(x, split) if to_heads else _heads_to_sequence(x, split)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        undo = _heads_to_sequence if ctx.to_heads else _sequence_to_heads
        return undo(grad.contiguous(), ctx.split), None, None


class _GatherColumns(torch.autograd.Function):
    """x [b, this rank's columns, ...] -> [b, every column, ...] (all-gather in column order);
    the backward sums the whole gradient over the cp ranks and keeps this rank's columns (the
    reduce-scatter of the gathered tensor's gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
        ctx.split = split
        return gather_columns(split.cp, x, split.lengths)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        split: SequenceSplit = ctx.split
        cp, widest = split.cp, max(split.lengths)
        padded = grad.new_zeros((cp.size, grad.shape[0], widest, *grad.shape[2:]))
        for rank, piece in enumerate(grad.split(list(split.lengths), dim=1)):
            padded[rank, :, : piece.shape[1]] = piece
        mine = collectives.reduce_scatter(padded.view(-1), cp.group, cp.size, cp.rank)
        own = mine.view(padded.shape[1:])[:, : split.lengths[cp.rank]]
        return own.contiguous(), None


class _PreviousColumns(torch.autograd.Function):
    """x [b, cols, ...] (this rank's runs, `SequenceSplit.runs`) -> every run with the last column
    of the run before it (another rank's, or this one's) prepended, the first run of the row as it
    is; the backward hands each borrowed column's gradient back to its owner. Every cp rank's
    output enters its loss, so every rank runs the backward's all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
        ctx.split = split
        owners = _run_owners(split)
        # [b, runs, ...] per rank
        lasts = collectives.all_gathered(x[:, _run_ends(split, split.cp.rank)], split.cp.group)
        pieces = []
        for (start, stop), offset in zip(split.runs[split.cp.rank], _run_offsets(split, split.cp.rank), strict=True):
            if start > 0:
                rank, run = owners[start - 1]
                pieces.append(lasts[rank][:, run : run + 1])
            pieces.append(x[:, offset : offset + stop - start])
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        split: SequenceSplit = ctx.split
        me, owners = split.cp.rank, _run_owners(split)
        own, borrowed, at = [], [], 0
        for start, stop in split.runs[me]:
            if start > 0:
                borrowed.append(grad[:, at : at + 1])
                at += 1
            else:
                borrowed.append(torch.zeros_like(grad[:, :1]))
            own.append(grad[:, at : at + stop - start])
            at += stop - start
        parts = collectives.all_gathered(torch.cat(borrowed, dim=1), split.cp.group)  # [b, runs, ...] per rank
        result = torch.cat(own, dim=1).contiguous().clone()
        ends = _run_ends(split, me)
        for (_, stop), end in zip(split.runs[me], ends, strict=True):
            if stop in owners:  # the run starting at `stop` borrowed this run's last column
                rank, run = owners[stop]
                result[:, end : end + 1] += parts[rank][:, run : run + 1]
        return result, None


def _run_offsets(split: SequenceSplit, rank: int) -> list[int]:
    """Where each of `rank`'s runs starts among its held columns."""
    return list(itertools.accumulate((stop - start for start, stop in split.runs[rank][:-1]), initial=0))


def _run_ends(split: SequenceSplit, rank: int) -> list[int]:
    """The held-column index of the last column of each of `rank`'s runs."""
    return [end - 1 for end in itertools.accumulate(stop - start for start, stop in split.runs[rank])]


def _run_owners(split: SequenceSplit) -> dict[int, tuple[int, int]]:
    """(rank, index among its runs) of the run holding each run's first and last column: keyed by
    the start column and by the last column (start and stop - 1 of one run map to the same)."""
    owners: dict[int, tuple[int, int]] = {}
    for rank, runs in enumerate(split.runs):
        for index, (start, stop) in enumerate(runs):
            owners[start] = owners[stop - 1] = (rank, index)
    return owners


def stage_forward(
    stage: DecoderPipelineStage,
    cp: ContextParallel,
    part: Batch,
    device: torch.device,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The (single) stage's output on this rank's columns of `part`: [b, cols, vocab / tp] or [b, cols];
    given a `reduce`, that of it (an LM head's final hidden states [b, cols, hidden]) inside the forward."""
    mask = part.mask().to(device)
    split = cp.split(mask)
    positions = positions_from_mask(mask)[:, split.held]
    tokens = part.tokens[:, split.held.cpu()].to(device)
    return stage(tokens, mask, positions, split=split, reduce=reduce)


def chunk_loss(
    cp: ContextParallel,
    objective: Objective,
    output: torch.Tensor,
    part: Batch,
    weights: torch.Tensor,
    normalizer: float,
    head: HeadOps,
) -> torch.Tensor:
    """This rank's share of the normalised loss of `part` from its columns' `output`; `weights`
    [b, seq] are the objective's weights of the whole `part` (a row's weights may depend on
    the whole row). Each run of columns is scored with the column before it borrowed (its
    loss weighted 0: its owner scores it). Summed over the cp ranks it is the unsplit loss."""
    split = cp.split(part.mask())
    extended = _PreviousColumns.apply(output, split)
    total, at = output.new_zeros((), dtype=torch.float32), 0
    for start, stop in split.runs[cp.rank]:
        first = max(start - 1, 0)
        scored = weights[:, first:stop].clone()
        if start > 0:
            scored[:, 0] = 0.0  # the borrowed column is its owner's to score
        piece = extended[:, at : at + stop - first]
        at += stop - first
        total = total + (objective.token_losses(piece, part.columns(first, stop), head) * scored).sum()
    return total / normalizer


def gather_columns(cp: ContextParallel, chunk: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Every cp rank's [b, lengths[rank], ...] columns in rank order: [b, sum(lengths), ...] on every rank."""
    widest = max(lengths)
    padded = chunk.new_zeros((chunk.shape[0], widest, *chunk.shape[2:]))
    padded[:, : chunk.shape[1]] = chunk
    parts = collectives.all_gathered(padded, cp.group)
    return torch.cat([part[:, :length] for part, length in zip(parts, lengths, strict=True)], dim=1)


def _in_column_order(cp: ContextParallel, chunk: torch.Tensor, held: list[list[int]]) -> torch.Tensor:
    """Every cp rank's per-column `chunk` of its columns `held[rank]`, gathered and put in column order."""
    gathered = gather_columns(cp, chunk, [len(columns) for columns in held])
    where = torch.tensor([col for columns in held for col in columns], device=chunk.device)
    return gathered[:, where.argsort()]


def whole_columns(cp: ContextParallel, chunk: torch.Tensor, seq: int) -> torch.Tensor:
    """A per-column result of this rank's columns of a `seq`-column batch, gathered whole."""
    return _in_column_order(cp, chunk, cp.columns(seq))


def next_token_log_probs(
    cp: ContextParallel, hidden: torch.Tensor, tokens: torch.Tensor, head: HeadOps
) -> torch.Tensor:
    """[b, seq - 1] log p(tokens[:, i + 1]) from this rank's columns' final hidden states: each rank scores
    the positions it holds that have a next token (every rank has the tokens), gathered whole."""
    seq = int(tokens.shape[1])
    every = cp.columns(seq)
    held = [[col for col in columns if col < seq - 1] for columns in every]
    local = torch.tensor([index for index, col in enumerate(every[cp.rank]) if col < seq - 1], device=hidden.device)
    targets = torch.tensor(held[cp.rank], device=tokens.device) + 1
    scores = head.token_log_probs(hidden[:, local], tokens[:, targets])
    return _in_column_order(cp, scores.float(), held)

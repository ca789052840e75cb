"""How a training step splits one replica's rows into micro-batches.

Without a token budget, into `count` contiguous runs of rows whose sizes differ by at most one
(every micro-batch as wide as the batch). With a token budget (`StagePlan.token_budget`, the
planner's `micro_batch_tokens`), rows are packed: a micro-batch keeps only the columns where
one of its rows has a real token, and holds at most `token_budget` tokens counted as rows
times those columns (the [rows, columns] tensor its activations are sized by). Rows are taken
in the order of their first and last real column, so rows of similar spans share a
micro-batch, and a micro-batch is closed when the next row would pass the budget (verl's
`ppo_max_token_len_per_gpu`, over padded rather than concatenated rows). The plan's
micro-batch count is a floor: the fullest micro-batches are halved until there are that many.

The loss is normalised over the whole batch, so the gradient is the same sum of token
gradients under any split (up to the order of the floating-point sums). Columns a
micro-batch cuts off hold no real token of its rows, and a real token's forward reads only
the real tokens before it in its row, so a packed micro-batch computes every real token's
output from the same inputs as the unpacked batch.
"""

from __future__ import annotations

import torch

from nereus.runtime.model.transformer import Batch
from nereus.runtime.state.sharded_state import even_split


def split_micro_batches(rows: Batch, count: int, token_budget: int | None = None) -> list[Batch]:
    """`rows` as micro-batches: `count` equal runs, or packed to `token_budget` tokens (at least `count`)."""
    if not 1 <= count <= rows.num_rows:
        raise ValueError(f"{rows.num_rows} rows per replica cannot make {count} non-empty micro-batches")
    if token_budget is None:
        return [rows.rows(start, stop) for start, stop in even_split(rows.num_rows, count)]
    if token_budget <= 0:
        raise ValueError(f"token_budget must be > 0 tokens, got {token_budget}")
    spans = row_spans(rows.mask())
    groups = _at_least(_packed_groups(spans, token_budget), spans, count)
    micro_batches = []
    for group in groups:
        start = min(spans[row][0] for row in group)
        stop = max(spans[row][1] for row in group)
        micro_batches.append(rows.take(torch.tensor(sorted(group), dtype=torch.long)).columns(start, stop))
    return micro_batches


def row_spans(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(first, last + 1) real column of every row of a [rows, seq] mask ((0, 0): no real token)."""
    real = mask.bool()
    columns = torch.arange(real.shape[1])
    first = torch.where(real, columns, real.shape[1]).min(dim=1).values
    last = torch.where(real, columns, -1).max(dim=1).values
    return [(int(a), int(b) + 1) if b >= 0 else (0, 0) for a, b in zip(first.tolist(), last.tolist(), strict=True)]


def group_tokens(group: list[int], spans: list[tuple[int, int]]) -> int:
    """Tokens of a micro-batch of rows `group`: its rows times the columns their real tokens span."""
    live = [spans[row] for row in group if spans[row][1] > spans[row][0]]
    if not live:
        return 0
    return len(group) * (max(stop for _, stop in live) - min(start for start, _ in live))


def _packed_groups(spans: list[tuple[int, int]], budget: int) -> list[list[int]]:
    """Rows in order of their spans, each group closed when the next row would pass `budget`."""
    groups: list[list[int]] = []
    for row in sorted(range(len(spans)), key=lambda r: (spans[r], r)):
        length = spans[row][1] - spans[row][0]
        if length > budget:
            raise ValueError(
                f"a row of {length} tokens (padding inside it included) is longer than the plan's "
                f"token_budget of {budget}; raise token_budget to at least {length}"
            )
        if groups and group_tokens([*groups[-1], row], spans) <= budget:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def _at_least(groups: list[list[int]], spans: list[tuple[int, int]], count: int) -> list[list[int]]:
    """`groups` with the fullest halved (by rows, in span order) until there are `count`."""
    while len(groups) < count:
        fullest = max((g for g in groups if len(g) > 1), key=lambda g: group_tokens(g, spans))
        at, half = groups.index(fullest), len(fullest) // 2
        groups[at : at + 1] = [fullest[:half], fullest[half:]]
    return groups

"""The closed-form continuous-batching decode against the iteration-by-iteration engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from nereus.cost.continuous_batching import (
    decode_profile,
    mean_context,
    priced_decode,
    quantile_batch,
    reference_runs,
    simulate_continuous_batching,
)
from nereus.spec.workload import ResponseLengths

pytestmark = pytest.mark.logic

#: The closed form against the reference engine's mean over arrival orders, on this domain.
TOLERANCE = 0.10
#: Arrival orders the reference runs per case: the closed form prices the expectation over
#: where the longest response falls in the order, and one order alone can sit 16% either side
#: of that mean (the CI case below runs 227-307 s over 40 orders).
ORDERS = 4


@st.composite
def cases(draw: st.DrawFn) -> tuple[ResponseLengths, int, int, int, tuple[float, float, float, float]]:
    # RL responses: at least 64 tokens, with a spread (a tail ten-odd times the median at most).
    median = draw(st.integers(64, 400))
    p99 = draw(st.integers(median * 11 // 10, median * 12))
    lengths = ResponseLengths(median=median, p99=p99, max=draw(st.integers(p99, p99 * 3)))
    prompt, n = draw(st.integers(8, 1024)), draw(st.integers(2, 96))
    # From six sequences of the longest kind up to well past the whole batch (below six,
    # admission granularity and preemption dominate: docs/cost-model-memory.md records that error).
    share = draw(st.floats(0.0, 1.0))
    capacity = int((prompt + lengths.max) * (6 + share * n))
    # Per iteration: weights read (1), KV read per token, dense compute per running sequence, attention per token.
    costs = (1.0, draw(st.floats(1e-5, 1e-3)), draw(st.floats(1e-3, 0.1)), draw(st.floats(1e-6, 1e-4)))
    return lengths, prompt, n, capacity, costs


def iteration_cost(weights: float, kv: float, dense: float, attention: float):
    def cost(running, tokens):  # memory- or compute-bound, whichever is slower, plus a fixed cost
        return np.maximum(dense * running + attention * tokens, weights + kv * tokens) + 0.1

    return cost


def relative_error(lengths: ResponseLengths, prompt: int, n: int, capacity: int, costs) -> float:
    cost = iteration_cost(*costs)
    runs = reference_runs(lengths, prompt, n, capacity, lambda r, t: float(cost(r, t)), ORDERS)
    longest = float(max(quantile_batch(lengths, n, 0)))
    fast = float(priced_decode(decode_profile(lengths, prompt, n, capacity, longest), cost))
    return fast / float(np.mean([run.time_s for run in runs])) - 1


@pytest.mark.slow
# Seeded: CI runs the same 25 cases on every machine (derandomize=True seeds from the test's
# digest, which changed with the checkout path).
@seed(20261202)
@settings(max_examples=25, deadline=None, database=None)
@given(cases())
def test_closed_form_within_tolerance_of_reference(case) -> None:
    assert abs(relative_error(*case)) <= TOLERANCE, case


def test_many_preemptions_case_found_by_ci() -> None:
    # 68 preemptions on arrival order 0: the closed form once priced it 20% over that order
    # (it had the longest response wait half the saturated phase wherever it arrived).
    lengths = ResponseLengths(median=64, p99=159, max=237)
    costs = (1.0, 6.103515625e-05, 0.015625, 6.103515625e-05)
    assert abs(relative_error(lengths, 8, 71, 1470, costs)) <= TOLERANCE


def test_unbounded_budget_runs_the_longest_response() -> None:
    lengths = ResponseLengths(median=100, p99=400, max=1000)
    iterations, running, _ = decode_profile(lengths, 50, 64, math.inf, 380.0)
    assert iterations.sum() == pytest.approx(380.0)
    assert running[0] == pytest.approx(64 * 1.0, rel=0.05)  # nearly all still running at the start


def test_small_budget_is_slower_and_holds_at_most_its_tokens() -> None:
    lengths = ResponseLengths(median=300, p99=1500, max=3000)
    free = decode_profile(lengths, 256, 128, math.inf, 1400.0)
    tight = decode_profile(lengths, 256, 128, 4 * (256 + 3000), 1400.0)
    assert tight[0].sum() > 1.5 * free[0].sum()
    assert tight[2].max() <= 4 * (256 + 3000)


def test_reference_refuses_a_budget_without_room_for_one_sequence() -> None:
    with pytest.raises(ValueError, match="cannot hold one"):
        simulate_continuous_batching([10, 20], 5, 24, lambda r, t: 1.0)


#: Response lengths of the monotonicity grid: equal lengths (the batch peaks at once), a narrow
#: spread, RL's long tail, and a tail capped near the median.
GRID_LENGTHS = (
    ResponseLengths(median=500, p99=500, max=500),
    ResponseLengths(median=200, p99=220, max=240),
    ResponseLengths(median=300, p99=1500, max=3000),
    ResponseLengths(median=64, p99=700, max=800),
)
#: Iteration costs (weights, kv, dense, attention): memory-bound, compute-bound, per iteration only.
GRID_COSTS = ((1.0, 1e-4, 1e-3, 1e-5), (0.0, 0.0, 0.01, 0.0), (0.0, 1e-4, 0.0, 0.0), (1.0, 0.0, 0.0, 0.0))


def grid_budgets(lengths: ResponseLengths, prompt: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Budgets from one maximum-length sequence to past the unbounded cache's peak demand (finer
    near the peak), and whether each holds the whole batch at its time-averaged context."""
    free = decode_profile(lengths, prompt, n, math.inf, float(lengths.max))
    peak = float(free[2].max())  # the unbounded cache's fullest slice
    budgets = np.unique(
        np.concatenate([np.geomspace(prompt + lengths.max, 1.2 * peak, 60), np.linspace(0.5, 1, 201) * peak])
    )
    budgets = budgets[budgets >= prompt + lengths.max]
    holds_batch = budgets - prompt / 2 >= n * mean_context(lengths, prompt)
    return budgets, holds_batch


@pytest.mark.parametrize("lengths", GRID_LENGTHS, ids=lambda x: f"{x.median}-{x.p99}-{x.max}")
@pytest.mark.parametrize("prompt", [16, 256, 2048])
@pytest.mark.parametrize("n", [8, 64, 300])
def test_a_budget_that_holds_the_batch_is_never_faster_and_more_is_never_slower(
    lengths: ResponseLengths, prompt: int, n: int
) -> None:
    """A budget that holds the whole batch at its time-averaged context but not at its peak: the
    decode time is at least the unbounded cache's and never grows with the budget, for iteration
    costs memory- or compute-bound or fixed per iteration. (It once priced an equal-length batch
    at 0.87x the unbounded time at 90% of its peak: the sequences were taken to share the cache at
    their time-averaged context, while equal lengths peak together.) With equal lengths, every
    budget is at least the unbounded time."""
    longest = float(lengths.max)
    budgets, holds_batch = grid_budgets(lengths, prompt, n)
    free = decode_profile(lengths, prompt, n, math.inf, longest)
    profile = decode_profile(lengths, prompt, np.full(budgets.size, n), budgets, longest)
    if lengths.sigma < 0.05:  # equal or narrow lengths peak near n (prompt + max): the case is tested
        assert holds_batch.sum() >= 3, holds_batch.sum()
    for costs in GRID_COSTS:
        cost = iteration_cost(*costs)
        unbounded = float(priced_decode(free, cost))
        times = priced_decode(profile, cost)
        checked = holds_batch if lengths.sigma > 0 else np.ones(budgets.size, dtype=bool)
        faster = budgets[checked & (times < unbounded * (1 - 1e-12))]
        assert faster.size == 0, (costs, faster / float(free[2].max()))
        late = times[holds_batch]
        grows = np.nonzero(np.diff(late) > 1e-12 * late[1:])[0]
        assert grows.size == 0, (costs, budgets[holds_batch][grows], late[grows], late[grows + 1])


@pytest.mark.parametrize(
    "lengths",
    [
        ResponseLengths(median=500, p99=500, max=500),
        ResponseLengths(median=200, p99=220, max=240),
    ],
    ids=lambda x: f"{x.median}-{x.p99}-{x.max}",
)
@pytest.mark.parametrize("prompt", [16, 256])
@pytest.mark.parametrize("n", [8, 32])
def test_a_budget_that_holds_the_batch_matches_the_reference(lengths: ResponseLengths, prompt: int, n: int) -> None:
    """Budgets that hold an equal- or narrow-length batch at its time-averaged context but not at
    its peak: the closed form within TOLERANCE of the reference engine (sized as a saturated queue,
    200 / 220 / 240 was priced up to 10.5% off here). Wider spreads err more in this band, all
    under the reference: median 300 / p99 400 / max 450 with 32 sequences up to 11%, 100 / 150 /
    300 up to 13.5% (the queue sizing: up to 23% there)."""
    budgets, holds_batch = grid_budgets(lengths, prompt, n)
    inside = budgets[holds_batch]
    assert inside.size >= 3
    for capacity in inside[[0, inside.size // 2, -1]]:
        for costs in ((1.0, 1e-4, 1e-2, 1e-5), (1.0, 1e-5, 1e-3, 1e-6)):
            assert abs(relative_error(lengths, prompt, n, int(capacity), costs)) <= TOLERANCE, (capacity, costs)

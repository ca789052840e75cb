"""The closed-form continuous-batching decode against the iteration-by-iteration engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from nereus.cost.continuous_batching import (
    decode_profile,
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

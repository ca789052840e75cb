"""The CP-SAT peak windows: never slower, never higher, their peak is the evaluator's replay,
and a window covering a small schedule reaches CP-SAT's least peak at its makespan."""

from __future__ import annotations

import random

import pytest

from nereus.solver.pipeline.evaluate import evaluate
from nereus.solver.pipeline.model import Instance, ModelTimes, build_instance, fused_problem
from nereus.solver.pipeline.search import SearchConfig, search_fused
from nereus.solver.pipeline.starts import starting_schedules

pytestmark = pytest.mark.logic


def _instance(seed: int, stages: int, microbatches: int) -> Instance:
    """Integer times with a longest op of 10 and activations of 1 or 2 (CP-SAT's scaling is exact)."""
    rng = random.Random(seed)

    def model(name: str, count: int) -> ModelTimes:
        def times(top: int) -> tuple[float, ...]:
            return tuple(float(rng.randint(1, top)) for _ in range(count))

        backward = list(times(9))
        backward[0] = 10.0
        return ModelTimes(name, microbatches, times(5), tuple(backward), times(2))

    return build_instance(fused_problem(model("actor", stages), model("critic", stages), p2p_latency=seed % 2))


def _fastest_start(inst: Instance) -> list[list[int]]:
    _, starts = starting_schedules(inst, ("actor", "critic"))
    return starts[0].orders


@pytest.mark.parametrize("seed", range(3))
def test_windows_never_slow_or_raise_and_report_their_replay(seed: int) -> None:
    pytest.importorskip("ortools")
    from nereus.solver.pipeline.window import lower_peak

    inst = _instance(seed, 4, 8)
    orders = _fastest_start(inst)
    before = evaluate(inst, orders)
    out = lower_peak(inst, orders, time_limit_s=1.0, seed=seed, workers=1)
    replay = evaluate(inst, out.orders)
    assert replay.ok
    assert replay.makespan <= before.makespan * (1 + 1e-9)
    assert replay.makespan == pytest.approx(out.makespan, rel=1e-12)
    assert replay.max_peak_memory == out.peak <= before.max_peak_memory


@pytest.mark.parametrize("seed", [1, 3, 4])
def test_a_window_over_a_small_schedule_reaches_the_least_peak(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 + 2 stages, 3 micro-batches: 24 ops, fewer than the smallest window, so one window
    frees them all and re-solves the whole schedule at its makespan (given the time CP-SAT
    needs to prove it; these seeds prove in under a second)."""
    pytest.importorskip("ortools")
    from nereus.solver.pipeline import window
    from nereus.solver.pipeline.exact import solve_memory_at

    inst = _instance(seed, 2, 3)
    assert inst.num_ops <= window.WINDOW_OPS[0]
    orders = _fastest_start(inst)
    least = solve_memory_at(inst, orders, time_limit_s=30, workers=1)
    assert least.status == "optimal" and least.peak_memory is not None
    assert least.peak_memory < evaluate(inst, orders).max_peak_memory  # there is something to find
    monkeypatch.setattr(window, "WINDOW_SOLVE_S", 30.0)
    out = window.lower_peak(inst, orders, time_limit_s=60.0, target=least.peak_memory, workers=1)
    assert out.peak == pytest.approx(least.peak_memory)
    assert out.makespan <= evaluate(inst, orders).makespan * (1 + 1e-9)


def test_the_search_gives_the_windows_their_share() -> None:
    pytest.importorskip("ortools")
    actor = ModelTimes.uniform("actor", 4, 8, 3.0, 6.0, 2.0)
    critic = ModelTimes.uniform("critic", 4, 8, 1.0, 2.0, 1.0)
    result = search_fused(actor, critic, SearchConfig(time_limit_s=2.0, seeds=1, window_share=0.5))
    solved, kept, before = result.windows
    assert kept <= solved and result.evaluation.max_peak_memory <= before
    assert result.evaluation.ok and result.evaluation.makespan <= result.greedy.makespan * (1 + 1e-9)
    # With an iteration budget (a run that must not depend on time) no window runs.
    fixed = search_fused(actor, critic, SearchConfig(time_limit_s=2.0, seeds=1, max_iterations=200))
    assert fixed.windows[:2] == (0, 0)

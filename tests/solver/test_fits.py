"""`fits` and `CountProbe`: whether a request holds any plan, judged by outcome against exhaustive
enumeration (of one pool's rows, and of whole small requests), and on the 70B refusals."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_plan_search import NO_TRAIN_OFFLOAD, cases, ppo_request

from nereus.solver.plan_search import (
    CountProbe,
    PlanRequest,
    fits,
    front_rows,
    pool_fits,
    reference_search,
    resized,
    search,
)
from nereus.spec.presets import cluster_preset, models_for, workload_preset

pytestmark = pytest.mark.logic

#: Random pools `test_pool_fits_matches_every_assignment` draws.
POOLS = 4000


def every_assignment_fits(stages: list[np.ndarray], budget: float, host_budget: float) -> bool:
    """Whether some row per model-stage (rows: transient, resident, host) fits, each assignment
    of the product tried: resident summed plus the largest transient within `budget`, host
    summed within `host_budget`."""
    resident, transient, host = np.zeros(1), np.zeros(1), np.zeros(1)
    for rows in stages:
        resident = (resident[:, None] + rows[None, :, 1]).ravel()
        transient = np.maximum(transient[:, None], rows[None, :, 0]).ravel()
        host = (host[:, None] + rows[None, :, 2]).ravel()
    return bool(np.any((resident + transient <= budget) & (host <= host_budget)))


def random_pool(rng: random.Random) -> tuple[list[np.ndarray], float, float]:
    """1-5 model-stages of 1-6 rows: small integers (ties and exact fits), offload-like rows (the
    states split between GPU and host: GPU bytes saved cost host bytes, which weighted sums
    bound loosely) or any floats; budgets from just under to well over the least each needs."""
    kind = rng.choice(["integers", "offload", "floats"])
    stages = []
    for _ in range(rng.randint(1, 5)):
        rows = []
        for _ in range(rng.randint(1, 6)):
            if kind == "integers":
                rows.append([rng.randint(0, 6), rng.randint(0, 8), rng.randint(0, 6)])
            elif kind == "offload":
                states, kept = rng.uniform(1, 10), rng.choice([0.0, 0.25, 0.5, 1.0])
                rows.append([rng.uniform(0, 4), states * kept + rng.uniform(0, 1), states * (1 - kept)])
            else:
                rows.append([rng.uniform(0, 5), rng.uniform(0, 5), rng.uniform(0, 5)])
        stages.append(np.array(rows, dtype=float))
    least = sum(s[:, 1].min() for s in stages) + max(s[:, 0].min() for s in stages)
    budget = least * rng.uniform(0.9, 1.8)
    host_budget = sum(s[:, 2].min() for s in stages) * rng.uniform(0.9, 3) + rng.choice([0, 1])
    if kind == "integers":
        return stages, float(round(budget)), float(round(host_budget))
    return stages, budget, host_budget


def test_pool_fits_matches_every_assignment() -> None:
    """A pool's answer (`pool_fits` on each model-stage's `front_rows`) is the answer of trying
    every assignment, on random pools of both answers."""
    rng = random.Random(0)
    verdicts = []
    for case in range(POOLS):
        stages, budget, host_budget = random_pool(rng)
        verdicts.append(every_assignment_fits(stages, budget, host_budget))
        assert pool_fits([front_rows(rows) for rows in stages], budget, host_budget) == verdicts[-1], case
    assert POOLS // 4 < sum(verdicts) < POOLS * 3 // 4


def test_front_rows_keeps_what_no_row_covers() -> None:
    rows = np.array([[1.0, 5, 5], [1, 5, 5], [2, 5, 5], [2, 4, 6], [0, 9, 9], [3, 1, 1], [3, 1, 0]])
    assert front_rows(rows).tolist() == [[0, 9, 9], [1, 5, 5], [2, 4, 6], [3, 1, 0]]
    assert front_rows(np.zeros((0, 3))).shape == (0, 3)


@pytest.mark.slow
@pytest.mark.parametrize("context_parallel", [False, True])
def test_fits_matches_exhaustive_enumeration(context_parallel: bool) -> None:
    """Random small requests (one and two pools, host memory binding in some, context
    parallelism searched or not): `fits` says yes exactly where `reference_search`, which scores
    every assignment of every placement, finds a plan."""
    verdicts = []
    for chunk in range(2):
        for seed, request in cases(chunk, 60, cp=context_parallel):
            verdicts.append(bool(reference_search(request).candidates))
            assert fits(request) == verdicts[-1], seed
    assert 10 < sum(verdicts) < len(verdicts) - 10  # both answers are tested


def probe_answers(request: PlanRequest, largest: int) -> list[int]:
    probe = CountProbe.up_to(request, largest)
    return [n for n in range(1, largest + 1) if probe.fits(n)]


def test_70b_counts_that_fit() -> None:
    """Llama-3.3-70B on H100s: the counts up to 16 (24 without training-time offload) that hold a
    plan, as the first-fit search that `fits` was before said them (it took a minute to prove 9
    GPUs hold no PPO plan). `fits` on each count's own request agrees, and so does `search`
    where it is quick (it finds the plans; on a count without one, where host memory binds, its
    capped passes take long)."""
    request = ppo_request("llama-3.3-70b", 8)
    assert probe_answers(request, 16) == list(range(10, 17))
    assert [fits(resized(request, n)) for n in (8, 9, 10, 16)] == [False, False, True, True]
    assert all(search(resized(request, n)).candidates for n in (10, 16))
    pinned = ppo_request("llama-3.3-70b", 8, choices=NO_TRAIN_OFFLOAD)
    assert probe_answers(pinned, 24) == list(range(20, 25))
    assert [bool(search(resized(pinned, n)).candidates) for n in (16, 19, 20)] == [False, False, True]
    workload = workload_preset("grpo", actor="llama-3.3-70b")
    grpo = PlanRequest(cluster_preset("h100", 8), models_for(workload, None), workload, 8)
    assert probe_answers(grpo, 24) == list(range(6, 25))
    assert not search(resized(grpo, 5)).candidates and search(resized(grpo, 6)).candidates


def test_a_probe_answers_as_each_count_alone() -> None:
    """One pricing for every count (`CountProbe.up_to`) answers as pricing each count on its own
    request (`fits`), on random requests."""
    for seed, request in cases(0, 12):
        largest = min(request.cluster.num_gpus, 10)
        probe = CountProbe.up_to(request, largest)
        for n in range(1, largest + 1):
            assert probe.fits(n) == fits(resized(request, n)), (seed, n)

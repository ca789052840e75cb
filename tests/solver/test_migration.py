"""The long-tail generation simulator: decode timing, destinations, mechanism, threshold sweep."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from repo_paths import EXAMPLES

from nereus.solver.migration import (
    THRESHOLDS,
    GenerationProfile,
    decode_finish_times,
    generation_profile,
    run_batch,
    sample_lengths,
    sweep_thresholds,
)
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.workload import ResponseLengths

pytestmark = pytest.mark.logic

EXAMPLE = EXAMPLES / "plan-tiny-ppo-4rank.yaml"

PROFILE = GenerationProfile(
    num_instances=8,
    samples_per_instance=64,
    prompt_len=100,
    lengths=ResponseLengths(median=64, p99=512, max=1024),
    weight_read_s=0.01,
    kv_read_s_per_token=1e-7,
    compute_s_per_token=1e-4,
    prefill_s_per_token=1e-5,
    kv_capacity_tokens=200_000,
    kv_bytes_per_token=1e5,
    transfer_bytes_per_s=2.5e10,
    transfer_latency_s=1e-5,
    inference_s_per_token=2e-4,
)


def test_decode_times_by_hand() -> None:
    profile = replace(PROFILE, prompt_len=0, weight_read_s=1.0, kv_read_s_per_token=0.0, compute_s_per_token=0.1)
    # Two samples of 2 and 3 tokens: 3 memory-bound steps of 1 s each.
    finish = decode_finish_times(profile, np.array([0, 0]), np.array([2, 3]), 5.0)
    assert finish.tolist() == [7.0, 8.0]
    # 20 active samples pass the ridge point (10): a step takes 20 * 0.1 = 2 s.
    finish = decode_finish_times(profile, np.zeros(20, dtype=int), np.ones(20, dtype=int), 0.0)
    assert finish.tolist() == [2.0] * 20
    assert profile.ridge_batch == pytest.approx(10)


def test_lengths_are_long_tailed_and_truncated() -> None:
    rng = np.random.default_rng(0)
    lengths = sample_lengths(replace(PROFILE, samples_per_instance=4096), rng)
    assert lengths.max() <= 1024 and lengths.min() >= 1
    median = np.median(lengths)
    assert 56 <= median <= 72
    assert np.quantile(lengths, 0.999) >= 10 * median  # p99.9 at least 10x the median


def test_without_fusion_is_generation_then_balanced_inference() -> None:
    lengths = sample_lengths(PROFILE, np.random.default_rng(1))
    outcome = run_batch(PROFILE, lengths, None)
    work = float(((PROFILE.prompt_len + lengths) * PROFILE.inference_s_per_token).sum())
    assert outcome.total_s == pytest.approx(outcome.generation_s + work / PROFILE.num_instances)
    assert outcome.mechanism == "none"


def test_fusion_overlaps_inference_with_the_tail() -> None:
    lengths = sample_lengths(PROFILE, np.random.default_rng(2))
    base = run_batch(PROFILE, lengths, None)
    fused = run_batch(PROFILE, lengths, 0.2)
    assert fused.total_s < base.total_s
    assert fused.migration_s < base.generation_s
    # The remaining samples' KV at full length fits the destinations.
    remaining = int(0.2 * lengths.size)
    assert fused.destinations * PROFILE.kv_capacity_tokens >= remaining * (PROFILE.prompt_len + 1024)
    assert fused.mechanism == "kv-transfer"
    # Work is conserved: no schedule beats all inference spread over every instance from time 0.
    work = float(((PROFILE.prompt_len + lengths) * PROFILE.inference_s_per_token).sum())
    assert fused.total_s >= work / PROFILE.num_instances
    assert fused.total_s >= fused.generation_s


def test_destinations_follow_the_stricter_constraint() -> None:
    lengths = sample_lengths(PROFILE, np.random.default_rng(3))
    tight_memory = replace(PROFILE, kv_capacity_tokens=4 * (PROFILE.prompt_len + 1024))
    remaining = int(0.1 * lengths.size)
    # Memory: each destination holds 4 samples at full length.
    assert run_batch(tight_memory, lengths, 0.1).destinations == min(8, int(np.ceil(remaining / 4)))
    # Throughput: compute-bound steps (ridge batch 1) mean a destination may not take more samples
    # than the busiest instance has now, so more destinations are needed than memory alone asks.
    cheap = replace(PROFILE, kv_read_s_per_token=0.0, compute_s_per_token=1e-6)
    assert run_batch(cheap, lengths, 0.1).destinations == 1  # memory alone: 51 samples fit one instance
    compute_bound = replace(cheap, compute_s_per_token=PROFILE.weight_read_s)
    assert run_batch(compute_bound, lengths, 0.1).destinations > 1


def test_recompute_when_the_link_is_slow() -> None:
    lengths = sample_lengths(PROFILE, np.random.default_rng(4))
    slow_link = replace(PROFILE, transfer_bytes_per_s=1e6)
    assert run_batch(slow_link, lengths, 0.3).mechanism == "recompute"


def test_sweep_picks_the_fastest_threshold() -> None:
    result = sweep_thresholds(PROFILE, num_batches=2, seed=5)
    assert [p.threshold for p in result.points] == list(THRESHOLDS)
    assert result.best.total_s == min(p.total_s for p in result.points)
    assert result.speedup > 1.0


def test_profile_from_plan() -> None:
    plan = load_document(EXAMPLE)
    assert isinstance(plan, Plan)
    profile = generation_profile(plan)
    entry = plan.stage_plan("actor/generation")
    assert profile.num_instances == entry.dp
    assert profile.samples_per_instance * entry.dp >= plan.workload.samples_per_step
    assert profile.kv_capacity_tokens > 0 and profile.inference_s_per_token > 0
    assert profile.lengths == plan.workload.response_len

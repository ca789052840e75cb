"""The continuous-batching scheduler: never past its block pool, every request to its end, and
with blocks of one token the cost model's reference engine step for step."""

from __future__ import annotations

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from nereus.cost.continuous_batching import simulate_continuous_batching
from nereus.runtime.generation.block_scheduler import Request, Scheduler
from nereus.runtime.generation.kv_cache import BlockAllocator, KVBudget, blocks_for, pool_blocks

pytestmark = pytest.mark.logic


def fingerprint(running: int, tokens: int) -> float:
    """An iteration 'cost' that tells apart every (running, tokens) pair: equal sums over two
    runs mean (almost surely) the same sequence of batches."""
    return running * 1_000_003.0 + tokens


def drive(lengths: list[int], prompts: list[int], num_blocks: int, block_tokens: int) -> dict[str, object]:
    """Run the scheduler as the engine does, each step generating one token per running request."""
    scheduler = Scheduler(num_blocks, block_tokens)
    requests = [Request(i, [1] * p, p, n) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    scheduler.submit(requests)
    cost, iterations, peak, generated_order = 0.0, 0, 0, []
    while scheduler.waiting or scheduler.running:
        scheduler.admit()
        assert scheduler.running, "the head of the queue always fits an empty pool"
        reserved = sum(len(r.tokens) + 1 for r in scheduler.running)
        held = sum(len(r.blocks) for r in scheduler.running)
        assert held == scheduler.blocks_in_use <= num_blocks
        assert all(len(r.blocks) == blocks_for(len(r.tokens) + 1, block_tokens) for r in scheduler.running)
        cost += fingerprint(len(scheduler.running), reserved)
        iterations += 1
        for request in list(scheduler.running):
            request.tokens.append(0)
            generated_order.append(request.sample_id)
            if request.generated >= request.budget:
                scheduler.finish(request)
        scheduler.grow()
        peak = max(peak, scheduler.blocks_in_use)
        assert scheduler.blocks_in_use + scheduler.allocator.num_free == num_blocks
    assert [r.generated for r in requests] == lengths
    return {"cost": cost, "iterations": iterations, "preemptions": scheduler.preemptions, "peak": peak}


def test_one_token_blocks_follow_the_reference_engine() -> None:
    lengths = [30, 4, 17, 9, 25, 2, 12, 30, 6, 11]
    for capacity in (40, 60, 100, 400):
        ours = drive(lengths, [5] * len(lengths), capacity, 1)
        reference = simulate_continuous_batching(lengths, 5, capacity, fingerprint)
        assert (ours["iterations"], ours["preemptions"]) == (reference.iterations, reference.preemptions), capacity
        assert ours["cost"] == reference.time_s, capacity
    assert drive(lengths, [5] * len(lengths), 60, 1)["preemptions"] > 0  # the rule is exercised


@seed(29)
@settings(max_examples=60, deadline=None, database=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    prompt=st.integers(1, 8),
    spare=st.integers(0, 120),
    block_tokens=st.sampled_from([1, 2, 4, 16]),
)
def test_random_mixes_never_exceed_the_pool(lengths: list[int], prompt: int, spare: int, block_tokens: int) -> None:
    longest = blocks_for(prompt + max(lengths), block_tokens)
    num_blocks = longest + blocks_for(spare, block_tokens)
    result = drive(lengths, [prompt] * len(lengths), num_blocks, block_tokens)
    assert result["peak"] <= num_blocks
    if block_tokens == 1:
        reference = simulate_continuous_batching(lengths, prompt, num_blocks, fingerprint)
        assert (result["iterations"], result["preemptions"], result["cost"]) == (
            reference.iterations,
            reference.preemptions,
            reference.time_s,
        )


def test_preempted_requests_return_to_the_head_in_admission_order() -> None:
    scheduler = Scheduler(num_blocks=6, block_tokens=1)
    requests = [Request(i, [1], 1, 5) for i in range(3)]
    scheduler.submit(requests)
    assert scheduler.admit() == requests  # 2 tokens each
    for request in requests:
        request.tokens.append(0)  # 3 tokens each: 9 > 6
    assert scheduler.grow() == [requests[2]]
    assert list(scheduler.waiting) == [requests[2]] and requests[2].blocks == [] and requests[2].cached == 0
    for request in requests[:2]:
        request.tokens += [0, 0]  # 6 tokens each: the second goes too
    assert scheduler.grow() == [requests[1]]
    assert list(scheduler.waiting) == [requests[1], requests[2]]


def test_pool_size_follows_budget_memory_and_demand() -> None:
    cpu = __import__("torch").device("cpu")
    assert pool_blocks(KVBudget(), 100, 50, cpu) == 50  # unbounded: the demand
    assert pool_blocks(KVBudget(budget_bytes=1000), 100, 50, cpu) == 10
    rank = KVBudget(rank_memory_bytes=10_000, resident_bytes=5_000, utilisation=0.5)
    assert pool_blocks(rank, 100, 50, cpu) == 25  # (10000 - 5000) * 0.5 / 100
    allocator = BlockAllocator(3)
    blocks = allocator.allocate(2)
    allocator.release(blocks)
    assert allocator.num_free == 3 and sorted(allocator.allocate(3)) == [0, 1, 2]
    with pytest.raises(ValueError, match="utilisation"):
        KVBudget(utilisation=1.5)

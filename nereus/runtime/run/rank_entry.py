"""What every rank of a `nereus run` runs, spawned or under torchrun: the synchronous rank loop
(`rank_loop.run_rank`), or an async plan's (`async_loop.run_async`: generation and training on
their own pools)."""

from __future__ import annotations

from nereus.runtime.run.async_loop import run_async
from nereus.runtime.run.rank_loop import run_rank
from nereus.runtime.run.run_setup import RunSetup


def rank_main(rank: int, world_size: int, setup: RunSetup) -> int:
    """The whole run on this rank, by the plan's execution; the number of steps finished."""
    if setup.plan.workload.execution == "async":
        return run_async(rank, world_size, setup)
    return run_rank(rank, world_size, setup)

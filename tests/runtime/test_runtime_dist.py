"""The launcher's failure behaviour (tier: multi-process gloo): a rank that raises or dies
takes the world down within seconds, and the error names the rank that caused it."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from nereus.runtime.comm.spawn import BLAS_THREADS_ENV, spawn

pytestmark = pytest.mark.one_rank


def all_reduce_one(rank: int, world_size: int) -> float:
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return float(tensor)


def rank_one_raises(rank: int, world_size: int) -> float:
    if rank == 1:
        raise ValueError("rank one cannot go on")
    return all_reduce_one(rank, world_size)


def rank_one_dies(rank: int, world_size: int) -> float:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return all_reduce_one(rank, world_size)


@pytest.mark.multiprocess
def test_every_rank_returns() -> None:
    assert spawn(all_reduce_one, 3) == [3.0, 3.0, 3.0]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (rank_one_raises, "rank 1: ValueError: rank one cannot go on"),
        (rank_one_dies, "rank 1: died from signal SIGKILL"),
    ],
)
def test_a_failing_rank_takes_the_world_down_and_is_named(fn: object, expected: str) -> None:
    """The peers block in an all-reduce the failed rank never joins; they must not wait for
    the 120 s collective timeout."""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        spawn(fn, 3)
    assert str(caught.value).splitlines()[0] == expected
    assert time.monotonic() - start < 60


def _blas_worker(rank: int, world_size: int) -> tuple[str | None, int]:
    import numpy as np

    matrix = np.random.default_rng(rank).random((200, 200))
    np.linalg.lstsq(matrix, matrix[:, 0], rcond=None)
    return os.environ.get(BLAS_THREADS_ENV), len(os.listdir("/proc/self/task"))


@pytest.mark.multiprocess
def test_ranks_get_as_many_blas_threads_as_torch_threads_unless_the_user_set_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(BLAS_THREADS_ENV, raising=False)
    (one, threads_one), _ = spawn(_blas_worker, 2)
    assert one == "1" and BLAS_THREADS_ENV not in os.environ  # the launcher's environment is restored
    monkeypatch.setenv(BLAS_THREADS_ENV, "3")
    (three, threads_three), _ = spawn(_blas_worker, 2)
    # OpenBLAS's pool: min(3, cores) threads, one of them the caller.
    assert three == "3" and threads_three == threads_one + min(3, os.cpu_count() or 1) - 1

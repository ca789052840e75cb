"""The bounded staleness queue (runtime/rl/async_queue.py): over random interleavings of
generation, weight syncs, training and checkpoints, no trained sample is more than k versions
old, and every accepted sample is trained once, in the stream's order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.errors import NereusError
from nereus.runtime.rl.async_queue import STATE_FILE, TENSORS_FILE, StalenessQueue, VersionedSample

pytestmark = pytest.mark.logic


def sample(index: int, version: int) -> VersionedSample:
    tokens = torch.arange(index % 5 + 1, dtype=torch.int64) + index
    return VersionedSample(index, version, {"tokens": tokens, "log_probs": -tokens.float() / 7}, {"prompt": index // 2})


def same(a: VersionedSample, b: VersionedSample) -> bool:
    return (
        (a.index, a.version, a.info) == (b.index, b.version, b.info)
        and a.tensors.keys() == b.tensors.keys()
        and all(torch.equal(a.tensors[name], b.tensors[name]) for name in a.tensors)
    )


ACTIONS = st.lists(st.sampled_from(["generate", "generate", "generate", "sync", "train", "checkpoint"]), max_size=120)


@settings(max_examples=150, deadline=None)
@given(k=st.integers(0, 3), batch_size=st.integers(1, 4), actions=ACTIONS)
def test_staleness_never_exceeds_k_and_nothing_is_lost_or_repeated(
    k: int, batch_size: int, actions: list[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    queue = StalenessQueue(k, batch_size)
    generator_version = 0
    accepted: list[VersionedSample] = []
    trained: list[VersionedSample] = []
    for action in actions:
        # Liveness: training can take a batch, or a generator with the latest weights has room.
        assert queue.ready() or queue.room(queue.version) > 0
        if action == "generate":
            room = queue.room(generator_version)
            candidate = sample(queue.next_index, generator_version)
            assert queue.put(candidate) == (room > 0)
            if room > 0:
                accepted.append(candidate)
        elif action == "sync":
            generator_version = queue.version
        elif action == "train" and queue.ready():
            version = queue.version
            batch = queue.take(version)
            assert len(batch) == batch_size
            assert all(0 <= version - s.version <= k for s in batch)
            assert sum(queue.staleness(batch, version).values()) == batch_size
            trained.extend(batch)
        elif action == "checkpoint":
            folder = tmp_path_factory.mktemp("queue")
            queue.save(folder)
            restored = StalenessQueue.load(folder)
            assert (restored.version, restored.next_index, len(restored)) == (
                queue.version,
                queue.next_index,
                len(queue),
            )
            queue = restored
    while queue.ready():  # drain
        trained.extend(queue.take(queue.version))
    assert [s.index for s in accepted] == list(range(len(accepted)))
    # Trained = accepted minus the partial batch left, in order, each once, tensors intact.
    assert len(accepted) - len(trained) == len(queue) < batch_size
    assert all(same(a, b) for a, b in zip(accepted, trained, strict=False))


def test_generation_runs_at_most_k_batches_ahead() -> None:
    queue = StalenessQueue(max_staleness=2, batch_size=3)
    assert queue.room(0) == 9  # the batches of versions 0, 1 and 2
    for index in range(9):
        assert queue.put(sample(index, 0))
    assert not queue.put(sample(9, 0)) and queue.next_index == 9  # refused, nothing queued
    assert queue.take(0)[0].index == 0
    assert queue.room(0) == 0  # a take frees no room for old weights ...
    assert queue.room(1) == 3  # ... only the next version's batch


def test_k0_takes_turns() -> None:
    queue = StalenessQueue(max_staleness=0, batch_size=2)
    assert queue.put(sample(0, 0)) and queue.put(sample(1, 0)) and not queue.put(sample(2, 0))
    queue.take(0)
    assert not queue.put(sample(2, 0)) and queue.put(sample(2, 1))


def test_invariants_are_asserted() -> None:
    queue = StalenessQueue(max_staleness=1, batch_size=1)
    with pytest.raises(AssertionError, match="is next"):
        queue.put(sample(3, 0))  # out of the stream's order
    with pytest.raises(AssertionError, match="ahead of training"):
        queue.put(sample(0, 1))
    with pytest.raises(AssertionError, match="whole batch"):
        queue.take(0)
    queue.put(sample(0, 0))
    with pytest.raises(AssertionError, match="takes where"):
        queue.take(1)


def test_bad_checkpoint_files_are_one_line(tmp_path: Path) -> None:
    queue = StalenessQueue(1, 2)
    queue.put(sample(0, 0))
    queue.save(tmp_path)
    good = (tmp_path / STATE_FILE).read_text()
    head, tail = good.rsplit('"version": 0', 1)  # the sample's, after the queue's own
    (tmp_path / STATE_FILE).write_text(head + '"version": 5' + tail)
    with pytest.raises(NereusError, match=r"queue\.json: samples\[0\]\.version: 5 is ahead"):
        StalenessQueue.load(tmp_path)
    (tmp_path / STATE_FILE).write_text("{not json")
    with pytest.raises(NereusError, match="unreadable async queue") as error:
        StalenessQueue.load(tmp_path)
    assert "\n" not in str(error.value)
    (tmp_path / STATE_FILE).write_text(good)
    (tmp_path / TENSORS_FILE).unlink()
    with pytest.raises(NereusError, match="missing"):
        StalenessQueue.load(tmp_path)

"""The list scheduler's replay state (nereus.solver.transition.replay): pure logic."""

from __future__ import annotations

import pytest

from nereus.solver.transition.primitives import Primitive
from nereus.solver.transition.replay import Replay, list_schedule

pytestmark = pytest.mark.logic


def _primitive(pid: int, stage: str, gpus: tuple[int, ...], duration: float, **fields: object) -> Primitive:
    kind = fields.pop("kind", "extend")
    p = Primitive(
        id=pid,
        kind=kind,  # type: ignore[arg-type]
        model_stage=stage,
        source_layout=(1, 1),
        target_layout=(1, 1),
        reads=(),
        writes=gpus,
        alloc=fields.pop("alloc", {}),  # type: ignore[arg-type]
        free=fields.pop("free", {}),  # type: ignore[arg-type]
        transfers=(),
        deps=fields.pop("deps", []),  # type: ignore[arg-type]
        duration_s=duration,
    )
    return p


def test_a_copy_waiting_for_memory_starts_when_another_model_stage_frees_it_and_records_that_release() -> None:
    release = _primitive(0, "critic/inference", (0,), 2.0, kind="destroy", free={0: 60.0})
    copy = _primitive(1, "actor/training", (0, 1), 1.0, alloc={0: 50.0, 1: 50.0})
    replay = Replay({0: 80.0}, 100.0)
    assert list_schedule([copy, release], replay) == []
    times = replay.schedule()
    assert (times.start_s(release), times.start_s(copy), times.end_s(copy)) == (0.0, 2.0, 3.0)
    assert times.ownership_deps(copy) == [0]
    assert replay.usage(0) == 70.0 and replay.usage(1) == 50.0
    assert replay.peak == {0: 70.0, 1: 50.0}  # GPUs that allocated; the most they held after it


def test_a_release_by_the_same_model_stage_is_no_ownership_dependency() -> None:
    release = _primitive(0, "actor/training", (0,), 2.0, kind="destroy", free={0: 60.0})
    copy = _primitive(1, "actor/training", (0,), 1.0, alloc={0: 50.0})
    replay = Replay({0: 80.0}, 100.0)
    assert list_schedule([copy, release], replay) == []
    times = replay.schedule()
    assert times.start_s(copy) == 2.0 and times.ownership_deps(copy) == []


def test_wide_primitives_wait_on_the_busy_gpus_and_start_when_they_finish() -> None:
    wide = tuple(range(40))  # above WIDE-style sizes: hundreds of GPUs at 1024
    first = _primitive(0, "actor/training", wide, 1.0, alloc=dict.fromkeys(wide, 1.0))
    second = _primitive(1, "critic/training", wide[::2], 1.0, alloc=dict.fromkeys(wide[::2], 1.0))
    replay = Replay({}, 10.0)
    assert list_schedule([first, second], replay) == []
    times = replay.schedule()
    assert (times.start_s(first), times.start_s(second)) == (0.0, 1.0)
    assert replay.usage(0) == 2.0 and replay.usage(1) == 1.0


def test_a_replay_carries_its_state_into_a_later_wider_schedule() -> None:
    first = _primitive(0, "actor/training", (0,), 1.0, alloc={0: 60.0})
    replay = Replay({}, 100.0)
    assert list_schedule([first], replay) == []
    later = _primitive(1, "actor/training", (0, 7), 1.0, alloc={0: 50.0, 7: 50.0})
    assert list_schedule([later], replay, explain=False) == ["blocked"]  # GPU 0 would hold 110 > 100
    assert not replay.schedule().scheduled(later) and replay.usage(0) == 60.0
    assert replay.usage(7) == 0.0 and replay.usage(9) == 0.0  # a GPU past the arrays holds what it started with


def test_a_restored_replay_reports_the_snapshot_peak() -> None:
    assert Replay({0: 1.0}, 10.0, peak={0: 5.0}).peak == {0: 5.0}
    assert Replay({0: 1.0}, 10.0).peak == {}

"""Spawned ranks allocate large CPU tensors on transparent huge pages when asked.

`spawn(huge_pages=True)` starts the ranks with THP_MEM_ALLOC_ENABLE=1, so torch advises
its large allocations MADV_HUGEPAGE (the kernel's "hg" flag on the mapping: a freshly
resharded state then faults in 2 MiB pages, not 4 KiB ones); by default the ranks inherit
the environment as it is, a value the user set is passed on unchanged either way, and the
launcher's own environment is left as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nereus.runtime.comm.spawn import HUGE_PAGES_ENV, spawn

pytestmark = [
    pytest.mark.one_rank,
    pytest.mark.skipif(
        not Path("/sys/kernel/mm/transparent_hugepage").is_dir() or not Path("/proc/self/smaps").is_file(),
        reason="needs Linux with transparent huge pages",
    ),
]


def mapping_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(bound, 16) for bound in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _allocation_worker(rank: int, world_size: int) -> tuple[str | None, bool]:
    tensor = torch.empty(1 << 20)  # 4 MiB: above torch's 2 MiB huge-page threshold
    return os.environ.get(HUGE_PAGES_ENV), "hg" in mapping_flags(tensor.data_ptr())


@pytest.mark.multiprocess
def test_ranks_get_huge_pages_when_asked_and_a_users_value_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    assert spawn(_allocation_worker, 1) == [(None, False)]
    assert spawn(_allocation_worker, 1, huge_pages=True) == [("1", True)]
    assert HUGE_PAGES_ENV not in os.environ  # the launcher's environment is restored
    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    assert spawn(_allocation_worker, 1, huge_pages=True) == [("0", False)]
    assert os.environ[HUGE_PAGES_ENV] == "0"

"""The CPU peak reading's baseline (`nereus.runtime.observe.memory`): with a run's
`memory_baseline: step`, re-read at each step's start as the private memory that holds no
tensor, so Python objects and other non-tensor memory made after the idle reading count in no
model-stage's peak, while every tensor still does; with `idle` (the default), read once.

The two baseline tests run in a fresh interpreter, as a rank is: a long-lived test worker holds
other tests' tensors and freed heap, which can make the step-start reading over- or undercount
(a tensor allocated but never written is counted at its size, though none of its pages are
resident)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from nereus.runtime.observe import memory

pytestmark = [
    pytest.mark.one_rank,
    pytest.mark.skipif(not memory.cpu_peak_supported(), reason="needs /proc/self peak readings (Linux)"),
]

MB = 1 << 20

PRELUDE = """
import torch
from nereus.runtime.observe import memory
MB = 1 << 20
"""


def run_fresh(body: str) -> None:
    """Run `body` (asserts) in a new Python process; fail with its error output."""
    code = PRELUDE + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_private_tensor_bytes_counts_each_private_storage_once() -> None:
    before = memory.private_tensor_bytes()
    tensor = torch.ones(8 * MB, dtype=torch.uint8)
    views = [tensor[:MB], tensor.view(8, MB), tensor[MB:]]
    shared = torch.ones(8 * MB, dtype=torch.uint8).share_memory_()  # shared pages: not RssAnon's
    assert memory.private_tensor_bytes() - before == tensor.nbytes
    del views, shared


def test_step_baseline_leaves_out_non_tensor_memory_but_not_tensors() -> None:
    run_fresh("""
        tracker = memory.PeakTracker.for_device("cpu", rebase_each_step=True)  # the idle reading
        junk = b"x" * (48 * MB)  # resident, private, no tensor: Python objects made after the idle reading
        kept = torch.ones(16 * MB, dtype=torch.uint8)  # a tensor that exists when the step starts
        tracker.start_step()
        tracker.enter("stage")
        made = torch.ones(16 * MB, dtype=torch.uint8)  # a tensor the model-stage makes
        tracker.exit("stage")
        peak = tracker.segment_peaks["stage"]
        # Both tensors count (32 MB); the 48 MB of bytes, present since before the step, does not.
        assert kept.nbytes + made.nbytes <= peak < kept.nbytes + made.nbytes + 16 * MB, peak
        assert len(junk) == 48 * MB
    """)


def test_idle_baseline_counts_non_tensor_memory_made_after_it() -> None:
    run_fresh("""
        tracker = memory.PeakTracker.for_device("cpu")  # `memory_baseline: idle`: read once, here
        junk = b"x" * (48 * MB)
        tracker.start_step()
        tracker.enter("stage")
        made = torch.ones(16 * MB, dtype=torch.uint8)
        tracker.exit("stage")
        # The 48 MB of bytes counts.
        assert tracker.segment_peaks["stage"] >= len(junk) + made.nbytes // 2, tracker.segment_peaks
    """)

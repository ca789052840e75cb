"""A hold a test puts on a run: every rank waits before a chosen step until released.

Read from the environment, which spawned and torchrun ranks inherit: with HOLD_STEP_ENV=N and
HOLD_FOLDER_ENV=F, every rank reaching step N writes F/rank-R.holding and waits there until
F/release exists. A fault test then signals, stops or kills a run at a known point (an event
the run reports), never in a race with its steps. Without the variables it does nothing.
Pure Python (no torch), so the tests' helpers import it cheaply.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

HOLD_STEP_ENV = "NEREUS_HOLD_BEFORE_STEP"
HOLD_FOLDER_ENV = "NEREUS_HOLD_FOLDER"


def hold_before(step: int, rank: int) -> None:
    """Wait before `step` while the environment asks for it (see the module docstring)."""
    held = os.environ.get(HOLD_STEP_ENV)
    if held is None or int(held) != step:
        return
    folder = Path(os.environ[HOLD_FOLDER_ENV])
    (folder / f"rank-{rank}.holding").write_text(f"{step}\n")
    while not (folder / "release").exists():
        time.sleep(0.05)

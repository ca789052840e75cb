"""Test tiers: every test carries one of the tier markers registered in pyproject.toml.

Loading this file puts tests/ on sys.path (pytest's default import mode), so the helper
modules there (cli_helpers, plan_helpers, repo_paths) import the same way from every layer
folder. A test with no tier marker is a collection error: the fast loop
(`-m "not multiprocess and not slow"`) must not include or drop a test by accident.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Ranks start from a server that imported torch once instead of each importing it
# (nereus.runtime.comm.spawn): the suite spawns hundreds of ranks. Subprocesses inherit it.
os.environ.setdefault("NEREUS_SPAWN_START_METHOD", "forkserver")
# One torch (OpenMP) thread per test process, as every rank already has: the suite runs one
# worker per core, and a worker's default of one thread per core oversubscribes them (OpenMP's
# threads spin while they wait). Measured on the 2 cores, `pytest tests/runtime -m "one_rank and
# not slow" -n 2`: 54-58 s of CPU with one thread, 65-185 s with the default. Set before any test
# module imports torch; subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

TIERS = ("logic", "one_rank", "multiprocess", "cli")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered = [item.nodeid for item in items if not any(item.get_closest_marker(tier) for tier in TIERS)]
    if untiered:
        raise pytest.UsageError(
            f"{len(untiered)} test(s) carry no tier marker ({', '.join(TIERS)}), first: {untiered[0]}; "
            "set `pytestmark = pytest.mark.<tier>` in the module"
        )


@pytest.fixture(scope="session")
def plain_three_step_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run folder of `tests.run_helpers.write_config`'s 2-rank config run for 3 steps
    (checkpoints after steps 2 and 3) under its own plan: the reference several run tests
    compare against, made once per test process. Read it; a test that resumes it works on a copy."""
    from tests.cli_helpers import invoke
    from tests.run_helpers import write_config

    folder = tmp_path_factory.mktemp("plain-three")
    result = invoke("run", write_config(folder, num_steps=3), "--out", folder / "out")
    assert result.exit_code == 0, result.output
    return folder / "out"

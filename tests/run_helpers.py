"""What the `nereus run` tests share: a small 2-rank config, launching a run as a process,
finding its ranks, and waiting with a bound."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from nereus.runtime.comm.spawn import START_METHOD_ENV
from nereus.runtime.run.hold import HOLD_FOLDER_ENV, HOLD_STEP_ENV

DATA = Path(__file__).parent / "data"
PLAN_2RANK = DATA / "plan-tiny-ppo-2rank.yaml"


#: metrics.jsonl fields that depend on wall time or on measured memory (predictions come from
#: a calibration fitted to measured times; peaks from the process's resident set).
TIMING_FIELDS = (
    "stage_seconds",
    "step_seconds",
    "predicted_step_seconds",
    "predicted_stage_seconds",
    "memory_peak_bytes",
    "memory_peak_bytes_by_stage",
    "host_memory_bytes",
)


def write_config(folder: Path, **fields: Any) -> Path:
    """A small 2-rank PPO config (short responses) next to a copy of the 2-rank plan."""
    shutil.copy(PLAN_2RANK, folder / "plan.yaml")
    document = {
        "kind": "RunConfig",
        "version": 1,
        "plan": "plan.yaml",
        "num_steps": 4,
        "checkpoint_every": 2,
        "rl": {"task": "sort", "seed": 3, "max_new_tokens": 6},
        **fields,
    }
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def start_run(*args: str | Path, hold: tuple[int, Path] | None = None) -> subprocess.Popen[bytes]:
    """`nereus run ARGS` as a process in its own session (a signal to its group reaches the ranks).
    `hold=(step, folder)`: every rank waits before `step` until `release(folder)` (the run's
    HOLD_STEP_ENV hook), so a test acts on a run at a known step, whatever the machine's load."""
    # As a user starts it: its ranks are fresh interpreters (the suite's forkserver would make
    # them the server's children, not the launcher's), so the fault tests see the real process tree.
    env = {**{k: v for k, v in os.environ.items() if k != START_METHOD_ENV}, "PYTHONUNBUFFERED": "1"}
    if hold is not None:
        step, folder = hold
        folder.mkdir(parents=True, exist_ok=True)
        env |= {HOLD_STEP_ENV: str(step), HOLD_FOLDER_ENV: str(folder)}
    command = [sys.executable, "-m", "nereus", "run", *map(str, args)]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    """The run starts with Ctrl-C's default disposition, as in a terminal, whatever the test
    runner inherited: a shell starts a background job (`pytest ... &`, nohup, some CI
    runners) with SIGINT ignored, the ignore passes through exec, and Python then installs
    no KeyboardInterrupt handler, so the Ctrl-C test's signal would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_until_held(folder: Path, num_ranks: int, timeout: float = 600) -> None:
    """Until every rank of a `start_run(hold=...)` run waits at its step."""
    wait_for(lambda: len(list(folder.glob("rank-*.holding"))) == num_ranks, timeout)


def release(folder: Path) -> None:
    """Let the held ranks go on."""
    (folder / "release").write_text("")


def rank_pids(parent: int) -> list[int]:
    """PIDs of the spawned ranks of `parent` (children running multiprocessing's spawn_main)."""
    pids = []
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            pids.append(int(child))
    return pids


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def wait_for(condition: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def kill_async_run_after_step_two_and_resume(
    config: Path, tmp_path: Path, batch: int, handed_over: bool = False, queued_version: int = 1
) -> Path:
    """Start the async run of `config` (`batch` samples a batch) held after its step-2
    checkpoint, check the checkpoint's queue holds batch 2 generated at `queued_version` (1 at
    k = 1), SIGKILL its process group mid-queue, then `nereus run --resume` it; its run folder.
    `handed_over`: batch 3 also waits in the hand-off folder at the kill."""
    import json

    from nereus.runtime.run.checkpoints import checkpoint_problem
    from nereus.spec.run_folder import read_metrics
    from tests.cli_helpers import invoke

    out, hold = tmp_path / "out", tmp_path / "hold"
    process = start_run(config, "--out", out, hold=(3, hold))
    wait_until_held(hold, 2)  # after the step-2 checkpoint; batch 3 generated, in the hand-off folder
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2]
    assert not handed_over or (out / "async" / "batch-000003.json").is_file()
    queued = json.loads((out / "checkpoints" / "step-000002" / "queue.json").read_text())
    assert [(s["index"], s["version"]) for s in queued["samples"]] == [
        (i, queued_version) for i in range(2 * batch, 3 * batch)
    ]
    ranks = rank_pids(process.pid)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=120)  # a killed group exits at once; 120 s only bounds a hang
    wait_for(lambda: not any(alive(pid) for pid in ranks), 60)
    assert checkpoint_problem(out / "checkpoints" / "step-000002") is None
    resumed = invoke("run", "--resume", out)
    assert resumed.exit_code == 0, resumed.output
    return out

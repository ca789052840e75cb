"""Faults a long run meets, each survived and named within a stated time: a planted pickle,
a corrupted newest checkpoint, a full disk during a checkpoint, Ctrl-C, and a stopped rank.

Every test starts from one finished 4-step run (checkpoints after steps 2 and 4) and works
on a copy of it; each bounds how long it waits and says so."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from nereus.runtime.run.checkpoints import checkpoint_problem
from nereus.spec.run_folder import finished_checkpoints, read_metrics
from tests.cli_helpers import invoke, one_error_line
from tests.run_helpers import (
    TIMING_FIELDS,
    alive,
    rank_pids,
    release,
    start_run,
    wait_for,
    wait_until_held,
    write_config,
)

pytestmark = pytest.mark.multiprocess

#: How long a killed or stopped run may take to exit. The ranks go down within seconds (Ctrl-C:
#: 3 s on a machine at load 20, 10 s with two CPU burners besides); the bound catches a run
#: that does not stop at all, not a slow one, so it leaves a wide margin.
EXIT_BOUND_S = 120.0
#: The stopped-rank test's collective timeout: long enough that no collective of a healthy
#: run on a loaded machine waits so long (rendezvous included: both ranks are spawned together;
#: a step of this tiny 2-rank run takes well under a second, and tests/runtime/test_run_torchrun.py
#: runs the same config under 10 s), short enough to wait for.
COLLECTIVE_TIMEOUT_S = 15.0


def training(out: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in read_metrics(out)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run (checkpoints step-000002 and step-000004)."""
    folder = tmp_path_factory.mktemp("finished")
    config = write_config(folder)
    result = invoke("run", config, "--out", folder / "out")
    assert result.exit_code == 0, result.output
    return folder / "out"


def copy_of(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    return out


class PlantsAMarker:
    """Unpickling this creates `path`: proof that code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_a_planted_pickle_never_runs_and_the_resume_is_refused(finished: Path, tmp_path: Path) -> None:
    out = copy_of(finished, tmp_path)
    marker = tmp_path / "code-ran"
    (out / "checkpoints" / "step-000004" / "controller.pkl").write_bytes(pickle.dumps(PlantsAMarker(marker)))
    line = one_error_line(invoke("run", "--resume", out, "--steps", "6"))
    assert "controller.pkl: a pickled run state" in line and "never loaded" in line, line
    assert "--resume-from-previous" in line, line
    assert not marker.exists()
    # The run state itself replaced by a pickle (its checksum updated to match): not JSON, refused.
    newest = out / "checkpoints" / "step-000004"
    (newest / "controller.pkl").unlink()
    state = newest / "controller.json"
    state.write_bytes(pickle.dumps(PlantsAMarker(marker)))
    manifest = json.loads((newest / "state.json").read_text())
    manifest["files"]["controller.json"] = hashlib.sha256(state.read_bytes()).hexdigest()
    (newest / "state.json").write_text(json.dumps(manifest))
    line = one_error_line(invoke("run", "--resume", out, "--steps", "6"))
    assert "controller.json: unreadable" in line, line
    assert not marker.exists()


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize(
    ("damage", "file", "expected"),
    [
        (flip_byte, "actor/shard-00000.safetensors", "shard-00000.safetensors: fails its CRC-32 check"),
        (truncate, "critic/shard-00001.safetensors", "the index says"),
        (Path.unlink, "plan.yaml", "plan.yaml: missing"),
        (flip_byte, "controller.json", "controller.json: sha256 differs"),
        (Path.unlink, "actor/index.json", "index.json: missing"),
        (flip_byte, "critic/index.json", "index.json: not UTF-8 text"),
    ],
)
def test_a_damaged_newest_checkpoint_is_named_and_refused(
    finished: Path, tmp_path: Path, damage: Any, file: str, expected: str
) -> None:
    """Refused before any rank starts (well under a second of work)."""
    out = copy_of(finished, tmp_path)
    damage(out / "checkpoints" / "step-000004" / file)
    before = (out / "metrics.jsonl").read_bytes()
    line = one_error_line(invoke("run", "--resume", out, "--steps", "6"))
    assert expected in line and "step-000004" in line and "--resume-from-previous" in line, line
    assert (out / "metrics.jsonl").read_bytes() == before  # nothing touched


def test_resume_from_previous_continues_from_the_newest_valid_checkpoint(finished: Path, tmp_path: Path) -> None:
    out = copy_of(finished, tmp_path)
    flip_byte(out / "checkpoints" / "step-000004" / "actor" / "shard-00001.safetensors")
    result = invoke("run", "--resume", out, "--resume-from-previous")
    assert result.exit_code == 0, result.output
    assert "set aside damaged checkpoint step-000004" in result.stderr
    assert "resuming from" in result.stderr and "step-000002" in result.stderr
    assert (out / "damaged-checkpoints" / "step-000004").is_dir()
    assert training(out) == training(finished)  # steps 3 and 4 again, bitwise
    assert [p.name for p in finished_checkpoints(out)] == ["step-000002", "step-000004"]
    assert all(checkpoint_problem(p) is None for p in finished_checkpoints(out))


def can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs a private tmpfs (unshare -rm + mount)")
def test_a_full_disk_during_a_checkpoint_stops_the_run_and_keeps_the_previous_one(
    finished: Path, tmp_path: Path
) -> None:
    """The run folder on a tmpfs 2 MiB larger than it: the step-6 checkpoint (4.5 MB) cannot fit.
    Bound: the whole failing run under 600 s (a hang guard; about 20 s on an idle machine)."""
    used = sum(p.stat().st_size for p in finished.rglob("*") if p.is_file())
    size_kib = used // 1024 + 2048
    disk, after = tmp_path / "disk", tmp_path / "after"
    disk.mkdir()
    script = (
        f"mount -t tmpfs -o size={size_kib}k tmpfs {disk} && cp -a {finished} {disk}/out && "
        f"{sys.executable} -m nereus run --resume {disk}/out --steps 6; code=$?; cp -a {disk}/out {after}; exit $code"
    )
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, timeout=600)
    stderr = result.stderr.decode().strip().splitlines()
    assert result.returncode == 1, stderr
    line = stderr[-1]
    assert line.startswith("error: run failed: rank ") and "No space left on device" in line, line
    assert f"{disk}/out/checkpoints/.step-000006" in line, line  # the path it could not write
    assert "resume from step-000004" in line, line
    assert [p.name for p in finished_checkpoints(after)] == ["step-000002", "step-000004"]
    assert checkpoint_problem(after / "checkpoints" / "step-000004") is None
    assert (after / "failure.log").is_file()
    # Off the full disk, the resume goes on from step 4.
    resumed = invoke("run", "--resume", after, "--steps", "6")
    assert resumed.exit_code == 0, resumed.output
    assert [r["step"] for r in read_metrics(after)] == list(range(6))
    assert training(after)[:4] == training(finished)


def test_ctrl_c_during_a_step_exits_130_and_resumes_cleanly(finished: Path, tmp_path: Path) -> None:
    """SIGINT to the run's process group (what Ctrl-C does) while every rank is in step 3
    (held there by the run's hook, after the step-2 checkpoint: no race with the steps).
    Bound: the run exits within EXIT_BOUND_S of the signal."""
    config = write_config(tmp_path)
    out, hold = tmp_path / "out", tmp_path / "hold"
    process = start_run(config, "--out", out, hold=(2, hold))
    wait_until_held(hold, 2)
    assert [r["step"] for r in read_metrics(out)] == [0, 1]
    ranks = rank_pids(process.pid)
    os.killpg(process.pid, signal.SIGINT)
    start = time.monotonic()
    _, stderr = process.communicate(timeout=EXIT_BOUND_S)
    assert time.monotonic() - start < EXIT_BOUND_S
    assert process.returncode == 130, stderr.decode()
    line = stderr.decode().strip().splitlines()[-1]
    assert line.startswith("error: run interrupted: ") and "failure.log" in line, line
    assert "resume from step-000002" in line, line
    assert (out / "failure.log").is_file()
    wait_for(lambda: not any(alive(pid) for pid in ranks), 60)
    assert [p.name for p in finished_checkpoints(out)] == ["step-000002"]
    assert checkpoint_problem(out / "checkpoints" / "step-000002") is None
    resumed = invoke("run", "--resume", out)
    assert resumed.exit_code == 0, resumed.output
    assert training(out) == training(finished)


def test_a_stopped_rank_is_named_within_the_collective_timeout(tmp_path: Path) -> None:
    """SIGSTOP on rank 1 while both ranks wait before step 2 (the run's hook), then the hold is
    released: rank 0 goes into the step's collectives alone. The run stops within
    COLLECTIVE_TIMEOUT_S + EXIT_BOUND_S, names rank 1, leaves no rank behind and keeps its
    checkpoints valid."""
    config = write_config(tmp_path, num_steps=4, checkpoint_every=1, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    out, hold = tmp_path / "out", tmp_path / "hold"
    process = start_run(config, "--out", out, hold=(2, hold))
    wait_until_held(hold, 2)
    ranks = rank_pids(process.pid)
    os.kill(ranks[1], signal.SIGSTOP)
    release(hold)
    start = time.monotonic()
    _, stderr = process.communicate(timeout=COLLECTIVE_TIMEOUT_S + EXIT_BOUND_S)
    assert time.monotonic() - start < COLLECTIVE_TIMEOUT_S + EXIT_BOUND_S
    assert process.returncode == 1
    line = stderr.decode().strip().splitlines()[-1]
    assert line.startswith("error: run failed: rank 1: stopped by a signal (SIGSTOP)"), line
    assert f"waited {COLLECTIVE_TIMEOUT_S:g} s" in line, line
    assert "resume from step-000002" in line, line
    wait_for(lambda: not any(alive(pid) for pid in ranks), 60)
    checkpoints = finished_checkpoints(out)
    assert [p.name for p in checkpoints] == ["step-000001", "step-000002"]
    assert all(checkpoint_problem(p) is None for p in checkpoints)

"""`nereus run` under torchrun, with two torchrun agents on this machine as two nodes (each
given its own NEREUS_NODE_ID, so no shared memory crosses them: the cross-node paths run
over gloo), the rendezvous on 127.0.0.1 (tier: multi-process, several launchers)."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from repo_paths import EXAMPLES

from nereus.runtime.checkpoint import load_checkpoint
from nereus.runtime.rl.setup import checkpoint_problem
from nereus.runtime.shard_layout import RankLayout
from nereus.spec.run_folder import finished_checkpoints, read_metrics
from tests.cli_helpers import invoke
from tests.run_helpers import alive, wait_for, write_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

#: The stopped-rank test's collective timeout: long enough that a loaded 2-core machine's
#: slow steps never hit it, so only the stopped rank does.
TIMEOUT_S = 10.0
#: Fields of a step record that measure time (they differ run to run); the rest must agree.
TIMED = ("step_seconds", "stage_seconds", "predicted_step_seconds", "predicted_stage_seconds")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def start_agents(nodes: int, per_node: int, *args: str | Path, env: dict[str, str] | None = None) -> list[Any]:
    """`nodes` torchrun agents of one job, agent n as node `node<n>`, each in its own session."""
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node"]
    command += [str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    command += ["--rdzv-id", f"test-{port}", "-m", "nereus", "run", *map(str, args)]
    agents = []
    for node in range(nodes):
        node_env = {**os.environ, "PYTHONUNBUFFERED": "1", "NEREUS_NODE_ID": f"node{node}", **(env or {})}
        agents.append(
            subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=node_env, start_new_session=True
            )
        )
    return agents


def finish(agents: list[Any], timeout: float) -> list[str]:
    """Every agent's stderr once all have exited (each must exit 0)."""
    outputs = [agent.communicate(timeout=timeout) for agent in agents]
    for agent, (_, stderr) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, stderr.decode()[-3000:]
    return [stderr.decode() for _, stderr in outputs]


def running(agents: list[Any]) -> bool:
    """True while every agent runs (an agent that exited fails the test at once, with its error)."""
    for agent in agents:
        if agent.poll() is not None:
            raise AssertionError(agent.stderr.read().decode()[-3000:])
    return True


def close(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_two_nodes_match_one_node_and_resume_on_one_node_with_fewer_ranks(tmp_path: Path) -> None:
    """examples/run-ppo.yaml (4 ranks) for 4 steps on 2 nodes x 2 ranks equals a 4-rank run on
    one host step for step (1e-6 relative), as does its checkpoint; 1 node x 2 ranks then
    resumes it, replanned for 2 ranks."""
    single, multi = tmp_path / "single", tmp_path / "multi"
    assert invoke("run", EXAMPLES / "run-ppo.yaml", "--steps", "4", "--out", single).exit_code == 0
    finish(start_agents(2, 2, EXAMPLES / "run-ppo.yaml", "--steps", "4", "--out", multi), 400)
    world = json.loads((multi / "world.json").read_text())
    assert [(peer["rank"], peer["node"]) for peer in world] == [(0, "node0"), (1, "node0"), (2, "node1"), (3, "node1")]
    assert len({peer["memory_domain"] for peer in world}) == 2  # no shared memory across the nodes
    expected, got = read_metrics(single), read_metrics(multi)
    assert len(expected) == len(got) == 4
    for want, have in zip(expected, got, strict=True):
        for field, value in want.items():
            assert field in TIMED or close(value, have[field]), (want["step"], field, value, have[field])
    one = RankLayout(1, 1, 1, (0,))
    for role in ("actor", "critic"):
        saved = load_checkpoint(single / "checkpoints" / "step-000004" / role, one, 0).tensors
        joined = load_checkpoint(multi / "checkpoints" / "step-000004" / role, one, 0).tensors
        for key, tensor in saved.items():
            assert (tensor - joined[key]).abs().max() <= 1e-6 * max(1.0, float(tensor.abs().max())), (role, key)
    (stderr,) = finish(start_agents(1, 2, "--resume", multi, "--steps", "5"), 300)
    assert "planned a new layout for 2 ranks" in stderr
    assert "resuming from" in stderr and "step-000004 (step 4)" in stderr
    assert [record["step"] for record in read_metrics(multi)] == [0, 1, 2, 3, 4]
    assert [peer["node"] for peer in json.loads((multi / "world.json").read_text())] == ["node0", "node0"]
    assert all(checkpoint_problem(folder) is None for folder in finished_checkpoints(multi))


def test_a_stopped_rank_on_another_node_stops_the_job_within_the_timeout(tmp_path: Path) -> None:
    """SIGSTOP on rank 1, alone on node 1, with collective_timeout_s = 10: both agents exit
    within 10 s + 30 s, the error names rank 1 and its node, no worker is left, and the
    checkpoints stay valid (torchrun's watchdog kills the stopped worker, and then its own
    agent: torch's FileTimerServer ends the agent process after reaping a worker)."""
    config = write_config(tmp_path, num_steps=40, checkpoint_every=1, collective_timeout_s=TIMEOUT_S)
    out = tmp_path / "out"
    agents = start_agents(2, 1, config, "--out", out, env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1"})
    wait_for(lambda: running(agents) and (out / "metrics.jsonl").is_file() and len(read_metrics(out)) >= 2, 200)
    workers = [peer["pid"] for peer in json.loads((out / "world.json").read_text())]
    os.kill(workers[1], signal.SIGSTOP)
    start = time.monotonic()
    outputs = [agent.communicate(timeout=TIMEOUT_S + 30.0) for agent in agents]
    assert time.monotonic() - start < TIMEOUT_S + 30.0
    assert all(agent.returncode != 0 for agent in agents)
    errors = [line for _, err in outputs for line in err.decode().splitlines() if line.startswith("error: run failed")]
    assert errors, outputs[0][1].decode()[-2000:]
    assert all("rank 1 (node node1" in line for line in errors), errors
    wait_for(lambda: not any(alive(pid) for pid in workers), 10)
    checkpoints = finished_checkpoints(out)
    assert checkpoints and all(checkpoint_problem(folder) is None for folder in checkpoints)
    assert "rank 1 (node node1" in (out / "failure.log").read_text()

"""`nereus run` under torchrun, with two torchrun agents on this machine as two nodes (each
given its own NEREUS_NODE_ID, so no shared memory crosses them: the cross-node paths run
over gloo), the rendezvous on 127.0.0.1 (tier: multi-process, several launchers)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
import yaml
from repo_paths import EXAMPLES

from nereus.runtime.run.checkpoints import checkpoint_problem
from nereus.runtime.run.torchrun import joined_setup
from nereus.runtime.state.checkpoint import load_checkpoint
from nereus.runtime.state.shard_layout import RankLayout
from nereus.spec.run_folder import finished_checkpoints, read_metrics
from tests.cli_helpers import invoke
from tests.run_helpers import alive, wait_for, write_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

#: The stopped-rank test's collective timeout: long enough that a loaded 2-core machine's
#: slow steps never hit it, so only the stopped rank does.
TIMEOUT_S = 10.0
#: Fields of a step record that depend on the model's state, not on the layout it runs in.
LEARNING = ("reward", "score", "kl", "response_len_mean", "actor_loss", "critic_loss", "grad_norm", "lr")
#: An elastic job: one node may go, and torchrun then restarts the workers once.
ELASTIC = ("--nnodes", "1:2", "--max-restarts", "1")
#: The restart's rendezvous waits 5 s for more nodes and takes a node silent for 2 s as gone.
RENDEZVOUS = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2"
#: Fields of a step record that measure time or memory (they differ run to run); the rest must agree.
MEASURED = (
    "step_seconds",
    "stage_seconds",
    "predicted_step_seconds",
    "predicted_stage_seconds",
    "memory_peak_bytes",
    "memory_peak_bytes_by_stage",
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def start_agents(
    nodes: int, per_node: int, *args: str | Path, store_on: int = 0, extra: tuple[str, ...] = (), rdzv_conf: str = ""
) -> list[Any]:
    """`nodes` torchrun agents of one job, agent n as node `node<n>`, each in its own session,
    started in node order (torchrun orders nodes by process id: node 0 gets rank 0). Node
    `store_on` hosts the rendezvous store; the others are told not to (`is_host=0`)."""
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node"]
    command += [str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", *extra]
    command += ["--rdzv-id", f"test-{port}"]
    agents = []
    for node in range(nodes):
        node_env = {**os.environ, "PYTHONUNBUFFERED": "1", "NEREUS_NODE_ID": f"node{node}"}
        conf = ",".join(item for item in (rdzv_conf, "" if node == store_on else "is_host=0") if item)
        argv = [*command, *(("--rdzv-conf", conf) if conf else ()), "-m", "nereus", "run", *map(str, args)]
        agents.append(
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=node_env, start_new_session=True)
        )
    return agents


def guards_of(workers: list[int]) -> list[int]:
    """The guard processes (`nereus.runtime.comm.guard`) still watching any of `workers`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"nereus.runtime.comm.guard" in argv and argv[argv.index(b"nereus.runtime.comm.guard") + 1] in {
            str(pid).encode() for pid in workers
        }:
            found.append(int(entry.name))
    return found


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


def close(a: Any, b: Any, rel: float = 1e-6, tiny: float = 1e-12) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=rel, abs_tol=tiny)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, rel, tiny) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[key], b[key], rel, tiny) for key in a)
    return bool(a == b)


def ppo_config(folder: Path) -> Path:
    """examples/run-ppo.yaml, checkpointing every 4 steps (nothing else changes: the same
    model-stages, plan, seeds and task), next to a copy of its plan."""
    document = yaml.safe_load((EXAMPLES / "run-ppo.yaml").read_text())
    shutil.copy(EXAMPLES / document["plan"], folder / document["plan"])
    path = folder / "run-ppo.yaml"
    path.write_text(yaml.safe_dump({**document, "checkpoint_every": 4}))
    return path


def lose_node(agent: Any, pids: list[int]) -> None:
    """The node of `agent` goes away: its agent and its ranks `pids` are SIGKILLed at once."""
    os.killpg(agent.pid, signal.SIGKILL)
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.communicate(timeout=10)


def resume_by_its_own_job(multi: Path, folder: Path) -> dict[str, Any]:
    """`torchrun --nnodes 1 --nproc-per-node 2 -m nereus run --resume` for one more step, on
    the 2x2 job's run folder as it was at that job's last checkpoint (step 4): a copy of
    `multi` without the elastic restart's step-5 checkpoint, so its plan.json is already the
    2-rank plan the restart made, while step 4's checkpoint holds the 4-rank plan it ran.
    Checks that the job resumes from step 4, replanned for 2 ranks; returns its step-4 record."""
    shutil.copytree(multi, folder)
    shutil.rmtree(folder / "checkpoints" / "step-000005")
    (stderr,) = finish(start_agents(1, 2, "--resume", folder, "--steps", "5"), 400)
    step_4 = folder / "checkpoints" / "step-000004"
    assert "planned a new layout for 2 ranks" in stderr and f"resuming from {step_4} (step 4)" in stderr, stderr
    records = read_metrics(folder)
    assert [record["step"] for record in records] == [0, 1, 2, 3, 4]
    assert [peer["node"] for peer in json.loads((folder / "world.json").read_text())] == ["node0", "node0"]
    assert [f.name for f in finished_checkpoints(folder)] == ["step-000004", "step-000005"]
    return records[4]


def test_two_nodes_match_one_node_then_go_on_elastically_on_one_node_with_fewer_ranks(tmp_path: Path) -> None:
    """examples/run-ppo.yaml (4 ranks) on 2 nodes x 2 ranks as an elastic job (`--nnodes 1:2
    --max-restarts 1`): its first 4 steps equal a 4-rank run on one host step for step (1e-6
    relative), as does its step-4 checkpoint. Node 1 then dies (agent and ranks SIGKILLed)
    and the job goes on on node 0 alone: torchrun restarts its workers on a world of 2, which
    resume from step 4 replanned for 2 ranks, run step 5, and log the pool event in
    decisions.jsonl. A `--resume` of the folder on 2 ranks then continues after step 5, and a
    torchrun `--resume` job of 1 node x 2 ranks of the folder as it was at the 2x2 job's last
    checkpoint goes on from the same logical state (`resume_by_its_own_job`)."""
    config, single, multi = ppo_config(tmp_path), tmp_path / "single", tmp_path / "multi"
    assert invoke("run", config, "--steps", "5", "--out", single).exit_code == 0
    agents = start_agents(2, 2, config, "--steps", "5", "--out", multi, extra=ELASTIC, rdzv_conf=RENDEZVOUS)
    step_4 = multi / "checkpoints" / "step-000004"
    wait_for(lambda: running(agents) and "step-000004" in {f.name for f in finished_checkpoints(multi)}, 400)
    world = json.loads((multi / "world.json").read_text())
    assert [(peer["rank"], peer["node"]) for peer in world] == [(0, "node0"), (1, "node0"), (2, "node1"), (3, "node1")]
    assert len({peer["memory_domain"] for peer in world}) == 2  # no shared memory across the nodes
    lose_node(agents[1], [peer["pid"] for peer in world[2:]])
    (stderr,) = finish(agents[:1], 400)

    expected, got = read_metrics(single), read_metrics(multi)
    assert [record["step"] for record in got] == [0, 1, 2, 3, 4]
    for want, have in zip(expected[:4], got[:4], strict=True):
        for field, value in want.items():
            assert field in MEASURED or close(value, have[field]), (want["step"], field, value, have[field])
    one = RankLayout(1, 1, 1, (0,))
    for role in ("actor", "critic"):
        saved = load_checkpoint(single / "checkpoints" / "step-000004" / role, one, 0).tensors
        joined = load_checkpoint(step_4 / role, one, 0).tensors
        for key, tensor in saved.items():
            assert (tensor - joined[key]).abs().max() <= 1e-6 * max(1.0, float(tensor.abs().max())), (role, key)

    assert "planned a new layout for 2 ranks" in stderr and f"resuming from {step_4} (step 4)" in stderr
    # the failed attempt says the agent carries on, not to resume by hand
    failed = [line for line in stderr.splitlines() if line.startswith("error: run failed")]
    assert failed and all("torchrun's agent restarts the workers (restart 1 of 1)" in line for line in failed), stderr
    assert all("they resume from step-000004 on their own" in line for line in failed), failed
    assert [peer["node"] for peer in json.loads((multi / "world.json").read_text())] == ["node0", "node0"]
    decisions = [json.loads(line) for line in (multi / "decisions.jsonl").read_text().splitlines()]
    pool = [record for record in decisions if record["observation"].get("event") == "pool"]
    assert len(pool) == 1, decisions
    assert pool[0]["observation"] == {"step": 4, "event": "pool", "restart": 1, "gpus": 2, "previous_gpus": 4}
    assert pool[0]["decision"]["action"] == "replan" and pool[0]["checkpoint"] == "step-000004"
    assert all(checkpoint_problem(folder) is None for folder in finished_checkpoints(multi))
    pids = [peer["pid"] for peer in world]
    wait_for(lambda: not any(alive(pid) for pid in pids) and not guards_of(pids), 10)
    # `--resume` under torchrun takes the same path on the job's world: 2 ranks, no replanning
    again = joined_setup(2, None, None, 6, None, multi)
    assert (again.start_step, again.planned, again.num_ranks) == (5, False, 2)
    # A job of its own resumes the 2x2 job's last checkpoint on 1 node x 2 ranks: its step 4
    # is the elastic restart's (the same checkpoint onto the same 2-rank plan) and continues
    # the uninterrupted 4-rank run's logical state (1e-5 relative or 1e-6 absolute: 2 ranks sum
    # in another order, and the PPO loss is a difference of near-equal terms).
    resumed = resume_by_its_own_job(multi, tmp_path / "resumed")
    for field, value in got[4].items():
        assert field in MEASURED or close(value, resumed[field]), (field, value, resumed[field])
    for field in LEARNING:
        assert close(expected[4][field], resumed[field], 1e-5, 1e-6), (field, expected[4][field], resumed[field])


def test_a_stopped_rank_on_another_node_stops_the_job_within_the_timeout(tmp_path: Path) -> None:
    """SIGSTOP on rank 1, alone on node 1, which hosts the job's store, with
    collective_timeout_s = 10 and no torchrun watchdog: both agents exit within 10 s + 30 s,
    rank 0's terminal gets the one-line error naming rank 1 and its node, no worker or guard
    is left, and the checkpoints stay valid (rank 1's guard kills it; its agent then ends and
    takes the store with it, so rank 0 names rank 1 from what it saw before)."""
    config = write_config(tmp_path, num_steps=40, checkpoint_every=1, collective_timeout_s=TIMEOUT_S)
    out = tmp_path / "out"
    agents = start_agents(2, 1, config, "--out", out, store_on=1)
    wait_for(lambda: running(agents) and bool(finished_checkpoints(out)), 300)
    workers = [peer["pid"] for peer in json.loads((out / "world.json").read_text())]
    assert len(guards_of(workers)) == 2
    os.kill(workers[1], signal.SIGSTOP)
    start = time.monotonic()
    outputs = [agent.communicate(timeout=TIMEOUT_S + 30.0) for agent in agents]
    assert time.monotonic() - start < TIMEOUT_S + 30.0
    assert all(agent.returncode != 0 for agent in agents)
    rank0 = [line for line in outputs[0][1].decode().splitlines() if line.startswith("error: ")]
    assert len(rank0) == 1 and rank0[0].startswith("error: run failed: rank 1 (node node1"), outputs[0][1].decode()
    wait_for(lambda: not any(alive(pid) for pid in workers) and not guards_of(workers), 10)
    checkpoints = finished_checkpoints(out)
    assert checkpoints and all(checkpoint_problem(folder) is None for folder in checkpoints)
    assert "rank 1 (node node1" in (out / "failure.log").read_text()

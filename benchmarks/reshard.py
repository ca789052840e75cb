"""Benchmark: resharding a ~100M-parameter model with its AdamW state between layouts on 2 ranks.

The model is a Llama-style decoder of 100.1M parameters (12 layers, hidden 768, 12 heads,
4 KV heads, SwiGLU 2048, vocabulary 32000, tied embeddings); its state is param, exp_avg
and exp_avg_sq in fp32 (1.2 GB). For each pair of layouts on the same 2 ranks (gloo, one
thread per rank) it times:
  in-memory     nereus.runtime.state.reshard.execute, transport "auto" (the two ranks share a
                host), with each rank's state in its state arena (nereus.runtime.comm.arena:
                shared memory reserved and mapped by both ranks before timing, as a GPU
                job registers its buffers), so every moved piece is copied once, straight
                out of the sender's tensor; the result is allocated in the arena;
  staged        the same without arenas: pieces staged through a shared-memory segment
                (two copies), the result in fresh memory (page faults count);
  DCP           a round trip through torch.distributed.checkpoint: save the source layout
                (tensor-parallel tensors as DTensors, the rest as plain tensors), then load
                into freshly allocated tensors of the target layout (DCP reshards by its
                own chunk metadata);
  buffers       in-memory and DCP again, filling the previous run's target tensors instead
                of fresh ones (the steady state of a repeated reshard such as a weight sync);
  gloo          execute with transport "process_group": every piece a gloo TCP message;
  nereus ckpt   the round trip through nereus.runtime.state.checkpoint.
Every result is checked bitwise against the expected target shards. Both checkpoint
round trips write to a temporary folder on the local disk with fsync; their reads come
from the page cache. Reports medians of --runs, the in-memory speed-ups over DCP, bytes
moved against the lower bound, the busier rank's CPU seconds (user + system, so page
faults count; less sensitive than wall time to other work on the machine), the machine's
load average (others may be working) and whether the ranks ran with transparent huge pages
(--huge-pages; off by default, as in nereus's launcher).
Prints a table and writes benchmarks/results/reshard.json.

    .venv/bin/python benchmarks/reshard.py [--runs 3] [--huge-pages] [--arena-gb 2.5] [--output FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _record import begin, write_result

from nereus.runtime.comm import arena
from nereus.runtime.comm.spawn import HUGE_PAGES_ENV, spawn
from nereus.runtime.state.checkpoint import load_checkpoint, save_checkpoint_distributed
from nereus.runtime.state.piece_exchange import Transport
from nereus.runtime.state.reshard import execute
from nereus.runtime.state.reshard_plan import ReshardPlan, plan_reshard
from nereus.runtime.state.shard_layout import RankLayout, box_shape
from nereus.runtime.state.sharded_state import StateMeta, random_rank_state, state_meta
from nereus.spec.model import Model

RESULTS = Path(__file__).resolve().parent / "results" / "reshard.json"
FAMILIES = ("param", "exp_avg", "exp_avg_sq")
SEED = 2026
MODEL = Model(
    name="bench-100m",
    num_layers=12,
    hidden_dim=768,
    num_heads=12,
    num_kv_heads=4,
    head_dim=64,
    ffn_dim=2048,
    vocab_size=32000,
    tied_embeddings=True,
)
#: (name, source (tp, pp, dp), target (tp, pp, dp)), all on ranks (0, 1).
PAIRS = (
    ("tp2 -> pp2", (2, 1, 1), (1, 2, 1)),
    ("pp2 -> tp2", (1, 2, 1), (2, 1, 1)),
    ("tp2 -> dp2", (2, 1, 1), (1, 1, 2)),
)


def layout_meta(shape: tuple[int, int, int]) -> StateMeta:
    return state_meta(MODEL, "lm", RankLayout(*shape, (0, 1)), FAMILIES)


def timed(action: Any) -> tuple[float, float, Any]:
    """Wall time of `action` across both ranks (barriers on both sides), and this rank's CPU
    seconds in it (user + system: page faults included; less sensitive to other load)."""
    dist.barrier()
    started, started_cpu = time.perf_counter(), time.process_time()
    result = action()
    cpu = time.process_time() - started_cpu
    dist.barrier()
    return time.perf_counter() - started, cpu, result


def dcp_state(meta: StateMeta, rank: int, tensors: dict[str, torch.Tensor], mesh: Any) -> dict[str, Any]:
    """A state dict DCP can reshard: tensor-split shards as DTensors over both ranks, whole ones plain."""
    from torch.distributed.tensor import DTensor, Shard

    state: dict[str, Any] = {}
    for key, box in meta.rank_boxes(rank).items():
        shape = meta.tensors[key].global_shape
        split = [dim for dim, (_, length) in enumerate(box) if length != shape[dim]]
        if not split:
            state[key] = tensors[key]
            continue
        assert meta.layout.tp == 2 and len(split) == 1, (key, box)
        stride = torch.empty(shape, device="meta").stride()
        state[key] = DTensor.from_local(
            tensors[key], mesh, [Shard(split[0])], run_check=False, shape=torch.Size(shape), stride=stride
        )
    return state


def local_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {key: value.to_local() if isinstance(value, DTensor) else value for key, value in state.items()}


#: The target tensors of the previous run to fill in place, or None to allocate fresh ones.
Buffers = dict[str, torch.Tensor] | None


def dcp_round_trip(
    plan: ReshardPlan, rank: int, tensors: dict[str, torch.Tensor], into: Buffers, folder: str, mesh: Any
) -> dict[str, torch.Tensor]:
    """DCP save of the source layout, then load into the target layout (into `into`, else fresh tensors)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(dcp_state(plan.source, rank, tensors, mesh), storage_writer=dcp.FileSystemWriter(folder))
    empty = into or {key: torch.empty(box_shape(box)) for key, box in plan.target.rank_boxes(rank).items()}
    loading = dcp_state(plan.target, rank, empty, mesh)
    dcp.load(loading, storage_reader=dcp.FileSystemReader(folder))
    return local_tensors(loading)


def nereus_round_trip(
    plan: ReshardPlan, rank: int, tensors: dict[str, torch.Tensor], into: Buffers, folder: str, mesh: Any
) -> dict[str, torch.Tensor]:
    path = Path(folder) / "ckpt"
    save_checkpoint_distributed(path, plan.source, rank, tensors, 1)
    return load_checkpoint(path, plan.target.layout, rank).tensors


def in_memory(transport: Transport) -> Any:
    def run(
        plan: ReshardPlan, rank: int, tensors: dict[str, torch.Tensor], into: Buffers, folder: str, mesh: Any
    ) -> dict[str, torch.Tensor]:
        return execute(plan, rank, tensors, 1, transport=transport, out=into).tensors

    return run


def staged(
    plan: ReshardPlan, rank: int, tensors: dict[str, torch.Tensor], into: Buffers, folder: str, mesh: Any
) -> dict[str, torch.Tensor]:
    """execute without the arena: `tensors` is the copy of the state outside it (see measure_pair)."""
    with arena.suspended():
        return execute(plan, rank, tensors, 1, out=into).tensors


#: (name, how, fills the previous run's target tensors). A "buffers" method runs right after
#: its fresh twin and fills that run's result (zeroed first): the steady state of a repeated
#: reshard, e.g. a weight sync every RL step, against DCP loading into the same buffers.
METHODS = (
    ("memory", in_memory("auto"), False),
    ("memory_buffers", in_memory("auto"), True),
    ("memory_staged", staged, False),
    ("memory_gloo", in_memory("process_group"), False),
    ("dcp", dcp_round_trip, False),
    ("dcp_buffers", dcp_round_trip, True),
    ("nereus_ckpt", nereus_round_trip, False),
)


def fresh_folder(rank: int, scratch: str, name: str) -> str:
    """A new empty folder that both ranks use (rank 0 clears it)."""
    folder = Path(scratch) / name
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
    dist.barrier()
    return str(folder)


def zeroed(previous: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`previous` with every tensor zeroed, except those passed through from the source (kept as they are)."""
    return {key: tensor if tensor is source.get(key) else tensor.zero_() for key, tensor in previous.items()}


def measure_pair(
    rank: int, shapes: tuple[tuple[int, int, int], tuple[int, int, int]], runs: int, scratch: str, mesh: Any
) -> dict[str, Any]:
    source, target = layout_meta(shapes[0]), layout_meta(shapes[1])
    plan = plan_reshard(source, target)
    plain = random_rank_state(source, rank, SEED)
    tensors = {key: arena.adopt(tensor) for key, tensor in plain.items()}  # into the worker's arena
    arena.connect()  # maps any chunk the arena grew by since (untimed, like the first connect)
    expected = random_rank_state(target, rank, SEED)
    times: dict[str, list[float]] = {name: [] for name, _, _ in METHODS}
    cpu_times: dict[str, list[float]] = {name: [] for name, _, _ in METHODS}
    correct = True
    for run in range(runs):
        previous: Buffers = None
        for name, trip, fills in METHODS:
            into = zeroed(previous, tensors) if fills and previous else None
            previous = None  # at most one target state alive, so methods do not pay for each other's memory
            folder = fresh_folder(rank, scratch, f"{name}-{run}")
            state = plain if trip is staged else tensors
            elapsed, cpu, result = timed(partial(trip, plan, rank, state, into, folder, mesh))
            times[name].append(elapsed)
            cpu_times[name].append(cpu)
            correct &= result.keys() == expected.keys() and all(torch.equal(result[k], expected[k]) for k in expected)
            previous, into = result, None
            del result
    flags: list[Any] = [None, None]
    dist.all_gather_object(flags, correct)
    per_rank_cpu: list[Any] = [None, None]
    dist.all_gather_object(per_rank_cpu, cpu_times)
    # Per run, the busier rank's CPU seconds.
    cpu = {name: [max(pair) for pair in zip(*(c[name] for c in per_rank_cpu), strict=True)] for name in cpu_times}
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "source": shapes[0],
        "target": shapes[1],
        **{f"{name}_s": median for name, median in medians.items()},
        **{f"{name}_cpu_s": statistics.median(values) for name, values in cpu.items()},
        "speedup_vs_dcp": medians["dcp"] / medians["memory"],
        "speedup_buffers_vs_dcp_buffers": medians["dcp_buffers"] / medians["memory_buffers"],
        "speedup_gloo_vs_dcp": medians["dcp"] / medians["memory_gloo"],
        "speedup_staged_vs_dcp": medians["dcp"] / medians["memory_staged"],
        "bytes_moved": plan.bytes_moved,
        "lower_bound_bytes": plan.lower_bound,
        "state_bytes": sum(source.rank_bytes(r) for r in (0, 1)),
        "bitwise_equal": all(flags),
        "all_times_s": times,
        "all_cpu_s": cpu,
    }


def _worker(
    rank: int, world_size: int, runs: int, scratch: str, arena_bytes: int
) -> tuple[str | None, list[dict[str, Any]], int]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))  # made once: not part of any timed round trip
    state_arena = arena.reserve(arena_bytes)  # reserved and mapped once, untimed
    rows = [
        {"pair": name, **measure_pair(rank, (source, target), runs, scratch, mesh)} for name, source, target in PAIRS
    ]
    return os.environ.get(HUGE_PAGES_ENV), rows, len(state_arena.chunks)


def kernel_thp_mode(kind: str) -> str:
    """The kernel's transparent-huge-page mode for anonymous ("enabled") or shmem memory."""
    try:
        text = Path(f"/sys/kernel/mm/transparent_hugepage/{kind}").read_text()
    except OSError:
        return "unavailable"
    return text.split("[")[1].split("]")[0] if "[" in text else text.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="timed repetitions per pair (median reported)")
    parser.add_argument(
        "--huge-pages",
        action=argparse.BooleanOptionalAction,
        default=False,
        help=f"spawn the ranks with {HUGE_PAGES_ENV}=1 (off by default, as in nereus; a value in the environment wins)",
    )
    parser.add_argument(
        "--arena-gb", type=float, default=2.5, help="each rank's state arena in GB (it grows when short)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="where the JSON results go")
    args = parser.parse_args()
    if not args.arena_gb > 0:
        parser.error(f"--arena-gb must be positive, got {args.arena_gb}")
    recording = begin()
    load_before = os.getloadavg()[0]
    arena_bytes = int(args.arena_gb * 1e9)
    with tempfile.TemporaryDirectory(prefix="nereus-reshard-bench-") as scratch:
        outcomes = spawn(_worker, 2, args.runs, scratch, arena_bytes, huge_pages=args.huge_pages)
    rank_huge_pages, rows, _ = outcomes[0]
    arena_chunks = [chunks for _, _, chunks in outcomes]
    thp = {
        "rank_env": rank_huge_pages,
        "kernel_anon": kernel_thp_mode("enabled"),
        "kernel_shmem": kernel_thp_mode("shmem_enabled"),
    }
    gb = 1e9
    print(f"{MODEL.name}: {MODEL.num_params() / 1e6:.1f}M params, state {rows[0]['state_bytes'] / gb:.2f} GB (fp32 x3)")
    print(f"load average before/after: {load_before:.2f} / {os.getloadavg()[0]:.2f} (1 min)")
    print(
        f"ranks' {HUGE_PAGES_ENV}={thp['rank_env']}; kernel THP: anonymous {thp['kernel_anon']}, "
        f"shmem {thp['kernel_shmem']}"
    )
    print(f"state arena: {args.arena_gb:g} GB per rank; chunks at the end per rank: {arena_chunks}")
    print(
        f"{'pair':<12} {'in-memory':>10} {'DCP':>7} {'speed-up':>9} {'| buffers:':>10} {'in-mem':>7} {'DCP':>7} "
        f"{'speed-up':>9} {'| staged':>9} {'gloo':>6} {'nereus ckpt':>12} {'moved GB':>9} {'bound GB':>9}"
    )
    for row in rows:
        print(
            f"{row['pair']:<12} {row['memory_s']:>9.3f}s {row['dcp_s']:>6.2f}s {row['speedup_vs_dcp']:>8.1f}x "
            f"{'':>10} {row['memory_buffers_s']:>6.3f}s {row['dcp_buffers_s']:>6.2f}s "
            f"{row['speedup_buffers_vs_dcp_buffers']:>8.1f}x {row['memory_staged_s']:>8.3f}s "
            f"{row['memory_gloo_s']:>5.2f}s "
            f"{row['nereus_ckpt_s']:>11.2f}s {row['bytes_moved'] / gb:>9.3f} {row['lower_bound_bytes'] / gb:>9.3f}"
            + ("" if row["bitwise_equal"] else "  MISMATCH")
        )
    print(f"{'CPU s, busier rank':<19} {'in-memory':>10} {'buffers':>8} {'staged':>8} {'DCP':>7}")
    for row in rows:
        fresh, buffers, dcp = row["memory_cpu_s"], row["memory_buffers_cpu_s"], row["dcp_cpu_s"]
        print(f"{row['pair']:<19} {fresh:>9.3f}s {buffers:>7.3f}s {row['memory_staged_cpu_s']:>7.3f}s {dcp:>6.2f}s")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "reshard",
        "model": MODEL.name,
        "params": MODEL.num_params(),
        "ranks": 2,
        "threads_per_rank": 1,
        "runs": args.runs,
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "transparent_huge_pages": thp,
        "arena_gb_per_rank": args.arena_gb,
        "arena_chunks_at_end": arena_chunks,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "results": rows,
    }
    repetitions = {row["pair"]: {"wall_s": row["all_times_s"], "cpu_s": row["all_cpu_s"]} for row in rows}
    write_result(args.output, payload, recording, repetitions)


if __name__ == "__main__":
    main()

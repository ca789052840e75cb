"""The hardware profiler behind `nereus profile`: GEMMs, attention, memory copies, collectives.

Compute is timed in this process with the threads one rank gets; collectives and
communicator set-up are timed across `num_ranks` spawned local ranks (gloo on CPUs, NCCL
on GPUs). Every time is a median of repeated runs after a warm-up run.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from nereus.cost.profile import (
    COLLECTIVE_OPS,
    AttentionMeasurement,
    CollectiveMeasurement,
    GemmMeasurement,
    Profile,
    TimedSize,
    fit_latency_bandwidth,
)
from nereus.errors import ArgumentError
from nereus.runtime.observe.vllm_profiling import cpu_only, measure_vllm_engine, vllm_problem
from nereus.spec.model import Model

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ProfileConfig:
    """What to measure and how long to spend on it."""

    models: tuple[Model, ...]
    """Models whose layer shapes the GEMMs and attention take."""
    num_ranks: int = 2
    """Local ranks for the collectives (one device each); 1 skips them."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where to measure."""
    quick: bool = False
    """Fewer, shorter measurements (well under a minute on a 2-core CPU)."""
    threads_per_rank: int = 1
    """CPU threads each rank uses (torch.set_num_threads)."""
    vllm: bool = False
    """Also start a tiny vLLM engine and time its phases (`nereus.runtime.observe.vllm_profiling`)."""

    @property
    def tokens(self) -> int:
        """Rows of every GEMM: a micro-batch of tokens."""
        return 256 if self.quick else 1024

    @property
    def seconds_per_point(self) -> float:
        """Wall time spent repeating one measurement."""
        return 0.04 if self.quick else 0.25

    @property
    def collective_bytes(self) -> list[int]:
        """Message sizes of the collective sweep: 4 B up to 4 MiB (quick) or 64 MiB."""
        top, step = (22, 4) if self.quick else (26, 2)  # powers of 2: every 16th or every 4th
        return [2**exponent for exponent in range(2, top + 1, step)]

    @property
    def copy_bytes(self) -> int:
        """Size of the memory-bandwidth copy."""
        return 2**25 if self.quick else 2**28

    @property
    def adam_params(self) -> int:
        """fp32 parameters of the host AdamW step (1 MiB or 16 MiB of them, and thrice that of
        gradients and moments)."""
        return 2**18 if self.quick else 2**22


def gemm_shapes(models: tuple[Model, ...], tokens: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of every dense layer of the models: QKV, output, MLP in and out, LM head."""
    shapes: list[tuple[int, int, int]] = []
    for model in models:
        q_dim, kv_dim = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
        h = model.hidden_dim
        for n, k in (
            (q_dim + 2 * kv_dim, h),
            (h, q_dim),
            (model.ffn_dim, h),
            (h, model.ffn_dim),
            (model.vocab_size, h),
        ):
            shapes.append((tokens, n, k))
    return list(dict.fromkeys(shapes))  # each shape once, in first-seen order


def attention_shapes(models: tuple[Model, ...], quick: bool) -> list[tuple[int, int, int, int]]:
    """(batch, heads, seq_len, head_dim) per distinct head shape of the models."""
    batch, seq_len = (4, 128) if quick else (8, 512)
    return list(dict.fromkeys((batch, model.num_heads, seq_len, model.head_dim) for model in models))


def median_seconds(fn: Callable[[], Any], budget_s: float, synchronize: Callable[[], None]) -> float:
    """Median time of `fn` over repeats filling `budget_s` (one warm-up call first)."""
    fn()
    synchronize()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 10_000):
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronizer(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def measure_gemms(config: ProfileConfig, dtype: Any, progress: Callable[[], None]) -> list[GemmMeasurement]:
    import torch

    out = []
    for m, n, k in gemm_shapes(config.models, config.tokens):
        a = torch.randn(m, k, dtype=dtype, device=config.device)
        b = torch.randn(k, n, dtype=dtype, device=config.device)
        seconds = median_seconds(partial(torch.matmul, a, b), config.seconds_per_point, _synchronizer(config.device))
        out.append(GemmMeasurement(m=m, n=n, k=k, seconds=seconds, flops_per_s=2.0 * m * n * k / seconds))
        progress()
    return out


def measure_attention(config: ProfileConfig, dtype: Any, progress: Callable[[], None]) -> list[AttentionMeasurement]:
    import torch
    import torch.nn.functional as F

    out = []
    for batch, heads, seq_len, head_dim in attention_shapes(config.models, config.quick):
        q, k, v = (torch.randn(batch, heads, seq_len, head_dim, dtype=dtype, device=config.device) for _ in range(3))
        seconds = median_seconds(
            partial(F.scaled_dot_product_attention, q, k, v, is_causal=True),
            config.seconds_per_point,
            _synchronizer(config.device),
        )
        flops = 2.0 * batch * heads * seq_len * seq_len * head_dim  # causal: half of 4 b h s^2 d
        out.append(
            AttentionMeasurement(
                batch=batch,
                heads=heads,
                seq_len=seq_len,
                head_dim=head_dim,
                seconds=seconds,
                flops_per_s=flops / seconds,
            )
        )
        progress()
    return out


def measure_copy_bandwidth(config: ProfileConfig) -> float:
    """Bytes read plus written per second by a large device-to-device copy."""
    import torch

    source = torch.ones(config.copy_bytes // 4, dtype=torch.float32, device=config.device)
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), config.seconds_per_point, _synchronizer(config.device))
    return 2.0 * config.copy_bytes / seconds


def measure_host_adam(config: ProfileConfig) -> float:
    """Parameters per second torch's AdamW updates on this machine's CPUs with every thread
    (fp32 parameters, gradients and moments): the host optimizer step of training-time offload
    (`Calibration.host_adam_params_per_s`)."""
    import torch

    param = torch.nn.Parameter(torch.zeros(config.adam_params))
    param.grad = torch.full_like(param, 1e-3)
    optimizer = torch.optim.AdamW([param], lr=1e-4)
    seconds = median_seconds(optimizer.step, config.seconds_per_point, lambda: None)
    return config.adam_params / seconds


# ---- collectives, on spawned ranks ----


def _slowest(seconds: float) -> float:
    """The largest of every rank's `seconds` (collective)."""
    import torch

    from nereus.runtime.comm import collectives
    from nereus.runtime.comm.world import device as rank_device

    value = torch.tensor([seconds], dtype=torch.float64, device=rank_device())
    collectives.all_reduce(value, op="max")
    return float(value.item())


def _collective_call(op: str, rank: int, world: int, tensor: Any) -> Callable[[], None]:
    import torch
    import torch.distributed as dist

    from nereus.runtime.comm import collectives

    # The engine's own calls: on one host they go through shared memory, not the process group.
    if op == "all_reduce":
        return lambda: collectives.all_reduce(tensor)
    if op == "all_gather":
        shards = [torch.empty_like(tensor) for _ in range(world)]
        return lambda: collectives.all_gather(shards, tensor)
    if op == "broadcast":
        return lambda: collectives.broadcast(tensor, 0)
    assert op == "p2p", op

    def ping_pong() -> None:  # rank 0 -> 1 -> 0; the others wait at the next barrier
        if rank == 0:
            dist.send(tensor, dst=1)
            dist.recv(tensor, src=1)
        elif rank == 1:
            dist.recv(tensor, src=0)
            dist.send(tensor, dst=0)

    return ping_pong


def _time_collective(call: Callable[[], None], budget_s: float, device: str) -> float:
    """Median over 3 trials of the slowest rank's mean time per call."""
    from nereus.runtime.comm import collectives

    sync = _synchronizer(device)
    call()
    sync()
    start = time.perf_counter()
    call()
    sync()
    once = time.perf_counter() - start
    # Repeats every rank agrees on (the largest estimate), so the loops stay matched.
    repeats = int(_slowest(max(1.0, min(200.0, budget_s / 3 / max(once, 1e-7)))))
    trials = []
    for _ in range(3):
        collectives.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        sync()
        trials.append(_slowest((time.perf_counter() - start) / repeats))
    return statistics.median(trials)


def collective_worker(
    rank: int, world: int, sizes: list[int], budget_s: float, device: str
) -> tuple[dict[str, list[tuple[int, float]]], float]:
    """Every collective at every size, and the communicator set-up time (on every rank)."""
    import torch
    import torch.distributed as dist

    from nereus.runtime.comm import collectives
    from nereus.runtime.comm.world import device as rank_device

    timings: dict[str, list[tuple[int, float]]] = {}
    for op in COLLECTIVE_OPS:
        timings[op] = []
        for size in sizes:
            tensor = torch.ones(max(1, size // 4), dtype=torch.float32, device=rank_device())
            seconds = _time_collective(_collective_call(op, rank, world, tensor), budget_s, device)
            # A ping-pong crosses the link twice.
            timings[op].append((size, seconds / 2 if op == "p2p" else seconds))
    setups = []
    probe = torch.ones(1, device=rank_device())
    for _ in range(3):
        collectives.barrier()
        start = time.perf_counter()
        group = dist.new_group(list(range(world)))  # a fresh communicator each time: its set-up is measured
        dist.all_reduce(probe, group=group)
        _synchronizer(device)()
        setups.append(_slowest(time.perf_counter() - start))
    return timings, statistics.median(setups)


def measure_collectives(config: ProfileConfig) -> tuple[list[CollectiveMeasurement], float]:
    from nereus.runtime.comm.spawn import spawn

    sizes = config.collective_bytes
    with cpu_only(config.device):
        results = spawn(
            collective_worker,
            config.num_ranks,
            sizes,
            config.seconds_per_point,
            config.device,
            num_threads=config.threads_per_rank,
        )
    timings, setup_s = results[0]  # every rank holds the slowest rank's times
    measured = []
    for op in COLLECTIVE_OPS:
        points = [TimedSize(bytes=size, seconds=seconds) for size, seconds in timings[op]]
        latency, bandwidth = fit_latency_bandwidth([(p.bytes, p.seconds) for p in points])
        ranks = 2 if op == "p2p" else config.num_ranks
        measured.append(
            CollectiveMeasurement(op=op, num_ranks=ranks, sizes=points, latency_s=latency, bytes_per_s=bandwidth)
        )
    return measured, setup_s


# ---- the whole profile ----


def _device_facts(config: ProfileConfig) -> tuple[str, int]:
    """(device name, memory bytes per rank)."""
    import torch

    if config.device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        return str(properties.name), int(properties.total_memory)
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:  # not Linux: keep the name
        name = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), name)
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return name or "cpu", int(total // max(1, config.num_ranks))


def device_problem(config: ProfileConfig) -> str | None:
    """Why `config` cannot run on this machine (None when it can)."""
    import torch

    if config.device == "cuda":
        if not torch.cuda.is_available():
            return "`device` cuda: no CUDA device is visible; use `device` cpu"
        if config.num_ranks > torch.cuda.device_count():
            return f"`num_ranks` {config.num_ranks}: only {torch.cuda.device_count()} GPUs are visible"
    elif config.num_ranks > (os.cpu_count() or 1):
        return f"`num_ranks` {config.num_ranks}: more ranks than the {os.cpu_count()} CPU cores measure contention"
    return None


def run_profile(config: ProfileConfig, progress: Progress | None = None) -> Profile:
    """Measure this machine; `progress(done, total)` is called after each measurement."""
    import torch

    problem = device_problem(config) or (vllm_problem() if config.vllm else None)
    if problem:
        raise ArgumentError(problem, *(name for name in ("device", "num_ranks", "vllm") if f"`{name}`" in problem))
    dtype_name = "bf16" if config.device == "cuda" else "fp32"
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    total = len(gemm_shapes(config.models, config.tokens)) + len(attention_shapes(config.models, config.quick)) + 3
    total += int(config.vllm)
    done = [0]

    def step() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total)

    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads_per_rank)
    try:
        gemm = measure_gemms(config, dtype, step)
        attention = measure_attention(config, dtype, step)
        bandwidth = measure_copy_bandwidth(config)
        step()
    finally:
        torch.set_num_threads(threads)
    host_adam = measure_host_adam(config)  # the host's every thread, as an offloaded optimizer steps
    step()
    collectives: list[CollectiveMeasurement] = []
    setup_s = None
    if config.num_ranks > 1:
        collectives, setup_s = measure_collectives(config)
    step()
    engine = None
    if config.vllm:
        engine = measure_vllm_engine(config.device, config.quick)
        step()
    name, memory = _device_facts(config)
    return Profile(
        device=config.device,
        device_name=name,
        backend="nccl" if config.device == "cuda" else "gloo",
        num_ranks=config.num_ranks,
        threads_per_rank=config.threads_per_rank,
        memory_bytes=memory,
        dtype=dtype_name,  # type: ignore[arg-type]
        gemm=gemm,
        attention=attention,
        memory_bytes_per_s=bandwidth,
        host_adam_params_per_s=host_adam,
        collectives=collectives,
        communicator_setup_s=setup_s,
        models=list(dict.fromkeys(m.name for m in config.models)),
        vllm=engine,
    )

"""Profile: what `nereus profile` measured on one machine, and the Cluster it stands for.

The measurements themselves run in `nereus.runtime.observe.profiling` (torch); this module is the
document, its semantic checks and the conversion to a Cluster, and imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import numpy as np
from pydantic import Field

from nereus.cost.calibration import Calibration
from nereus.cost.vllm_engine import VllmEngineMeasurement
from nereus.spec.base import Document, StrictModel
from nereus.spec.check import Problem
from nereus.spec.cluster import Cluster, GpuKind, Link, size_problem
from nereus.spec.workload import DType

CollectiveOp = Literal["all_reduce", "all_gather", "broadcast", "p2p"]
COLLECTIVE_OPS: tuple[CollectiveOp, ...] = ("all_reduce", "all_gather", "broadcast", "p2p")


class GemmMeasurement(StrictModel):
    """One matrix product [m, k] x [k, n], timed."""

    m: int = Field(gt=0)
    """Rows of the left operand (tokens)."""
    n: int = Field(gt=0)
    """Columns of the right operand (output features)."""
    k: int = Field(gt=0)
    """Shared dimension (input features)."""
    seconds: float = Field(gt=0)
    """Median wall time of one product."""
    flops_per_s: float = Field(gt=0)
    """2 m n k / seconds."""


class AttentionMeasurement(StrictModel):
    """One causal scaled-dot-product attention forward, timed."""

    batch: int = Field(gt=0)
    """Sequences."""
    heads: int = Field(gt=0)
    """Attention heads."""
    seq_len: int = Field(gt=0)
    """Tokens per sequence (queries = keys)."""
    head_dim: int = Field(gt=0)
    """Features per head."""
    seconds: float = Field(gt=0)
    """Median wall time of one forward."""
    flops_per_s: float = Field(gt=0)
    """Causal QK^T and AV FLOPs (2 b h s^2 d) / seconds."""


class TimedSize(StrictModel):
    """One message size of a collective and its median time."""

    bytes: int = Field(gt=0)
    """Bytes each rank contributes (all-gather: its own shard)."""
    seconds: float = Field(gt=0)
    """Median wall time on the slowest rank."""


class CollectiveMeasurement(StrictModel):
    """One collective over all ranks (p2p: rank 0 to rank 1) at several sizes, and its line fit."""

    op: CollectiveOp
    """all_reduce, all_gather, broadcast or p2p (a send/recv pair)."""
    num_ranks: int = Field(ge=2)
    """Ranks taking part."""
    sizes: list[TimedSize] = Field(min_length=2)
    """Measured message sizes, ascending."""
    latency_s: float = Field(ge=0)
    """Intercept of seconds = latency + bytes / bandwidth (least squares)."""
    bytes_per_s: float = Field(gt=0)
    """Inverse slope of that line: the bandwidth large messages see."""


class Profile(Document):
    """Measured throughput of one machine's devices and the links between its local ranks."""

    kind: Literal["Profile"] = "Profile"
    device: Literal["cpu", "cuda"]
    """Where the measurements ran."""
    device_name: str = Field(min_length=1)
    """The processor or GPU model, as the system names it."""
    backend: Literal["gloo", "nccl"]
    """torch.distributed backend of the collective measurements."""
    num_ranks: int = Field(gt=0)
    """Local ranks (processes, one device each) the collectives ran on."""
    threads_per_rank: int = Field(gt=0)
    """CPU threads each rank used (torch.set_num_threads)."""
    memory_bytes: int = Field(gt=0)
    """Device memory per rank (on a CPU: the machine's memory divided by the ranks)."""
    dtype: DType
    """Dtype of the GEMM and attention measurements (fp32 on CPUs, bf16 on GPUs)."""
    gemm: list[GemmMeasurement] = Field(min_length=1)
    """Matrix products of the shapes the profiled models' layers use."""
    attention: list[AttentionMeasurement] = Field(min_length=1)
    """Causal attention forwards of the profiled models' head shapes."""
    memory_bytes_per_s: float = Field(gt=0)
    """Device-memory bandwidth of a large copy (bytes read + written per second)."""
    host_adam_params_per_s: float | None = Field(default=None, gt=0)
    """Parameters per second torch's AdamW step updates on the host CPUs with every thread (fp32;
    None: profiled before it was measured): `Calibration.host_adam_params_per_s`."""
    collectives: list[CollectiveMeasurement] = Field(default_factory=list)
    """Collectives across the ranks (empty with one rank)."""
    communicator_setup_s: float | None = Field(default=None, ge=0)
    """Seconds to create a process group over all ranks and run its first collective (None: one rank)."""
    models: list[str] = Field(default_factory=list)
    """Names of the models whose shapes were measured."""
    vllm: VllmEngineMeasurement | None = None
    """A tiny vLLM engine's start-up, weight load and sleep/wake times (`nereus profile --vllm`);
    None: not measured. `nereus fit --profile` starts from them."""

    @property
    def peak_flops(self) -> float:
        """The best GEMM throughput measured: the cost model's 100% for this dtype."""
        return max(g.flops_per_s for g in self.gemm)

    def collective(self, op: CollectiveOp) -> CollectiveMeasurement | None:
        return next((c for c in self.collectives if c.op == op), None)


def fit_latency_bandwidth(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(latency, bytes/s) of seconds = latency + bytes / bandwidth over (bytes, seconds) points.

    Least squares on relative residuals, so the small messages (which fix the latency)
    count as much as the large ones (which fix the bandwidth). A negative intercept is
    noise: it becomes 0 and the slope is refitted through the origin.
    """
    assert len(points) >= 2, points
    sizes = np.array([float(b) for b, _ in points])
    seconds = np.array([t for _, t in points])
    weights = 1.0 / seconds
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (latency, slope), *_ = np.linalg.lstsq(design, np.ones_like(sizes), rcond=None)
    if latency < 0 or slope <= 0:
        latency = max(0.0, float(latency)) if slope > 0 else float(np.min(seconds))
        slope = float(np.median(np.maximum(seconds - latency, 1e-12) / sizes))
    return float(latency), float(1.0 / slope)


def cluster_from_profile(profile: Profile, source: str, num_gpus: int | None = None) -> Cluster:
    """A one-node Cluster of `num_gpus` devices (default: the profiled ranks) as measured.

    The cost model prices fp32 at half the bf16 rate, so an fp32 GEMM peak is doubled to
    give the bf16 figure it expects. The link is the point-to-point fit; one machine has no
    inter-node link, so the inter-node link repeats it.
    """
    p2p = profile.collective("p2p")
    if p2p is None:
        raise ValueError(
            f"{source}: collectives: no p2p measurement (profiled on {profile.num_ranks} rank); "
            "rerun `nereus profile --nproc 2` or more"
        )
    flops = profile.peak_flops * (2.0 if profile.dtype == "fp32" else 1.0)
    gpu = GpuKind(
        name=f"{profile.device_name} (measured)",
        memory_bytes=profile.memory_bytes,
        bf16_flops=flops,
        hbm_bytes_per_s=profile.memory_bytes_per_s,
    )
    link = Link(bytes_per_s=p2p.bytes_per_s, latency_s=p2p.latency_s)
    count = num_gpus or profile.num_ranks
    problem = size_problem(1, count)
    if problem:
        raise ValueError(f"{source}: a one-node cluster of {problem}")
    return Cluster(
        name=f"profile-{profile.device}-1x{count}",
        num_nodes=1,
        gpus_per_node=count,
        gpu=gpu,
        intra_node=link,
        inter_node=link,
    )


def calibration_from_profile(profile: Profile, calibration: Calibration) -> Calibration:
    """`calibration` with what the profile measured of it: the host AdamW throughput."""
    if profile.host_adam_params_per_s is None:
        return calibration
    return calibration.model_copy(update={"host_adam_params_per_s": profile.host_adam_params_per_s})


def profile_problems(profile: Profile) -> Iterator[Problem]:
    """Measurements that contradict each other (a hand-edited or truncated profile)."""
    ops = [c.op for c in profile.collectives]
    for i, op in enumerate(ops):
        if ops.index(op) != i:
            yield Problem(f"collectives[{i}].op", f"{op} is measured twice; keep one")
    for i, measured in enumerate(profile.collectives):
        if measured.num_ranks > profile.num_ranks and measured.op != "p2p":
            yield Problem(
                f"collectives[{i}].num_ranks",
                f"{measured.num_ranks} ranks but the profile has num_ranks {profile.num_ranks}; fix either",
            )
        sizes = [s.bytes for s in measured.sizes]
        if sizes != sorted(set(sizes)):
            yield Problem(f"collectives[{i}].sizes", "sizes must be distinct and ascending by bytes")
    if profile.num_ranks > 1 and not profile.collectives:
        yield Problem("collectives", f"{profile.num_ranks} ranks but no collective measured", "warning")

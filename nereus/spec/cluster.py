"""Cluster: the GPUs a job may use and the links between them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from nereus.spec.base import Document, StrictModel

#: The most GPUs a cluster may have: the plan search was measured at 6 s for 16384 GPUs on a
#: 2-core VM, and nothing larger is tested (a careless `num_nodes: 1e9` would search for hours).
MAX_CLUSTER_GPUS = 16384


def size_problem(num_nodes: int, gpus_per_node: int) -> str | None:
    """Why a cluster of this size is refused (None: it is not)."""
    if num_nodes * gpus_per_node > MAX_CLUSTER_GPUS:
        return f"{num_nodes * gpus_per_node} GPUs; nereus handles clusters of at most {MAX_CLUSTER_GPUS}"
    return None


class GpuKind(StrictModel):
    """One accelerator type, from its vendor datasheet."""

    name: str = Field(min_length=1)
    """Human-readable name, e.g. `H100-SXM-80GB`."""
    memory_bytes: int = Field(gt=0)
    """Device memory in bytes (80 GiB = 85899345920)."""
    bf16_flops: float = Field(gt=0)
    """Dense (non-sparse) bf16 tensor throughput in FLOP/s."""
    hbm_bytes_per_s: float = Field(gt=0)
    """Device-memory bandwidth in bytes/s."""


class Link(StrictModel):
    """A link class as one GPU sees it: bandwidth per direction and latency."""

    bytes_per_s: float = Field(gt=0)
    """Unidirectional bandwidth available to one GPU, in bytes/s."""
    latency_s: float = Field(ge=0)
    """One-message latency in seconds."""


#: PCIe Gen5 x16 is 64 GB/s per direction; a node's GPUs pair up behind shared switch
#: uplinks to the host, so one GPU offloading while its neighbour does gets about half.
PCIE5_X16_SHARE = Link(bytes_per_s=32e9, latency_s=10e-6)

#: A DGX H100's system memory: 2 TB of DDR5 per node (NVIDIA DGX H100 datasheet), taken as 2 TiB.
DGX_HOST_MEMORY_BYTES = 2 * 2**40


class Cluster(Document):
    """Homogeneous nodes of identical GPUs; GPU ids are node * gpus_per_node + local."""

    kind: Literal["Cluster"] = "Cluster"
    name: str = Field(min_length=1)
    """Name used in reports, e.g. `h100-sxm-8x8`."""
    num_nodes: int = Field(gt=0, le=MAX_CLUSTER_GPUS)
    """Number of nodes."""
    gpus_per_node: int = Field(gt=0, le=MAX_CLUSTER_GPUS)
    """GPUs in each node; tensor parallelism stays inside one node."""
    gpu: GpuKind
    """The accelerator in every slot."""
    intra_node: Link
    """GPU-to-GPU link inside a node (NVLink, Infinity Fabric)."""
    inter_node: Link
    """Per-GPU network link between nodes (InfiniBand, RoCE, Slingshot)."""
    host_link: Link = PCIE5_X16_SHARE
    """Per-GPU share of the host-device link (PCIe) when every GPU of a node moves states to or
    from host memory at once: prices offloading idle model-stages and training-time offload.
    Default: half of PCIe Gen5 x16."""
    host_memory_bytes: int = Field(default=DGX_HOST_MEMORY_BYTES, gt=0)
    """Host (CPU) memory of one node in bytes, shared by its GPUs' offloaded states: a plan whose
    model-stages keep more in one node's host memory (training-time offload, and idle states
    asleep) is refused. Default: a DGX H100's 2 TB (NVIDIA's datasheet), as 2 TiB."""

    @model_validator(mode="after")
    def _not_too_large(self) -> Cluster:
        problem = size_problem(self.num_nodes, self.gpus_per_node)
        if problem:
            raise ValueError(f"{self.num_nodes} nodes x {self.gpus_per_node} GPUs: {problem}")
        return self

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        """The node that holds GPU id `gpu`."""
        return gpu // self.gpus_per_node


def _shape_fields(cluster: Cluster) -> dict[str, object]:
    """What a pool change keeps: everything but the name and the node count."""
    return cluster.model_dump(exclude={"name", "num_nodes"})


def cluster_mismatch(a: Cluster, b: Cluster) -> list[str]:
    """The fields (besides name and node count) in which two clusters differ."""
    shape_a, shape_b = _shape_fields(a), _shape_fields(b)
    return [name for name in shape_a if shape_a[name] != shape_b[name]]


def larger_pool(a: Cluster, b: Cluster) -> Cluster | None:
    """The larger of two clusters of the same GPU kind, node shape and links that differ only
    in node count (the smaller one is then its first nodes: GPU ids agree); None otherwise."""
    if cluster_mismatch(a, b) or a.num_nodes == b.num_nodes:
        return None
    return a if a.num_nodes > b.num_nodes else b

"""Cluster: the GPUs a job may use and the links between them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nereus.spec.base import Document, StrictModel


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


class Cluster(Document):
    """Homogeneous nodes of identical GPUs; GPU ids are node * gpus_per_node + local."""

    kind: Literal["Cluster"] = "Cluster"
    name: str = Field(min_length=1)
    """Name used in reports, e.g. `h100-sxm-8x8`."""
    num_nodes: int = Field(gt=0)
    """Number of nodes."""
    gpus_per_node: int = Field(gt=0)
    """GPUs in each node; tensor parallelism stays inside one node."""
    gpu: GpuKind
    """The accelerator in every slot."""
    intra_node: Link
    """GPU-to-GPU link inside a node (NVLink, Infinity Fabric)."""
    inter_node: Link
    """Per-GPU network link between nodes (InfiniBand, RoCE, Slingshot)."""
    host_link: Link = PCIE5_X16_SHARE
    """Per-GPU share of the host-device link (PCIe) when every GPU of a node moves states to or
    from host memory at once: prices offloading idle model-stages. Default: half of PCIe Gen5 x16."""

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        """The node that holds GPU id `gpu`."""
        return gpu // self.gpus_per_node

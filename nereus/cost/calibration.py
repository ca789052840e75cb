"""Calibration: the cost model's efficiency knobs, one per operation class."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nereus.spec.base import Document
from nereus.spec.cluster import Cluster


class Calibration(Document):
    """Achieved fraction of peak per operation class, plus fixed overheads.

    The defaults are typical of Megatron/vLLM on NVIDIA GPUs (GEMMs reach 50-70% of
    dense peak, decode streams weights at 60-80% of HBM bandwidth, NCCL rings reach
    70-80% of link bandwidth). Pass measured values with `nereus plan --calibration FILE`.
    """

    kind: Literal["Calibration"] = "Calibration"
    gemm: float = Field(default=0.6, gt=0, le=1)
    """Fraction of dense bf16 peak reached by the dense layers (GEMMs)."""
    decode_gemm: float | None = Field(default=None, gt=0, le=1)
    """Fraction of dense peak reached by the decode GEMMs (a few rows per token step, far
    below large-batch GEMMs on most hardware); None: the same as `gemm`."""
    attention: float = Field(default=0.4, gt=0, le=1)
    """Fraction of dense bf16 peak reached by attention score/value products."""
    decode_memory: float = Field(default=0.7, gt=0, le=1)
    """Fraction of HBM bandwidth reached by memory-bound work (decode, optimizer)."""
    collective_intra: float = Field(default=0.75, gt=0, le=1)
    """Fraction of intra-node link bandwidth reached by collectives and p2p."""
    collective_inter: float = Field(default=0.7, gt=0, le=1)
    """Fraction of inter-node link bandwidth reached by collectives and p2p."""
    launch_overhead_s: float = Field(default=1e-5, ge=0)
    """Fixed cost per layer per forward or backward pass (kernel launches)."""
    communicator_setup_s: float = Field(default=0.1, ge=0)
    """Seconds to create one process group (NCCL communicator) for a new layout."""
    workspace_fraction: float = Field(default=0.03, ge=0, lt=1)
    """Device memory reserved per GPU for runtime, communicators and allocator slack."""
    memory_headroom: float = Field(default=0.1, ge=0, lt=1)
    """A layout is feasible when it uses at most (1 - headroom) of device memory."""
    link_latency_scale: float = Field(default=1.0, gt=0)
    """Achieved over nominal link latency: the software cost of one small message or collective hop."""
    micro_batch_overhead_s: float = Field(default=0.0, ge=0)
    """Fixed seconds per micro-batch per forward or backward pass beyond the layers (embedding,
    head, loss and the objective's element-wise work): large on CPUs, negligible on GPUs."""
    stage_overhead_s: float = Field(default=0.0, ge=0)
    """Fixed seconds per model-stage per step (moving its rows between ranks, building batches)."""
    decode_token_overhead_s: float = Field(default=0.0, ge=0)
    """Fixed seconds per generated token beyond the layers (sampling, stop checks, sharing tokens)."""
    step_overhead_s: float = Field(default=0.0, ge=0)
    """Fixed seconds per RL step outside the model-stages (advantages, prompt sampling, metrics)."""
    vllm_engine_start_s: float = Field(default=20.0, ge=0)
    """Seconds to start one vLLM engine before its weights arrive (worker and process-group set-up,
    the memory-profiling pass, KV-cache allocation; CUDA-graph capture on GPUs): what a live
    transition pays per new actor/generation replica under `generation: {engine: vllm}`. The default
    is typical of an eager-mode engine on one GPU node; `nereus profile` measures it, `nereus fit`
    fits it from the `vllm_engine_start` times a run records."""
    vllm_weight_load_bytes_per_s: float = Field(default=5e9, gt=0)
    """Bytes per second per GPU at which a vLLM engine takes the actor's weights through its
    weight-loading API (bucketed copies into its parameters, and their repacking): a new engine's
    weight load is its shard's bytes over this rate."""
    vllm_sleep_s: float = Field(default=0.5, ge=0)
    """Seconds for one vLLM engine to sleep (level 2: free its KV cache and drop its weights) so a
    colocated training stage gets the memory back."""
    vllm_wake_s: float = Field(default=0.5, ge=0)
    """Seconds for one vLLM engine to wake (re-map its weights' memory for the weight sync, then
    its KV cache's), the sync's load not included."""
    vllm_iteration_overhead_s: float = Field(default=2e-3, ge=0)
    """Fixed seconds per vLLM scheduler iteration beyond the layers (scheduling, sampling, output
    processing; kernel launches are in CUDA graphs on GPUs)."""
    host_adam_params_per_s: float = Field(default=2e9, gt=0)
    """Parameters one node's host CPUs update per second with torch's AdamW (fp32 state, all
    cores; the node's GPUs that offload their optimizer share it): prices training-time offload's
    host optimizer step. `nereus profile` measures it on the machine it runs on
    (`Profile.host_adam_params_per_s`). Default 2e9: a dual-socket DGX host, AdamW being memory
    bound at about 28 bytes read and written per parameter, reaching some 56 GB/s of its DDR5."""
    concurrent_pools: bool = True
    """Pools of one phase run at the same time (nereus's runtime does: each rank runs only its own
    model-stages); false prices a runtime that runs model-stages one after another."""

    def link(self, cluster: Cluster, inter: bool) -> tuple[float, float]:
        """(achieved bytes/s, latency) of the cluster's intra- or inter-node link."""
        scale = self.link_latency_scale
        if inter:
            return cluster.inter_node.bytes_per_s * self.collective_inter, cluster.inter_node.latency_s * scale
        return cluster.intra_node.bytes_per_s * self.collective_intra, cluster.intra_node.latency_s * scale


DEFAULT_CALIBRATION = Calibration()

"""Named clusters, models and workloads, with where each number comes from.

Clusters: GPU figures from the vendors' datasheets (dense bf16, no sparsity).
Bandwidths are per GPU and per direction: NVLink 3 = 600 GB/s bidirectional
-> 300 GB/s; NVLink 4 = 900 GB/s -> 450 GB/s; one 200 Gb/s HDR NIC per A100 =
25 GB/s; one 400 Gb/s NDR NIC per H100/H200 = 50 GB/s. MI250X figures are per GCD
(the card is two GCDs): 383 TFLOP/s bf16 and 3.2 TB/s HBM2e per card, halved;
Frontier-style nodes have 8 GCDs and 4 x 25 GB/s Slingshot NICs (12.5 GB/s per GCD);
GCD-to-GCD Infinity Fabric is 50-200 GB/s depending on the pair: we use 100 GB/s.

Models: hyperparameters from each model's published Hugging Face `config.json`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from nereus.errors import NereusError
from nereus.spec.cluster import Cluster, GpuKind, Link, size_problem
from nereus.spec.hf_config import model_from_hf_config
from nereus.spec.model import Llama3RopeScaling, Model, MoE
from nereus.spec.workload import Optimizer, ResponseLengths, Workload

GIB = 2**30

GPU_KINDS: dict[str, tuple[GpuKind, Link, Link, int]] = {
    # name: (gpu, intra-node link, inter-node link, gpus per node)
    "a100-80gb": (
        GpuKind(name="A100-SXM-80GB", memory_bytes=80 * GIB, bf16_flops=312e12, hbm_bytes_per_s=2.039e12),
        Link(bytes_per_s=300e9, latency_s=3e-6),
        Link(bytes_per_s=25e9, latency_s=10e-6),
        8,
    ),
    "h100-sxm": (
        GpuKind(name="H100-SXM-80GB", memory_bytes=80 * GIB, bf16_flops=989e12, hbm_bytes_per_s=3.35e12),
        Link(bytes_per_s=450e9, latency_s=3e-6),
        Link(bytes_per_s=50e9, latency_s=10e-6),
        8,
    ),
    "h200": (
        GpuKind(name="H200-SXM-141GB", memory_bytes=141 * 10**9, bf16_flops=989e12, hbm_bytes_per_s=4.8e12),
        Link(bytes_per_s=450e9, latency_s=3e-6),
        Link(bytes_per_s=50e9, latency_s=10e-6),
        8,
    ),
    "mi250x": (
        GpuKind(name="MI250X-GCD-64GB", memory_bytes=64 * GIB, bf16_flops=191.5e12, hbm_bytes_per_s=1.6384e12),
        Link(bytes_per_s=100e9, latency_s=5e-6),
        Link(bytes_per_s=12.5e9, latency_s=15e-6),
        8,
    ),
}

#: Per-GPU share of the host link when a node's GPUs offload at once (see Cluster.host_link):
#: PCIe Gen4 x16 (32 GB/s per direction) for A100, Gen5 x16 (64 GB/s) for H100/H200, both
#: halved for two GPUs per switch uplink; MI250X: 36 GB/s Infinity Fabric per GCD pair, halved.
HOST_LINKS: dict[str, Link] = {
    "a100-80gb": Link(bytes_per_s=16e9, latency_s=10e-6),
    "h100-sxm": Link(bytes_per_s=32e9, latency_s=10e-6),
    "h200": Link(bytes_per_s=32e9, latency_s=10e-6),
    "mi250x": Link(bytes_per_s=18e9, latency_s=10e-6),
}

#: Host memory per node: DGX A100 (80 GB), DGX H100 and DGX H200 ship 2 TB of system memory
#: (NVIDIA's datasheets), taken as 2 TiB; a Frontier node has 512 GiB of DDR4 for its 8 GCDs.
HOST_MEMORY: dict[str, int] = {
    "a100-80gb": 2 * 2**40,
    "h100-sxm": 2 * 2**40,
    "h200": 2 * 2**40,
    "mi250x": 512 * GIB,
}

GPU_ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "h200-sxm": "h200", "mi250": "mi250x"}


def _llama(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    kv: int,
    ffn: int,
    vocab: int,
    head_dim: int = 0,
    tied: bool = False,
    qk_norm: bool = False,
    **numerics: Any,
) -> Model:
    return Model(
        name=name,
        num_layers=layers,
        hidden_dim=hidden,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim or hidden // heads,
        ffn_dim=ffn,
        vocab_size=vocab,
        tied_embeddings=tied,
        qk_norm=qk_norm,
        **numerics,
    )


#: Llama 3.1 / 3.3's RoPE: theta 500000, llama3 scaling from the 8k pre-training context.
_LLAMA3_ROPE: dict[str, Any] = {
    "rope_theta": 500000.0,
    "rope_scaling": Llama3RopeScaling(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_positions=8192
    ),
    "max_positions": 131072,
}
#: Qwen3-8B, -14B, -32B and -30B-A3B config.json: theta 1e6, eps 1e-6, 40960 positions, q/k norms.
_QWEN3: dict[str, Any] = {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_positions": 40960, "qk_norm": True}
#: Qwen3-30B-A3B's experts (its config.json: norm_topk_prob true, every layer sparse).
_QWEN3_30B_A3B = MoE(num_experts=128, experts_per_token=8, expert_ffn_dim=768, norm_topk_prob=True)
#: Qwen3-235B-A22B's experts (its config.json: 128 experts, 8 per token, 1536 wide, norm_topk_prob
#: true, decoder_sparse_step 1, no mlp_only_layers).
_QWEN3_235B_A22B = MoE(num_experts=128, experts_per_token=8, expert_ffn_dim=1536, norm_topk_prob=True)
#: Qwen2-7B-Instruct's config.json: QKV bias, theta 1e6, 32768 positions (max_position_embeddings).
_QWEN2: dict[str, Any] = {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_positions": 32768, "qkv_bias": True}
#: LLaMA 1's converted configs (huggyllama/llama-13b, ...): eps 1e-6, 2048 positions.
_LLAMA1: dict[str, Any] = {"rms_norm_eps": 1e-6, "max_positions": 2048}


MODELS: dict[str, Model] = {
    m.name: m
    for m in (
        _llama("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, **_LLAMA3_ROPE),
        _llama("llama-3.3-70b", 80, 8192, 64, 8, 28672, 128256, **_LLAMA3_ROPE),
        _llama("qwen2-7b", 28, 3584, 28, 4, 18944, 152064, **_QWEN2),
        _llama("qwen3-8b", 36, 4096, 32, 8, 12288, 151936, head_dim=128, **_QWEN3),
        _llama("qwen3-14b", 40, 5120, 40, 8, 17408, 151936, head_dim=128, **_QWEN3),
        _llama("qwen3-32b", 64, 5120, 64, 8, 25600, 151936, head_dim=128, **_QWEN3),
        # Qwen3-30B-A3B's config.json: 48 layers of 128 experts, 8 per token, 768 wide each.
        _llama("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 151936, head_dim=128, moe=_QWEN3_30B_A3B, **_QWEN3),
        # Qwen3-235B-A22B's config.json: 94 layers, hidden 4096, 64 heads, 4 KV heads of 128, the dense
        # intermediate_size 12288 (unused: every layer is sparse), 128 experts, 8 per token, 1536 wide.
        _llama("qwen3-235b-a22b", 94, 4096, 64, 4, 12288, 151936, head_dim=128, moe=_QWEN3_235B_A22B, **_QWEN3),
        _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, max_positions=4096),  # Llama-2-7b-hf: eps 1e-5
        _llama("llama-13b", 40, 5120, 40, 40, 13824, 32000, **_LLAMA1),
        _llama("llama-33b", 60, 6656, 52, 52, 17920, 32000, **_LLAMA1),
        _llama("llama-65b", 80, 8192, 64, 64, 22016, 32000, **_LLAMA1),
        # Tiny models for tests and CPU runs.
        _llama("tiny", 4, 64, 4, 2, 172, 64, tied=True),
        _llama("tiny-wide", 8, 128, 8, 4, 344, 64, tied=True),
    )
}


def _workload(name: str, algorithm: str, models: dict[str, str | None], **fields: Any) -> Workload:
    return Workload(name=name, algorithm=algorithm, **models, **fields)  # type: ignore[arg-type]


def _paper_workloads(actor: str) -> dict[str, Workload]:
    """PPO/GRPO/ReMax with settings like the papers': 512 samples, 1k prompts, long tail.

    Who scores, as the published set-ups do:
    - ppo: a reward model as large as the actor (RLHF as in InstructGPT, Ouyang et al. 2022,
      and OpenRLHF's PPO examples, which score with a trained reward model).
    - grpo: a rule (reward: null), as the GRPO runs people publish do: verl's GRPO examples
      (examples/grpo_trainer/run_qwen2-7b.sh, GSM8K scored by a function, experiment
      "..._function_rm") and TRL's GRPOTrainer quick start (`reward_funcs` a Python function).
    - remax: a rule, as verl's ReMax examples (examples/remax_trainer/run_qwen2.5-7b_seq_balance.sh,
      GSM8K, "qwen2.5_7b_function_rm"). The ReMax paper (Li et al. 2023, arXiv:2310.10505)
      scored with a trained reward model instead.
    A reward model stays one field away: `reward: MODEL` in a Workload YAML (or
    `workload.model_copy(update={"reward": name})`) prices and runs it as reward/inference.
    """
    lengths = ResponseLengths(median=500, p99=2500, max=8192)
    shared: dict[str, Any] = dict(
        prompt_len=1024,
        response_len=lengths,
        ppo_epochs=1,
        mini_batches=4,
        micro_batch_size=2,
        dtype="bf16",
        optimizer=Optimizer(),
    )
    return {
        "ppo": _workload(
            "ppo", "ppo", dict(actor=actor, critic=actor, reference=actor, reward=actor), prompts_per_step=512, **shared
        ),
        "grpo": _workload(
            "grpo",
            "grpo",
            dict(actor=actor, reference=actor, reward=None),  # a rule scores (verl's and TRL's GRPO examples)
            prompts_per_step=64,
            samples_per_prompt=8,
            **shared,
        ),
        "remax": _workload(
            "remax",
            "remax",
            dict(actor=actor, reference=actor, reward=None),  # a rule scores (verl's ReMax examples)
            prompts_per_step=512,
            **shared,
        ),
    }


def _long_response_workload(actor: str) -> Workload:
    """`grpo-long`: GRPO on reasoning tasks with long responses, as the published long-response
    RL set-ups run: 1k-token prompts and responses of median 8k, p99 24k, at most 32k tokens,
    scored by a rule (the answer checked by a function), 8 samples per prompt.

    The set-ups it follows (nereus/spec/long_response_setups.py holds them as Workload
    documents): verl's DAPO recipes (recipe/dapo/run_dapo_qwen2.5_32b.sh: Qwen2.5-32B on 16
    nodes of 8 GPUs, 2k prompts, responses up to 20k, Ulysses sequence parallel 8, scored by
    verl's `dapo` rule; recipe/dapo/test_dapo_7b_math.sh: Qwen2.5-Math-7B on 8 x 8 GPUs,
    responses up to 8k, sequence parallel 4) and NeMo-RL's DAPO recipe
    (examples/configs/recipes/llm/dapo-qwen2.5-7b.yaml: 16 x 8 GPUs, 16k-token sequences,
    context parallel 4 on its DTensor path, 2 on its Megatron one). Their caps (8k-20k) are below
    this preset's 32k, which reasoning models are run to (Qwen3's model card generates with
    max_new_tokens=32768); the median (8k) and the p99 (24k) span those runs' caps. Micro-batches
    hold one sequence: at 32k tokens one is what a GPU's activations take.
    """
    grpo = _paper_workloads(actor)["grpo"]  # the same step, prompts and scoring; longer responses
    lengths = ResponseLengths(median=8192, p99=24576, max=32768)
    return grpo.model_copy(update={"name": "grpo-long", "response_len": lengths, "micro_batch_size": 1})


WORKLOAD_NAMES = ("ppo", "grpo", "grpo-long", "remax", "tiny-ppo", "grpo-async")


class UnknownPreset(NereusError):
    """A name that is no preset of its kind (the CLI then says whether it is a file either)."""


def workload_preset(name: str, actor: str = "llama-3.1-8b") -> Workload:
    """A workload preset with `actor` (and the same architecture for the other roles)."""
    if name == "tiny-ppo":
        return _workload(
            "tiny-ppo",
            "ppo",
            dict(actor="tiny", critic="tiny", reference="tiny", reward="tiny"),
            prompts_per_step=16,
            prompt_len=16,
            response_len=ResponseLengths(median=8, p99=40, max=48),
            mini_batches=2,
            micro_batch_size=2,
            dtype="fp32",
        )
    workloads = {**_paper_workloads(actor), "grpo-long": _long_response_workload(actor)}
    # grpo with generation on its own pool, one batch ahead of training (verl's one-step-off policy).
    workloads["grpo-async"] = workloads["grpo"].model_copy(
        update={"name": "grpo-async", "execution": "async", "max_staleness": 1}
    )
    if name not in workloads:
        raise UnknownPreset(f"unknown workload preset {name!r}; use one of {', '.join(WORKLOAD_NAMES)} or a YAML file")
    return workloads[name]


def models_for(workload: Workload, given: Model | None) -> tuple[Model, ...]:
    """Every model the workload names: `given` where its name is one of them, the others by
    preset name (a NereusError names one that is no preset)."""
    names = {name for name in workload.role_models().values() if name is not None}
    if given is not None and given.name in names:
        names.discard(given.name)
        return (given, *(model_preset(n) for n in sorted(names)))
    return tuple(model_preset(n) for n in sorted(names))


_CLUSTER_NAME = re.compile(r"^(?P<gpu>[a-z0-9-]+?)(?:-(?P<nodes>\d+)x(?P<per_node>\d+))?$")


def cluster_preset(name: str, num_gpus: int | None = None) -> Cluster:
    """`h100`, `h100-sxm-8x8` (nodes x GPUs per node); `num_gpus` sizes a bare GPU name."""
    match = _CLUSTER_NAME.match(name.lower())
    gpu_name = GPU_ALIASES.get(match["gpu"], match["gpu"]) if match else name
    if not match or gpu_name not in GPU_KINDS:
        known = ", ".join([*GPU_KINDS, *GPU_ALIASES])
        raise UnknownPreset(
            f"unknown cluster preset {name!r}; use one of {known} (optionally -NODESxGPUS) or a YAML file"
        )
    gpu, intra, inter, per_node = GPU_KINDS[gpu_name]
    if match["nodes"]:
        num_nodes, per_node = int(match["nodes"]), int(match["per_node"])
    else:
        num_gpus = num_gpus or per_node
        num_nodes = -(-num_gpus // per_node)
    if num_nodes < 1 or per_node < 1:
        raise NereusError(f"cluster preset {name!r}: nodes and GPUs per node must be positive")
    problem = size_problem(num_nodes, per_node)
    if problem:
        raise NereusError(f"cluster preset {name!r}: {problem}")
    return Cluster(
        name=f"{gpu_name}-{num_nodes}x{per_node}",
        num_nodes=num_nodes,
        gpus_per_node=per_node,
        gpu=gpu,
        intra_node=intra,
        inter_node=inter,
        host_link=HOST_LINKS[gpu_name],
        host_memory_bytes=HOST_MEMORY[gpu_name],
    )


def model_preset(name: str) -> Model:
    """A model by preset name, or from a Hugging Face `config.json` (file or folder)."""
    if name.lower() in MODELS:
        return MODELS[name.lower()]
    path = Path(name)
    if path.is_dir() or (path.name == "config.json" and path.is_file()):
        return model_from_hf_config(path)
    raise UnknownPreset(
        f"unknown model preset {name!r}; use one of {', '.join(MODELS)}, a Model YAML or a Hugging Face config.json"
    )

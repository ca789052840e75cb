"""Benchmark: GRPO by TRL's GRPOTrainer and by `nereus run`, side by side on this machine.

Both train the same tiny Llama that transformers makes here (random weights, seed 0) on the
same `sort` prompts in the same order (the ones nereus draws for each step), with the same
group size, response cap, learning rate, KL coefficient, gradient clipping, loss
aggregation and rule reward (`tasks.answer_score`). The model folder carries a `tokenizers`
tokenizer over nereus's characters with the same ids (pad 0, bos 1, eos 2, the alphabet
from 3), so both sides see the same tokens. TRL runs in one process on every core; nereus on
1 rank and on 2 ranks (one thread each), each run planned by `nereus run` itself for this
machine as `nereus profile --quick` measures it (the profile's cluster is the RunConfig's
`cluster:`): on the default H100 preset the planner lays 2 ranks out as two pools, the
actor on one GPU and the reference on the other, since a GPU's per-launch overheads do not
shrink with data parallelism; on a CPU the work is per row, and the measured machine's plan
splits every model-stage's batch over both ranks (dp=2 on a shared pool). The table names
each run's layout. TRL runs once more with one thread: on a loaded
machine a multi-threaded torch op waits for its other thread to be scheduled, which the
one-thread run shows apart from the trainer's own cost. The runs alternate (TRL, TRL one
thread, nereus 1 rank, nereus 2 ranks, and again per round), so the machine's load falls on
all of them.

Seconds per step: the wall time from one finished step to the next (TRL: its `on_step_end`
callbacks; nereus: the start of the next step on rank 0's timeline, so a step's metrics,
timeline and checkpoint writes count), median over the steps after the warm-up. Reward:
the mean over the last 5 steps of the mean reward per step.

TRL is not a dependency of nereus: install it for this benchmark only (benchmarks/README.md):

    pip install -c <(printf 'torch==2.13.0\ntransformers==5.23.0\n') trl==1.16.0
    python benchmarks/trl_compare.py [--steps 20] [--rounds 1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _record import begin, write_result

from nereus.runtime.rl.step import step_seed
from nereus.runtime.rl.tasks import ALPHABET, UNKNOWN_CHAR, CharTokenizer, answer_score, get_task, sample_problems

RESULTS = Path(__file__).resolve().parent / "results" / "trl_compare.json"
#: The shared recipe (nereus's GRPO defaults where TRL has the same knob).
PROMPTS, GROUP, MAX_NEW_TOKENS, LR, KL, CLIP, SEED = 8, 4, 12, 1e-3, 0.02, 1.0, 0
WARMUP_STEPS, REWARD_STEPS = 3, 5
RUNNERS = ("trl", "trl-1thread", "nereus-1", "nereus-2")
#: What else each side runs with (the same work per step on both).
SETTINGS = (
    f"settings: {PROMPTS} prompts x {GROUP} samples, <= {MAX_NEW_TOKENS} new tokens, lr {LR}, KL {KL} (k3, in the "
    f"loss), clip {CLIP}, token-mean loss, fp32, one update per batch; TRL: gradient checkpointing off (nereus "
    "recomputes nothing), no saving, no vLLM; nereus: planned for this machine (`nereus profile --quick`), "
    "online calibration off, one checkpoint at the end"
)


def make_model(folder: Path, shapes: dict[str, int] | None = None) -> Path:
    """A tiny random Llama (transformers' own init, seed 0) and its character tokenizer;
    `shapes` overrides the default layer shapes (hidden 64, 4 heads over 2 KV heads)."""
    import torch
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    chars = CharTokenizer()
    vocab = {"<pad>": chars.pad_id, "<s>": chars.bos_id, "</s>": chars.eos_id}
    vocab.update({char: chars.num_special + index for index, char in enumerate(ALPHABET + UNKNOWN_CHAR)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNKNOWN_CHAR))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", chars.bos_id)])
    tokenizer.decoder = decoders.Fuse()
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", padding_side="left"
    )
    layers = {"hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), num_hidden_layers=4, max_position_embeddings=64, tie_word_embeddings=True,
        bos_token_id=chars.bos_id, eos_token_id=chars.eos_id, pad_token_id=chars.pad_id, **{**layers, **(shapes or {})},
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder)
    wrapped.save_pretrained(folder)
    return folder


def prompts_by_step(num_steps: int) -> list[dict[str, str]]:
    """The prompts nereus draws for steps 0.. (seed SEED), in its order, with their answers."""
    task = get_task("sort")
    return [
        {"prompt": problem.prompt, "answer": problem.answer}
        for step in range(num_steps)
        for problem in sample_problems(task, PROMPTS, step_seed(SEED, step))
    ]


def sort_reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """nereus's rule reward of the sort task, as a TRL reward function."""
    return [answer_score(completion, right) for completion, right in zip(completions, answer, strict=True)]


def run_trl(folder: Path, num_steps: int, work: Path, threads: int) -> dict[str, Any]:
    """TRL's GRPOTrainer in one process with `threads` torch threads; per-step wall times and rewards."""
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    ends: list[float] = []
    cpu: list[float] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())
            cpu.append(time.process_time())  # every thread of the process

    config = GRPOConfig(
        output_dir=str(work / "trl"), max_steps=num_steps, per_device_train_batch_size=PROMPTS * GROUP,
        gradient_accumulation_steps=1, num_generations=GROUP, max_completion_length=MAX_NEW_TOKENS,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01, adam_epsilon=1e-8,
        gradient_checkpointing=False, max_grad_norm=CLIP, beta=KL, epsilon=0.2, num_iterations=1, loss_type="dapo",
        scale_rewards="group",
        temperature=1.0, top_p=1.0, top_k=0, shuffle_dataset=False, seed=SEED, use_cpu=True, bf16=False,
        logging_steps=1, report_to=[], save_strategy="no", disable_dropout=True, dataloader_num_workers=0,
        disable_tqdm=True,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    trainer = GRPOTrainer(
        model=model, reward_funcs=sort_reward, args=config, processing_class=tokenizer,
        train_dataset=Dataset.from_list(prompts_by_step(num_steps)), callbacks=[StepClock()],
    )  # fmt: skip
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # the table says it all
    start = time.perf_counter()
    trainer.train()
    rewards = [float(log["reward"]) for log in trainer.state.log_history if "reward" in log]
    runner = "trl" if threads > 1 else "trl-1thread"
    return {"runner": runner, "step_ends": [end - start for end in ends], "step_cpu": cpu, "rewards": rewards}


def measured_cluster(folder: Path, work: Path, num_ranks: int) -> Path:
    """This machine as `nereus profile --quick --nproc num_ranks` measures it (the model's
    layer shapes), written as the Cluster YAML a self-planned run is laid out for."""
    from nereus.cost.profile import cluster_from_profile
    from nereus.runtime.hf.run_setup import hf_weights
    from nereus.runtime.observe.profiling import ProfileConfig, run_profile
    from nereus.spec.io import save_document

    measured = run_profile(ProfileConfig((hf_weights(folder).model,), num_ranks=num_ranks, quick=True))
    where = work / "cluster.yaml"
    save_document(cluster_from_profile(measured, "the benchmark's profile"), where)
    return where


def layout(plan: Any) -> str:
    """A plan's placement in one line: each model-stage's dp x tp x pp and its GPUs."""
    return ", ".join(
        f"{entry.model_stage} dp{entry.dp} tp{entry.tp} pp{entry.pp} on {sorted({g for e in entry.emus for g in e})}"
        for entry in plan.stages
    )


def run_nereus(
    folder: Path, num_steps: int, num_ranks: int, work: Path, cluster: Path | None, generation: str = "nereus"
) -> dict[str, Any]:
    """`nereus run` of the same recipe on `num_ranks` ranks, planned for them from the folder
    on `cluster` (the measured machine; None: the default preset), `generation` the engine."""
    from nereus.runtime.run.launch import launch
    from nereus.runtime.run.resolve import new_run

    workload = {
        "kind": "Workload", "version": 1, "name": "trl-compare", "algorithm": "grpo", "actor": "tiny",
        "reference": "tiny", "prompts_per_step": PROMPTS, "samples_per_prompt": GROUP, "prompt_len": 16,
        "response_len": {"median": 8, "p99": MAX_NEW_TOKENS, "max": MAX_NEW_TOKENS}, "ppo_epochs": 1,
        "mini_batches": 1, "micro_batch_size": PROMPTS * GROUP, "dtype": "fp32",
    }  # fmt: skip
    rl = {"task": "sort", "seed": SEED, "actor_lr": LR, "kl_loss_coef": KL, "grad_clip": CLIP}
    rl.update(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, loss_agg_mode="token-mean")
    config = {"kind": "RunConfig", "version": 1, "model": str(folder), "workload": "workload.yaml", "rl": rl}
    if cluster is not None:
        config["cluster"] = str(cluster)
    config.update(num_steps=num_steps, checkpoint_every=num_steps, online_calibration=False)
    config["generation"] = {"engine": generation}
    run_folder = work / f"nereus-{num_ranks}"
    (run_folder.parent / "workload.yaml").write_text(json.dumps(workload))
    (run_folder.parent / f"run-{num_ranks}.yaml").write_text(json.dumps(config))
    setup = new_run(run_folder.parent / f"run-{num_ranks}.yaml", num_ranks=num_ranks, out=run_folder)
    cpu: list[float] = []
    records = launch(setup, on_step=lambda _: cpu.append(ranks_cpu_seconds()))
    ends, rewards = step_ends(run_folder), [r.reward for r in records]
    run = {"runner": f"nereus-{num_ranks}", "step_ends": ends, "step_cpu": cpu, "rewards": rewards}
    return {**run, "layout": layout(setup.plan), "first_step_start": first_step_start(run_folder)}


def first_step_start(run_folder: Path) -> float:
    """When rank 0 started its first step (`time.time()`, the timeline's clock)."""
    spans = [json.loads(line) for line in (run_folder / "timeline" / "rank-0.jsonl").read_text().splitlines()]
    return min(span["start"] for span in spans)


def ranks_cpu_seconds() -> float:
    """CPU seconds the spawned ranks (this process's multiprocessing children) used so far."""
    children = []
    for task in Path("/proc/self/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    total = 0.0
    for pid in children:
        try:
            cmdline, stat = Path(f"/proc/{pid}/cmdline").read_bytes(), Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        if b"spawn_main" in cmdline:  # a rank, not the resource tracker
            utime, stime = stat.rsplit(")", 1)[1].split()[11:13]
            total += (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
    return total


def step_ends(run_folder: Path) -> list[float]:
    """When each step of the run finished, from rank 0's timeline: a step ends where the next
    one's first span starts (its metrics, samples and timeline written), the last one at its
    last span's end. (The launcher reads metrics.jsonl ten times a second: too coarse here.)"""
    spans = [json.loads(line) for line in (run_folder / "timeline" / "rank-0.jsonl").read_text().splitlines()]
    starts: dict[int, float] = {}
    for span in spans:
        starts[span["step"]] = min(span["start"], starts.get(span["step"], span["start"]))
    last = max(starts)
    return [starts[step] for step in sorted(starts) if step > 0] + [max(s["end"] for s in spans if s["step"] == last)]


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """Median seconds per step after the warm-up, the CPU seconds per step after it (all
    threads, all ranks: what a loaded machine's share of the cores does not change much),
    and the reward of the last steps."""
    ends, cpu = run["step_ends"], run["step_cpu"]
    gaps = [later - earlier for earlier, later in itertools.pairwise(ends)][WARMUP_STEPS - 1 :]
    return {
        "runner": run["runner"],
        "median_step_s": statistics.median(gaps),
        "step_s": gaps,
        "cpu_step_s": (cpu[-1] - cpu[WARMUP_STEPS - 1]) / (len(cpu) - WARMUP_STEPS),
        "reward_first": statistics.mean(run["rewards"][:REWARD_STEPS]),
        "reward_last": statistics.mean(run["rewards"][-REWARD_STEPS:]),
        "rewards": run["rewards"],
        **({"layout": run["layout"]} if "layout" in run else {}),
    }


def print_table(by_runner: dict[str, list[dict[str, Any]]], medians: dict[str, float], cores: int, runs: str) -> None:
    """The side-by-side table, the settings and the closing ratio."""
    head = f"{'runner':<12}{'s/step':>9}{'vs TRL':>8}{'CPU s/step':>12}{'reward first 5':>16}{'reward last 5':>15}"
    print(f"{head}{'load':>7}")
    cpu = {name: statistics.median(run["cpu_step_s"] for run in group) for name, group in by_runner.items()}
    for name, group in by_runner.items():
        first = statistics.mean(run["reward_first"] for run in group)
        last = statistics.mean(run["reward_last"] for run in group)
        load = statistics.mean(statistics.mean(run["load"]) for run in group)
        speedup = medians["trl"] / medians[name]
        row = f"{name:<12}{medians[name]:>9.3f}{speedup:>7.2f}x{cpu[name]:>12.3f}{first:>16.3f}{last:>15.3f}"
        print(f"{row}{load:>7.1f}")
    print(SETTINGS)
    for name, plans in layouts(by_runner).items():
        print(f"{name} layout{'s' if len(plans) > 1 else ''}: {'; '.join(plans)}")
    slower = max(medians["nereus-1"], medians["nereus-2"])
    print(
        f"nereus is {medians['trl'] / slower:.2f}x faster per step than TRL on {cores} cores "
        f"({medians['trl-1thread'] / slower:.2f}x than TRL on one thread; the slower of nereus's 1- and 2-rank "
        f"runs; medians over {runs} after {WARMUP_STEPS} warm-up steps; load: the 1-minute load average "
        f"at each run's start and end, averaged); CPU seconds per step, nereus 1 rank against TRL on one "
        f"thread: {cpu['trl-1thread'] / cpu['nereus-1']:.2f}x fewer"
    )


def layouts(by_runner: dict[str, list[dict[str, Any]]]) -> dict[str, list[str]]:
    """The distinct layouts each nereus runner ran under (one, unless a round planned otherwise)."""
    found = {name: [run["layout"] for run in group if "layout" in run] for name, group in by_runner.items()}
    return {name: list(dict.fromkeys(plans)) for name, plans in found.items() if plans}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per run")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of TRL, nereus 1 rank, nereus 2 ranks")
    args = parser.parse_args()
    recording = begin()
    cores = len(os.sched_getaffinity(0))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="trl-compare-") as folder:
        work = Path(folder)
        model = make_model(work / "model")
        cluster = measured_cluster(model, work, max(int(r[-1]) for r in RUNNERS if r.startswith("nereus")))
        for round_ in range(args.rounds):
            for runner in RUNNERS:
                place = work / f"round-{round_}"
                place.mkdir(exist_ok=True)
                load_before = os.getloadavg()[0]
                if runner.startswith("trl"):
                    run = run_trl(model, args.steps, place, 1 if runner == "trl-1thread" else cores)
                else:
                    run = run_nereus(model, args.steps, int(runner[-1]), place, cluster)
                runs.append({**summary(run), "round": round_, "load": [load_before, os.getloadavg()[0]]})
                print(f"round {round_} {runner}: {runs[-1]['median_step_s']:.3f} s/step", flush=True)
    by_runner = {name: [run for run in runs if run["runner"] == name] for name in RUNNERS}
    medians = {name: statistics.median(s for run in group for s in run["step_s"]) for name, group in by_runner.items()}
    print_table(by_runner, medians, cores, f"{args.rounds} round(s) x {args.steps} steps")
    recipe = {"prompts": PROMPTS, "group": GROUP, "max_new_tokens": MAX_NEW_TOKENS, "lr": LR, "kl": KL, "clip": CLIP}
    cpu = {name: statistics.median(run["cpu_step_s"] for run in group) for name, group in by_runner.items()}
    payload = {"recipe": recipe, "steps": args.steps, "rounds": args.rounds, "median_step_s": medians}
    payload.update(median_cpu_step_s=cpu, settings=SETTINGS, layouts=layouts(by_runner), runs=runs)
    step_s = {name: [run["step_s"] for run in group] for name, group in by_runner.items()}
    write_result(RESULTS, payload, recording, {"step_s": step_s})


if __name__ == "__main__":
    main()

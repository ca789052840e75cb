"""What a run's steps draw and score: its tokenizer, its prompts (a dataset or a synthetic
task) and its reward, settled before any rank exists (no torch) and rebuilt on every rank.

`prepare_data` reads and checks everything a careless input can break (the tokenizer, every
dataset line, the reward function) so that `nereus run` refuses it with one line before it
spawns; the ranks get the encoded prompts and rebuild the tokenizer and scorer from them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nereus.errors import NereusError
from nereus.runtime.rl.datasets import Prompt, draw, file_sha256, load_prompts, position
from nereus.runtime.rl.rewards import Scorer, import_reward, make_scorer
from nereus.runtime.rl.tasks import CharTokenizer, Task, get_task, sample_problems
from nereus.runtime.rl.tokenizer import Tokenizer, has_folder_tokenizer, load_folder_tokenizer
from nereus.spec.data_config import PythonReward
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig, RunConfig

#: File of a run checkpoint recording where in the dataset the next step starts.
DATA_STATE_NAME = "data.json"
#: File of the run folder listing the samples a user reward function failed on.
REWARD_ERRORS_NAME = "reward_errors.jsonl"


@dataclass(frozen=True)
class RunData:
    """The run's tokenizer source and encoded prompts, the same on every rank."""

    tokenizer_folder: Path | None
    """Model folder whose tokenizer.json the run uses (None: the character tokenizer)."""
    train: tuple[Prompt, ...] = ()
    """The dataset's prompts (empty: the synthetic task's generator)."""
    eval: tuple[Prompt, ...] = ()
    """Held-out prompts scored greedily every `eval_every` steps (empty: none)."""
    train_file: Path | None = None
    train_sha256: str | None = None
    eval_every: int = 1


def run_tokenizer(folder: Path | None) -> Tokenizer:
    """The folder's tokenizer when it has a tokenizer.json, else the character tokenizer."""
    if folder is not None and has_folder_tokenizer(folder):
        return load_folder_tokenizer(folder)
    return CharTokenizer()


def prepare_data(config: RunConfig, plan: Plan, folder: Path) -> RunData:
    """Check the tokenizer against the plan's model, the reward and every dataset line
    (paths relative to `folder`); NereusError naming the file, the line or the function."""
    model_folder = None if config.model is None else (folder / config.model).resolve()
    tokenizer = run_tokenizer(model_folder)
    actor = plan.model(plan.workload.actor)
    if tokenizer.vocab_size > actor.vocab_size:
        raise NereusError(
            f"{model_folder}: the tokenizer has {tokenizer.vocab_size} tokens, more than the model's {actor.vocab_size}"
        )
    uses_folder = not isinstance(tokenizer, CharTokenizer)
    fitted_reward_model = config.rl.reward == "model" and config.reward_model is None
    if fitted_reward_model and (uses_folder or config.data is not None):
        raise NereusError(
            "rl.reward: model is fitted on the synthetic task's character tokens; with a folder's tokenizer or "
            "data: give reward_model: (a reward model folder)"
        )
    data = config.data
    if data is None:
        check_reward(config, tokenizer, None)
        return RunData(model_folder if uses_folder else None)
    max_len = plan.workload.prompt_len
    train_file = folder / data.train
    train = load_prompts(train_file, "train", data, tokenizer, max_len)
    evaluation = () if data.eval is None else load_prompts(folder / data.eval, "eval", data, tokenizer, max_len)
    check_reward(config, tokenizer, train[0])
    return RunData(
        model_folder if uses_folder else None, train, evaluation, train_file, file_sha256(train_file), data.eval_every
    )


def check_reward(config: RunConfig, tokenizer: Tokenizer, probe: Prompt | None) -> None:
    """A user reward function must import, and score `probe`'s own answer as a response
    without raising (the one input every reward must handle)."""
    reward = config.rl.reward
    if not isinstance(reward, PythonReward):
        return
    function = import_reward(reward)
    if probe is None:
        return
    try:
        float(function(probe.prompt, probe.answer, probe.answer))
    except Exception as error:  # the user's function may raise anything
        raise NereusError(
            f"rl.reward.python: {reward.python} raised on line {probe.line}'s answer given as the response "
            f"({type(error).__name__}: {error})"
        ) from None


@dataclass
class StepInputs:
    """What every step draws its prompts from and scores its responses with, on one rank."""

    tokenizer: Tokenizer
    scorer: Scorer
    data: RunData
    task: Task

    def draw(self, seed: int, step: int, count: int, sample_seed: int) -> list[Prompt]:
        """The step's `count` prompts: the dataset's at the step's position, else the task's
        drawn with `sample_seed`."""
        if self.data.train:
            return draw(self.data.train, seed, step, count)
        return [
            Prompt(problem.prompt, problem.answer, tuple(self.tokenizer.prompt_ids(problem.prompt)))
            for problem in sample_problems(self.task, count, sample_seed)
        ]


def step_inputs(config: RLConfig, data: RunData | None) -> StepInputs:
    """The rank's tokenizer, scorer and prompt source for `data` (None: the synthetic task)."""
    data = data if data is not None else RunData(None)
    tokenizer = run_tokenizer(data.tokenizer_folder)
    return StepInputs(tokenizer, make_scorer(config, tokenizer), data, get_task(config.task))


def data_state(data: RunData, step: int, per_step: int) -> str | None:
    """The checkpoint's record of the dataset position step `step` starts at (None: no dataset)."""
    if not data.train:
        return None
    epoch, index = position(step, per_step, len(data.train))
    record = {"train_sha256": data.train_sha256, "size": len(data.train), "epoch": epoch, "index": index}
    return json.dumps(record, indent=1)


def check_data_state(checkpoint: Path, data: RunData, step: int, per_step: int) -> None:
    """A resume must see the dataset the checkpoint was taken with, at the same position."""
    path = checkpoint / DATA_STATE_NAME
    expected = data_state(data, step, per_step)
    if not path.is_file():
        if expected is not None:
            raise NereusError(f"{path}: missing; the checkpoint was taken by a run without data:")
        return
    saved = json.loads(path.read_text())
    if expected is None:
        raise NereusError(f"{path}: the checkpoint was taken by a run with data:, this config has none")
    if saved.get("train_sha256") != data.train_sha256:
        raise NereusError(
            f"data.train: {data.train_file} changed since the run started (sha256 differs from {path}); "
            "a resume must see the same prompts in the same order"
        )
    if saved != json.loads(expected):
        raise NereusError(f"{path}: position {saved} differs from the one step {step} starts at; the file is damaged")


def append_reward_errors(path: Path, step: int, scorer: Scorer) -> None:
    """Append the samples the scorer's function failed on since the last call (one line each)."""
    errors = scorer.drain_errors()
    if errors:
        with path.open("a", encoding="utf-8") as handle:
            for error in errors:
                record = {"step": step, "sample": error.sample, "reward": scorer.name, "error": error.message}
                handle.write(json.dumps(record) + "\n")

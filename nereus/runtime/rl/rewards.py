"""Verifiable rewards: a response's text scored against the prompt's answer (no torch).

`math` compares final numeric answers (GSM8K's `#### 42`, a LaTeX `\\boxed{42}`, else the last
number of the text), `exact` compares normalised strings, `rule` is the synthetic tasks'
partial-credit score, and `python` calls a user function `(prompt, response, answer) -> float`
imported from the config's folder. A format bonus (a regex the response must contain) can be
added to any of them.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from nereus.errors import NereusError
from nereus.runtime.rl.tasks import answer_score
from nereus.runtime.rl.tokenizer import PromptValue, Tokenizer
from nereus.spec.data_config import FormatReward, PythonReward
from nereus.spec.run_config import RLConfig

#: A reward function: (prompt as the data gives it, response text, answer) -> score.
RewardFunction = Callable[[PromptValue, str, str], float]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_GSM8K = re.compile(r"####\s*(.+)")
_BOXED = "\\boxed{"


def boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}` of `text` (braces balanced), None without one."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for index in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index]
    return None


def final_answer(text: str) -> str | None:
    """The final answer a text gives: after its last `####`, in its last `\\boxed{}`, else its
    last number; None when it gives none."""
    marked = _GSM8K.findall(text)
    if marked:
        return marked[-1].strip()
    boxed = boxed_content(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def as_number(text: str) -> Fraction | None:
    """`text` as an exact number (commas, `$`, `%`, spaces, a trailing period and LaTeX
    `\\frac{a}{b}` allowed), None when it is not one."""
    cleaned = re.sub(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", r"\1/\2", text)
    cleaned = re.sub(r"[\s,$%]|\\!|\\,", "", cleaned).rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def reference_answer(answer: str) -> str | None:
    """The answer a dataset's answer field gives: the marked one (`####`, `\\boxed{}`) of a
    worked solution, else the whole field (`72`, `x + 1`)."""
    if _GSM8K.search(answer) or boxed_content(answer) is not None:
        return final_answer(answer)
    return answer.strip() or None


def math_matches(response: str, answer: str) -> bool:
    """Whether the response's final answer equals the answer's (numerically when both are
    numbers, else as whitespace-free strings)."""
    theirs, ours = final_answer(response), reference_answer(answer)
    if theirs is None or ours is None:
        return False
    left, right = as_number(theirs), as_number(ours)
    if left is not None and right is not None:
        return left == right
    return re.sub(r"\s", "", theirs) == re.sub(r"\s", "", ours)


def math_reward(prompt: PromptValue, response: str, answer: str) -> float:
    """1.0 when the final answers match, else 0.0."""
    return 1.0 if math_matches(response, answer) else 0.0


def normalise(text: str) -> str:
    """Lower case, surrounding space and punctuation stripped, inner white space collapsed."""
    return " ".join(text.lower().split()).strip(" .!?")


def exact_reward(prompt: PromptValue, response: str, answer: str) -> float:
    """1.0 when the normalised response equals the normalised answer, else 0.0."""
    return 1.0 if normalise(response) == normalise(answer) else 0.0


def rule_reward(prompt: PromptValue, response: str, answer: str) -> float:
    """The synthetic tasks' score: exact 1.0, else partial credit for answer characters."""
    return answer_score(response, answer)


#: The built-in reward functions by name (a constant table, never written).
BUILT_IN: dict[str, RewardFunction] = {"math": math_reward, "exact": exact_reward, "rule": rule_reward}


def import_reward(spec: PythonReward) -> RewardFunction:
    """The user's function `module:function`, its module imported from `spec.folder` (first
    on the import path); NereusError naming the module or function when it is not there."""
    module_name, _, function_name = spec.python.partition(":")
    folder = str(Path(spec.folder or ".").resolve())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    cached = sys.modules.get(module_name)
    if cached is not None and not str(getattr(cached, "__file__", "")).startswith(folder + "/"):
        del sys.modules[module_name]  # a module of that name from another folder (an earlier run)
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # any failure of the user's module is a user error
        raise NereusError(
            f"rl.reward.python: cannot import {module_name!r} from {folder} ({type(error).__name__}: {error})"
        ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise NereusError(f"rl.reward.python: {module_name} ({module.__file__}) has no function {function_name!r}")
    return function


@dataclass(frozen=True)
class RewardError:
    """A sample the user's reward function failed on (scored 0)."""

    sample: int
    message: str


@dataclass
class Scorer:
    """Decodes responses and scores them with the run's reward and format bonus."""

    tokenizer: Tokenizer
    function: RewardFunction
    name: str
    """The reward's name in errors: `math`, `exact`, `rule` or `module:function`."""
    format_reward: FormatReward | None = None
    errors: list[RewardError] = field(default_factory=list)
    """Failures of the user's function since `drain_errors`."""

    def score_all(self, prompts: Sequence[Any], responses: Sequence[Sequence[int]]) -> list[float]:
        """Every response's score (`prompts[i].prompt` and `.answer` are its prompt's); a sample the
        function fails on scores 0 and is kept in `errors`; NereusError when every one fails."""
        scores, failed = [], []
        for index, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            text = self.tokenizer.decode(response)
            try:
                value = float(self.function(prompt.prompt, text, prompt.answer))
                if not math.isfinite(value):
                    raise ValueError(f"returned {value}")
            except Exception as error:  # a user function may raise anything; it is reported per sample
                failed.append(RewardError(index, f"{type(error).__name__}: {error}"))
                value = 0.0
            scores.append(value + self.format_bonus(text))
        self.errors += failed
        if failed and len(failed) == len(scores):
            raise NereusError(f"reward {self.name} failed on every sample of the step (first: {failed[0].message})")
        return scores

    def format_bonus(self, text: str) -> float:
        """The format reward's weight when the response holds its pattern, else 0."""
        if self.format_reward is None or re.search(self.format_reward.pattern, text) is None:
            return 0.0
        return self.format_reward.weight

    def drain_errors(self) -> list[RewardError]:
        errors, self.errors = self.errors, []
        return errors


def make_scorer(config: RLConfig, tokenizer: Tokenizer) -> Scorer:
    """The scorer of the run's `reward` (`model` runs keep the rule score beside the model's)."""
    reward = config.reward
    if isinstance(reward, PythonReward):
        return Scorer(tokenizer, import_reward(reward), reward.python, config.format_reward)
    name = "rule" if reward == "model" else reward
    return Scorer(tokenizer, BUILT_IN[name], name, config.format_reward)

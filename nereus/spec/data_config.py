"""The run config's prompt dataset (`data:`) and reward options (`rl.reward: {python: ...}`,
`rl.format_reward`): spec-layer documents, checked before any rank exists."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from nereus.spec.base import StrictModel

#: What a prompt longer than the plan's prompt length does: refuse the dataset naming the
#: line, keep its last tokens, or leave the line out.
Overlong = Literal["error", "truncate", "skip"]


class DataConfig(StrictModel):
    """Prompts from a file: each line (jsonl) or row (parquet) holds a prompt and its answer."""

    train: str
    """The training prompts: a .jsonl file (one JSON object a line) or a .parquet file (needs
    pyarrow), relative to the config file."""
    prompt_key: str = "prompt"
    """Field holding the prompt: a string, or a list of chat messages ({role, content}) that the
    model folder's chat template renders."""
    answer_key: str = "answer"
    """Field holding what the reward checks the response against (a string or a number)."""
    eval: str | None = None
    """Optional held-out prompts (same format and keys), scored greedily every `eval_every`
    steps; the mean reward goes into metrics.jsonl as `eval_reward`."""
    eval_every: int = Field(default=10, gt=0)
    """Steps between evaluations on `eval` (and after the last step)."""
    overlong: Overlong = "error"
    """A prompt longer than the plan's prompt length: `error` (refuse the run naming the line),
    `truncate` (keep its last tokens, where the question and the assistant's turn are) or
    `skip` (leave the line out)."""


class PythonReward(StrictModel):
    """A user reward function `(prompt, response, answer) -> float`."""

    python: str
    """`module:function`, the module imported from `folder`."""
    folder: str | None = None
    """Folder the module is imported from; None: the config file's folder (`nereus run` writes
    the absolute folder into the run folder's copy of the config)."""

    @field_validator("python")
    @classmethod
    def _module_function(cls, value: str) -> str:
        module, _, function = value.partition(":")
        if not module or not function.isidentifier():
            raise ValueError(f"{value!r} is not module:function (for example rewards:score)")
        return value


class FormatReward(StrictModel):
    """A bonus for responses in the expected form, added to any reward."""

    pattern: str
    """Regular expression the response must contain (re.search), e.g. `#### -?[0-9]+` or `\\\\boxed\\{`."""
    weight: float = Field(default=0.1, gt=0)
    """Added to the reward of a response that contains `pattern`."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"not a regular expression ({error})") from None
        return pattern

"""Careless dataset and reward inputs to `nereus run`: each is refused with one line naming
the file and line (or the function), exit 1, before any rank is spawned, nothing written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli_helpers import invoke, one_error_line
from tests.run_helpers import write_config

pytestmark = pytest.mark.cli

#: Prompts the character tokenizer encodes (the preset plan's tiny model, prompt_len 16).
GOOD = [{"question": "A:1+2=", "answer": "3"}, {"question": "A:4+4=", "answer": 8}]


def lines(*records: Any) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def refused(tmp_path: Path, text: str | None, rl: dict[str, Any] | None = None, **data: Any) -> str:
    """The error line of a run over a train file holding `text` (None: no file)."""
    if text is not None:
        (tmp_path / "train.jsonl").write_text(text)
    fields = {"train": "train.jsonl", "prompt_key": "question", **data}
    rl = {"seed": 3, "max_new_tokens": 4, "reward": "math", **(rl or {})}
    config = write_config(tmp_path, data=fields, rl=rl)
    line = one_error_line(invoke("run", config, "--out", tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    return line


def test_a_missing_dataset_file(tmp_path: Path) -> None:
    assert f"data.train: {tmp_path / 'train.jsonl'} does not exist" in refused(tmp_path, None)


def test_a_line_that_is_not_json(tmp_path: Path) -> None:
    line = refused(tmp_path, lines(GOOD[0], '{"question": "A:1+1=", "answer": ', GOOD[1]))
    assert f"{tmp_path / 'train.jsonl'}:2: not JSON" in line


def test_a_missing_key(tmp_path: Path) -> None:
    line = refused(tmp_path, lines(GOOD[0], {"prompt": "A:1+1=", "answer": "2"}))
    assert "train.jsonl:2: no field 'question' (data.prompt_key); the line has 'prompt', 'answer'" in line
    line = refused(tmp_path, lines({"question": "A:1+1="}))
    assert "train.jsonl:1: no field 'answer' (data.answer_key)" in line


def test_an_empty_dataset(tmp_path: Path) -> None:
    assert "train.jsonl has no prompts (it holds no lines)" in refused(tmp_path, "\n\n")


def test_an_overlong_prompt_names_its_line_unless_skipped(tmp_path: Path) -> None:
    long = {"question": "A:" + "1" * 20 + "+2=", "answer": "3"}
    line = refused(tmp_path, lines(GOOD[0], long))
    assert "train.jsonl:2: the prompt has 26 tokens, more than the plan's prompt length 16" in line
    line = refused(tmp_path, lines(long), overlong="skip")
    assert "has no prompts (all 1 are longer than the prompt length 16)" in line


def test_chat_messages_with_a_tokenizer_without_a_template(tmp_path: Path) -> None:
    chat = {"question": [{"role": "user", "content": "A:1+2="}], "answer": "3"}
    assert "train.jsonl:1: the character tokenizer has no chat template" in refused(tmp_path, lines(chat))


@pytest.mark.parametrize(
    ("module", "function", "expected"),
    [
        (None, "rewards:score", "rl.reward.python: cannot import 'rewards' from"),
        ("import nothing_here\n", "rewards:score", "ModuleNotFoundError: No module named 'nothing_here'"),
        ("def other(p, r, a):\n    return 1.0\n", "rewards:score", "rewards.py) has no function 'score'"),
        ("def score(p, r, a):\n    return 1 / 0\n", "rewards:score", "raised on line 1's answer"),
    ],
)
def test_a_reward_function_that_cannot_be_imported_or_raises(
    tmp_path: Path, module: str | None, function: str, expected: str
) -> None:
    if module is not None:
        (tmp_path / "rewards.py").write_text(module)
    line = refused(tmp_path, lines(*GOOD), rl={"reward": {"python": function}})
    assert expected in line

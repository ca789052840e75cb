"""Prompt datasets: a .jsonl or .parquet file of prompts and answers, read and encoded once
before any rank exists (no torch), then drawn in a per-epoch shuffled order.

Step `s` takes positions `s * P .. (s + 1) * P - 1` (P prompts a step) of the endless
sequence of epochs, each epoch a permutation of the dataset seeded by (seed, epoch): the
order is a function of the seed and the step alone, so a run resumed at step `s` continues
at the same position of the same order, bitwise.
"""

from __future__ import annotations

import hashlib
import json
import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nereus.errors import MissingDependency, NereusError
from nereus.runtime.rl.tokenizer import PromptValue, Tokenizer
from nereus.spec.data_config import DataConfig, Overlong

#: File suffixes a dataset may have.
SUFFIXES = (".jsonl", ".parquet")


@dataclass(frozen=True)
class Prompt:
    """One prompt of a step: as the data gives it, its answer and its token ids."""

    prompt: PromptValue
    answer: str
    ids: tuple[int, ...]
    line: int = 0
    """Line (jsonl) or row (parquet, from 1) it came from; 0 for a synthetic task's prompt."""


def read_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, decoded JSON value) of every non-blank line of a jsonl file, or (row
    number, dict) of every row of a parquet file; NereusError naming the file and line."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as parquet
        except ImportError:
            raise MissingDependency(f"reading {path}", "pyarrow", "data") from None
        try:
            rows = parquet.read_table(path).to_pylist()
        except Exception as error:  # pyarrow raises its own types for a damaged file
            raise NereusError(f"{path}: not a parquet file pyarrow reads ({error})") from None
        yield from enumerate(rows, start=1)
        return
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except ValueError as error:
                raise NereusError(f"{path}:{number}: not JSON ({error}); each line holds one JSON object") from None


def _is_message(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("role"), str) and isinstance(value.get("content"), str)


def prompt_value(value: Any, where: str, key: str) -> PromptValue:
    """The prompt field: a non-empty string or a list of {role, content} string messages."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(_is_message(m) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise NereusError(f"{where}: {key}: must be a non-empty string or a list of {{role, content}} chat messages")


def answer_text(value: Any, where: str, key: str) -> str:
    """The answer field as text (a string, or a number as JSON writes it)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise NereusError(f"{where}: {key}: must be a string or a number, got {type(value).__name__}")
    return value if isinstance(value, str) else json.dumps(value)


def fit_length(ids: list[int], max_len: int, overlong: Overlong, where: str) -> list[int] | None:
    """`ids` within `max_len` tokens as `overlong` says (None: leave the line out)."""
    if len(ids) <= max_len:
        return ids
    if overlong == "error":
        raise NereusError(
            f"{where}: the prompt has {len(ids)} tokens, more than the plan's prompt length {max_len}; "
            "shorten it, set data.overlong: truncate or skip, or plan a longer prompt_len"
        )
    return ids[-max_len:] if overlong == "truncate" else None


def load_prompts(path: Path, field: str, config: DataConfig, tokenizer: Tokenizer, max_len: int) -> tuple[Prompt, ...]:
    """Every prompt of a dataset file, encoded and fitted to `max_len` tokens; NereusError
    naming the file, the line and the fix for a missing file, a bad line or an empty set."""
    if not path.is_file():
        raise NereusError(f"data.{field}: {path} does not exist; give a .jsonl or .parquet file of prompts")
    if path.suffix not in SUFFIXES:
        raise NereusError(f"data.{field}: {path} is neither .jsonl nor .parquet")
    prompts, skipped = [], 0
    for number, row in read_rows(path):
        where = f"{path}:{number}"
        if not isinstance(row, dict):
            raise NereusError(
                f"{where}: a line must hold a JSON object with {config.prompt_key!r} and {config.answer_key!r}"
            )
        for key, name in ((config.prompt_key, "prompt_key"), (config.answer_key, "answer_key")):
            if key not in row:
                have = ", ".join(map(repr, row)) or "no fields"
                raise NereusError(f"{where}: no field {key!r} (data.{name}); the line has {have}")
        prompt = prompt_value(row[config.prompt_key], where, config.prompt_key)
        try:
            ids = tokenizer.prompt_ids(prompt)
        except ValueError as error:
            raise NereusError(f"{where}: {error}") from None
        fitted = fit_length(ids, max_len, config.overlong, where)
        if fitted is None:
            skipped += 1
            continue
        prompts.append(
            Prompt(prompt, answer_text(row[config.answer_key], where, config.answer_key), tuple(fitted), number)
        )
    if not prompts:
        why = f"all {skipped} are longer than the prompt length {max_len}" if skipped else "it holds no lines"
        raise NereusError(f"data.{field}: {path} has no prompts ({why})")
    return tuple(prompts)


def epoch_order(size: int, seed: int, epoch: int) -> list[int]:
    """The dataset's order in `epoch`: a permutation of range(size) seeded by (seed, epoch)."""
    order = list(range(size))
    random.Random(zlib.crc32(f"data:{seed}:{epoch}".encode())).shuffle(order)
    return order


def position(step: int, per_step: int, size: int) -> tuple[int, int]:
    """(epoch, index within the epoch's order) of the first prompt step `step` draws."""
    return divmod(step * per_step, size)


def draw(prompts: tuple[Prompt, ...], seed: int, step: int, per_step: int) -> list[Prompt]:
    """The `per_step` prompts of step `step` (an epoch boundary may fall inside a step)."""
    epoch, index = position(step, per_step, len(prompts))
    drawn: list[Prompt] = []
    while len(drawn) < per_step:
        order = epoch_order(len(prompts), seed, epoch)
        take = order[index : index + per_step - len(drawn)]
        drawn += [prompts[i] for i in take]
        epoch, index = epoch + 1, 0
    return drawn


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()

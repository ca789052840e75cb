"""Synthetic verifiable tasks with rule-based rewards and a character-level tokenizer.

Every task draws prompts from a seeded `random.Random`, knows each prompt's right answer
and scores a response by rule: 1.0 for the right answer, partial credit for answer
characters in the right place and for answer characters present at all. Problem sizes are drawn from a long-tailed
distribution (most small, a few large), so response lengths vary per sample and a batch's
generation has a long tail.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

#: Characters the tasks write; token ids follow the special tokens in this order.
ALPHABET = "0123456789+-=:SA"
#: What `decode` writes for an id outside the alphabet; it never matches an answer character.
UNKNOWN_CHAR = "?"


@dataclass(frozen=True)
class CharTokenizer:
    """One token per character, after three special tokens (pad, begin, end of sequence)."""

    alphabet: str = ALPHABET
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    @property
    def num_special(self) -> int:
        return 3

    @property
    def vocab_size(self) -> int:
        return self.num_special + len(self.alphabet)

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset((self.eos_id,))

    def prompt_ids(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """A begin-of-sequence token and the prompt's characters (no chat template)."""
        if not isinstance(prompt, str):
            raise ValueError("the character tokenizer has no chat template; give prompts as strings")
        return [self.bos_id, *self.encode(prompt)]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens); ValueError naming an unknown character."""
        ids = []
        for char in text:
            index = self.alphabet.find(char)
            if index < 0:
                raise ValueError(f"character {char!r} is not in the tokenizer's alphabet {self.alphabet!r}")
            ids.append(self.num_special + index)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to the first end-of-sequence token; other special tokens are dropped
        and ids past the alphabet (a model's vocabulary may be larger) become `UNKNOWN_CHAR`."""
        kept = itertools.takewhile(lambda token: token != self.eos_id, ids)
        indices = [token - self.num_special for token in kept if token >= self.num_special]
        return "".join(self.alphabet[index] if index < len(self.alphabet) else UNKNOWN_CHAR for index in indices)


@dataclass(frozen=True)
class Problem:
    """One prompt and its right answer."""

    prompt: str
    answer: str


class Task(Protocol):
    """A family of verifiable problems."""

    @property
    def name(self) -> str:
        """The task's name in `TASKS`."""
        ...

    def sample(self, rng: random.Random) -> Problem:
        """One problem drawn with `rng`."""
        ...


def long_tailed_size(rng: random.Random, smallest: int, largest: int, mean_extra: float) -> int:
    """smallest + an exponential draw of mean `mean_extra`, capped at `largest`."""
    return min(largest, smallest + int(rng.expovariate(1.0 / mean_extra)))


def answer_score(response: str, answer: str) -> float:
    """1.0 for the exact answer; otherwise partial credit, at most 0.8 so exactness always pays:
    0.5 x the share of positions holding the answer's character plus 0.3 x the share of the
    answer's characters the response contains (as a multiset), both over the longer of the two
    strings, so a response too long or too short loses credit. The dense part gives a
    randomly initialised policy a signal to climb before it ever gets an answer right."""
    if response == answer:
        return 1.0
    longest = max(len(response), len(answer))
    if longest == 0:
        return 0.0
    in_place = sum(a == b for a, b in zip(response, answer, strict=False))
    shared = sum((Counter(response) & Counter(answer)).values())
    return (0.5 * in_place + 0.3 * shared) / longest


@dataclass(frozen=True)
class SortDigits:
    """`S:<digits>=` -> the digits in ascending order; the answer is as long as the prompt's digits."""

    min_digits: int = 2
    """Fewest digits in a prompt."""
    max_digits: int = 12
    """Most digits in a prompt (the tail of the length distribution is cut here)."""
    mean_extra_digits: float = 2.0
    """Mean of the exponential number of digits beyond `min_digits`."""
    name: str = "sort"

    def sample(self, rng: random.Random) -> Problem:
        size = long_tailed_size(rng, self.min_digits, self.max_digits, self.mean_extra_digits)
        digits = "".join(rng.choice("0123456789") for _ in range(size))
        return Problem(f"S:{digits}=", "".join(sorted(digits)))


@dataclass(frozen=True)
class AddNumbers:
    """`A:<a>+<b>=` -> the decimal sum; operand widths are long-tailed."""

    max_digits: int = 6
    """Most digits of an operand."""
    mean_extra_digits: float = 1.0
    """Mean of the exponential number of operand digits beyond one."""
    name: str = "add"

    def sample(self, rng: random.Random) -> Problem:
        def operand() -> int:
            width = long_tailed_size(rng, 1, self.max_digits, self.mean_extra_digits)
            return rng.randrange(10 ** (width - 1) if width > 1 else 0, 10**width)

        a, b = operand(), operand()
        return Problem(f"A:{a}+{b}=", str(a + b))


#: The shipped tasks by name (`nereus.spec.run_config.TASK_NAMES` lists the same, for the config's check).
TASKS: dict[str, Task] = {task.name: task for task in (SortDigits(), AddNumbers())}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    return TASKS[name]


def sample_problems(task: Task, num_problems: int, seed: int) -> list[Problem]:
    """`num_problems` problems drawn from a generator seeded with `seed` (same seed, same problems)."""
    rng = random.Random(seed)
    return [task.sample(rng) for _ in range(num_problems)]


def score_response(tokenizer: CharTokenizer, problem: Problem, response_ids: Sequence[int]) -> float:
    """Rule-based reward of a generated response (its tokens through EOS)."""
    return answer_score(tokenizer.decode(response_ids), problem.answer)

"""Tokenizer, rule-based rewards, seeded sampling and the long tail of the synthetic tasks."""

from __future__ import annotations

import random
import statistics

import pytest

from nereus.runtime.rl.tasks import (
    ALPHABET,
    TASKS,
    AddNumbers,
    CharTokenizer,
    Problem,
    SortDigits,
    answer_score,
    get_task,
    sample_problems,
    score_response,
)
from nereus.spec.run_config import TASK_NAMES

pytestmark = pytest.mark.one_rank

TOKENIZER = CharTokenizer()


def test_tokenizer_round_trip_and_specials() -> None:
    text = "S:3141=1134A:12+30=42"
    ids = TOKENIZER.encode(text)
    assert len(ids) == len(text) and min(ids) >= TOKENIZER.num_special
    assert TOKENIZER.decode(ids) == text
    assert TOKENIZER.decode([TOKENIZER.bos_id, *ids[:3], TOKENIZER.eos_id, *ids[3:]]) == text[:3]
    assert TOKENIZER.vocab_size == 3 + len(ALPHABET) <= 64  # fits the tiny preset's vocabulary
    assert TOKENIZER.decode([ids[0], TOKENIZER.vocab_size, 63]) == text[0] + "??"  # ids a bigger model may emit
    with pytest.raises(ValueError, match="'x' is not in"):
        TOKENIZER.encode("1x")


def test_sort_rewards_right_wrong_partial() -> None:
    problem = SortDigits().sample(random.Random(3))
    assert problem.answer == "".join(sorted(problem.prompt[2:-1]))
    fixed = Problem("S:3120=", "0123")
    right = [*TOKENIZER.encode("0123"), TOKENIZER.eos_id]
    assert score_response(TOKENIZER, fixed, right) == 1.0
    # two digits in place, all four present
    assert score_response(TOKENIZER, fixed, TOKENIZER.encode("0132")) == pytest.approx((0.5 * 2 + 0.3 * 4) / 4)
    # the answer followed by junk: four in place and present, over the longer length 6
    assert score_response(TOKENIZER, fixed, TOKENIZER.encode("012345")) == pytest.approx(0.8 * 4 / 6)
    # one 1 in place; the multiset counts the repeated 1s once
    assert score_response(TOKENIZER, fixed, TOKENIZER.encode("1119")) == pytest.approx((0.5 * 1 + 0.3 * 1) / 4)
    assert score_response(TOKENIZER, fixed, TOKENIZER.encode("9999")) == 0.0
    assert score_response(TOKENIZER, fixed, [TOKENIZER.eos_id]) == 0.0


def test_add_rewards_and_answers() -> None:
    problems = sample_problems(AddNumbers(), 50, seed=1)
    for problem in problems:
        a, b = problem.prompt[2:-1].split("+")
        assert int(problem.answer) == int(a) + int(b)
        assert score_response(TOKENIZER, problem, [*TOKENIZER.encode(problem.answer), TOKENIZER.eos_id]) == 1.0
    assert answer_score("579", "579") == 1.0
    assert answer_score("578", "579") == pytest.approx(0.8 * 2 / 3)
    assert answer_score("975", "579") == pytest.approx((0.5 * 1 + 0.3 * 3) / 3)
    assert answer_score("", "579") == 0.0


def test_only_the_exact_answer_scores_above_partial_credit() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        answer = "".join(rng.choice("0123") for _ in range(rng.randint(1, 5)))
        response = "".join(rng.choice("0123?") for _ in range(rng.randint(0, 6)))
        score = answer_score(response, answer)
        assert score == 1.0 if response == answer else 0.0 <= score <= 0.8


def test_seeded_sampling_is_deterministic() -> None:
    for name in ("sort", "add"):
        task = get_task(name)
        assert sample_problems(task, 20, seed=7) == sample_problems(task, 20, seed=7)
        assert sample_problems(task, 20, seed=7) != sample_problems(task, 20, seed=8)
    with pytest.raises(ValueError, match="unknown task 'mul'"):
        get_task("mul")


def test_the_config_accepts_exactly_the_shipped_tasks() -> None:
    assert tuple(TASKS) == TASK_NAMES


def test_prompts_encode_and_fit_the_tokenizer() -> None:
    for name in ("sort", "add"):
        for problem in sample_problems(get_task(name), 200, seed=0):
            ids = TOKENIZER.prompt_ids(problem.prompt)
            assert ids[0] == TOKENIZER.bos_id and TOKENIZER.decode(ids) == problem.prompt


@pytest.mark.parametrize("name", ["sort", "add"])
def test_answer_lengths_have_a_long_tail(name: str) -> None:
    lengths = [len(p.answer) for p in sample_problems(get_task(name), 2000, seed=0)]
    median = statistics.median(lengths)
    p99 = sorted(lengths)[int(0.99 * len(lengths))]
    assert p99 >= 2 * median, (median, p99)  # the slowest sample in a batch is far above typical
    assert min(lengths) < median < max(lengths)

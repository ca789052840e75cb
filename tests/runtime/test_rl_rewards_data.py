"""Verifiable rewards (math, exact, format bonus, a user's function) and the dataset order:
what each scores, and that the per-epoch order depends on the seed and step alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereus.errors import NereusError
from nereus.runtime.rl.datasets import Prompt, draw, epoch_order, load_prompts
from nereus.runtime.rl.rewards import Scorer, final_answer, make_scorer, math_matches
from nereus.runtime.rl.tasks import CharTokenizer
from nereus.spec.data_config import DataConfig, FormatReward
from nereus.spec.run_config import RLConfig

pytestmark = pytest.mark.logic


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so 3 + 4 = 7. #### 7", "7"),
        ("The total is \\boxed{\\frac{3}{4}} dollars", "0.75"),
        ("she has 1,200 apples", "1200"),
        ("#### $42.", "42"),
        ("it is 12 then 13", "13"),
        ("\\boxed{x+1}", "x + 1"),
    ],
)
def test_math_matches_final_answers(text: str, answer: str) -> None:
    assert math_matches(text, answer)
    assert math_matches(text, f"some working ... #### {answer}")


@pytest.mark.parametrize(("text", "answer"), [("7 then 8", "7"), ("no number", "3"), ("\\boxed{2", "3"), ("", "0")])
def test_math_refuses_other_or_missing_answers(text: str, answer: str) -> None:
    assert not math_matches(text, answer)


def test_final_answer_prefers_the_marked_one() -> None:
    assert final_answer("#### 5 and later 9") == "5 and later 9"
    assert final_answer("\\boxed{4} then 9") == "4"
    assert final_answer("nothing") is None


def prompts(*answers: str) -> list[Prompt]:
    return [Prompt("A:1+2=", answer, (1,)) for answer in answers]


def test_exact_and_format_rewards_on_decoded_responses() -> None:
    tokenizer = CharTokenizer()
    config = RLConfig(reward="exact", format_reward=FormatReward(pattern="^[0-9]+$", weight=0.25))
    scorer = make_scorer(config, tokenizer)
    responses = [[*tokenizer.encode("3"), tokenizer.eos_id, 5], tokenizer.encode("3+"), tokenizer.encode("4")]
    assert scorer.score_all(prompts("3", "3", "3"), responses) == [1.25, 0.0, 0.25]


def test_a_failing_user_function_scores_zero_and_is_reported_unless_every_sample_fails() -> None:
    def picky(prompt: object, response: str, answer: str) -> float:
        if response == "4":
            raise KeyError("four")
        return 1.0

    tokenizer = CharTokenizer()
    scorer = Scorer(tokenizer, picky, "mine:picky")
    assert scorer.score_all(prompts("3", "3"), [tokenizer.encode("3"), tokenizer.encode("4")]) == [1.0, 0.0]
    errors = scorer.drain_errors()
    assert [(e.sample, e.message) for e in errors] == [(1, "KeyError: 'four'")] and not scorer.errors
    with pytest.raises(NereusError, match="reward mine:picky failed on every sample of the step"):
        scorer.score_all(prompts("3"), [tokenizer.encode("4")])


def test_the_order_is_a_fresh_permutation_each_epoch_and_a_function_of_seed_and_step() -> None:
    data = tuple(Prompt(str(i), str(i), (i,)) for i in range(10))
    steps = [draw(data, 7, step, 4) for step in range(5)]  # 20 prompts: two epochs exactly
    flat = [p.answer for step in steps for p in step]
    assert sorted(flat[:10]) == sorted(flat[10:]) == sorted(str(i) for i in range(10))
    assert epoch_order(10, 7, 0) != epoch_order(10, 7, 1) and epoch_order(10, 7, 0) != epoch_order(10, 8, 0)
    assert draw(data, 7, 3, 4) == steps[3]  # a resumed step draws what the uninterrupted one drew


def test_overlong_prompts_truncated_keep_their_end(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "A:123456789+1=", "answer": 0}) + "\n")
    config = DataConfig(train="train.jsonl", overlong="truncate")
    (prompt,) = load_prompts(path, "train", config, CharTokenizer(), 5)
    assert CharTokenizer().decode(prompt.ids) == "89+1=" and prompt.answer == "0" and prompt.line == 1


def test_a_folder_tokenizer_renders_chat_messages_with_its_template(tmp_path: Path) -> None:
    from hf_helpers import tiny_math_model
    from repo_paths import DATA

    from nereus.runtime.rl.tokenizer import load_folder_tokenizer

    pytest.importorskip("tokenizers")
    maker = tiny_math_model()
    maker.save_tokenizer(tmp_path, [DATA / "math-chat.jsonl"])
    tokenizer = load_folder_tokenizer(tmp_path)
    assert (tokenizer.pad_id, tokenizer.eos_id, tokenizer.vocab_size) == (0, 2, maker.VOCAB_SIZE)
    messages = [{"role": "user", "content": "Ana has 3 apples."}]
    assert tokenizer.render_chat(messages) == "<s>user: Ana has 3 apples.\nassistant:"
    ids = tokenizer.prompt_ids(messages)
    assert ids[0] == 1 and tokenizer.decode(ids) == "user: Ana has 3 apples.\nassistant:"
    assert tokenizer.decode([*tokenizer.encode(" #### 42"), 2, *tokenizer.encode("9")]) == " #### 42"
    assert tokenizer.prompt_ids("Ana")[0] == 1  # a string prompt gets the tokenizer's <s>
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has no chat template"):
        load_folder_tokenizer(tmp_path).prompt_ids(messages)

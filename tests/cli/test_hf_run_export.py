"""A run from a transformers-made Hugging Face folder and back: `model: DIR` with no plan
plans itself, loads the folder's weights, and `nereus export hf` writes a folder transformers
loads; with a learning rate too small to move a float32 weight the round trip is bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from cli_helpers import invoke, one_error_line
from hf_helpers import save_random_model

from nereus.spec.io import load_document, save_document
from nereus.spec.plan import Plan

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.cli


def qwen2_folder(root: Path, head: str = "ForCausalLM") -> Path:
    """Qwen2-style: tied embeddings, qkv bias, theta 1e6, eps 1e-6; every weight nonzero.
    `head` ForSequenceClassification: a one-label value-head checkpoint of the same shapes."""
    fields = {
        "num_hidden_layers": 2,
        "vocab_size": 32,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "eos_token_id": 2,
    }
    if head != "ForCausalLM":  # one label, read at the last token (batches of one: no pad id)
        fields.update(num_labels=1, pad_token_id=None)
    name = "qwen-tiny" if head == "ForCausalLM" else "qwen-tiny-rm"
    folder = save_random_model(root / name, "Qwen2Config", fields, head=head)
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 256}\n')
    return folder


def write_config(root: Path, **fields: object) -> Path:
    document = {
        "kind": "RunConfig",
        "version": 1,
        "model": "qwen-tiny",
        "workload": "tiny-ppo",
        "num_steps": 1,
        "checkpoint_every": 1,
        "rl": {"task": "sort", "seed": 3, "max_new_tokens": 4, "actor_lr": 1e-30, "log_samples": 6},
        **fields,
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def check_samples(run: Path, source: Path) -> int:
    """samples.jsonl's log-probs against transformers' for the same prompt + response ids."""
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    records = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 6 and {r["step"] for r in records} == {0}
    for record in records:
        ids = record["prompt_ids"] + record["response_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        start = len(record["prompt_ids"])
        theirs = [float(logits[j - 1, ids[j]]) for j in range(start, len(ids))]
        assert len(record["logprobs"]) == len(theirs) > 0
        assert max(abs(a - b) for a, b in zip(record["logprobs"], theirs, strict=True)) < 1e-4, record
        assert set(record) >= {"prompt", "response", "reward"} and record["prompt"]
    return len(records)


def forced_plan(root: Path, source: Path, tp: int, pp: int) -> Path:
    """A 2-rank plan for the folder's model with every model-stage at (tp, pp) on both ranks."""
    path = root / f"plan-tp{tp}-pp{pp}.yaml"
    result = invoke("plan", "--model", source, "--workload", "tiny-ppo", "--gpus", "2", "-o", path)
    assert result.exit_code == 0, result.output
    plan = load_document(path)
    assert isinstance(plan, Plan)
    pool = plan.pools[0].model_copy(update={"name": "all", "gpus": [0, 1]})
    stages = [s.model_copy(update={"pool": "all", "tp": tp, "pp": pp, "dp": 1, "emus": [[0, 1]]}) for s in plan.stages]
    save_document(plan.model_copy(update={"pools": [pool], "stages": stages, "predictions": None}), path)
    return path


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_samples_of_a_tp_or_pp_run_match_transformers(tmp_path: Path, tp: int, pp: int) -> None:
    source = qwen2_folder(tmp_path)
    plan = forced_plan(tmp_path, source, tp, pp)
    result = invoke("run", write_config(tmp_path, plan=plan.name), "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    stored = load_document(tmp_path / "run" / "plan.yaml")
    assert isinstance(stored, Plan) and {(s.tp, s.pp) for s in stored.stages} == {(tp, pp)}
    check_samples(tmp_path / "run", source)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_run_from_a_folder_and_export_it_back_bitwise(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    source = qwen2_folder(tmp_path)
    result = invoke("run", write_config(tmp_path), "--nproc", "2", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    plan = load_document(tmp_path / "run" / "plan.yaml")
    assert isinstance(plan, Plan) and plan.weights == dict.fromkeys(("actor", "reference", "critic"), str(source))
    assert {m.rope_theta for m in plan.models} == {1e6} and plan.models[0].qkv_bias
    check_samples(tmp_path / "run", source)

    exported = tmp_path / "exported"
    result = invoke("export", "hf", tmp_path / "run", "--step", "1", "-o", exported)
    assert result.exit_code == 0, result.output
    assert (exported / "config.json").read_bytes() == (source / "config.json").read_bytes()
    assert (exported / "tokenizer_config.json").read_bytes() == (source / "tokenizer_config.json").read_bytes()
    before, after = load_file(source / "model.safetensors"), load_file(exported / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)

    tokens = torch.randint(3, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()(tokens).logits
        ours = transformers.AutoModelForCausalLM.from_pretrained(source).eval()(tokens).logits
    assert torch.equal(theirs, ours)

    critic = tmp_path / "critic"
    assert invoke("export", "hf", tmp_path / "run", "--model", "critic", "-o", critic).exit_code == 0
    assert json.loads((critic / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]
    assert "score.weight" in load_file(critic / "model.safetensors")


def test_bad_folder_is_refused_before_any_rank(tmp_path: Path) -> None:
    (tmp_path / "qwen-tiny").mkdir()
    result = invoke("run", write_config(tmp_path), "--nproc", "2", "--out", tmp_path / "run")
    assert "qwen-tiny/config.json: not found" in one_error_line(result)
    assert not (tmp_path / "run").exists()


def test_weights_that_disagree_with_the_config_are_refused(tmp_path: Path) -> None:
    source = qwen2_folder(tmp_path)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    result = invoke("run", write_config(tmp_path), "--nproc", "2", "--out", tmp_path / "run")
    line = one_error_line(result)
    assert "model.safetensors: tensor model.layers.0.mlp.gate_proj.weight has shape [128, 64]" in line
    assert not (tmp_path / "run").exists()


def test_export_of_a_missing_step_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    line = one_error_line(invoke("export", "hf", tmp_path / "run", "--step", "3", "-o", tmp_path / "x"))
    assert "no checkpoint of step 3" in line


@pytest.mark.multiprocess
@pytest.mark.slow
def test_critic_and_reward_model_from_a_value_head_folder(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    qwen2_folder(tmp_path)
    value_folder = qwen2_folder(tmp_path, "ForSequenceClassification")
    rl: dict[str, object] = {"task": "sort", "seed": 3, "max_new_tokens": 4, "actor_lr": 1e-30, "critic_lr": 1e-30}
    rl["log_samples"] = 6
    rl["reward"] = "model"
    config = write_config(tmp_path, critic_model=value_folder.name, reward_model=value_folder.name, rl=rl)
    result = invoke("run", config, "--nproc", "2", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    # The reward of every logged sample is what transformers' classifier says of it.
    scorer = transformers.AutoModelForSequenceClassification.from_pretrained(value_folder).eval()
    for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        with torch.no_grad():
            expected = float(scorer(torch.tensor([record["prompt_ids"] + record["response_ids"]])).logits[0, 0])
        assert abs(record["reward"] - expected) < 1e-4, (record, expected)
    # The critic started from the same folder, and a learning rate of 1e-30 leaves it there.
    critic = tmp_path / "critic"
    assert invoke("export", "hf", tmp_path / "run", "--model", "critic", "-o", critic).exit_code == 0
    assert (critic / "config.json").read_bytes() == (value_folder / "config.json").read_bytes()
    before, after = load_file(value_folder / "model.safetensors"), load_file(critic / "model.safetensors")
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_a_reward_folder_needs_a_score_head_and_the_model_reward(tmp_path: Path) -> None:
    qwen2_folder(tmp_path)
    config = write_config(tmp_path, reward_model="qwen-tiny")
    assert "reward_model: needs rl.reward: model" in one_error_line(invoke("run", config, "--nproc", "2"))
    rl = {"task": "sort", "reward": "model"}
    config = write_config(tmp_path, reward_model="qwen-tiny", rl=rl)
    assert "has no score.weight" in one_error_line(invoke("run", config, "--nproc", "2"))


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path: Path) -> None:
    save_random_model(tmp_path / "qwen-tiny", "Qwen2Config", {"num_hidden_layers": 2, "vocab_size": 16})
    line = one_error_line(invoke("run", write_config(tmp_path), "--nproc", "2", "--out", tmp_path / "run"))
    assert "has 16 tokens, the tokenizer needs 19" in line
    assert not (tmp_path / "run").exists()

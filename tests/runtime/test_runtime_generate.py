"""KV-cache generation and inference forwards under TP x PP x DP, against the reference model.

One 8-rank gloo world runs every layout with tp * pp * dp <= 8 the tiny model admits:
greedy generation must give exactly the reference's tokens (which recomputes the whole
prefix every step, no cache), per-token log-probs and values must match it.
"""

from __future__ import annotations

import pytest
import torch
from reference_generation import reference_generate
from test_runtime_parallel import merge_rank_errors

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.generation.continuous import BatchingDecoder
from nereus.runtime.generation.decoding import left_pad
from nereus.runtime.generation.generate import SamplingConfig, generate
from nereus.runtime.generation.kv_cache import KVBudget
from nereus.runtime.generation.sampling import sample_at
from nereus.runtime.model.engine import Engine
from nereus.runtime.model.initialization import init_logical_params
from nereus.runtime.model.parallel_groups import admissible_layouts
from nereus.runtime.model.transformer import Batch, ReferenceModel
from nereus.runtime.state.shard_layout import RankLayout
from nereus.spec.model import Head
from nereus.spec.presets import MODELS

pytestmark = pytest.mark.one_rank

TINY = MODELS["tiny"]
LAYOUTS = admissible_layouts(TINY, 8)
SEED = 5
MATRIX_SCALE = 5.0
PROMPTS = [[3, 17, 42, 8, 1], [9, 9], [60, 2, 33]]
GREEDY = SamplingConfig(max_new_tokens=6)
NUCLEUS = SamplingConfig(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=123)
VALUE_LAYOUTS = [(1, 1, 1), (4, 1, 2), (2, 4, 1), (1, 2, 3)]


def logical_params(head: Head) -> dict[str, torch.Tensor]:
    """Random weights with matrices at 5x the init scale: with the tied embedding at the
    usual scale the model just repeats its last token, which would test little."""
    logical = init_logical_params(TINY, head, SEED, randomize_all=True)
    return {name: value * MATRIX_SCALE if value.dim() == 2 else value for name, value in logical.items()}


def reference(head: Head) -> ReferenceModel:
    ref = ReferenceModel(TINY, head)
    logical = logical_params(head)
    with torch.no_grad():
        for name, param in ref.named_logical_parameters().items():
            param.copy_(logical[name])
    return ref


def scoring_batch() -> Batch:
    tokens, mask = left_pad([[5, 6, 7, 8, 9, 10], [11, 12, 13], [1, 2, 3, 4]], 0)
    return Batch(tokens, mask)


def expected_results() -> dict[str, torch.Tensor]:
    lm, value = reference("lm"), reference("value")
    batch = scoring_batch()
    with torch.no_grad():
        logits = lm(batch.tokens, batch.attention_mask)
        log_probs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        values = value(batch.tokens, batch.attention_mask)
    return {
        "greedy": reference_generate(lm, PROMPTS, GREEDY).tokens,
        "nucleus": reference_generate(lm, PROMPTS, NUCLEUS).tokens,
        "log_probs": log_probs,
        "values": values,
    }


def run_layout(head: Head, dims: tuple[int, int, int], expected: dict[str, torch.Tensor]) -> dict[str, float] | None:
    tp, pp, dp = dims
    engine = Engine.create(TINY, head, RankLayout(tp, pp, dp, tuple(range(tp * pp * dp))))
    if engine is None:
        return None
    engine.load_logical_params(logical_params(head))
    batch = scoring_batch()
    num_microbatches = 3 if pp > 1 else 1
    if head == "value":
        return {"values": float((engine.values(batch, num_microbatches) - expected["values"]).abs().max())}
    errors = {"log_probs": float((engine.log_probs(batch, num_microbatches) - expected["log_probs"]).abs().max())}
    for kind, config in (("greedy", GREEDY), ("nucleus", NUCLEUS)):
        tokens = generate(engine, PROMPTS, config).tokens
        errors[kind] = float(tokens.shape != expected[kind].shape or not torch.equal(tokens, expected[kind]))
    return errors


def world_worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    expected = expected_results()
    results = {}
    cases: list[tuple[Head, tuple[int, int, int]]] = [("lm", dims) for dims in LAYOUTS]
    cases += [("value", dims) for dims in VALUE_LAYOUTS]
    for head, dims in cases:
        errors = run_layout(head, dims, expected)
        if errors is not None:
            results[f"{head}-{dims}"] = errors
    return results


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_layout_generates_and_scores_like_reference() -> None:
    """One test for the whole world (a parametrised one would spawn it once per xdist worker)."""
    merged = merge_rank_errors(spawn(world_worker, 8))
    assert set(merged) == {f"lm-{dims}" for dims in LAYOUTS} | {f"value-{dims}" for dims in VALUE_LAYOUTS}
    bad = {}
    for case, errors in merged.items():
        if case.startswith("lm"):
            wrong = {k: v for k, v in errors.items() if (v != 0.0 if k in ("greedy", "nucleus") else not v <= 1e-5)}
        else:
            wrong = {k: v for k, v in errors.items() if not v <= 1e-5}
        if wrong:
            bad[case] = wrong
    assert not bad, f"layouts that differ from the reference (greedy/nucleus: 1 = tokens differ): {bad}"


def test_reference_greedy_is_decisive() -> None:
    """The layouts' greedy equality means something only if no step is a near tie."""
    ref = reference("lm")
    generation = reference_generate(ref, PROMPTS, GREEDY)
    with torch.no_grad():
        logits = ref(generation.tokens, generation.attention_mask)[:, generation.prompt_width - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-4
    responses = generation.responses()
    assert len({tuple(r) for r in responses}) == len(PROMPTS)
    assert all(len(set(r)) >= 3 for r in responses), responses  # not a repeated token


def test_generation_stops_at_eos() -> None:
    ref = reference("lm")
    free = reference_generate(ref, PROMPTS, GREEDY).responses()
    # The first token of sequence 0 that is new at its step: it must stop there.
    stop_at = next((k for k in range(1, len(free[0])) if free[0][k] not in free[0][:k]), 0)
    eos = free[0][stop_at]
    stopped = reference_generate(ref, PROMPTS, SamplingConfig(max_new_tokens=6, eos_token_id=eos)).responses()
    for full, cut in zip(free, stopped, strict=True):
        end = full.index(eos) + 1 if eos in full else len(full)
        assert cut == full[:end]
    assert stopped[0] == free[0][: stop_at + 1]
    every_step_eos = SamplingConfig(max_new_tokens=6, eos_token_id=free[1][0])
    assert reference_generate(ref, [PROMPTS[1]], every_step_eos).tokens.shape[1] == len(PROMPTS[1]) + 1


def sample_next(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> torch.Tensor:
    """[b] next tokens from [b, vocab] logits, the uniforms drawn from `generator`."""
    return sample_at(logits, config, torch.rand(logits.shape[0], generator=generator, dtype=torch.float64))


def test_top_p_draws_only_from_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    config = SamplingConfig(max_new_tokens=1, temperature=1.0, top_p=0.7)
    generator = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, config, generator)) for _ in range(300)}
    assert draws == {0, 1}
    first = [int(sample_next(logits, config, torch.Generator().manual_seed(9))) for _ in range(3)]
    assert len(set(first)) == 1  # same seed, same draw
    assert int(sample_next(logits, GREEDY, generator)) == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 1, "temperature": -1.0}, "temperature"),
        ({"max_new_tokens": 1, "top_p": 0.0}, "top_p"),
    ],
)
def test_sampling_config_refuses_bad_values(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)  # type: ignore[arg-type]


def test_left_pad_refuses_empty_prompts() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []], 0)
    tokens, mask = left_pad([[1, 2], [3]], 0)
    assert tokens.tolist() == [[1, 2], [0, 3]] and mask.tolist() == [[True, True], [False, True]]


#: A long-tailed mix for the KV-budget tests (the longest: 5 + 30 tokens, 9 blocks of 4).
MIX_PROMPTS = PROMPTS * 3
MIX_BUDGETS = [6, 20, 3, 12, 30, 1, 9, 25, 4]
#: KV bytes per token of the tiny model on one rank: 2 x 2 kv heads x 16 x 4 layers x fp32.
TOKEN_BYTES = 1024
BUDGET_SAMPLING = {
    "greedy": SamplingConfig(max_new_tokens=30),
    "sampled": SamplingConfig(max_new_tokens=30, temperature=1.0, top_p=0.9, top_k=40, seed=7),
}


def budget_worker(rank: int, world: int) -> dict[str, object]:
    engine = Engine.create(TINY, "lm", RankLayout(1, 1, 1, (0,)))
    assert engine is not None
    engine.load_logical_params(logical_params("lm"))
    out: dict[str, object] = {}
    for kind, config in BUDGET_SAMPLING.items():
        runs = []
        for budget in (KVBudget(), KVBudget(budget_bytes=12 * 4 * TOKEN_BYTES, block_tokens=4)):
            decoder = BatchingDecoder(engine, config, budget)
            decoder.start(MIX_PROMPTS, range(len(MIX_PROMPTS)), MIX_BUDGETS)
            decoder.run()
            assert decoder.scheduler is not None
            runs.append((decoder.responses, decoder.scheduler.preemptions, decoder.peak_blocks))
        out[kind] = runs
    try:
        BatchingDecoder(engine, GREEDY, KVBudget(budget_bytes=TOKEN_BYTES * 8)).start([PROMPTS[0]], [0], [6])
    except ValueError as error:
        out["refused"] = str(error)
    return out


@pytest.mark.multiprocess
def test_preemption_under_a_tight_budget_gives_the_unconstrained_tokens() -> None:
    out = spawn(budget_worker, 1)[0]
    lm = reference("lm")
    for kind in ("greedy", "sampled"):
        (free, free_preemptions, _), (tight, preemptions, peak) = out[kind]
        assert free_preemptions == 0 and preemptions > 0, (kind, preemptions)
        assert peak <= 12
        assert [tight[i] for i in range(len(MIX_PROMPTS))] == [free[i] for i in range(len(MIX_PROMPTS))], kind
        assert [len(free[i]) for i in range(len(MIX_PROMPTS))] == MIX_BUDGETS
        expected = reference_generate(lm, MIX_PROMPTS, BUDGET_SAMPLING[kind], budgets=MIX_BUDGETS).responses()
        assert [free[i] for i in range(len(MIX_PROMPTS))] == expected, kind
    # 5 + 6 tokens need one block of 16: 16 x 1024 bytes.
    assert "cannot hold one sequence of 11 tokens: it needs 16384 bytes" in str(out["refused"])


def test_sampling_config_refuses_negative_top_k() -> None:
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        SamplingConfig(max_new_tokens=1, top_k=-1)

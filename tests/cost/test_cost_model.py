"""The analytic cost model against hand-computed numbers from the published formulas.

Every expected value is computed here with plain arithmetic from the model's
hyperparameters, never through nereus's own size helpers:

* model states (ZeRO, Rajbhandari et al. 2020): 2 + 2 + 12 = 16 bytes per parameter for
  bf16 training with AdamW master weights; 4 + 4 + 8 for fp32;
* activations (Korthikanti et al. 2022, sequence parallel + flash attention):
  34 * s * b * h / tp bytes per layer at 16 bits;
* KV cache: 2 (K and V) * kv_heads * head_dim * bytes per token and layer.
"""

from __future__ import annotations

import math

import pytest
from repo_paths import EXAMPLES

from nereus.cost.calibration import DEFAULT_CALIBRATION
from nereus.cost.plan_cost import evaluate_plan
from nereus.cost.stage import StageCostModel
from nereus.spec.check import semantic_problems
from nereus.spec.cluster import Cluster
from nereus.spec.io import load_document
from nereus.spec.model import Model
from nereus.spec.plan import Plan, Pool, StagePlan
from nereus.spec.presets import MODELS, cluster_preset
from nereus.spec.stages import model_stage
from nereus.spec.workload import Optimizer, ResponseLengths, Workload, model_stages

pytestmark = pytest.mark.logic

EXAMPLES = EXAMPLES
GIB = 2**30

# h=64, 8 query heads of 8, 2 KV heads (GQA), 4 layers, SwiGLU 176, vocab 96.
TINY = Model(
    name="tiny-test",
    num_layers=4,
    hidden_dim=64,
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    ffn_dim=176,
    vocab_size=96,
    tied_embeddings=False,
)
TINY_TIED = TINY.model_copy(update={"name": "tiny-test-tied", "tied_embeddings": True})
# Qwen2-style q/k/v biases and Qwen3-style q/k norms on top.
TINY_QWEN = TINY.model_copy(update={"name": "tiny-test-qwen", "qkv_bias": True, "qk_norm": True})
CLUSTER = cluster_preset("h100", 64)
LLAMA_8B = MODELS["llama-3.1-8b"]


def workload(
    *,
    dtype: str = "bf16",
    master: bool = True,
    shard: bool = False,
    prompts: int = 64,
    prompt_len: int = 100,
    max_len: int = 156,
    mini_batches: int = 4,
) -> Workload:
    return Workload(
        name="w",
        algorithm="grpo",
        actor=TINY.name,
        prompts_per_step=prompts,
        samples_per_prompt=2,
        prompt_len=prompt_len,
        response_len=ResponseLengths(median=min(20, max_len), p99=min(60, max_len), max=max_len),
        mini_batches=mini_batches,
        micro_batch_size=1,
        dtype=dtype,  # type: ignore[arg-type]
        optimizer=Optimizer(master_weights=master, shard_across_dp=shard),
    )


def cost(stage: str, w: Workload, model: Model = TINY, cluster: Cluster = CLUSTER, head: str = "lm") -> StageCostModel:
    return StageCostModel(model, head, stage, w, cluster, DEFAULT_CALIBRATION)  # type: ignore[arg-type]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- hand counts of a Llama block ------------------------------------------------------------
def block_params_on_rank(m: Model, tp: int) -> float:
    """q and o split over tp; K and V split by head, one whole head per rank at least.

    Qwen2-style q/k/v biases split like their projections; Qwen3-style q/k RMSNorm
    weights (head_dim each) are replicated, like the two block norms.
    """
    q_dim = m.num_heads * m.head_dim
    kv_dim_rank = max(m.num_kv_heads / tp, 1) * m.head_dim
    q = m.hidden_dim * q_dim / tp
    o = q_dim * m.hidden_dim / tp
    k = v = m.hidden_dim * kv_dim_rank
    gate = up = down = m.hidden_dim * m.ffn_dim / tp
    norms = 2 * m.hidden_dim  # two RMSNorm weight vectors, replicated
    bias = q_dim / tp + 2 * kv_dim_rank if m.qkv_bias else 0
    qk_norm = 2 * m.head_dim if m.qk_norm else 0
    return q + k + v + o + gate + up + down + norms + bias + qk_norm


def busiest_gpu_params(m: Model, tp: int, pp: int, head: str = "lm") -> float:
    """Layers of one pipeline stage plus what sits around them on that stage.

    The first stage holds the embedding; the last the final RMSNorm (hidden_dim) and the
    output head: the LM head (its own copy of the embedding if tied and pp > 1) or the
    value head (hidden_dim weights + 1 bias).
    """
    layers = m.num_layers // pp * block_params_on_rank(m, tp)
    vocab = m.vocab_size * m.hidden_dim / tp
    final_norm = m.hidden_dim
    if head == "value":
        out_head = final_norm + m.hidden_dim + 1
    else:
        out_head = final_norm + (0 if m.tied_embeddings and pp == 1 else vocab)
    if pp == 1:
        return layers + vocab + out_head
    return max(layers + vocab, layers + out_head)  # first stage vs last stage


def total_params_by_hand(m: Model, head: str = "lm") -> int:
    q_dim, kv_dim = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    block = 2 * m.hidden_dim * q_dim + 2 * m.hidden_dim * kv_dim + 3 * m.hidden_dim * m.ffn_dim + 2 * m.hidden_dim
    block += (q_dim + 2 * kv_dim if m.qkv_bias else 0) + (2 * m.head_dim if m.qk_norm else 0)
    vocab = m.vocab_size * m.hidden_dim
    if head == "value":
        return m.num_layers * block + vocab + m.hidden_dim + m.hidden_dim + 1  # final norm + value head
    return m.num_layers * block + vocab * (1 if m.tied_embeddings else 2) + m.hidden_dim  # + final norm


def test_hand_count_matches_published_sizes() -> None:
    # Llama-3.1-8B: 8,030,261,248 parameters; Llama-3.3-70B: 70,553,706,496; Llama-2-7B: 6,738,415,616;
    # Qwen3-14B (qk-norm): 14,768,307,200 (HF safetensors indexes, bf16 total_size / 2).
    published = {
        "llama-3.1-8b": 8_030_261_248,
        "llama-3.3-70b": 70_553_706_496,
        "llama-2-7b": 6_738_415_616,
        "qwen3-14b": 14_768_307_200,
    }
    for name, count in published.items():
        assert total_params_by_hand(MODELS[name]) == count, name
        assert MODELS[name].num_params("lm") == count, name


# ---- (a) model states ------------------------------------------------------------------------
TINIES = pytest.mark.parametrize("model", [TINY, TINY_TIED, TINY_QWEN], ids=["untied", "tied", "qwen"])


@TINIES
@pytest.mark.parametrize("head", ["lm", "value"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (1, 4), (8, 4)])
def test_params_per_gpu_by_hand(model: Model, head: str, tp: int, pp: int) -> None:
    c = cost("training", workload(), model, head=head)
    assert float(c.params_per_gpu(tp, pp)) == pytest.approx(busiest_gpu_params(model, tp, pp, head), rel=1e-12)


def test_last_stage_is_busiest_with_an_lm_head() -> None:
    """pp > 1: the last stage holds the final norm on top of a vocabulary matrix."""
    for model in (TINY, TINY_TIED, TINY_QWEN):
        layers = 2 * block_params_on_rank(model, 2)
        last = layers + model.vocab_size * model.hidden_dim / 2 + model.hidden_dim
        assert float(cost("training", workload(), model).params_per_gpu(2, 2)) == last


@pytest.mark.parametrize(
    "model",
    [TINY, TINY_TIED, TINY_QWEN, MODELS["llama-3.1-8b"], MODELS["qwen3-14b"]],
    ids=["untied", "tied", "qwen", "llama-3.1-8b", "qwen3-14b"],
)
@pytest.mark.parametrize("head", ["lm", "value"])
def test_one_gpu_replica_holds_every_parameter(model: Model, head: str) -> None:
    c = cost("training", workload(), model, head=head)
    assert float(c.params_per_gpu(1, 1)) == total_params_by_hand(model, head) == model.num_params(head)  # type: ignore[arg-type]


@TINIES
@pytest.mark.parametrize("dp", [1, 4])
def test_bf16_adamw_is_16_bytes_per_param(model: Model, dp: int) -> None:
    terms = cost("training", workload(), model).memory_terms(1, 1, dp, 1)
    p = busiest_gpu_params(model, 1, 1)
    assert float(terms["parameters"]) == 2 * p
    assert float(terms["gradients"]) == 2 * p
    assert float(terms["optimizer"]) == 12 * p  # fp32 master + m + v, not sharded
    model_states = float(terms["parameters"] + terms["gradients"] + terms["optimizer"])
    assert model_states == 16 * p
    # A tp=1 pp=1 replica holds every parameter of the model:
    assert model_states == 16 * model.num_params("lm")


@pytest.mark.parametrize("dp", [1, 2, 3, 8])
def test_optimizer_sharded_across_dp(dp: int) -> None:
    terms = cost("training", workload(shard=True)).memory_terms(2, 2, dp, 1)
    p = busiest_gpu_params(TINY, 2, 2)
    assert float(terms["parameters"]) == pytest.approx(2 * p, rel=1e-12)
    assert float(terms["gradients"]) == pytest.approx(2 * p, rel=1e-12)
    assert float(terms["optimizer"]) == pytest.approx(12 * p / dp, rel=1e-12)


@pytest.mark.parametrize(
    ("dtype", "master", "expected"),
    [
        ("fp32", True, (4, 4, 8)),  # fp32 weights are their own master copy
        ("fp32", False, (4, 4, 8)),
        ("bf16", False, (2, 2, 8)),
        ("fp16", True, (2, 2, 12)),
    ],
)
def test_bytes_per_param_by_dtype(dtype: str, master: bool, expected: tuple[int, int, int]) -> None:
    terms = cost("training", workload(dtype=dtype, master=master)).memory_terms(1, 1, 1, 1)
    p = busiest_gpu_params(TINY, 1, 1)
    got = tuple(float(terms[k]) / p for k in ("parameters", "gradients", "optimizer"))
    assert got == pytest.approx(expected, rel=1e-12)


def test_inference_and_generation_hold_parameters_only() -> None:
    for stage in ("inference", "generation"):
        terms = cost(stage, workload()).memory_terms(2, 1, 4, 2)
        assert float(terms["parameters"]) == 2 * busiest_gpu_params(TINY, 2, 1)
        assert "gradients" not in terms
        assert "optimizer" not in terms


# ---- (b) activations (Korthikanti) -----------------------------------------------------------
@pytest.mark.parametrize(
    ("tp", "pp", "dp", "micro_batches"),
    [
        (1, 1, 1, 2),
        (2, 2, 2, 4),
        (4, 4, 1, 2),
        (8, 2, 3, 5),
        (1, 4, 5, 16),
        (2, 1, 7, 3),
    ],
)
def test_training_activations_korthikanti(tp: int, pp: int, dp: int, micro_batches: int) -> None:
    """Two micro-batches or more: the earlier ones' gradients are held beside the later ones'
    activations, so the terms add up (one: `test_one_micro_batch_peaks_at_the_head_or_the_end`)."""
    w = workload()  # 128 samples, 4 mini-batches, s = 100 + 156
    c = cost("training", w)
    s = 100 + 156
    share = ceil_div(128 // 4, dp)  # sequences of one mini-batch on the busiest replica
    b = ceil_div(share, micro_batches)
    per_layer = 34 * s * b * 64 / tp  # bytes, 16-bit activations
    in_flight = min(pp, micro_batches)  # 1F1B: the first stage holds pp micro-batches at most
    expected = per_layer * (4 / pp) * in_flight
    terms = c.memory_terms(tp, pp, dp, micro_batches)
    assert float(terms["activations"]) == pytest.approx(expected, rel=1e-12)
    # fp32 logits of one chunk of the chunked head (1024 tokens; the micro-batch's when it has
    # fewer), vocabulary split over tp
    assert float(terms["logits"]) == pytest.approx(4 * min(b * s, 1024) * 96 / tp, rel=1e-12)


@pytest.mark.parametrize(("tp", "dp", "micro_batches"), [(1, 1, 1), (2, 3, 4), (8, 5, 7)])
def test_inference_activations_are_one_layer(tp: int, dp: int, micro_batches: int) -> None:
    """Forward only: one layer's activations are live at a time, for one micro-batch."""
    terms = cost("inference", workload()).memory_terms(tp, 2, dp, micro_batches)
    b = ceil_div(ceil_div(128, dp), micro_batches)
    assert float(terms["activations"]) == pytest.approx(34 * 256 * b * 64 / tp, rel=1e-12)
    assert float(terms["logits"]) == pytest.approx(4 * min(b * 256, 1024) * 96 / tp, rel=1e-12)


@pytest.mark.parametrize("stage", ["training", "inference"])
def test_logits_term_prices_one_chunk_whatever_the_length(stage: str) -> None:
    """The runtime takes log-probs a chunk of tokens at a time (`chunked_head`): the logits term
    stops growing at one chunk, where activations keep growing with the sequence."""
    short = cost(stage, workload(prompt_len=100, max_len=156)).memory_terms(1, 1, 1, 1)
    long = cost(stage, workload(prompt_len=1024, max_len=31744)).memory_terms(1, 1, 1, 1)
    assert float(long["logits"]) == float(short["logits"]) == 4 * 1024 * 96
    assert float(long["activations"]) > 100 * float(short["activations"])


def test_fp32_activations_are_twice_bf16() -> None:
    bf16 = cost("training", workload()).memory_terms(2, 2, 2, 4)["activations"]
    fp32 = cost("training", workload(dtype="fp32")).memory_terms(2, 2, 2, 4)["activations"]
    assert float(fp32) == pytest.approx(2 * float(bf16), rel=1e-12)


def test_activations_grow_linearly_in_sequence_length() -> None:
    short = cost("training", workload(prompt_len=100, max_len=156)).memory_terms(1, 1, 1, 2)["activations"]
    long = cost("training", workload(prompt_len=100, max_len=412)).memory_terms(1, 1, 1, 2)["activations"]
    assert float(long) / float(short) == pytest.approx(512 / 256, rel=1e-12)


@pytest.mark.parametrize("model", [TINY, TINY_TIED])
@pytest.mark.parametrize(
    ("prompts", "prompt_len", "max_len", "recompute", "at_head"),
    [(64, 100, 156, 0, True), (64, 100, 156, 2, True), (2, 2, 2, 0, False)],
)
def test_one_micro_batch_peaks_at_the_head_or_the_end(
    model: Model, prompts: int, prompt_len: int, max_len: int, recompute: int, at_head: bool
) -> None:
    """A rank running its rows as one micro-batch: the engine sets the gradients to None before
    the forward, so the peak is the larger of the LM head's backward (kept activations, one
    logits chunk, the head's weight gradient; no other gradient yet) and the backward's end
    (every gradient, the tied sum's two extra copies), not their sum. The gradients term stays
    whole (resident after the step); the transient terms carry the rest. Short rows of a large
    model (the last case) peak at the end."""
    w = workload(prompts=prompts, prompt_len=prompt_len, max_len=max_len)
    c = cost("training", w, model)
    s, b = prompt_len + max_len, 2 * prompts // 4  # one micro-batch: a mini-batch's sequences
    per_sbh = 34 - 2 * 176 / 64 if recompute else 34  # selective drops the gate's output
    kept = per_sbh * s * b * 64 * 4  # 16-bit, 4 layers
    logits = 4 * min(s * b, 1024) * 96
    head_gradient = 96 * 64 * 2
    tied = 2 * 96 * 64 * 2 if model.tied_embeddings else 0
    one = c.memory_terms(1, 1, 1, 1, recompute=recompute)
    gradients = float(one["gradients"])
    head, end = kept + logits + head_gradient, gradients + tied
    assert (head >= end) == at_head
    transient = float(one["activations"] + one["logits"] + one["tied_gradients"])
    assert gradients + transient == pytest.approx(max(head, end), rel=1e-12)
    assert min(float(v) for v in one.values()) >= 0
    # Two micro-batches, a token budget's packs, full recompute: the terms add up.
    summed = [
        c.memory_terms(1, 1, 1, 2, recompute=recompute),
        c.memory_terms(1, 1, 1, 1, recompute=recompute, token_budget=s * b),
        c.memory_terms(1, 1, 1, 1, recompute=1),
    ]
    for terms in summed:
        assert float(terms["tied_gradients"]) == tied
        assert float(terms["gradients"]) == gradients
    budget = summed[1]
    assert float(budget["activations"] + budget["logits"]) == pytest.approx(kept + logits, rel=1e-12)
    # Training-time offload keeps them summed too (its measured peaks exceed even the sum).
    offloaded = c.memory_terms(1, 1, 1, 1, recompute=recompute, train_offload=1)
    assert float(offloaded["tied_gradients"]) == tied
    assert float(offloaded["activations"] + offloaded["logits"]) == pytest.approx(kept + logits, rel=1e-12)


# ---- (c) KV cache ----------------------------------------------------------------------------
@pytest.mark.parametrize(("tp", "pp", "dp"), [(1, 1, 1), (2, 1, 1), (4, 1, 3), (8, 2, 2), (1, 4, 16)])
def test_kv_cache_by_hand(tp: int, pp: int, dp: int) -> None:
    w = workload()  # 128 samples, prompt 100, max response 156
    samples = ceil_div(128, dp)
    kv_heads_per_rank = max(2 / tp, 1)  # beyond 2 ranks each rank keeps one whole KV head
    expected = samples * (100 + 156) * 2 * kv_heads_per_rank * 8 * (4 / pp) * 2
    terms = cost("generation", w).memory_terms(tp, pp, dp, 1)
    assert float(terms["kv_cache"]) == pytest.approx(expected, rel=1e-12)
    assert float(terms["logits"]) == pytest.approx(4 * samples * 1 * 96 / tp, rel=1e-12)  # one token


def test_llama_8b_kv_cache_is_128_kib_per_token() -> None:
    c = cost("generation", workload(), MODELS["llama-3.1-8b"])
    # 2 (K, V) * 8 KV heads * 128 * 32 layers * 2 bytes
    assert float(c.kv_bytes_per_token(1, 1)) == 128 * 1024
    assert float(c.kv_bytes_per_token(8, 1)) == 16 * 1024
    assert float(c.kv_bytes_per_token(8, 4)) == 4 * 1024


# ---- latency sanity ---------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["training", "inference"])
@pytest.mark.parametrize(("tp", "pp", "micro_batches"), [(1, 1, 4), (1, 2, 4), (2, 4, 8), (1, 4, 2), (8, 8, 16)])
def test_1f1b_bubble_is_pp_minus_one_slots(stage: str, tp: int, pp: int, micro_batches: int) -> None:
    w = workload()
    model = MODELS["llama-3.1-8b"]
    c = cost(stage, w, model)
    t = {k: float(v) for k, v in c.time_terms(tp, pp, 1, micro_batches, False, False).items()}
    rounds = w.mini_batches * w.ppo_epochs if stage == "training" else 1
    busy = t["compute"] + t["tp_comm"] + t["pp_comm"] + t["overhead"]
    slot = busy / (rounds * micro_batches)
    assert t["bubble"] == pytest.approx(rounds * (pp - 1) * slot, rel=1e-12)
    if pp == 1:
        assert t["bubble"] == 0.0


def decode_time(w: Workload, tp: int, *, flops_scale: float = 1.0, hbm_scale: float = 1.0) -> float:
    gpu = CLUSTER.gpu.model_copy(
        update={
            "bf16_flops": CLUSTER.gpu.bf16_flops * flops_scale,
            "hbm_bytes_per_s": CLUSTER.gpu.hbm_bytes_per_s * hbm_scale,
        }
    )
    c = cost("generation", w, MODELS["llama-3.1-8b"], CLUSTER.model_copy(update={"gpu": gpu}))
    return float(c.time_terms(tp, 1, 1, 1, False, False)["decode"])


def test_decode_is_memory_bound_at_small_batch() -> None:
    w = workload(prompts=4)  # 8 sequences on one replica
    base = decode_time(w, 1)
    assert decode_time(w, 1, flops_scale=10) == pytest.approx(base, rel=1e-12)  # compute is not the limit
    assert decode_time(w, 1, hbm_scale=0.5) == pytest.approx(2 * base, rel=1e-12)  # HBM bandwidth is
    for tp in (2, 4, 8):  # weights and KV split over tp: ~1/tp before communication
        assert decode_time(w, tp) * tp == pytest.approx(base, rel=0.01)


def test_decode_turns_compute_bound_at_large_batch_short_context() -> None:
    w = workload(prompts=2048, prompt_len=8, max_len=16, mini_batches=1)  # 4096 short sequences
    base = decode_time(w, 1)
    assert decode_time(w, 1, flops_scale=10) < 0.5 * base


def test_training_time_scales_with_ppo_epochs() -> None:
    one = cost("training", workload()).time_terms(2, 2, 2, 4, False, False)
    two = cost("training", workload().model_copy(update={"ppo_epochs": 2})).time_terms(2, 2, 2, 4, False, False)
    for term in one:
        assert float(two[term]) == pytest.approx(2 * float(one[term]), rel=1e-12)


def gemm_flops_by_hand(m: Model, pp: int, head: str = "lm") -> float:
    """Forward GEMM FLOPs per token of the busiest (last) stage: its layers and the head."""
    q_dim, kv_dim = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    per_layer = 2 * m.hidden_dim * q_dim + 2 * m.hidden_dim * kv_dim + 3 * m.hidden_dim * m.ffn_dim
    out_head = m.vocab_size * m.hidden_dim if head == "lm" else m.hidden_dim
    return 2.0 * (m.num_layers // pp * per_layer + out_head)


@pytest.mark.parametrize("head", ["lm", "value"])
@pytest.mark.parametrize("pp", [1, 2, 4, 8, 32])
def test_dense_flops_are_those_of_the_busiest_stage(head: str, pp: int) -> None:
    c = cost("training", workload(), LLAMA_8B, head=head)
    assert float(c.dense_flops_per_token(pp)) == pytest.approx(gemm_flops_by_hand(LLAMA_8B, pp, head), rel=1e-12)
    if pp > 1:  # the head does not split: the last stage is more than 1/pp of the model
        assert float(c.dense_flops_per_token(pp)) > float(c.dense_flops_per_token(1)) / pp


def test_whole_model_gemm_flops_are_twice_the_matrix_parameters() -> None:
    """pp=1, untied: every parameter but the embedding and the norms is one multiply-add."""
    m = LLAMA_8B
    matrices = m.num_params("lm") - m.vocab_size * m.hidden_dim - (2 * m.num_layers + 1) * m.hidden_dim
    assert float(cost("training", workload(), m).dense_flops_per_token(1)) == 2 * matrices


def attention_flops_by_hand(m: Model, queries: float, keys: float) -> float:
    """QK^T and AV: 2 products * 2 FLOPs per multiply-add, every query head, every layer."""
    return 4.0 * queries * keys * m.num_heads * m.head_dim * m.num_layers


@pytest.mark.parametrize("stage", ["training", "inference"])
@pytest.mark.parametrize(("tp", "pp", "dp", "micro_batches"), [(1, 1, 1, 4), (2, 4, 2, 8), (8, 8, 1, 16), (4, 2, 3, 1)])
def test_pipeline_compute_is_the_busiest_stage_by_hand(
    stage: str, tp: int, pp: int, dp: int, micro_batches: int
) -> None:
    w = workload()  # 128 samples, 4 mini-batches
    c = cost(stage, w, LLAMA_8B)
    seq = 100 + w.response_len.mean()
    if stage == "training":
        b = ceil_div(ceil_div(128 // 4, dp), micro_batches)
        passes, rounds = 3, 4  # forward + backward (2x); 4 mini-batches, 1 epoch
    else:
        b = ceil_div(ceil_div(128, dp), micro_batches)
        passes, rounds = 1, 1
    rate = CLUSTER.gpu.bf16_flops * tp
    dense = gemm_flops_by_hand(LLAMA_8B, pp) * b * seq * passes
    attention = attention_flops_by_hand(LLAMA_8B, b * seq, seq / 2) / pp * passes  # layers split evenly
    slot = dense / (rate * DEFAULT_CALIBRATION.gemm) + attention / (rate * DEFAULT_CALIBRATION.attention)
    t = c.time_terms(tp, pp, dp, micro_batches, False, False)
    assert float(t["compute"]) == pytest.approx(rounds * micro_batches * slot, rel=1e-12)


@pytest.mark.parametrize(("tp", "pp", "dp"), [(1, 1, 1), (2, 1, 2), (8, 1, 1), (2, 4, 3), (4, 2, 1), (1, 8, 2)])
def test_generation_prefill_by_hand(tp: int, pp: int, dp: int) -> None:
    """pp micro-batches of n / pp prompts; (2 pp - 1) slots of the busiest stage; tp all-reduces."""
    m = LLAMA_8B
    n = ceil_div(128, dp)
    rate = CLUSTER.gpu.bf16_flops * tp
    terms = {}
    for p in (100, 612):
        w = workload(prompt_len=p)
        dense = gemm_flops_by_hand(m, pp) * n * p / pp
        attention = attention_flops_by_hand(m, n * p / pp, p / 2) / pp
        slot = dense / (rate * DEFAULT_CALIBRATION.gemm) + attention / (rate * DEFAULT_CALIBRATION.attention)
        terms[p] = {k: float(v) for k, v in cost("generation", w, m).time_terms(tp, pp, dp, 1, False, False).items()}
        assert terms[p]["prefill"] == pytest.approx((2 * pp - 1) * slot, rel=1e-12)
    # Decode communication does not depend on the prompt; the prefill all-reduces do:
    # (2 pp - 1) slots of 2 L / pp ring all-reduces of (n / pp) * p * h * 2 bytes each.
    link = CLUSTER.intra_node.bytes_per_s * DEFAULT_CALIBRATION.collective_intra
    extra_bytes = n / pp * (612 - 100) * m.hidden_dim * 2
    expected = (2 * pp - 1) * 2 * m.num_layers / pp * 2 * (tp - 1) / tp * extra_bytes / link
    assert terms[612]["tp_comm"] - terms[100]["tp_comm"] == pytest.approx(expected, rel=1e-9)
    if tp == 1:
        assert terms[612]["tp_comm"] == 0.0
    else:
        assert expected > 0


# ---- whole plans --------------------------------------------------------------------------------
def test_example_plan_is_feasible_and_step_is_sum_of_phases() -> None:
    plan = load_document(EXAMPLES / "plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan, Plan)
    evaluation = evaluate_plan(plan)
    assert evaluation.feasible, evaluation.memory_problems
    predictions = evaluation.predictions
    assert set(predictions.step_breakdown_s) == {"generation", "inference", "training", "weight_sync"}
    assert predictions.step_time_s == pytest.approx(sum(predictions.step_breakdown_s.values()), rel=1e-12)
    assert predictions.step_time_s > 0
    for entry in plan.stages:
        stage = predictions.model_stages[entry.model_stage]
        own = sum(v for k, v in stage.time_breakdown_s.items() if k != "weight_sync")
        assert stage.time_s == pytest.approx(own, rel=1e-12)
        assert stage.peak_memory_bytes <= plan.cluster.gpu.memory_bytes
    # one pool: a phase is the sum of its model-stages
    inference = sum(predictions.model_stages[e.model_stage].time_s for e in plan.stages if e.stage == "inference")
    assert predictions.step_breakdown_s["inference"] == pytest.approx(inference, rel=1e-12)
    # actor/generation (tp=2) differs from actor/training (tp=1, pp=2): weights must move
    assert predictions.step_breakdown_s["weight_sync"] > 0


def hand_plan(
    cluster: Cluster,
    models: list[Model],
    w: Workload,
    pools: dict[str, list[int]],
    layouts: dict[str, tuple[str, int, int, int]],
) -> Plan:
    """A plan with contiguous EMUs: layouts maps model-stage -> (pool, tp, pp, micro_batches)."""
    stages = []
    for role, stage in model_stages(w):
        name = model_stage(role, stage)
        pool, tp, pp, micro_batches = layouts[name]
        gpus = pools[pool]
        dp = len(gpus) // (tp * pp)
        emus = [gpus[k * tp * pp : (k + 1) * tp * pp] for k in range(dp)]
        stages.append(
            StagePlan(
                model_stage=name,
                pool=pool,
                tp=tp,
                pp=pp,
                dp=dp,
                emus=emus,  # type: ignore[arg-type]
                micro_batches=micro_batches,
            )
        )
    return Plan(
        cluster=cluster,
        models=models,
        workload=w,
        pools=[Pool(name=k, gpus=v) for k, v in pools.items()],
        stages=stages,
    )


def test_kv_cache_overflow_is_named() -> None:
    w = Workload(
        name="long",
        algorithm="grpo",
        actor=LLAMA_8B.name,
        prompts_per_step=64,
        samples_per_prompt=8,
        prompt_len=1024,
        response_len=ResponseLengths(median=500, p99=2500, max=65536),
        mini_batches=4,
        micro_batch_size=1,
    )
    plan = hand_plan(
        cluster_preset("h100", 16),
        [LLAMA_8B],
        w,
        {"all": list(range(16))},
        {
            "actor/generation": ("all", 8, 1, 1),
            "actor/inference": ("all", 8, 1, 256),
            "actor/training": ("all", 8, 2, 128),
        },
    )
    # 256 samples per replica * 66560 tokens * 16 KiB per token on a GPU: 260 GiB
    kv = 256 * (1024 + 65536) * 2 * 1 * 128 * 32 * 2
    evaluation = evaluate_plan(plan)
    assert not evaluation.feasible
    assert evaluation.predictions.model_stages["actor/generation"].memory_breakdown_bytes["kv_cache"] == kv
    assert len(evaluation.memory_problems) == 1, evaluation.memory_problems
    (message,) = evaluation.memory_problems
    assert message.startswith("actor/generation (tp=8, pp=1)")
    assert f"largest term: kv_cache {kv / GIB:.3g} GiB" in message
    errors = [p for p in semantic_problems(plan) if p.severity == "error"]
    assert [p.path for p in errors] == ["stages[0]"]
    assert "kv_cache" in errors[0].message and "actor/generation" in errors[0].message


def test_optimizer_overflow_is_named() -> None:
    w = Workload(
        name="short",
        algorithm="grpo",
        actor=LLAMA_8B.name,
        reference=LLAMA_8B.name,
        prompts_per_step=64,
        samples_per_prompt=8,
        prompt_len=128,
        response_len=ResponseLengths(median=64, p99=100, max=128),
        mini_batches=4,
        micro_batch_size=1,
    )
    plan = hand_plan(
        cluster_preset("h100", 16),
        [LLAMA_8B],
        w,
        {"train": list(range(8)), "rest": list(range(8, 16))},
        {
            "actor/generation": ("rest", 8, 1, 1),
            "actor/inference": ("rest", 8, 1, 64),
            "reference/inference": ("rest", 8, 1, 64),
            "actor/training": ("train", 1, 1, 16),  # tp=1 pp=1: 16 bytes * 8.03e9 params on every GPU
        },
    )
    evaluation = evaluate_plan(plan)
    memory = evaluation.predictions.model_stages["actor/training"].memory_breakdown_bytes
    params = LLAMA_8B.num_params("lm")  # a tp=1 pp=1 replica holds every parameter
    assert memory["optimizer"] == 12 * params
    assert memory["parameters"] + memory["gradients"] + memory["optimizer"] == 16 * params
    assert 16 * params > 72 * GIB
    assert len(evaluation.memory_problems) == 1, evaluation.memory_problems
    (message,) = evaluation.memory_problems
    assert message.startswith("actor/training (tp=1, pp=1)")
    assert f"largest term: optimizer {12 * params / GIB:.3g} GiB" in message
    errors = [p for p in semantic_problems(plan) if p.severity == "error"]
    assert [p.path for p in errors] == ["stages[3]"]
    assert "optimizer" in errors[0].message and errors[0].message.startswith("memory: actor/training")


def test_usable_limit_is_capacity_less_headroom() -> None:
    plan = load_document(EXAMPLES / "plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan, Plan)
    # squeeze the GPU until the busiest model-stage overflows, and no further
    peak = max(s.peak_memory_bytes for s in evaluate_plan(plan).predictions.model_stages.values())
    workspace = DEFAULT_CALIBRATION.workspace_fraction
    headroom = DEFAULT_CALIBRATION.memory_headroom
    # peak = rest + workspace * capacity  <=  (1 - headroom) * capacity
    rest = peak - workspace * plan.cluster.gpu.memory_bytes
    fits = math.ceil(rest / (1 - headroom - workspace)) + 1
    for capacity, feasible in ((fits, True), (int(rest / (1 - headroom - workspace)) - 1024, False)):
        gpu = plan.cluster.gpu.model_copy(update={"memory_bytes": capacity})
        squeezed = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"gpu": gpu})})
        assert evaluate_plan(squeezed).feasible is feasible


# ---- full sharding (ZeRO-3 / FSDP full shard) --------------------------------------------------
@pytest.mark.parametrize(("tp", "pp", "dp"), [(1, 1, 2), (2, 2, 4), (1, 4, 8)])
def test_full_sharding_divides_every_state_by_dp_and_gathers_units(tp: int, pp: int, dp: int) -> None:
    model = cost("training", workload())
    whole = model.memory_terms(tp, pp, dp, 2)
    sharded = model.memory_terms(tp, pp, dp, 2, full_shard=1)
    for name in ("parameters", "gradients", "optimizer"):
        assert float(sharded[name]) == pytest.approx(float(whole[name]) / dp, rel=1e-12)
    # the largest gathered unit: TINY's vocabulary embedding (96 x 64) beats a block's parameters
    unit = max(block_params_on_rank(TINY, tp), TINY.vocab_size * TINY.hidden_dim / tp)
    assert float(sharded["gathered"]) == pytest.approx(3 * 2 * unit, rel=1e-12)  # 2 parameter copies + 1 gradient
    assert "gathered" not in whole
    assert float(sharded["activations"]) == float(whole["activations"])
    inference = cost("inference", workload()).memory_terms(tp, pp, dp, 2, full_shard=1)
    assert float(inference["gathered"]) == pytest.approx(2 * 2 * unit, rel=1e-12)


@pytest.mark.parametrize(("dp", "micro_batches"), [(2, 1), (4, 3), (8, 5)])
def test_full_sharding_gathers_per_micro_batch(dp: int, micro_batches: int) -> None:
    """Training: 2 all-gathers + 1 reduce-scatter of the replica's parameters per micro-batch
    (1.5 all-reduces) instead of one all-reduce per mini-batch; inference: 1 all-gather each."""
    w = workload()
    training = cost("training", w)
    whole = training.time_terms(1, 1, dp, micro_batches, False, False)
    sharded = training.time_terms(1, 1, dp, micro_batches, False, False, full_shard=1)
    assert float(sharded["dp_sync"]) == pytest.approx(1.5 * micro_batches * float(whole["dp_sync"]), rel=1e-12)
    assert float(sharded["compute"]) == float(whole["compute"])
    assert float(sharded["optimizer"]) == pytest.approx(float(whole["optimizer"]) / dp, rel=1e-12)
    inference = cost("inference", w)
    one = training.allreduce_time(busiest_gpu_params(TINY, 1, 1) * 2, dp, False)
    gathered = inference.time_terms(1, 1, dp, micro_batches, False, False, full_shard=1)
    assert float(gathered["dp_sync"]) == pytest.approx(0.5 * micro_batches * float(one), rel=1e-12)
    assert "dp_sync" not in inference.time_terms(1, 1, dp, micro_batches, False, False)


def test_full_sharding_applies_to_training_and_inference_only() -> None:
    with pytest.raises(ValueError, match="full_shard applies to training and inference only"):
        StagePlan(model_stage="actor/generation", pool="p", tp=1, pp=1, dp=1, emus=[[0]], full_shard=True)
    # the optimizer state is sharded with the rest, whatever zero1 says
    sharded = cost("training", workload()).model_state_terms(1000.0, 4, False, 1)
    assert float(sharded["optimizer"]) == pytest.approx(12 * 1000.0 / 4, rel=1e-12)


# ---- training-time offload and host memory ----------------------------------------------------------
def offloaded(plan: Plan, level: str, **update: object) -> Plan:
    """`plan` with actor/training's training-time offload at `level` (and `update` on it)."""
    stages = [
        StagePlan.model_validate({**s.model_dump(), "train_offload": level, **update})
        if s.model_stage == "actor/training"
        else s
        for s in plan.stages
    ]
    return plan.model_copy(update={"stages": stages, "predictions": None})


def test_training_time_offload_moves_states_to_the_host_and_prices_the_host_step() -> None:
    """`optimizer`: AdamW state and gradients leave the GPU (one unit of gradients stays on its
    way out) for host memory, sharded over dp; the step runs at the host's AdamW throughput and
    the shards cross the host link. `params` (fully sharded) moves the parameters too."""
    plan = load_document(EXAMPLES / "plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan, Plan)
    base = evaluate_plan(plan.model_copy(update={"predictions": None})).predictions.model_stages["actor/training"]
    entry = plan.stage_plan("actor/training")
    moved = evaluate_plan(offloaded(plan, "optimizer")).predictions.model_stages["actor/training"]
    assert moved.memory_breakdown_bytes["optimizer"] == moved.memory_breakdown_bytes["gradients"] == 0
    assert moved.memory_breakdown_bytes["offload_buffer"] > 0
    assert moved.memory_breakdown_bytes["parameters"] == base.memory_breakdown_bytes["parameters"]
    host = moved.host_memory_bytes
    assert set(host) == {"gradients", "optimizer"}  # parameters stay: 0 is not listed
    assert host["optimizer"] == pytest.approx(base.memory_breakdown_bytes["optimizer"] / entry.dp, rel=1e-6, abs=2)
    assert moved.time_breakdown_s["host_transfer"] > 0
    model = StageCostModel(
        plan.model(plan.workload.actor), "lm", "training", plan.workload, plan.cluster, DEFAULT_CALIBRATION
    )
    rounds = plan.workload.mini_batches * plan.workload.ppo_epochs
    assert moved.time_breakdown_s["optimizer"] == pytest.approx(
        rounds * float(model.host_optimizer_time(entry.tp, entry.pp, entry.dp))
    )
    with pytest.raises(ValueError, match="needs full_shard"):
        offloaded(plan, "params")
    if entry.dp > 1:
        params = evaluate_plan(offloaded(plan, "params", full_shard=True)).predictions.model_stages["actor/training"]
        assert params.memory_breakdown_bytes["parameters"] == 0 and params.host_memory_bytes["parameters"] > 0


def test_a_plan_overflowing_a_nodes_host_memory_is_refused_naming_the_node() -> None:
    plan = offloaded(load_document(EXAMPLES / "plan-tiny-ppo-4rank.yaml"), "optimizer")  # type: ignore[arg-type]
    fits = evaluate_plan(plan)
    assert fits.feasible
    used = sum(
        sum(fits.predictions.model_stages[e.model_stage].host_memory_bytes.values()) * len(e.gpus) for e in plan.stages
    )
    small = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"host_memory_bytes": int(used) - 1})})
    problems = evaluate_plan(small).memory_problems
    assert len(problems) == 1 and problems[0].startswith("host memory of node 0: "), problems
    assert "(the cluster's host_memory_bytes)" in problems[0]
    from nereus.cost.plan_cost import plan_cost_problems

    located = [p for p in plan_cost_problems(small) if p.severity == "error"]
    assert [p.path for p in located] == ["cluster.host_memory_bytes"]


@pytest.mark.parametrize("model_stage_name", ["actor/generation", "actor/inference"])
def test_train_offload_applies_to_training_only(model_stage_name: str) -> None:
    plan = load_document(EXAMPLES / "plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan, Plan)
    with pytest.raises(ValueError, match="train_offload applies to training model-stages only"):
        StagePlan.model_validate({**plan.stage_plan(model_stage_name).model_dump(), "train_offload": "optimizer"})


def test_the_h100_preset_states_a_dgx_hosts_memory() -> None:
    assert cluster_preset("h100").host_memory_bytes == 2 * 2**40

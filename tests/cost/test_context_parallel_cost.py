"""Context parallelism (Ulysses) in the cost model, against hand counts: activations and logits
divided by cp, unsharded model states not, sharded ones (ZeRO-1, full sharding, offload) over
dp x cp; compute divided by cp; 4 all-to-alls of q, k, v and the output per layer and forward
pass (KV heads repeated where cp does not split them), over the link where the tp x cp group
sits; the gradient all-reduce over dp x cp ranks."""

from __future__ import annotations

import pytest

from nereus.cost.calibration import DEFAULT_CALIBRATION
from nereus.cost.plan_cost import evaluate_plan
from nereus.cost.stage import LOGIT_CHUNK_TOKENS, StageCostModel
from nereus.spec.plan import Plan, Pool, StagePlan
from nereus.spec.presets import MODELS, cluster_preset
from nereus.spec.stages import model_stage
from nereus.spec.workload import Optimizer, ResponseLengths, Workload, model_stages

pytestmark = pytest.mark.logic

QWEN3 = MODELS["qwen3-8b"]  # 36 layers, h 4096, 32 query heads and 8 KV heads of 128, vocab 151936
CLUSTER = cluster_preset("h100", 16)


def long_workload() -> Workload:
    return Workload(
        name="long",
        algorithm="grpo",
        actor=QWEN3.name,
        prompts_per_step=8,
        samples_per_prompt=4,
        prompt_len=1024,
        response_len=ResponseLengths(median=8192, p99=24576, max=32768),
        mini_batches=2,
        micro_batch_size=1,
        dtype="bf16",
        optimizer=Optimizer(),
    )


def cost(stage: str) -> StageCostModel:
    return StageCostModel(QWEN3, "lm", stage, long_workload(), CLUSTER, DEFAULT_CALIBRATION)  # type: ignore[arg-type]


@pytest.mark.parametrize("stage", ["training", "inference"])
@pytest.mark.parametrize(("tp", "cp"), [(1, 2), (2, 4), (1, 8)])
def test_cp_divides_activations_not_states_nor_the_logits_chunk(stage: str, tp: int, cp: int) -> None:
    c = cost(stage)
    one = {k: float(v) for k, v in c.memory_terms(tp, 1, 2, 4).items()}
    cut = {k: float(v) for k, v in c.memory_terms(tp, 1, 2, 4, cp=cp).items()}
    # Training under Ulysses keeps each layer's attention output twice (heads and sequence layouts).
    output = 33792 * (32 // 2 // 2 // 4) * 4096 / (tp * cp) * 2 * 36 if stage == "training" else 0.0
    assert cut["activations"] == pytest.approx(one["activations"] / cp + output, rel=1e-12)
    # The chunked head holds one chunk of logits (`LOGIT_CHUNK_TOKENS`) once a rank's tokens fill it.
    chunk = 4 * LOGIT_CHUNK_TOKENS * c.model.vocab_size / tp
    assert one["logits"] == pytest.approx(chunk, rel=1e-12) and cut["logits"] == pytest.approx(chunk, rel=1e-12)
    for term in ("parameters", "gradients", "optimizer", "tied_gradients"):
        if term in one:
            assert cut[term] == one[term], term
    # Hand count of the training activations at cp: 34 s b h / (tp cp) bytes per layer (bf16),
    # micro-batches of 16 / 2 replicas / 4 = 2 rows (training: 32 / 2 mini-batches / 2 / 4) at 33792 tokens,
    # plus the second copy of the attention output, 2 s b h / (tp cp) (32 heads of 128 = h).
    if stage == "training":
        rows = 32 // 2 // 2 // 4
        per_layer = (34 + 2) * 33792 * rows * 4096 / (tp * cp)
        assert cut["activations"] == pytest.approx(per_layer * 36, rel=1e-12)


@pytest.mark.parametrize(("recompute", "allgather", "copies"), [(0, 0, 1), (2, 0, 0), (1, 0, 0), (0, 1, 0)])
def test_ulysses_keeps_the_attention_output_twice_without_recompute(
    recompute: int, allgather: int, copies: int
) -> None:
    """Unsplit, the output projection's input is a view of the attention kernel's output (both
    kept for the backward). Under Ulysses the kernel's output (every column, 1/cp of the heads)
    and the projection's input (its columns, every head, after the all-to-all) are two tensors:
    one more output-sized tensor per layer, 2 s b h / (tp cp) bytes in bf16 (heads x head_dim =
    h). A recomputed core keeps only the projection's input; the all-gather method's output is
    in its own columns' layout."""
    c = cost("training")
    tp, cp, dp, m = 2, 4, 2, 4
    rows = 32 // 2 // dp // m
    method = {"cp_allgather": allgather} if allgather else {}
    split = c.memory_terms(tp, 1, dp, m, recompute=recompute, cp=cp, **method)
    whole = c.memory_terms(tp, 1, dp, m, recompute=recompute)
    output = rows * 33792 / cp * (32 / tp) * 128 * 2 * 36
    expected = float(whole["activations"]) / cp + copies * output
    if recompute == 1:  # the rerun's room is the logits' (one chunk whatever cp): not divided by cp
        kept = 2 * rows * 33792 / cp * 4096 * 36  # each layer's whole input (not split over tp)
        rerun = max(34 * rows * 33792 * 4096 / (tp * cp) - 4 * LOGIT_CHUNK_TOKENS * QWEN3.vocab_size / tp, 0.0)
        expected = kept + rerun
    assert float(split["activations"]) == pytest.approx(expected, rel=1e-12)


def test_ulysses_all_to_alls_by_hand() -> None:
    """tp=2, cp=4, training, one micro-batch per replica: 36 layers x 3 passes x 4 all-to-alls."""
    c = cost("training")
    tp, cp, dp, m = 2, 4, 2, 4
    rows = 32 // 2 // dp // m
    seq = 1024 + long_workload().response_len.mean()
    tokens = rows * seq / cp
    # q and the output: 32 / tp heads each way; k and v: 8 / tp heads; 128 wide, 2 bytes.
    nbytes = tokens * (2 * 32 / tp + 2 * 8 / tp) * 128 * 2
    bandwidth, latency = DEFAULT_CALIBRATION.link(CLUSTER, False)
    one = (cp - 1) * latency + (cp - 1) / cp * nbytes / bandwidth
    rounds = 2 * 1  # mini-batches x epochs
    expected = rounds * m * 3 * 36 * one
    terms = c.time_terms(tp, 1, dp, m, False, False, cp=cp, cp_inter=False)
    assert float(terms["cp_comm"]) == pytest.approx(expected, rel=1e-12)
    inter = c.time_terms(tp, 1, dp, m, False, False, cp=cp, cp_inter=True)
    assert float(inter["cp_comm"]) > 2 * float(terms["cp_comm"])  # the inter-node link is slower
    assert "cp_comm" not in c.time_terms(tp, 1, dp, m, False, False)  # no term without cp


def test_ulysses_repeats_the_kv_heads_cp_does_not_split() -> None:
    """tp=2 leaves 4 KV heads per tensor rank: cp=8 cannot split them, so keys and values move
    as many heads as the 16 queries (the runtime's repeat); cp=4 splits them and moves 4."""
    c = cost("training")
    tokens = 1000.0
    split = float(c.ulysses_bytes(tokens, 2, 4))
    repeated = float(c.ulysses_bytes(tokens, 2, 8))
    assert split == pytest.approx(tokens * (2 * 16 + 2 * 4) * 128 * 2, rel=1e-12)
    assert repeated == pytest.approx(tokens * (2 * 16 + 2 * 16) * 128 * 2, rel=1e-12)
    assert float(c.ulysses_bytes(tokens, 2)) == split  # cp = 1: nothing to repeat


@pytest.mark.parametrize(("dp", "cp"), [(1, 2), (2, 2), (2, 4)])
def test_sharded_states_divide_over_dp_times_cp(dp: int, cp: int) -> None:
    """ZeRO-1 and full sharding split the state over the dp x cp ranks holding the same weights
    (torchtitan's dp_shard x cp); the optimizer step shrinks with the shard."""
    c = cost("training")
    params = float(c.params_per_gpu(2, 1))
    whole = c.memory_terms(2, 1, dp, 4, zero1=False, cp=cp)
    zero1 = c.memory_terms(2, 1, dp, 4, zero1=True, cp=cp)
    full = c.memory_terms(2, 1, dp, 4, zero1=True, full_shard=1, cp=cp)
    shards = dp * cp
    assert float(whole["optimizer"]) == pytest.approx(params * 12, rel=1e-12)  # bf16 with fp32 masters
    assert float(zero1["optimizer"]) == pytest.approx(params * 12 / shards, rel=1e-12)
    assert float(zero1["parameters"]) == float(whole["parameters"]) == pytest.approx(params * 2, rel=1e-12)
    for term, per_param in (("parameters", 2), ("gradients", 2), ("optimizer", 12)):
        assert float(full[term]) == pytest.approx(params * per_param / shards, rel=1e-12), term
    one = c.time_terms(2, 1, dp, 4, False, False, zero1=False, cp=cp)
    cut = c.time_terms(2, 1, dp, 4, False, False, zero1=True, cp=cp)
    assert float(cut["optimizer"]) == pytest.approx(float(one["optimizer"]) / shards, rel=1e-12)
    host = c.host_terms(2, 1, dp, 1, cp)
    assert float(host["optimizer"]) == pytest.approx(params * 12 / shards, rel=1e-12)


def test_cp_divides_compute_and_joins_the_gradient_all_reduce() -> None:
    c = cost("training")
    one = c.time_terms(2, 1, 2, 4, False, False)
    cut = c.time_terms(2, 1, 2, 4, False, False, cp=2)
    assert float(cut["compute"]) == pytest.approx(float(one["compute"]) / 2, rel=1e-12)
    assert float(cut["tp_comm"]) < float(one["tp_comm"])
    bandwidth, latency = DEFAULT_CALIBRATION.link(CLUSTER, False)
    nbytes = float(c.params_per_gpu(2, 1)) * 2
    ranks = 2 * 2  # dp x cp hold the same weights
    expected = 2 * (2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * nbytes / bandwidth)
    assert float(cut["dp_sync"]) == pytest.approx(expected, rel=1e-12)
    # Full recomputation reruns the forward: 4 passes of all-to-alls instead of 3.
    full = c.time_terms(2, 1, 2, 4, False, False, cp=2, recompute=1)
    assert float(full["cp_comm"]) == pytest.approx(float(cut["cp_comm"]) * 4 / 3, rel=1e-12)


def _plan(tp: int, cp: int, first: int) -> Plan:
    """actor/training on tp x cp GPUs from `first` (dp=1); the other model-stages on GPU 0..7."""
    w = long_workload()
    entries = []
    for role, stage in model_stages(w):
        name = model_stage(role, stage)
        if stage == "training":
            emus = [list(range(first, first + tp * cp))]
            entry = StagePlan(model_stage=name, pool="all", tp=tp, pp=1, cp=cp, dp=1, emus=emus, micro_batches=8)
            entries.append(entry)
        else:
            entries.append(StagePlan(model_stage=name, pool="all", tp=8, pp=1, dp=1, emus=[list(range(8))]))
    return Plan(
        cluster=CLUSTER,
        models=[QWEN3],
        workload=w,
        pools=[Pool(name="all", gpus=list(range(16)))],
        stages=entries,
    )


def test_evaluate_plan_prices_the_cp_group_by_where_it_sits() -> None:
    """A tp=2 x cp=4 group inside node 0 all-to-alls over NVLink; shifted to GPUs 4-11 it
    straddles the two nodes and the same layout pays the inter-node link."""
    inside = evaluate_plan(_plan(2, 4, 0)).predictions.model_stages["actor/training"]
    across = evaluate_plan(_plan(2, 4, 4)).predictions.model_stages["actor/training"]
    assert inside.time_breakdown_s["cp_comm"] > 0
    assert across.time_breakdown_s["cp_comm"] > 2 * inside.time_breakdown_s["cp_comm"]
    assert across.memory_breakdown_bytes["activations"] == inside.memory_breakdown_bytes["activations"]


def test_allgather_kv_by_hand() -> None:
    """All-gather KV, tp=2, cp=4, training without recompute: per layer a gather of the whole
    sequence's keys and values (4 KV heads of a tensor rank, 128 wide, 2 bytes) in the forward and
    a reduce-scatter of their gradients in the backward, (cp - 1) / cp moved; with selective
    recompute the core's rerun gathers again. Every cp rank's attention is the balanced share
    (zigzag runs), as Ulysses'; the dense compute too; no all-to-alls."""
    c = cost("training")
    tp, cp, dp, m = 2, 4, 2, 4
    rows = 32 // 2 // dp // m
    seq = 1024 + long_workload().response_len.mean()
    nbytes = rows * seq * 2 * (8 / tp) * 128 * 2
    bandwidth, latency = DEFAULT_CALIBRATION.link(CLUSTER, False)
    one = (cp - 1) * latency + (cp - 1) / cp * nbytes / bandwidth
    rounds = 2 * 1
    gathered = c.time_terms(tp, 1, dp, m, False, False, cp=cp, cp_inter=False, cp_allgather=1)
    assert float(gathered["cp_comm"]) == pytest.approx(rounds * m * 2 * 36 * one, rel=1e-12)
    selective = c.time_terms(tp, 1, dp, m, False, False, recompute=2, cp=cp, cp_inter=False, cp_allgather=1)
    assert float(selective["cp_comm"]) == pytest.approx(rounds * m * 3 * 36 * one, rel=1e-12)
    ulysses = c.time_terms(tp, 1, dp, m, False, False, cp=cp, cp_inter=False)
    dense = c.time_terms(tp, 1, dp, m, False, False, cp=cp, cp_inter=False, cp_allgather=0)
    assert float(dense["compute"]) == float(ulysses["compute"])
    assert float(gathered["compute"]) == float(ulysses["compute"])
    assert float(c.cp_attention_share(1, 1)) == 1.0 and float(c.cp_attention_share(4, 1)) == 1.0


def test_allgather_holds_the_gathered_kv_unless_recomputed() -> None:
    """The whole sequences' keys and values of every layer (no recompute: autograd keeps them for
    the backward) or of one (recomputed: the core gathers again); none under Ulysses."""
    c = cost("training")
    tp, cp, dp, m = 2, 4, 2, 4
    rows = 32 // 2 // dp // m
    layer = rows * 33792 * 2 * (8 / tp) * 128 * 2
    kept = c.memory_terms(tp, 1, dp, m, cp=cp, cp_allgather=1)
    assert float(kept["cp_kv"]) == pytest.approx(layer * 36, rel=1e-12)
    rerun = c.memory_terms(tp, 1, dp, m, recompute=1, cp=cp, cp_allgather=1)
    assert float(rerun["cp_kv"]) == pytest.approx(layer, rel=1e-12)
    assert "cp_kv" not in c.memory_terms(tp, 1, dp, m, cp=cp)
    inference = cost("inference").memory_terms(tp, 1, dp, m, cp=cp, cp_allgather=1)
    assert float(inference["cp_kv"]) == pytest.approx(32 / dp / m * 33792 * 2 * (8 / tp) * 128 * 2, rel=1e-12)

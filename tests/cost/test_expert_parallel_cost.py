"""Expert parallelism in the cost model: expert state divided by ep, the rest not; tokens split
over the ep ranks; active-parameter FLOPs with the load-imbalance factor; the dispatch and
combine all-to-alls (`ep_comm`) over the link where the tp x ep group sits; gradients of the
non-expert weights over dp x ep ranks, the experts' over dp."""

from __future__ import annotations

import pytest

from nereus.cost.calibration import Calibration
from nereus.cost.plan_cost import ep_spans_nodes, evaluate_plan
from nereus.cost.stage import EXPERT_LOAD_IMBALANCE, StageCostModel
from nereus.spec.moe_setups import SETUPS, published_plan
from nereus.spec.presets import MODELS, cluster_preset, workload_preset
from nereus.spec.stages import ACTOR_GENERATION, ACTOR_TRAINING

pytestmark = pytest.mark.logic

MODEL = MODELS["qwen3-30b-a3b"]
WORKLOAD = workload_preset("grpo", "qwen3-30b-a3b")
CLUSTER = cluster_preset("h100", 16)


def cost(stage: str = "training") -> StageCostModel:
    return StageCostModel(MODEL, "lm", stage, WORKLOAD, CLUSTER, Calibration())  # type: ignore[arg-type]


def test_expert_parameters_are_divided_by_ep_and_the_rest_is_not() -> None:
    c = cost()
    moe = MODEL.moe
    assert moe is not None
    experts = MODEL.num_layers * moe.num_experts * moe.expert_params(MODEL.hidden_dim)
    whole = float(c.params_per_gpu(2, 1))
    for ep in (2, 8, 128):
        held = float(c.params_per_gpu(2, 1, ep))
        assert held == pytest.approx(whole - experts / 2 * (1 - 1 / ep), rel=1e-12)
    # the expert share of the 30B model is most of it: ep = 8 holds under a quarter
    assert float(c.params_per_gpu(1, 1, 8)) < 0.25 * float(c.params_per_gpu(1, 1))
    memory = c.memory_terms(1, 1, 2, 4, ep=8, zero1=True)
    expected = float(c.params_per_gpu(1, 1, 8))
    assert float(memory["parameters"]) == pytest.approx(expected * 2)
    assert float(memory["gradients"]) == pytest.approx(expected * 2)
    assert float(memory["optimizer"]) == pytest.approx(expected * 12 / 2)  # ZeRO-1 over dp only


def test_flops_are_the_active_parameters_and_imbalance_applies_to_the_experts_where_ep_splits_them() -> None:
    c = cost()
    moe = MODEL.moe
    assert moe is not None
    active = MODEL.layer_params(active=True) - 2 * MODEL.hidden_dim
    head = MODEL.vocab_size * MODEL.hidden_dim
    assert float(c.dense_flops_per_token()) == pytest.approx(2 * (MODEL.num_layers * active + head))
    routed = MODEL.num_layers * moe.experts_per_token * moe.expert_params(MODEL.hidden_dim)
    extra = 2 * routed * (EXPERT_LOAD_IMBALANCE - 1)
    assert float(c.dense_flops_per_token(1, 4)) == pytest.approx(float(c.dense_flops_per_token()) + extra)
    assert EXPERT_LOAD_IMBALANCE > 1
    # The dense Qwen3-8B prices the same FLOPs whatever ep says (it never gets ep > 1).
    dense = StageCostModel(MODELS["qwen3-8b"], "lm", "training", WORKLOAD, CLUSTER, Calibration())
    assert float(dense.dense_flops_per_token(1, 4)) == float(dense.dense_flops_per_token())


def test_each_ep_rank_holds_its_share_of_the_tokens() -> None:
    training, inference, generation = cost(), cost("inference"), cost("generation")
    for model in (training, inference):
        one = model.memory_terms(1, 1, 2, 4)
        split = model.memory_terms(1, 1, 2, 4, ep=4)
        assert float(split["activations"]) == pytest.approx(float(one["activations"]) / 4)
    one = generation.memory_terms(1, 1, 2, 1)
    split = generation.memory_terms(1, 1, 2, 1, ep=4)
    assert float(split["kv_cache"]) == pytest.approx(float(one["kv_cache"]) / 4)


def test_ep_comm_is_dispatch_and_combine_per_moe_layer_three_passes_in_training() -> None:
    c = cost()
    moe = MODEL.moe
    assert moe is not None
    tp, pp, dp, m, ep = 1, 1, 2, 4, 8
    terms = c.time_terms(tp, pp, dp, m, False, True, ep=ep, ep_inter=False)
    assert "ep_comm" in terms and "ep_comm" not in c.time_terms(tp, pp, dp, m, False, True)
    w = WORKLOAD
    b = float(c.micro_batch_size(dp, m))
    tokens = b * (w.prompt_len + w.response_len.mean()) / ep
    nbytes = tokens * moe.experts_per_token * MODEL.hidden_dim * 2
    bandwidth, latency = Calibration().link(CLUSTER, False)
    one = (ep - 1) * latency + (ep - 1) / ep * nbytes / bandwidth
    rounds = w.mini_batches * w.ppo_epochs
    expected = rounds * m * 2 * 3 * MODEL.num_layers * one
    assert float(terms["ep_comm"]) == pytest.approx(expected, rel=1e-12)
    across = c.time_terms(tp, pp, dp, m, False, True, ep=ep, ep_inter=True)
    assert float(across["ep_comm"]) > 5 * float(terms["ep_comm"])  # the inter-node link is ~9x slower


def test_gradients_of_non_expert_weights_sum_over_dp_times_ep_and_the_experts_over_dp() -> None:
    c = cost()
    tp, pp, dp, m, ep = 1, 1, 2, 4, 8
    terms = c.time_terms(tp, pp, dp, m, False, False, ep=ep, ep_inter=False)
    replica = float(c.params_per_gpu(tp, pp, ep)) * 2
    experts = float(c.expert_params_per_gpu(tp, pp, ep)) * 2
    rounds = WORKLOAD.mini_batches * WORKLOAD.ppo_epochs
    expected = rounds * (c.allreduce_time(replica - experts, dp * ep, False) + c.allreduce_time(experts, dp, False))
    assert float(terms["dp_sync"]) == pytest.approx(float(expected), rel=1e-12)


def test_ep_1_prices_a_moe_model_as_before_and_generation_has_ep_comm_with_ep() -> None:
    c = cost("generation")
    plain = c.time_terms(2, 1, 8, 1, False, True)
    same = c.time_terms(2, 1, 8, 1, False, True, ep=1, ep_inter=False)
    assert plain == same and "ep_comm" not in plain
    split = c.time_terms(2, 1, 2, 1, False, True, ep=4, ep_inter=False)
    assert float(split["ep_comm"]) > 0


def test_an_ep_group_across_nodes_is_priced_on_the_inter_node_link() -> None:
    setup = SETUPS["verl-grpo-qwen3-30b-a3b"]  # tp 4 x ep 4 x pp 2: each stage's 16 GPUs span 2 nodes
    plan = published_plan(setup, cluster_preset("h100", setup.gpus))
    training = plan.stage_plan(ACTOR_TRAINING)
    assert training.ep == 4 and ep_spans_nodes(plan.cluster, training)
    assert not ep_spans_nodes(plan.cluster, plan.stage_plan(ACTOR_GENERATION))
    prediction = evaluate_plan(plan).predictions.model_stages[ACTOR_TRAINING]
    assert prediction.time_breakdown_s["ep_comm"] > 0


def test_weight_sync_moves_an_ep_ranks_block_of_the_experts() -> None:
    """Each destination GPU receives its tp x pp share of the actor's weights, of the experts only
    its ep rank's block; a dense actor's sync is as before."""
    from nereus.cost.plan_cost import weight_sync_time
    from nereus.cost.stage import expert_params

    experts = expert_params(MODEL)
    assert experts == MODEL.num_layers * 128 * 3 * MODEL.hidden_dim * 768
    args = (CLUSTER, WORKLOAD, MODEL.num_params("lm"), Calibration())
    whole = weight_sync_time(*args, same_layout=False, tp=2, pp=1, inter=False)
    split = weight_sync_time(*args, same_layout=False, tp=2, pp=1, inter=False, ep=4, expert_params=experts)
    bandwidth, _ = Calibration().link(CLUSTER, False)
    saved = experts * (1 - 1 / 4) * 2 / 2 / bandwidth
    assert split == pytest.approx(whole - saved, rel=1e-12)
    assert expert_params(MODELS["qwen3-8b"]) == 0


def test_plan_explain_names_ep_and_prices_an_ep_ranks_expert_block() -> None:
    from nereus.cost.explain import explain_plan

    setup = SETUPS["slime-grpo-qwen3-30b-a3b"]  # training tp 1 x ep 8 on 8 GPUs
    plan = published_plan(setup, cluster_preset("h100", setup.gpus))
    explained = explain_plan(plan, Calibration())
    assert any(line.startswith("\nactor/training: tp=1 ep=8 pp=1 dp=1") for line in explained["lines"])
    derived = explained["model_stages"][ACTOR_TRAINING]["derived"]
    assert derived["params_per_gpu"] == pytest.approx(float(cost().params_per_gpu(1, 1, 8)))

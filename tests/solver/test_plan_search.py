"""Plan search: exact against exhaustive enumeration, sensible on presets, clear when impossible."""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from repo_paths import DATA

from nereus.cost.calibration import Calibration
from nereus.cost.plan_cost import (
    GIB,
    evaluate_plan,
    plan_cost_problems,
    stage_room,
    usable_capacity,
    workspace_bytes,
)
from nereus.errors import NereusError
from nereus.solver import plan_search
from nereus.solver.layouts import CP, MemoryChoices
from nereus.solver.plan_search import (
    Candidate,
    CountProbe,
    PlanRequest,
    SearchOutcome,
    closest_shortfall,
    compile_problem,
    fits,
    placements,
    price_all,
    reference_search,
    resized,
    search,
    split_sizes,
)
from nereus.solver.planner import build_plan, make_plan, smallest_feasible_gpus
from nereus.spec.check import kv_heads_rule, pp_rule, semantic_problems
from nereus.spec.cluster import Cluster, GpuKind, Link
from nereus.spec.io import load_document, save_document
from nereus.spec.model import Model
from nereus.spec.plan import Plan, Pool, StagePlan
from nereus.spec.presets import MODELS, cluster_preset, models_for, workload_preset
from nereus.spec.workload import Optimizer, ResponseLengths, Workload, with_max_response

pytestmark = pytest.mark.logic

REL = 1e-9
#: Exhaustive assignments (summed over placements) a random case may have.
MAX_PRODUCT = 20_000
CHUNKS = 4
CASES_PER_CHUNK = 50
#: Chunk c draws seeds from c * 1_000_000 + SEED_OFFSET on. Chosen (offsets 0, 1000, ..., 9000
#: tried) so that every chunk holds a case whose true top 3 needs an option that dominance
#: pruning drops (test_top_k_matches_reference): such cases are rare, and at offset 0 chunks
#: 0 and 2 have none. Offset 9000 also puts a training-leaves-GPUs-free case in every chunk.
SEED_OFFSET = 9000


# ---- random small instances ---------------------------------------------------------------------
def random_model(rng: random.Random, name: str) -> Model:
    heads = rng.choice([1, 2, 4, 8])
    kv_heads = rng.choice([d for d in (1, 2, 4, 8) if heads % d == 0])
    head_dim = rng.choice([4, 8, 16])
    return Model(
        name=name,
        num_layers=rng.randint(1, 4),
        hidden_dim=heads * head_dim,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_dim=rng.choice([16, 32, 64, 96]),
        vocab_size=rng.choice([32, 64, 128]),
        tied_embeddings=rng.random() < 0.5,
    )


def random_workload(rng: random.Random, actor: Model, other: Model) -> Workload:
    algorithm = rng.choice(["ppo", "grpo", "remax"])
    per_prompt = rng.choice([2, 4]) if algorithm == "grpo" else 1
    prompts = rng.choice([1, 2, 4, 8, 16])
    samples = prompts * per_prompt
    mini_batches = rng.choice([d for d in (1, 2, 4) if samples % d == 0])
    median = rng.randint(1, 32)
    p99 = rng.randint(median, 64)
    return Workload(
        name="random",
        algorithm=algorithm,  # type: ignore[arg-type]
        actor=actor.name,
        critic=other.name if algorithm == "ppo" else None,
        reference=rng.choice([actor.name, other.name, None]),
        reward=rng.choice([other.name, None]),
        prompts_per_step=prompts,
        samples_per_prompt=per_prompt,
        prompt_len=rng.randint(1, 64),
        response_len=ResponseLengths(median=median, p99=p99, max=rng.randint(p99, 128)),
        ppo_epochs=rng.randint(1, 2),
        mini_batches=mini_batches,
        micro_batch_size=rng.randint(1, samples // mini_batches),
        dtype=rng.choice(["bf16", "fp32"]),
        optimizer=Optimizer(master_weights=rng.random() < 0.7, shard_across_dp=rng.random() < 0.3),
    )


def random_request(seed: int, cp: bool = False) -> PlanRequest:
    """Up to 64 GPUs; GPU memory 10x..1000x the actor's parameter count in bytes, so
    some layouts (or every plan) overflow while others fit. Context parallelism is searched
    with `cp` only (the seeded case mix and its statistics below predate it; cp has its own
    reference check: test_search_with_cp_matches_reference)."""
    rng = random.Random(seed)
    actor = random_model(rng, "actor")
    other = random_model(rng, "other") if rng.random() < 0.5 else actor
    workload = random_workload(rng, actor, other)
    used = {name for name in workload.role_models().values() if name is not None}
    models = tuple(m for m in {actor.name: actor, other.name: other}.values() if m.name in used)
    per_node = rng.choice([1, 2, 4, 8])
    num_nodes = rng.randint(1, 64 // per_node)
    memory = int(actor.num_params() * math.exp(rng.uniform(math.log(10), math.log(1000)))) + 1
    fast = rng.random() < 0.5
    gpu = GpuKind(
        name="gpu", memory_bytes=memory, bf16_flops=989e12 if fast else 5e10, hbm_bytes_per_s=3.35e12 if fast else 1e10
    )
    num_gpus = rng.randint(1, num_nodes * per_node)
    # Half the cases have a node's host memory of 0.02x..2x its GPUs' memory, so that it binds
    # training-time offload and sleeping states in some; the others the default (it never binds).
    host = int(per_node * memory * math.exp(rng.uniform(math.log(0.02), math.log(2)))) + 1
    cluster = Cluster(
        name="random",
        num_nodes=num_nodes,
        gpus_per_node=per_node,
        gpu=gpu,
        intra_node=Link(bytes_per_s=450e9, latency_s=3e-6),
        inter_node=Link(bytes_per_s=50e9, latency_s=1e-5),
        **({"host_memory_bytes": host} if rng.random() < 0.5 else {}),
    )
    choices = MemoryChoices() if cp else MemoryChoices(context_parallel=(False,))
    return PlanRequest(cluster, models, workload, num_gpus, choices=choices)


def host_binds(request: PlanRequest, outcome: SearchOutcome) -> bool:
    """Whether the node's host memory changes the optimum (or rules out every plan)."""
    unbounded = request.cluster.model_copy(update={"host_memory_bytes": 2**62})
    free = search(dataclasses.replace(request, cluster=unbounded))
    return step_times(free)[:1] != step_times(outcome)[:1]


def exhaustive_size(request: PlanRequest, tables: dict[Any, Any] | None = None) -> int:
    """Assignments reference_search scores: the option-count product, summed over placements
    (`tables`: `price_all` of every placement, when the caller has them)."""
    layouts = placements(request)
    tables = price_all(request, layouts) if tables is None else tables
    return sum(math.prod(len(o) for o in compile_problem(request, p, tables, prune=False).options) for p in layouts)


def has_lone_infeasible_layout(request: PlanRequest) -> bool:
    budget = stage_room(request.cluster, request.calibration)
    tables = price_all(request, placements(request))
    return any(o[1] + o[2] > budget for table in tables.values() for o in table.options)


def training_leaves_gpus_free(request: PlanRequest) -> bool:
    """Some training model-stage has, on none of its pools, a layout that fills the pool.

    A layout is a power-of-two tp inside a node and a pp dividing the layers; it fills a
    pool when dp = pool // (tp pp) is at most the samples per mini-batch. Otherwise dp is
    capped at the samples and the rest of the pool's GPUs stay free (nereus used to crash
    here): see test_training_without_a_full_layout_leaves_gpus_free.
    """
    w, per_node = request.workload, request.cluster.gpus_per_node
    sizes: dict[str, set[int]] = {}
    for placement in placements(request):
        for _, _, size, stages in placement.pools:
            for name in stages:
                sizes.setdefault(name, set()).add(size)
    samples = w.samples_per_step // w.mini_batches
    for name, pool_sizes in sizes.items():
        role, stage = name.split("/")
        if stage != "training":
            continue
        model = request.model(w.model_name(role))  # type: ignore[arg-type]
        tps = [1 << i for i in range(8) if 1 << i <= per_node and kv_heads_rule(model, 1 << i) is None]
        pps = [pp for pp in range(1, model.num_layers + 1) if pp_rule(model, pp) is None]
        if not any(t * pp <= size and size // (t * pp) <= samples for size in pool_sizes for t in tps for pp in pps):
            return True
    return False


#: The seeds `cases` accepted so far, per (chunk, cp), in order: several tests read the same
#: chunk's cases, and pricing the rejected seeds is most of the selection's time.
_ACCEPTED: dict[tuple[int, bool], list[int]] = {}


def cases(chunk: int, count: int = CASES_PER_CHUNK, cp: bool = False) -> list[tuple[int, PlanRequest]]:
    """The first `count` seeded cases of `chunk` whose exhaustive product is small enough
    (`cp`: with context parallelism searched, `random_request`)."""
    seeds = _ACCEPTED.setdefault((chunk, cp), [])
    seed = seeds[-1] + 1 if seeds else chunk * 1_000_000 + SEED_OFFSET
    while len(seeds) < count:
        if exhaustive_size(random_request(seed, cp)) <= MAX_PRODUCT:
            seeds.append(seed)
        seed += 1
    return [(seed, random_request(seed, cp)) for seed in seeds[:count]]


def step_times(outcome: SearchOutcome) -> list[float]:
    return [c.step_time_s for c in outcome.candidates]


# ---- (a) exactness ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_search_matches_exhaustive_reference(chunk: int) -> None:
    """CHUNKS x CASES_PER_CHUNK = 200 cases in all, split so xdist can spread them."""
    stats: Counter[str] = Counter()
    for seed, request in cases(chunk):
        fast, slow = search(request), reference_search(request)
        stats["compared"] += 1
        if host_binds(request, slow):
            stats["host_binds"] += 1
        assert bool(fast.candidates) == bool(slow.candidates), seed
        if not slow.candidates:
            stats["no_feasible_plan"] += 1
            continue
        assert fast.candidates[0].step_time_s == pytest.approx(slow.candidates[0].step_time_s, rel=REL), seed
        assert fast.num_leaves <= slow.num_leaves, seed
        if slow.candidates[0].placement.name != "colocated":
            stats["optimum_split"] += 1
        if has_lone_infeasible_layout(request):
            stats["feasible_with_infeasible_layouts"] += 1
        if training_leaves_gpus_free(request):
            stats["training_leaves_gpus_free"] += 1
    for _seed, request in cases(chunk):
        if has_lone_infeasible_layout(request):
            stats["infeasible_layouts"] += 1
    # Per chunk (today 22-32, 2-7, 11-18, 17-29, 2-4, 1-3; a layout overflows alone when none of its
    # memory choices fits); over the 4 chunks: 200 compared, >= 60 with layouts that overflow alone,
    # >= 12 of them still feasible, >= 32 split optima, >= 32 with no plan, >= 4 feasible ones whose
    # training cannot fill its pool, >= 4 whose optimum the node's host memory changes.
    # (Selective recompute, searched too, fits more plans colocated.)
    assert stats["compared"] == CASES_PER_CHUNK
    assert stats["infeasible_layouts"] >= 15, stats
    # (2 in chunk 1 since full recompute's rerun reuses the logits' room: one layout fewer overflows)
    assert stats["feasible_with_infeasible_layouts"] >= 2, stats
    assert stats["optimum_split"] >= 8, stats
    assert stats["no_feasible_plan"] >= 8, stats
    assert stats["training_leaves_gpus_free"] >= 1, stats
    assert stats["host_binds"] >= 1, stats


def uses_pruned_option(request: PlanRequest, candidate: Candidate) -> bool:
    """Whether `candidate` picks an option that top-1 dominance pruning drops."""
    pruned = compile_problem(request, candidate.placement, price_all(request, [candidate.placement]), prune=True)
    return any(option not in pruned.options[pruned.names.index(name)] for name, option in candidate.choices)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_top_k_matches_reference(chunk: int) -> None:
    """search(top_k=3) is exact: the same three step times as exhaustive enumeration, each a
    real, feasible plan with its stated time."""
    mismatches = []
    for seed, request in cases(chunk):
        fast, slow = search(request, top_k=3), reference_search(request, top_k=3)
        got, want = step_times(fast), step_times(slow)
        assert got == sorted(got), seed
        assert fast.num_leaves <= slow.num_leaves, seed
        if len(got) != len(want) or any(g != pytest.approx(w, rel=REL) for g, w in zip(got, want, strict=True)):
            mismatches.append((seed, got, want))
        for candidate in fast.candidates:
            plan = build_plan(request, candidate)  # asserts feasibility and the same step time
            assert plan.predictions is not None
            assert plan.predictions.step_time_s == pytest.approx(candidate.step_time_s, rel=REL)
    assert mismatches == []
    # Cases whose true top 3 uses an option that top-1 pruning drops are 0-2 per chunk today (the option
    # tables list no choice that another choice of the same layout dominates); test_top_k_fixed_case
    # covers one for certain.


def assert_matches_reference(seed: int, request: PlanRequest) -> SearchOutcome:
    """The exact search finds the exhaustive enumeration's best step and its top 3, and every
    candidate builds into a plan that passes the checks with its stated time; the reference's
    top 3 are returned."""
    for k in (1, 3):
        fast, slow = search(request, top_k=k), reference_search(request, top_k=k)
        got, want = step_times(fast), step_times(slow)
        assert len(got) == len(want), seed
        assert all(g == pytest.approx(w, rel=REL) for g, w in zip(got, want, strict=True)), (seed, k)
        for candidate in fast.candidates:
            plan = build_plan(request, candidate)  # asserts feasibility and the same step time
            assert [p for p in semantic_problems(plan) if p.severity == "error"] == [], seed
    return slow


def cp_cases(chunk: int, count: int) -> list[tuple[int, PlanRequest]]:
    """The first `count` seeded cases of `chunk` with context parallelism searched, an exhaustive
    product small enough and some option with cp > 1 among their option tables (most random
    models have too few KV heads, or pools too small, for one)."""
    out: list[tuple[int, PlanRequest]] = []
    seed = chunk * 1_000_000
    while len(out) < count:
        request = random_request(seed, cp=True)
        tables = price_all(request, placements(request))
        has_cp = any(o[CP] > 1 for table in tables.values() for o in table.options)
        if has_cp and exhaustive_size(request, tables) <= MAX_PRODUCT:
            out.append((seed, request))
        seed += 1
    return out


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(2))
def test_search_with_cp_matches_reference(chunk: int) -> None:
    """With cp searched (training and inference, Ulysses and all-gather KV), the exact search
    finds the exhaustive enumeration's best step and its top 3, over cases whose option tables
    list cp > 1 options (all-gather ones where a model's heads stop Ulysses); every candidate builds into a plan that
    passes the checks with its stated time, and some optima do use cp."""
    stats: Counter[str] = Counter()
    for seed, request in cp_cases(chunk, 30):
        slow = assert_matches_reference(seed, request)
        if slow.candidates and any(o[CP] > 1 for _, o in slow.candidates[0].choices):
            stats["optimum_uses_cp"] += 1
        if any(o[CP] > 1 for c in slow.candidates for _, o in c.choices):
            stats["top3_uses_cp"] += 1
    # Today 3 (chunk 0) and 8 (chunk 1) of 30 optima use cp (5 and 8 of the top 3s).
    assert stats["optimum_uses_cp"] >= 2, stats


def dominated_runner_up_case() -> PlanRequest:
    """ReMax with 2 samples per step on 16 GPUs (4 per node), found by scanning random_request
    seeds (this is seed 52966). The best plan splits actor and others 8 + 8, every model-stage
    at dp=2, capped by the samples (actor/generation at tp=2 leaves 4 of its 8 GPUs free). The
    2nd and 3rd best run reward/ resp. reference/inference at tp=2 dp=2 on 4 of the 8 GPUs,
    which tp=4 dp=2 dominates (faster, no larger): top-1 pruning drops it."""
    actor = Model(
        name="actor",
        num_layers=1,
        hidden_dim=64,
        num_heads=8,
        num_kv_heads=8,
        head_dim=8,
        ffn_dim=32,
        vocab_size=128,
        tied_embeddings=True,
    )
    workload = Workload(
        name="w",
        algorithm="remax",
        actor="actor",
        reference="actor",
        reward="actor",
        prompts_per_step=2,
        prompt_len=22,
        response_len=ResponseLengths(median=23, p99=52, max=90),
        ppo_epochs=2,
        dtype="fp32",
    )
    gpu = GpuKind(name="g", memory_bytes=421819, bf16_flops=5e10, hbm_bytes_per_s=1e10)
    cluster = Cluster(
        name="c",
        num_nodes=4,
        gpus_per_node=4,
        gpu=gpu,
        intra_node=Link(bytes_per_s=450e9, latency_s=3e-6),
        inter_node=Link(bytes_per_s=50e9, latency_s=1e-5),
    )
    # Found in the space without memory-saving choices and without cp: pinned to it so the runners-up
    # stay these (cp layouts of the 1-layer actor would add runners-up of their own).
    choices = dataclasses.replace(NOTHING_SAVED, context_parallel=(False,))
    return PlanRequest(cluster, (actor,), workload, 16, choices=choices)


@pytest.mark.parametrize("top_k", [2, 3, 5])
def test_top_k_fixed_case(top_k: int) -> None:
    request = dominated_runner_up_case()
    fast, slow = search(request, top_k=top_k), reference_search(request, top_k=top_k)
    # the best needs no dominated option; the 2nd and 3rd do
    assert [uses_pruned_option(request, c) for c in slow.candidates[:3]] == [False, True, True][:top_k]
    got, want = step_times(fast), step_times(slow)
    assert len(got) == len(want) == top_k
    assert got == pytest.approx(want, rel=REL)
    assert got[0] == pytest.approx(step_times(search(request))[0], rel=REL)  # top-1 (pruned) agrees


# ---- (b) behaviour on presets ------------------------------------------------------------------------
def test_with_max_response_sets_the_cap_and_keeps_the_shape() -> None:
    base = workload_preset("ppo")
    assert (base.response_len.median, base.response_len.p99, base.response_len.max) == (500, 2500, 8192)
    for cap in (500, 8000, 8192, 32768):
        lengths = with_max_response(base, cap).response_len
        assert lengths.max == cap
        assert lengths.median == round(500 * cap / 8192)  # 500 -> 31, 8000 -> 488
        assert lengths.p99 == round(2500 * cap / 8192)  # 500 -> 153, 8000 -> 2441
    assert with_max_response(base, 1).response_len.median == 1
    for bad in (0, -5):
        with pytest.raises(ValueError, match="must be a positive number of tokens"):
            with_max_response(base, bad)


@dataclass(frozen=True)
class Layouts:
    generation_tp: int
    inference_emu: dict[str, int]  # model-stage -> GPUs per instance (tp * pp), for every inference model-stage
    training: tuple[int, int, int]  # actor/training (tp, pp, micro_batches)
    step_time_s: float
    kv_budget: bool  # actor/generation batches continuously into a KV budget


def ppo_8b_layouts(
    max_response: int,
    gpus: int = 16,
    prompts: int = 512,
    prompt_len: int = 1024,
    choices: MemoryChoices | None = None,
) -> Layouts:
    workload = with_max_response(workload_preset("ppo"), max_response)
    workload = workload.model_copy(update={"prompts_per_step": prompts, "prompt_len": prompt_len})
    request = PlanRequest(cluster_preset("h100", gpus), models_for(workload, None), workload, gpus)
    if choices is not None:
        request = dataclasses.replace(request, choices=choices)
    plan = make_plan(request).best
    assert plan.predictions is not None
    train, generation = plan.stage_plan("actor/training"), plan.stage_plan("actor/generation")
    inference = {s.model_stage: s.tp * s.pp for s in plan.stages if s.stage == "inference"}
    return Layouts(
        generation.tp,
        inference,
        (train.tp, train.pp, train.micro_batches),
        plan.predictions.step_time_s,
        generation.kv_budget_bytes is not None,
    )


def test_longer_responses_merge_inference_and_change_training_layout() -> None:
    """Llama-3.1-8B PPO on 16 H100s, responses capped at 500 vs 8000 tokens: both fit; at 8000
    some inference model-stage merges instances into larger ones (tp * pp grows: the transition
    DAG's merge primitive), generation tp does not shrink, and actor/training takes another
    layout. (Today: actor and reference inference go from pp=1 to pp=2, actor/training from
    tp=2 pp=4 to tp=2 pp=2; under the old worst-case memory model the merge was a wider tp.)"""
    short, long = ppo_8b_layouts(500), ppo_8b_layouts(8000)
    assert (
        set(short.inference_emu)
        == set(long.inference_emu)
        == {"actor/inference", "reference/inference", "reward/inference", "critic/inference"}
    )
    merged = [name for name, emu in short.inference_emu.items() if long.inference_emu[name] > emu]
    assert merged, (short, long)
    assert long.generation_tp >= short.generation_tp
    assert long.training != short.training
    assert long.step_time_s > short.step_time_s


#: No memory-saving choice at all: the whole batch's KV cache, every state resident and whole,
#: every activation kept.
NOTHING_SAVED = MemoryChoices(
    recompute=("none",),
    token_budget=(False,),
    zero1=(False,),
    offload=(False,),
    kv_budget=(False,),
    full_shard=(False,),
    train_offload=("none",),
)


def test_memory_pressure_from_longer_responses_merges_generation_and_inference() -> None:
    """With 768 prompts of 512 tokens per step and memory sized without memory-saving choices (the
    whole batch's KV cache, every state resident, every activation kept), 8000-token responses
    no longer fit at the short-response layouts: generation and every inference model-stage
    merge into larger instances, and training changes layout (the Nereus trend). With the
    memory-saving choices the same growth is absorbed differently: generation keeps its tp and
    bounds its KV cache (continuous batching), and the step is faster than the merged plan."""
    short = ppo_8b_layouts(500, prompts=768, prompt_len=512, choices=NOTHING_SAVED)
    long = ppo_8b_layouts(8000, prompts=768, prompt_len=512, choices=NOTHING_SAVED)
    assert long.generation_tp > short.generation_tp, (short, long)
    assert all(long.inference_emu[name] > emu for name, emu in short.inference_emu.items()), (short, long)
    assert long.training != short.training
    saving = ppo_8b_layouts(8000, prompts=768, prompt_len=512)
    assert saving.kv_budget and saving.generation_tp == short.generation_tp, saving
    assert saving.step_time_s < long.step_time_s


def test_step_time_grows_with_the_response_cap() -> None:
    times = [ppo_8b_layouts(cap).step_time_s for cap in (500, 1000, 2000, 4000, 8000)]
    assert times == sorted(times) and len(set(times)) == len(times), times


def test_more_gpus_never_slower() -> None:
    workload = workload_preset("ppo")
    times = []
    for gpus in (16, 32, 64, 128):
        request = PlanRequest(cluster_preset("h100", gpus), models_for(workload, None), workload, gpus)
        times.append(search(request).candidates[0].step_time_s)
    assert times == sorted(times, reverse=True)


# ---- (c) impossible requests -------------------------------------------------------------------------
def ppo_request(
    actor: str, gpus: int, cluster: Cluster | None = None, choices: MemoryChoices | None = None
) -> PlanRequest:
    workload = workload_preset("ppo", actor=actor)
    cluster = cluster or cluster_preset("h100", gpus)
    return PlanRequest(cluster, models_for(workload, None), workload, gpus, choices=choices or MemoryChoices())


#: Every memory-saving choice but training-time offload.
NO_TRAIN_OFFLOAD = MemoryChoices(train_offload=("none",))


def test_70b_on_8_gpus_says_what_fits() -> None:
    said = "the smallest GPU count that fits is 10; the smallest whole-node count is 16 (2 nodes of 8)"
    with pytest.raises(NereusError, match=re.escape(said)) as info:
        make_plan(ppo_request("llama-3.3-70b", 8))
    assert "\n" not in str(info.value)
    assert "no memory-feasible plan for ppo on 8 H100-SXM-80GB GPUs" in str(info.value)
    request = ppo_request("llama-3.3-70b", 8)
    assert search(resized(request, 10)).candidates and search(resized(request, 16)).candidates
    # 9 GPUs hold no plan: `fits` (memory alone, pool by pool; test_fits_agrees_with_the_search)
    # says so in milliseconds, where the search's capped passes (host memory binds here) take a
    # minute and a half to find nothing
    assert not fits(resized(request, 9))
    # without training-time offload (issue 47's search space): 20 GPUs fit, 24 (3 nodes) fit,
    # 16 (2 nodes) do not (80 under the old worst-case memory model)
    said = "the smallest GPU count that fits is 20; the smallest whole-node count is 24 (3 nodes of 8)"
    with pytest.raises(NereusError, match=re.escape(said)):
        make_plan(ppo_request("llama-3.3-70b", 8, choices=NO_TRAIN_OFFLOAD))
    request = ppo_request("llama-3.3-70b", 8, choices=NO_TRAIN_OFFLOAD)
    assert search(resized(request, 20)).candidates and search(resized(request, 24)).candidates
    assert not search(resized(request, 16)).candidates


def fitting_counts(
    request: PlanRequest, upto: int, holds: Callable[[PlanRequest], bool] = lambda r: bool(search(r).candidates)
) -> list[int]:
    """The GPU counts up to `upto` on which a plan fits, each asked of `holds` on its own (by
    default a full search of that count)."""
    return [n for n in range(1, upto + 1) if holds(resized(request, n))]


@pytest.mark.parametrize(
    ("algorithm", "actor", "gpus", "smallest", "whole"),
    [("grpo", "llama-3.1-8b", 1, 2, 8), ("grpo", "llama-3.3-70b", 16, 20, 24), ("ppo", "llama-3.3-70b", 2, 20, 24)],
)
def test_the_smallest_gpu_count_is_the_true_smallest(
    algorithm: str, actor: str, gpus: int, smallest: int, whole: int
) -> None:
    """Issue 47: only whole nodes were tried, so Llama-3.1-8B GRPO on 1 GPU said 8 though 2
    fit, and 70B on 16 said 24 though 20 fit. The refusal now gives the smallest count of all
    and, when it differs, the smallest whole-node count, each checked by a full search of every
    count up to it."""
    workload = workload_preset(algorithm, actor=actor)
    request = PlanRequest(cluster_preset("h100", gpus), models_for(workload, None), workload, gpus)
    request = dataclasses.replace(request, choices=NO_TRAIN_OFFLOAD)  # issue 47's search space
    found = smallest_feasible_gpus(request)
    assert found is not None and (found.gpus, found.whole_node_gpus) == (smallest, whole)
    counts = fitting_counts(request, whole)
    assert counts[0] == smallest and min(n for n in counts if n % 8 == 0) == whole
    with pytest.raises(NereusError) as info:
        make_plan(request)
    said = f"the smallest GPU count that fits is {smallest}; the smallest whole-node count is {whole}"
    assert str(info.value).endswith(f"{said} ({whole // 8} node{'s' if whole > 8 else ''} of 8)")


def test_the_smallest_counts_match_a_search_of_every_count() -> None:
    """Random requests on nodes of 4 GPUs, refused on 1 GPU and fitting on 64: both counts
    `smallest_feasible_gpus` gives are the first that a full search of every count finds. Some
    of them fit on fewer GPUs than on a whole number of nodes above them (6 fit, 8 do not, 12
    do): a search over whole nodes, or a bisection, would miss the smallest.

    Each count is asked of `fits` on its own request (test_fits_agrees_with_the_search holds it
    to the search): where host memory binds, a full search of a count that holds no plan runs
    every capped pass (seed 74's counts 16 to 19: a minute and a half together; `fits`: milliseconds)."""
    checked, gaps = 0, 0
    for seed in range(100):
        request = random_request(seed)
        cluster = request.cluster.model_copy(update={"gpus_per_node": 4, "num_nodes": 16})
        request = dataclasses.replace(request, cluster=cluster, num_gpus=1)
        if search(request).candidates or not search(resized(request, 64)).candidates:
            continue
        found = smallest_feasible_gpus(request)
        assert found is not None, seed
        counts = fitting_counts(request, found.whole_node_gpus, fits)
        assert (found.gpus, found.whole_node_gpus) == (counts[0], min(n for n in counts if n % 4 == 0)), seed
        checked += 1
        gaps += any(n not in counts for n in range(found.gpus, found.whole_node_gpus))
    assert checked >= 20 and gaps >= 1


def test_a_whole_node_answer_is_said_once() -> None:
    """When the smallest count is a whole number of nodes, there is nothing more to say."""
    workload = workload_preset("ppo", actor="llama-65b")
    request = PlanRequest(cluster_preset("h100", 8), models_for(workload, None), workload, 8)
    request = dataclasses.replace(request, choices=MemoryChoices(offload=(False,), train_offload=("none",)))
    found = smallest_feasible_gpus(request)
    assert found is not None and found.gpus == found.whole_node_gpus == fitting_counts(request, found.gpus)[0]
    assert found.describe() == f"the smallest GPU count that fits is {found.gpus}"


def test_fits_agrees_with_the_search() -> None:
    """`fits` (whether each pool of some placement holds its model-stages' memory) says yes
    exactly where `search` finds a plan."""
    verdicts = []
    for seed in range(150):
        request = random_request(seed)
        verdicts.append(fits(request))
        assert verdicts[-1] == bool(search(request).candidates), seed
    assert 10 < sum(verdicts) < len(verdicts) - 10  # both answers are tested


def holds_nowhere_somewhere(request: PlanRequest) -> bool:
    """Whether some placement of `request` has a pool that holds no plan (`CountProbe`)."""
    layouts = placements(request)
    probe = CountProbe(request, price_all(request, layouts))
    return any(not all(probe.holds(stages, size) for _, _, size, stages in p.pools) for p in layouts)


@pytest.mark.slow
def test_skipping_placements_that_hold_no_plan_keeps_the_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    """`search` skips placements with a pool that holds no plan; with every pool said to hold one
    (`CountProbe.holds` patched: the search before that skip) it must return the same candidates,
    placement and options included, for the top 1 and the top 3. On the
    seeded random cases with such a placement until 30 of them still have a plan (seeds 0-325)."""
    compared = Counter[str]()
    seed = 0
    while compared["feasible"] < 30:
        request = random_request(seed)
        seed += 1
        assert seed < 2000, compared  # the seeds are fixed: today 326 are drawn
        if not holds_nowhere_somewhere(request):
            continue
        compared["compared"] += 1
        for k in (1, 3):
            skipping = search(request, top_k=k)
            with monkeypatch.context() as patched:
                patched.setattr(CountProbe, "holds", lambda self, stages, size: True)
                exhaustive = search(request, top_k=k)
            assert skipping.candidates == exhaustive.candidates, (seed, k)
        compared["feasible"] += bool(skipping.candidates)
        compared["host_binds"] += host_binds(request, skipping)
    # Today: 85 compared (55 without a plan), 8 whose optimum the node's host memory changes.
    assert compared["compared"] >= 60, compared
    assert compared["host_binds"] >= 4, compared


def test_a_request_no_placement_holds_searches_no_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    """LLaMA-65B PPO on 8 H100s fits no placement (host memory binds): the search decides it from
    the pools' memory alone and runs no branch and bound (it used to exhaust the trees of the
    placements with a finite bound, 41 capped passes each, for minutes)."""
    workload = with_max_response(workload_preset("ppo", actor="llama-65b"), 1024)
    request = PlanRequest(cluster_preset("h100", 8), models_for(workload, None), workload, 8)
    searched: list[str] = []
    inner = plan_search.branch_and_bound

    def spy(problem: Any, best: Any) -> int:
        searched.append(problem.placement.name)
        return inner(problem, best)

    monkeypatch.setattr(plan_search, "branch_and_bound", spy)
    outcome = search(request)
    assert outcome.candidates == [] and searched == []
    assert not fits(request)
    # On the 16 GPUs where it fits, only placements whose pools hold a plan are searched.
    wider = resized(request, 16)
    layouts = placements(wider)
    probe = CountProbe(wider, price_all(wider, layouts))
    holding = {p.name for p in layouts if all(probe.holds(stages, size) for _, _, size, stages in p.pools)}
    assert search(wider).candidates and set(searched) <= holding and searched


def test_70b_on_16_gpus_offloads_its_training_states_to_the_host() -> None:
    """Llama-3.3-70B PPO on 16 H100s fits only with the optimizer state in host memory (issue 44):
    the training model-stages keep AdamW state and gradients there, priced by the host step and
    the host link, and every node's host memory holds what the plan puts in it."""
    plan = make_plan(ppo_request("llama-3.3-70b", 16)).best
    trained = [e for e in plan.stages if e.stage == "training"]
    assert trained and all(e.train_offload != "none" for e in trained), trained
    assert plan.predictions is not None
    for entry in trained:
        predicted = plan.predictions.model_stages[entry.model_stage]
        assert predicted.memory_breakdown_bytes["optimizer"] == 0
        assert predicted.host_memory_bytes["optimizer"] > 0
        assert predicted.time_breakdown_s["host_transfer"] > 0
    per_node: dict[int, float] = {}
    for entry in plan.stages:
        host = sum(plan.predictions.model_stages[entry.model_stage].host_memory_bytes.values())
        for gpu in entry.gpus:
            per_node[plan.cluster.node_of(gpu)] = per_node.get(plan.cluster.node_of(gpu), 0.0) + host
    assert 0 < max(per_node.values()) <= plan.cluster.host_memory_bytes


@pytest.mark.parametrize("gpus", [17, 0])
def test_gpu_count_outside_the_cluster(gpus: int) -> None:
    with pytest.raises(NereusError):
        make_plan(ppo_request("llama-3.1-8b", gpus, cluster_preset("h100-sxm-2x8")))


# ---- (c2) more GPUs than samples: the extra GPUs stay free ----------------------------------------
def one_layer_request(gpus: int, samples: int = 2, mini_batches: int = 1) -> PlanRequest:
    """GRPO, one prompt with `samples` samples; a one-layer, one-head model allows only tp = pp = 1."""
    model = Model(
        name="m", num_layers=1, hidden_dim=64, num_heads=1, num_kv_heads=1, head_dim=64, ffn_dim=128, vocab_size=64
    )
    workload = Workload(
        name="w",
        algorithm="grpo",
        actor="m",
        prompts_per_step=1,
        samples_per_prompt=samples,
        prompt_len=8,
        response_len=ResponseLengths(median=8, p99=16, max=16),
        mini_batches=mini_batches,
        micro_batch_size=1,
    )
    return PlanRequest(cluster_preset("h100", gpus), (model,), workload, gpus)


def idle_replicas(plan: Plan) -> list[str]:
    """Model-stages with more replicas than samples per mini-batch (training) or per step."""
    w = plan.workload
    out = []
    for s in plan.stages:
        samples = w.samples_per_step // w.mini_batches if s.stage == "training" else w.samples_per_step
        if s.dp > samples:
            out.append(f"{s.model_stage} dp={s.dp} > {samples}")
    return out


def error_messages(plan: Plan) -> list[str]:
    return [p.message for p in semantic_problems(plan) if p.severity == "error"]


def test_one_layer_request_fills_few_gpus() -> None:
    for gpus in (1, 2):
        request = one_layer_request(gpus)
        assert not training_leaves_gpus_free(request)
        assert step_times(search(request)) == pytest.approx(step_times(reference_search(request)), rel=REL)
        plan = build_plan(request, search(request).candidates[0])
        assert len(plan.stage_plan("actor/training").gpus) == gpus


@pytest.mark.parametrize("gpus", [16, 24])
def test_training_without_a_full_layout_leaves_gpus_free(gpus: int) -> None:
    """2 samples on 16+ GPUs (node-granular pools of 8+), tp = pp = 1: dp is capped at 2 and the
    other GPUs stay free. (Inside one node pools of 1 or 2 GPUs exist, which training fills.)"""
    request = one_layer_request(gpus)
    assert training_leaves_gpus_free(request)
    outcome = search(request)
    assert outcome.candidates
    assert step_times(outcome) == pytest.approx(step_times(reference_search(request)), rel=REL)
    plan = build_plan(request, outcome.candidates[0])  # asserts feasibility and the same step time
    assert error_messages(plan) == []
    assert idle_replicas(plan) == []
    training = plan.stage_plan("actor/training")
    assert (training.tp, training.pp, training.dp) == (1, 1, 2)
    assert len(training.gpus) == 2 < gpus


def test_make_plan_without_a_full_training_layout_builds_checked_plans() -> None:
    """make_plan used to fail here with numpy's 'zero-size array' text; now every plan is valid."""
    # full sharding off: its variants (slower by their all-gathers) would crowd the runners-up, as
    # would recompute's (the colocated plan again, rerunning layers for less activation memory) and
    # all-gather cp's (which one head does not bound)
    choices = MemoryChoices(full_shard=(False,), recompute=("none",), context_parallel=(False,))
    request = dataclasses.replace(one_layer_request(16), choices=choices)
    result = make_plan(request, top_k=5)
    plans = [result.best, *result.alternatives]
    # colocated and split-generation-8 at tp = pp = 1; the other alternatives only add offload
    assert [p.pools[0].name for p in plans[:2]] == ["shared", "rest"] and len(plans) == 5
    assert all((s.tp, s.pp) == (1, 1) for plan in plans for s in plan.stages)
    assert all(not s.offload for plan in plans[:2] for s in plan.stages)
    assert all(any(s.offload for s in plan.stages) for plan in plans[2:])
    for plan in plans:
        assert error_messages(plan) == []
        assert idle_replicas(plan) == []
        assert plan.predictions is not None
        assert plan.predictions == evaluate_plan(plan).predictions


@pytest.mark.parametrize(("mini_batches", "synced"), [(1, False), (2, True)])
def test_weight_sync_needs_equal_dp(mini_batches: int, synced: bool) -> None:
    """4 samples on 4 GPUs of one node (so only the colocated placement): generation and
    inference run 4 replicas, training 4 // mini_batches. Equal tp and pp but fewer training
    replicas are different EMUs, so the weights must move."""
    request = one_layer_request(4, samples=4, mini_batches=mini_batches)
    outcome = search(request)
    assert [c.placement.name for c in outcome.candidates] == ["colocated"]
    assert step_times(outcome) == pytest.approx(step_times(reference_search(request)), rel=REL)
    plan = build_plan(request, outcome.candidates[0])  # asserts the search priced the sync as evaluate_plan does
    train, generation = plan.stage_plan("actor/training"), plan.stage_plan("actor/generation")
    assert (train.tp, train.pp, train.dp) == (1, 1, 4 // mini_batches)
    assert (generation.tp, generation.pp, generation.dp) == (1, 1, 4)
    assert plan.predictions is not None
    assert (plan.predictions.step_breakdown_s["weight_sync"] > 0) == synced


# ---- (d) the built plan is a valid, self-consistent document --------------------------------------
@pytest.mark.parametrize("gpus", [16, 24, 32, 40, 48, 64, 96, 128])
def test_built_plan_passes_check_and_predictions_are_fresh(gpus: int, tmp_path: Path) -> None:
    result = make_plan(ppo_request("llama-3.1-8b", gpus), top_k=2)
    for plan in (result.best, *result.alternatives):
        assert plan.predictions is not None
        fresh = evaluate_plan(plan)
        assert fresh.feasible
        assert fresh.predictions == plan.predictions
        path = tmp_path / "plan.yaml"
        save_document(plan, path)
        loaded = load_document(path)
        assert list(plan_cost_problems(loaded)) == []  # nothing stale after a YAML round trip
        errors = [p for p in semantic_problems(loaded) if p.severity == "error"]
        assert errors == []


def test_planner_never_proposes_idle_replicas() -> None:
    """Every priced layout keeps dp <= samples per mini-batch (training) or per step."""
    requests = [r for chunk in range(2) for _, r in cases(chunk, 25)]
    requests += [ppo_request("llama-3.1-8b", g) for g in (24, 40, 48, 96, 1024)]
    requests += [one_layer_request(g) for g in (4, 16, 24)]
    for request in requests:
        w = request.workload
        for (name, _size), table in price_all(request, placements(request)).items():
            samples = w.samples_per_step // w.mini_batches if name.endswith("/training") else w.samples_per_step
            assert all(o[5] <= samples for o in table.options), name


def tiny_grpo_plan(layouts: dict[str, tuple[int, int]]) -> Plan:
    """6 samples per step, 1 mini-batch, on 8 GPUs; layouts: model-stage -> (tp, micro_batches), pp = 1."""
    workload = Workload(
        name="w",
        algorithm="grpo",
        actor="tiny",
        prompts_per_step=3,
        samples_per_prompt=2,
        prompt_len=16,
        response_len=ResponseLengths(median=8, p99=16, max=32),
        mini_batches=1,
        micro_batch_size=1,
    )
    stages = []
    for name, (tp, micro_batches) in layouts.items():
        dp = 8 // tp
        emus = [list(range(k * tp, (k + 1) * tp)) for k in range(dp)]
        stages.append(
            StagePlan(
                model_stage=name,
                pool="all",
                tp=tp,
                pp=1,
                dp=dp,
                emus=emus,  # type: ignore[arg-type]
                micro_batches=micro_batches,
            )
        )
    return Plan(
        cluster=cluster_preset("h100", 8),
        models=[MODELS["tiny"]],
        workload=workload,
        pools=[Pool(name="all", gpus=list(range(8)))],
        stages=stages,
    )


def batch_errors(plan: Plan) -> list[tuple[str, str]]:
    return [
        (p.path, p.message)
        for p in semantic_problems(plan)
        if p.severity == "error" and p.path.endswith((".dp", ".micro_batches"))
    ]


def test_check_counts_the_busiest_replica_and_rejects_idle_ones() -> None:
    ok = {"actor/generation": (2, 1), "actor/inference": (2, 2), "actor/training": (2, 2)}
    # dp=4 replicas split 6 samples 2, 2, 1, 1: the busiest can run 2 micro-batches
    assert batch_errors(tiny_grpo_plan(ok)) == []
    (error,) = batch_errors(tiny_grpo_plan({**ok, "actor/training": (2, 3)}))
    assert error[0] == "stages[2].micro_batches"
    assert "3 micro-batches but a replica gets at most 2 samples per mini-batch" in error[1]
    (error,) = batch_errors(tiny_grpo_plan({**ok, "actor/inference": (2, 3)}))
    assert error[0] == "stages[1].micro_batches" and "at most 2 samples per step" in error[1]
    # dp=8 replicas for 6 samples: two would idle, whatever the stage
    for i, name in enumerate(ok):
        (error,) = batch_errors(tiny_grpo_plan({**ok, name: (1, 1)}))
        per = "mini-batch" if name == "actor/training" else "step"
        assert error[0] == f"stages[{i}].dp" and f"dp=8 replicas share only 6 samples per {per}" in error[1]


def test_random_built_plans_match_their_candidates() -> None:
    """build_plan re-prices the candidate with evaluate_plan: same step time, feasible."""
    built = 0
    for _, request in cases(2, 40):
        outcome = search(request)
        if outcome.candidates:
            plan = build_plan(request, outcome.candidates[0])  # asserts feasibility and equal step time
            assert plan.predictions is not None
            assert plan.predictions == evaluate_plan(plan).predictions
            built += 1
    assert built >= 20


def test_random_built_plans_pass_check() -> None:
    failures = []
    for seed, request in cases(2, 40):
        outcome = search(request)
        if outcome.candidates:
            plan = build_plan(request, outcome.candidates[0])
            errors = error_messages(plan) + idle_replicas(plan)
            if errors:
                failures.append((seed, errors[0]))
    assert failures == []


def test_split_sizes_are_per_gpu_inside_one_node_and_per_node_beyond() -> None:
    assert split_sizes(2, 2) == [1]
    assert split_sizes(8, 8) == [1, 2, 3, 4, 5, 6, 7]
    assert split_sizes(16, 8) == [8]
    assert split_sizes(24, 8) == [8, 16]
    assert split_sizes(1, 8) == []


@pytest.mark.parametrize("overhead_s", [0.031, 1.0])
def test_the_step_overhead_shifts_every_plan_and_prunes_no_less(overhead_s: float) -> None:
    """A fixed step overhead adds the same seconds to every plan: the search finds the same top 3
    plans, each slower by it, after scoring as many full assignments. Its bounds once left the
    overhead out, so on a tiny model (plans 1e-4 s apart, an overhead of 0.03 s) the controller's
    replans scored 3-10 million leaves and stalled a run for minutes."""
    plan = load_document(DATA / "plan-tiny-ppo-2rank.yaml")
    assert isinstance(plan, Plan)
    calibration = Calibration(launch_overhead_s=5.7e-4, micro_batch_overhead_s=2.4e-3, stage_overhead_s=2.0e-3)
    request = PlanRequest(plan.cluster, tuple(plan.models), plan.workload, 2, calibration)
    without = search(request, top_k=3)
    shifted = dataclasses.replace(request, calibration=calibration.model_copy(update={"step_overhead_s": overhead_s}))
    with_overhead = search(shifted, top_k=3)
    assert [c.choices for c in with_overhead.candidates] == [c.choices for c in without.candidates]
    assert step_times(with_overhead) == pytest.approx([t + overhead_s for t in step_times(without)], rel=REL)
    assert with_overhead.num_leaves == without.num_leaves


def test_two_ranks_of_one_node_can_split_the_actor_from_the_other_models() -> None:
    """Per-rank overheads dominate (tiny model; the calibration `nereus fit` found on 2 CPU ranks,
    rounded): running the actor on one rank and the other models on the other beats every
    colocated layout, and the planner's step time equals evaluate_plan's for that intra-node
    split (the weight sync stays intra-node)."""
    plan = load_document(DATA / "plan-tiny-ppo-2rank.yaml")
    assert isinstance(plan, Plan)
    calibration = Calibration(
        gemm=1.0,
        decode_gemm=0.064,
        attention=0.016,
        decode_memory=0.081,
        collective_intra=0.075,
        launch_overhead_s=5.7e-4,
        micro_batch_overhead_s=2.4e-3,
        link_latency_scale=4.3,
        stage_overhead_s=2.0e-3,
        decode_token_overhead_s=4.4e-3,
        step_overhead_s=0.031,
    )
    request = PlanRequest(plan.cluster, tuple(plan.models), plan.workload, 2, calibration)
    names = {p.name for p in placements(request)}
    assert {"colocated", "split-actor-1", "split-generation-1"} <= names
    best = make_plan(request).best
    # The actor (and generation) on the last rank: rank 0 runs the controller while it generates.
    assert [(p.name, p.gpus) for p in best.pools] == [("others", [0]), ("actor", [1])]
    assert best.predictions is not None
    assert best.predictions.step_time_s == pytest.approx(evaluate_plan(best, calibration).predictions.step_time_s)
    # Nothing is short of memory here, so offloading only adds time, and neither a KV budget nor
    # full sharding is among the best three: the exhaustive check runs without them (560
    # thousand assignments; 6.7 million with the last two, 16 million with offload too).
    choices = MemoryChoices(offload=(False,), kv_budget=(False,), full_shard=(False,))
    resident = dataclasses.replace(request, choices=choices)
    with_both = dataclasses.replace(request, choices=MemoryChoices(offload=(False,)))
    assert step_times(search(resident, top_k=3)) == step_times(search(with_both, top_k=3))
    assert step_times(search(resident, top_k=3)) == pytest.approx(
        step_times(reference_search(resident, top_k=3)), rel=REL
    )
    assert step_times(search(resident))[0] == pytest.approx(best.predictions.step_time_s, rel=REL)


def test_70b_on_16_gpus_says_why_term_by_term() -> None:
    """The closest miss, per GPU: the model-stage that fits in no layout alone, its states by term
    plus what it needs while it runs, against the usable memory; the terms add up (without
    training-time offload, with which it fits)."""
    with pytest.raises(NereusError) as info:
        make_plan(ppo_request("llama-3.3-70b", 16, choices=NO_TRAIN_OFFLOAD))
    message = str(info.value)
    # The closest: one replica of tp=4 x cp=4 fully sharded over its 4 cp ranks (the cp ranks
    # share the state out as the replicas do), 0.5 GiB over.
    assert "actor/training alone [tp=4 cp=4 pp=1 dp=1 recompute=full full_shard]" in message, message
    short = closest_shortfall(ppo_request("llama-3.3-70b", 16, choices=NO_TRAIN_OFFLOAD))
    assert short is not None and short.needed_bytes > short.usable_bytes
    assert [name for name, _ in short.states] == ["parameters", "gradients", "optimizer"]
    assert {term for term, _ in short.transient} >= {"activations", "logits"}
    assert short.describe() in message
    assert short.needed_bytes == pytest.approx(sum(b for _, b in short.states) + sum(b for _, b in short.transient))
    # against the usable capacity, the workspace its own term
    request = ppo_request("llama-3.3-70b", 16)
    assert short.usable_bytes == usable_capacity(request.cluster, request.calibration)
    assert short.transient[-1] == ("workspace", workspace_bytes(request.cluster, request.calibration))


def lone_needs(request: PlanRequest, placement: str, pool: str) -> dict[str, float]:
    """Per model-stage of a pool: its smallest footprint alone, per GPU, with the workspace."""
    workspace = workspace_bytes(request.cluster, request.calibration)
    layouts = placements(request)
    tables = price_all(request, layouts)
    (size, stages), *_ = [(n, s) for p in layouts if p.name == placement for name, _, n, s in p.pools if name == pool]
    return {name: min(o[1] + o[2] for o in tables[name, size].options) + workspace for name in stages}


def test_70b_ppo_on_2_gpus_blames_the_largest_excess() -> None:
    """Issue 47: 70B PPO on 2 GPUs said `closest: ... 72.5 GiB > 69.6 GiB ... while
    actor/inference alone` (the first model-stage that fit in no layout alone) though
    actor/training alone needs over 500 GiB per GPU. The shortfall names the model-stage with
    the largest excess over the usable capacity, and its largest term. (In the issue's search
    space: with training-time offload, actor/training's least footprint drops below the others'.)"""
    request = ppo_request("llama-3.3-70b", 2, choices=NO_TRAIN_OFFLOAD)
    with pytest.raises(NereusError) as info:
        make_plan(request)
    message = str(info.value)
    short = closest_shortfall(request)
    assert short is not None and short.alone and short.describe() in message
    assert short.running.startswith("actor/training alone [") and "actor/inference" not in message
    assert short.largest[0] == "optimizer" and f"largest term: optimizer {short.largest[1] / GIB:.1f} GiB" in message
    assert short.needed_bytes > 500 * GIB
    needs = lone_needs(request, short.placement, short.pool)
    assert short.needed_bytes == pytest.approx(max(needs.values()))
    assert max(needs, key=lambda name: needs[name]) == "actor/training"


def test_the_shortfall_names_the_worst_model_stage_of_its_pool() -> None:
    """Over random impossible requests: where one model-stage fits in no layout alone, the
    shortfall's model-stage is the one of its pool that needs the most alone."""
    checked = 0
    for seed in range(150):
        request = random_request(seed)
        short = closest_shortfall(request)
        if short is None or not short.alone:
            continue
        needs = lone_needs(request, short.placement, short.pool)
        assert short.needed_bytes == pytest.approx(max(needs.values())), seed
        assert short.running.startswith(f"{max(needs, key=lambda name: needs[name])} alone ["), seed
        checked += 1
    assert checked >= 10


def test_one_memory_base_in_the_plan_and_its_rejections() -> None:
    """Issue 47: in the Qwen3-14B PPO plan on 16 GPUs the chosen actor/training showed
    `72.0 / 72.0` (its peak with the workspace, of the capacity less headroom) while a rejected
    layout read `needs 71.2 GiB > 69.6 GiB usable` (without the workspace, of the capacity less
    headroom and workspace). Both now count the workspace and compare with the usable capacity."""
    workload = workload_preset("ppo", actor="qwen3-14b")
    request = PlanRequest(cluster_preset("h100", 16), models_for(workload, None), workload, 16)
    # the search space (selective recompute and training-time offload came later)
    request = dataclasses.replace(request, choices=MemoryChoices(recompute=("none", "full"), train_offload=("none",)))
    result = make_plan(request)
    usable, workspace = (
        usable_capacity(request.cluster, request.calibration),
        workspace_bytes(request.cluster, request.calibration),
    )
    assert usable == 0.9 * 80 * GIB and workspace == pytest.approx(0.03 * 80 * GIB)
    assert result.best.predictions is not None
    for prediction in result.best.predictions.model_stages.values():
        assert prediction.memory_breakdown_bytes["workspace"] == int(workspace)
        assert prediction.peak_memory_bytes <= usable
    assert result.rejections
    for rejection in result.rejections:
        assert (rejection.usable_bytes, rejection.workspace_bytes) == (usable, workspace)
        assert rejection.needed_bytes > usable
        assert f"> {usable / GIB:.1f} GiB usable" in rejection.describe()
    # the layout that read `needs 71.2 GiB > 69.6 GiB usable`
    said = [r.describe() for r in result.rejections]
    # (that layout, tp=1 pp=8 dp=2 with one micro-batch, fits since the logits term prices one
    # chunk of the chunked head; pp=10 with one micro-batch of the whole budget still overflows)
    assert any(text.startswith("actor/training tp=1 pp=10 dp=1 micro_batches=1 ") for text in said)
    assert all("GiB > 72.0 GiB usable" in text for text in said)
    assert not any("69.6" in text for text in said)


def test_a_pin_that_leaves_a_model_stage_no_layout_is_said_so() -> None:
    """Random case 11 (2 GPUs) with KV budgets pinned on: generation has no candidate layout at
    all. The shortfall report skips such placements (it used to fail on an empty table) and the
    error names the model-stage and the cause, not a memory miss."""
    request = random_request(11)
    request = dataclasses.replace(request, choices=dataclasses.replace(request.choices, kv_budget=(True,)))
    assert closest_shortfall(request) is None
    with pytest.raises(NereusError, match="actor/generation has no candidate layout under the allowed memory-saving"):
        make_plan(request)

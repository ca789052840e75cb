"""Pure-logic tests of the transition core: intermediate layouts, local and global DAGs."""

from __future__ import annotations

import bisect
import dataclasses
import gc
import random

import pytest
from plan_helpers import relayout
from repo_paths import DATA

from nereus.errors import NereusError
from nereus.solver.transition import (
    Emu,
    Primitive,
    Schedule,
    build_transition,
    intermediate_layout,
    local_dag,
    priced,
    serial,
    sub_replicas,
)
from nereus.spec.io import load_document
from nereus.spec.plan import Plan

pytestmark = pytest.mark.logic


def test_intermediate_layout_is_the_gcd() -> None:
    assert intermediate_layout((4, 2), (2, 4)) == (2, 2)
    assert intermediate_layout((8, 1), (2, 1)) == (2, 1)


def test_sub_replica_boxes_contain_the_emu_boxes() -> None:
    emu = Emu("actor/training", 4, 2, tuple(range(8)))
    replicas = sub_replicas(emu, (2, 1))
    assert len(replicas) == 4 and sorted(g for r in replicas for g in r.gpus) == list(range(8))
    for replica in replicas:
        for index, gpu in enumerate(replica.gpus):
            stage, rank = emu.position(gpu)  # the EMU's GPU ids are its positions here
            i_stage, i_rank = divmod(index, 2)
            assert stage // 2 == i_stage and rank // 2 == i_rank


def test_merge_of_two_tp2_replicas_into_tp4() -> None:
    a = [Emu("x/training", 2, 1, (0, 1)), Emu("x/training", 2, 1, (2, 3))]
    b = [Emu("x/training", 4, 1, (0, 1, 2, 3))]
    kinds = [p.kind for p in local_dag("x/training", 100.0, a, b)]
    assert kinds.count("merge") == 1 and "split" not in kinds


def test_split_then_extend_to_new_gpus_keeps_a_copy_until_copied() -> None:
    a = [Emu("x/inference", 4, 1, (0, 1, 2, 3))]
    b = [Emu("x/inference", 1, 2, (4, 5)), Emu("x/inference", 1, 2, (0, 2))]
    dag = local_dag("x/inference", 100.0, a, b)
    by_id = {p.id: p for p in dag}
    split = next(p for p in dag if p.kind == "split")
    assert split.alloc == dict.fromkeys((0, 1, 2, 3), 75.0)  # each GPU gathers 3 more quarters
    for extend in (p for p in dag if p.kind == "extend"):
        assert split.id in extend.deps
    merges = [p for p in dag if p.kind == "merge"]
    assert sorted(m.adds[0].gpus for m in merges) == [(0, 2), (4, 5)]
    assert all(by_id[d].kind in ("split", "extend") for m in merges for d in m.deps)


def test_identical_plans_need_no_primitives() -> None:
    plan = load_document("examples/plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan, Plan)
    result = build_transition(plan, plan)
    assert result.primitives == [] and result.makespan_s == 0.0 and result.lower_bound_bytes == 0.0


@pytest.mark.parametrize("enabled", [True, False])
def test_a_build_leaves_the_garbage_collector_as_it_found_it(enabled: bool) -> None:
    plan_a = load_document("examples/plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan_a, Plan)
    plan_b = relayout(plan_a, "actor/training", 4, 1, [[0, 1, 2, 3]])
    was_enabled = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        assert build_transition(plan_a, plan_b).primitives
        assert gc.isenabled() is enabled
        with pytest.raises(NereusError):  # and so does a build that fails
            build_transition(plan_a, plan_b.model_copy(update={"stages": plan_b.stages[1:]}))
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was_enabled else gc.disable)()


@pytest.mark.parametrize(
    ("tp", "pp", "emus"),
    [(4, 1, [[0, 1, 2, 3]]), (1, 1, [[0], [1], [2], [3]]), (1, 4, [[3, 2, 1, 0]]), (2, 1, [[1, 0], [3, 2]])],
)
def test_global_transition_is_scheduled_and_moves_at_least_the_lower_bound(
    tp: int, pp: int, emus: list[list[int]]
) -> None:
    plan_a = load_document("examples/plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan_a, Plan)
    plan_b = relayout(relayout(plan_a, "actor/training", tp, pp, emus), "critic/inference", tp, pp, emus)
    result = build_transition(plan_a, plan_b)
    assert result.feasible
    assert result.primitives and result.makespan_s > 0
    assert result.bytes_moved >= result.lower_bound_bytes - 1e-6
    times = result.schedule
    for primitive in result.primitives:
        assert times.end_s(primitive) >= times.start_s(primitive)
        for dep in primitive.deps:
            assert times.end_s(result.primitives[dep]) <= times.start_s(primitive) + 1e-12


def test_sequential_fallback_when_every_priority_order_blocks() -> None:
    """A pair (from the coordination benchmark with busiest-GPU memory, seed 483) where every
    list-scheduling order deadlocks but whole model-stages one after another fit: the
    barrier edges are recorded as ownership dependencies and the replay checker accepts
    the schedule."""
    from nereus.solver.transition.check import check_result
    from nereus.solver.transition.schedule import Replay, _one_model_stage_at_a_time, list_schedule, priority_rules

    data = DATA
    # Tight on purpose: the plans' activations do not fit, only their model states matter here.
    plan_a = load_document(data / "sequential-fallback-a.yaml", check=False)
    plan_b = load_document(data / "sequential-fallback-b.yaml", check=False)
    assert isinstance(plan_a, Plan) and isinstance(plan_b, Plan)
    result = build_transition(plan_a, plan_b)
    assert result.feasible and result.priority_rule.startswith(
        ("serial: ", "local search", "one-model-stage-at-a-time")
    )
    assert check_result(result, plan_a, plan_b) == []
    serial_makespan = result.makespan_s
    sequential = _one_model_stage_at_a_time(result.primitives, result.initial_bytes, result.capacity_bytes)
    assert sequential is not None and sequential.rule.startswith("one-model-stage-at-a-time")
    result = dataclasses.replace(result, schedule=sequential.schedule)
    assert check_result(result, plan_a, plan_b) == []
    assert any(result.schedule.ownership_deps(p) for p in result.primitives)
    assert serial_makespan <= max(result.schedule.end_s(p) for p in result.primitives)
    for rule in priority_rules(result.primitives).values():
        assert list_schedule(result.primitives, Replay(dict(result.initial_bytes), result.capacity_bytes), rule)


def test_spare_replicas_of_one_split_go_in_one_destroy() -> None:
    a = [Emu("x/inference", 1, 1, (g,)) for g in range(4)]
    b = [Emu("x/inference", 1, 1, (0,)), Emu("x/inference", 1, 1, (1,))]
    dag = local_dag("x/inference", 8.0, a, b)
    assert [p.kind for p in dag] == ["destroy"]
    assert dag[0].removes == tuple(a[2:]) and dag[0].free == {2: 8.0, 3: 8.0}


def _reference_match(replicas: list[Emu], slots: list[Emu]) -> dict[int, Emu]:
    """The greedy by GPUs already in place, pair by pair (what `match_replicas` computes faster)."""
    pairs = [
        (-sum(g == h for g, h in zip(r.gpus, s.gpus, strict=True)), k, n, r)
        for k, s in enumerate(slots)
        for n, r in enumerate(replicas)
    ]
    assignment: dict[int, Emu] = {}
    for count, k, _, replica in sorted(pairs, key=lambda p: p[:3]):
        if count and k not in assignment and replica not in assignment.values():
            assignment[k] = replica
    return assignment


@pytest.mark.parametrize("seed", range(20))
def test_replica_matching_equals_the_pairwise_greedy(seed: int) -> None:
    import random

    from nereus.solver.transition import match_replicas

    rng = random.Random(seed)
    size, count = rng.choice([1, 2, 4]), rng.randint(1, 5)
    gpus_a, gpus_b = rng.sample(range(24), size * count), rng.sample(range(24), size * count)
    if seed % 3 == 0:  # some replicas stay exactly where they are
        gpus_b[:size] = gpus_a[:size]
    replicas = [Emu("x/inference", size, 1, tuple(gpus_a[i : i + size])) for i in range(0, len(gpus_a), size)]
    slots = [Emu("x/inference", size, 1, tuple(gpus_b[i : i + size])) for i in range(0, len(gpus_b), size)]
    assert match_replicas(replicas, slots) == _reference_match(replicas, slots)


def test_replicas_trading_gpus_are_copied_afresh_when_memory_binds() -> None:
    """tp4 pp2 -> tp2 pp4 on the same 8 GPUs: the two intermediate replicas of the split
    each move half their boxes onto the other's GPUs. With room for one extra box per GPU
    that is a cycle of memory waits; the unswapped DAG drops one replica first and copies
    its slot afresh, and the checker accepts it."""
    from nereus.solver.transition.check import check_transition
    from nereus.solver.transition.schedule import Replay, list_schedule

    a = [Emu("x/training", 4, 2, tuple(range(8)))]
    b = [Emu("x/training", 2, 4, tuple(range(8)))]
    initial, capacity = dict.fromkeys(range(8), 1.0), 3.0  # A's boxes; an I box is 2

    def schedule(unswap: bool) -> tuple[list[Primitive], Schedule, list[str]]:
        dag = local_dag("x/training", 8.0, a, b, unswap=unswap)
        dag = priced(dag, [1.0 if p.transfers else 0.0 for p in dag])
        replay = Replay(dict(initial), capacity)
        cycle = list_schedule(dag, replay)
        return dag, replay.schedule(), cycle

    swapped, _, cycle = schedule(unswap=False)
    assert cycle and all("needs 2 B more" in line for line in cycle)
    fresh, times, cycle = schedule(unswap=True)
    assert cycle == []
    assert check_transition(fresh, times, {"x/training": a}, {"x/training": b}, initial, capacity) == []
    assert sum(len(p.transfers) for p in fresh) > sum(len(p.transfers) for p in swapped)


def test_planner_pool_shrink_at_64_gpus_schedules_safely() -> None:
    """Llama-3.1-8B PPO planned for 64 H100s, then for 48 of them (the time benchmark's
    64-GPU pool-shrink). Actor training there goes tp4 pp2 -> tp2 pp4 on the same GPUs and
    its split replicas trade GPUs; this pair used to be reported infeasible."""
    from nereus.solver.plan_search import PlanRequest
    from nereus.solver.planner import make_plan
    from nereus.solver.transition.check import check_result
    from nereus.spec.presets import cluster_preset, models_for, workload_preset
    from nereus.spec.workload import with_max_response

    workload = with_max_response(workload_preset("ppo"), 8000)
    models = models_for(workload, None)
    plan_a, plan_b = (make_plan(PlanRequest(cluster_preset("h100", 64), models, workload, n)).best for n in (64, 48))
    result = build_transition(plan_a, plan_b)
    assert result.feasible, result.blocking_cycle
    assert check_result(result, plan_a, plan_b) == []


def _single_gpu_replicas(gpus: range) -> list[Emu]:
    return [Emu("x/inference", 1, 1, (g,)) for g in gpus]


@pytest.mark.parametrize(("node_size", "batches"), [(None, [1] * 16), (8, [16]), (24, [8, 8])])
def test_alike_copies_of_a_large_round_share_one_extend(node_size: int | None, batches: list[int]) -> None:
    """16 new replicas copied from 16 kept ones: one Extend per copy unless batched; batched,
    copies that all cross nodes (8 GPUs a node) share one Extend, and with 24 GPUs a node
    the copies staying inside node 0 and those leaving it go in two."""
    from nereus.solver.transition.check import check_transition
    from nereus.solver.transition.local import BATCH_MIN_COPIES
    from nereus.solver.transition.schedule import Replay, list_schedule

    assert BATCH_MIN_COPIES <= 16
    a, b = _single_gpu_replicas(range(16)), _single_gpu_replicas(range(32))
    dag = local_dag("x/inference", 8.0, a, b, node_size=node_size)
    extends = [p for p in dag if p.kind == "extend"]
    assert [len(p.adds) for p in extends] == batches and not [p for p in dag if p.kind != "extend"]
    for extend in extends:  # copy i reads copies_from[i] and fills adds[i]; no GPU in two copies
        assert [s.gpus[0] + 16 for s in extend.copies_from] == [t.gpus[0] for t in extend.adds]
        assert len(set(extend.reads) | set(extend.writes)) == 2 * len(extend.adds) == len(extend.gpus)
        assert extend.transfers == tuple(zip(extend.reads, extend.writes, [8.0] * len(extend.adds), strict=True))
    dag = priced(dag, [1.0] * len(dag))
    replay = Replay(dict.fromkeys(range(16), 8.0), 16.0)
    assert list_schedule(dag, replay) == []
    times = replay.schedule()
    assert max(times.end_s(p) for p in dag) == 1.0  # side by side, batched or not
    assert (
        check_transition(dag, times, {"x/inference": a}, {"x/inference": b}, dict.fromkeys(range(16), 8.0), 16.0) == []
    )


def test_small_rounds_are_never_batched() -> None:
    a, b = _single_gpu_replicas(range(4)), _single_gpu_replicas(range(8))
    assert [len(p.adds) for p in local_dag("x/inference", 8.0, a, b, node_size=2)] == [1, 1, 1, 1]


@pytest.mark.parametrize("seed", range(12))
def test_a_stamped_local_dag_equals_a_fresh_build(seed: int) -> None:
    """Model-stages with the same EMUs in both plans get the first one's DAG, renamed: it must
    be exactly what building theirs would give (ids, bytes, EMUs, edges, GPU sets)."""
    import random

    from nereus.solver.transition.local import replica_dag, stamp

    rng = random.Random(seed)
    gpus = 16

    def side() -> tuple[tuple[int, int], list[tuple[int, ...]]]:
        tp, pp = rng.choice([(tp, pp) for tp in (1, 2, 4) for pp in (1, 2, 4) if tp * pp <= gpus])
        order = rng.sample(range(gpus), tp * pp * rng.randint(1, gpus // (tp * pp)))
        return (tp, pp), [tuple(order[i : i + tp * pp]) for i in range(0, len(order), tp * pp)]

    def fields(dag: list[Primitive]) -> list[tuple[object, ...]]:
        names = "id model_stage kind source_layout target_layout reads writes alloc free transfers removes"
        names += " retires adds copies_from deps new_groups gpus"
        return [tuple(getattr(p, name) for name in names.split()) for p in dag]

    side_a, side_b = side(), side()
    template = replica_dag("x/training", 100.0, side_a, side_b, next_id=3, unswap=seed % 2 == 1)
    fresh = replica_dag("y/inference", 37.5, side_a, side_b, next_id=40, unswap=seed % 2 == 1)
    assert fields(stamp(template, "y/inference", 37.5, 40)) == fields(fresh)


def test_a_copy_tree_is_told_from_star_copies() -> None:
    """build_transition skips the star_rounds=None shape when the star shape grew no tree
    (it would be the same DAG): `_copies_a_new_replica` tells the two apart."""
    from nereus.solver.transition.local import STAR_ROUNDS
    from nereus.solver.transition.schedule import _copies_a_new_replica

    source = [Emu("actor/generation", 1, 1, (0,))]

    def grown(count: int, star_rounds: int | None) -> list[Primitive]:
        slots = [Emu("actor/generation", 1, 1, (gpu,)) for gpu in range(count)]
        return local_dag("actor/generation", 100.0, source, slots, star_rounds=star_rounds)

    few, many = STAR_ROUNDS + 1, 4 * STAR_ROUNDS
    assert not _copies_a_new_replica(grown(few, STAR_ROUNDS))  # every copy reads the source
    assert _copies_a_new_replica(grown(many, STAR_ROUNDS))  # later rounds read earlier copies
    assert not _copies_a_new_replica(grown(many, None))
    shape = [(p.kind, p.reads, p.writes, p.deps) for p in grown(few, STAR_ROUNDS)]
    assert shape == [(p.kind, p.reads, p.writes, p.deps) for p in grown(few, None)]


def _with_choices(plan: Plan, model_stage: str, **choices: object) -> Plan:
    stages = [s.model_copy(update=choices) if s.model_stage == model_stage else s for s in plan.stages]
    return plan.model_copy(update={"stages": stages, "predictions": None})


def test_offloaded_and_sharded_states_are_not_counted_as_resident() -> None:
    """The builder counts what the cost model keeps resident: an offloaded model-stage's states
    sleep in host memory (none on its GPUs, nothing to move), ZeRO-1 keeps 1/dp of AdamW state."""
    from nereus.cost.calibration import DEFAULT_CALIBRATION
    from nereus.cost.plan_cost import replica_state_bytes, resident_share
    from nereus.solver.plan_search import PlanRequest
    from nereus.solver.planner import make_plan
    from nereus.spec.presets import cluster_preset, models_for, workload_preset

    workload = workload_preset("ppo")
    planned = make_plan(PlanRequest(cluster_preset("h100", 16), models_for(workload, None), workload, 16)).best
    plan = _with_choices(planned, "critic/training", zero1=False, offload=False)
    training = plan.stage_plan("critic/training")
    full = replica_state_bytes(plan, "critic/training", DEFAULT_CALIBRATION) / (training.tp * training.pp)
    base = build_transition(plan, plan).initial_bytes
    offloaded = _with_choices(plan, "critic/training", offload=True)
    gpu = training.gpus[0]
    assert build_transition(offloaded, offloaded).initial_bytes[gpu] == pytest.approx(base[gpu] - full)
    assert resident_share(offloaded, offloaded.stage_plan("critic/training"), DEFAULT_CALIBRATION) == 0.0
    assert training.dp > 1
    sharded = _with_choices(plan, "critic/training", zero1=True)
    share = resident_share(sharded, sharded.stage_plan("critic/training"), DEFAULT_CALIBRATION)
    assert 0 < share < 1
    assert build_transition(sharded, sharded).initial_bytes[gpu] == pytest.approx(base[gpu] - full * (1 - share))
    # moving an offloaded model-stage to another layout moves no bytes between GPUs
    size = training.tp * training.pp * 2
    emus = [training.gpus[i : i + size] for i in range(0, len(training.gpus), size)]
    moved = relayout(offloaded, "critic/training", training.tp * 2, training.pp, emus)
    result = build_transition(offloaded, _with_choices(moved, "critic/training", offload=True))
    assert any(p.model_stage == "critic/training" for p in result.primitives)
    assert all(
        nbytes == 0 for p in result.primitives if p.model_stage == "critic/training" for *_, nbytes in p.transfers
    )
    assert result.bytes_moved == 0


def test_plans_whose_clusters_differ_only_in_node_count_build_on_the_larger_one() -> None:
    """A pool that grows: both plans move onto the larger cluster (its first nodes are the
    smaller one), either way round; a cluster of another node shape is refused with the
    reason, and so are plans that run other model-stages."""
    from nereus.solver.transition.pair import plan_pair

    small = load_document("examples/plan-tiny-ppo-4rank.yaml")
    assert isinstance(small, Plan)
    cluster = small.cluster
    grown = cluster.model_copy(update={"num_nodes": 2 * cluster.num_nodes, "name": "grown"})
    large = relayout(small.model_copy(update={"cluster": grown}), "actor/training", 4, 1, [[0, 1, 2, 3]])
    for a, b in ((small, large), (large, small)):
        pair = plan_pair(a, b)
        assert pair.source.cluster == pair.target.cluster == grown
        assert pair.sub_pool is not None and pair.sub_pool.smaller == cluster
        assert pair.sub_pool.describe().startswith(f"sub-pool: {cluster.name} ({cluster.num_gpus} GPUs) is the first")
        result = build_transition(a, b)
        assert result.primitives and result.feasible
        assert [p.kind for p in result.primitives] == [
            p.kind for p in build_transition(pair.source, pair.target).primitives
        ]
    assert plan_pair(small, small).sub_pool is None
    other = cluster.model_copy(update={"gpus_per_node": 2 * cluster.gpus_per_node, "name": "other"})
    with pytest.raises(NereusError, match=r"plans for different clusters \(.* vs other: gpus_per_node differ\)"):
        build_transition(small, small.model_copy(update={"cluster": other}))
    with pytest.raises(NereusError, match="run different model-stages"):
        build_transition(small, small.model_copy(update={"stages": small.stages[1:]}))


def _gpu_free_by_scan(runs: list[tuple[float, float]], start: float, end: float) -> bool:
    """The overlap rule read off every placed run: the reference for `_Profile.gpu_free`."""
    eps = serial.EPS
    for busy_start, busy_end in runs:
        if busy_end - busy_start <= eps:
            continue
        if end - start <= eps:
            if busy_start + eps < start < busy_end - eps:
                return False
        elif busy_start < end - eps and start < busy_end - eps:
            return False
    return True


@pytest.mark.parametrize("seed", range(10))
def test_gpu_free_equals_a_scan_of_every_run(seed: int) -> None:
    """Runs placed where they are free (zero-length ones, and runs that touch or overlap by
    less than EPS, among them): the bisected test answers every query as a full scan does."""
    rng = random.Random(seed)
    profile = serial._Profile({}, capacity=1.0)
    eps = serial.EPS
    jitter = [0.0, 0.0, eps / 2, -eps / 2]
    for _ in range(80):
        start = rng.randrange(40) / 4 + rng.choice(jitter)
        end = start + rng.choice([0.0, 0.0, eps / 2, 0.25, 0.5, 1.5])
        if profile.gpu_free(0, start, end):
            bisect.insort(profile.busy.setdefault(0, []), (start, end))
        for _ in range(25):
            query = rng.randrange(44) / 4 + rng.choice([*jitter, 0.1])
            query_end = query + rng.choice([0.0, eps / 2, 0.25, 1.0])
            expected = _gpu_free_by_scan(profile.busy.get(0, []), query, query_end)
            assert profile.gpu_free(0, query, query_end) == expected, (query, query_end)

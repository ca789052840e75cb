"""Sharded state and resharding: shard metadata, the box-overlap planner, and the executor.

The planner is checked on every pair of layouts the tiny models admit (pure Python); the
executor runs many layout pairs inside one spawned 8-rank gloo world, A -> B -> A, bitwise.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.state.reshard import execute
from nereus.runtime.state.reshard_plan import ReshardPlan, lower_bound, plan_reshard
from nereus.runtime.state.shard_layout import STATE_FAMILIES, RankLayout, box_numel, intersect
from nereus.runtime.state.sharded_state import StateMeta, cut, gather, random_logical_state, state_meta
from nereus.spec.check import layout_problem
from nereus.spec.presets import MODELS

pytestmark = pytest.mark.one_rank

WORLD = 8
SEED = 6


def layouts(model_name: str, max_ranks: int = WORLD) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) with tp * pp * dp <= max_ranks that the model admits."""
    model = MODELS[model_name]
    shapes = []
    for tp, pp in itertools.product((1, 2, 4, 8), repeat=2):
        if tp * pp <= max_ranks and layout_problem(model, tp, pp) is None:
            shapes += [(tp, pp, dp) for dp in range(1, max_ranks // (tp * pp) + 1)]
    return shapes


def meta(model: str, shape: tuple[int, int, int], ranks: tuple[int, ...], families=STATE_FAMILIES) -> StateMeta:
    return state_meta(MODELS[model], "lm", RankLayout(*shape, ranks), families)


def size(shape: tuple[int, int, int]) -> int:
    return shape[0] * shape[1] * shape[2]


# --- shard metadata -------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny", "tiny-wide"])
def test_cut_then_gather_is_the_identity(model: str) -> None:
    # Every (tp, pp) of both models; replicas only on the small one (they repeat the same boxes).
    for shape in [shape for shape in layouts(model) if model == "tiny" or shape[2] == 1]:
        source = meta(model, shape, tuple(reversed(range(size(shape)))), ("param",))
        logical = random_logical_state(source, SEED)
        states = {rank: cut(source, logical, rank) for rank in source.layout.ranks}
        assert sum(source.rank_bytes(rank) for rank in states) >= sum(t.numel() * 4 for t in logical.values())
        back = gather(source, states)
        assert all(torch.equal(back[key], logical[key]) for key in logical), shape


def test_gather_refuses_disagreeing_replicas_and_wrong_shapes() -> None:
    source = meta("tiny", (1, 1, 2), (0, 1), ("param",))
    logical = random_logical_state(source, SEED)
    states = {rank: cut(source, logical, rank) for rank in (0, 1)}
    states[1]["param/final_norm.weight"][0] += 1
    with pytest.raises(ValueError, match="a replica of its box"):
        gather(source, states)
    states[1]["param/final_norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="has shape"):
        gather(source, states)
    del states[1]["param/final_norm.weight"]
    with pytest.raises(ValueError, match="missing"):
        gather(source, states)


def test_state_meta_refuses_unknown_families_and_bad_layouts() -> None:
    with pytest.raises(ValueError, match="unknown state families"):
        meta("tiny", (1, 1, 1), (0,), ("momentum",))
    with pytest.raises(ValueError, match="does not divide"):
        meta("tiny", (1, 3, 1), (0, 1, 2))


# --- planner --------------------------------------------------------------------------


def check_plan(plan: ReshardPlan) -> None:
    """Every target box is covered exactly once by pieces its sources really hold."""
    pieces: dict[tuple[int, str], list] = {}
    for transfer in plan.transfers:
        assert plan.source.rank_boxes(transfer.src)[transfer.key] == transfer.src_box
        assert plan.target.rank_boxes(transfer.dst)[transfer.key] == transfer.dst_box
        assert intersect(transfer.piece, transfer.src_box) == transfer.piece
        assert intersect(transfer.piece, transfer.dst_box) == transfer.piece
        pieces.setdefault((transfer.dst, transfer.key), []).append(transfer.piece)
    for rank, boxes in plan.target.boxes.items():
        for key, box in boxes.items():
            mine = pieces[(rank, key)]
            assert sum(box_numel(piece) for piece in mine) == box_numel(box)
            assert all(intersect(a, b) is None for a, b in itertools.combinations(mine, 2))
    assert plan.bytes_moved >= plan.lower_bound


@pytest.mark.parametrize("model", ["tiny", "tiny-wide"])
def test_plans_cover_every_target_box_and_meet_the_lower_bound(model: str) -> None:
    shapes = layouts(model)
    for shape_a, shape_b in itertools.product(shapes, repeat=2):
        source = meta(model, shape_a, tuple(range(size(shape_a))), ("param",))
        target = meta(model, shape_b, tuple(reversed(range(WORLD - size(shape_b), WORLD))), ("param",))
        plan = plan_reshard(source, target)
        check_plan(plan)
        # Point-to-point sends exactly the missing bytes: the bound is always reached.
        assert plan.bytes_moved == plan.lower_bound, (shape_a, shape_b)


def test_dp_growth_moves_exactly_the_new_replicas() -> None:
    source = meta("tiny", (2, 2, 1), (0, 1, 2, 3))
    target = meta("tiny", (2, 2, 2), (0, 1, 2, 3, 4, 5, 6, 7))
    plan = plan_reshard(source, target)
    new_replica = sum(target.rank_bytes(rank) for rank in (4, 5, 6, 7))
    assert plan.bytes_moved == plan.lower_bound == new_replica
    # The new replica's ranks each receive from their twin in the old replica (least load).
    assert {(t.src, t.dst) for t in plan.moved()} == {(0, 4), (1, 5), (2, 6), (3, 7)}


def test_a_layout_onto_itself_moves_nothing_and_a_subset_of_families_is_allowed() -> None:
    source = meta("tiny-wide", (2, 2, 2), tuple(range(8)))
    assert plan_reshard(source, source).bytes_moved == 0
    params_only = meta("tiny-wide", (2, 2, 1), (4, 5, 6, 7), ("param",))
    plan = plan_reshard(source, params_only)
    assert plan.bytes_moved == plan.lower_bound == 0  # ranks 4-7 already hold replica 1's params
    with pytest.raises(ValueError, match="does not have"):
        plan_reshard(params_only, source)
    with pytest.raises(ValueError, match="cannot reshard"):
        plan_reshard(source, meta("tiny", (1, 1, 1), (0,)))


def test_sources_prefer_the_same_node_then_the_least_loaded() -> None:
    source = meta("tiny", (1, 1, 2), (0, 4), ("param",))
    target = meta("tiny", (1, 1, 4), (0, 4, 1, 5), ("param",))
    plan = plan_reshard(source, target, ranks_per_node=4)
    assert {(t.src, t.dst) for t in plan.moved()} == {(0, 1), (4, 5)}
    # Two replicas feed two new tensor ranks: each sender carries about half.
    spread = plan_reshard(meta("tiny", (1, 1, 2), (0, 1)), meta("tiny", (2, 1, 1), (2, 3)))
    sent = [sum(t.nbytes for t in spread.moved() if t.src == rank) for rank in (0, 1)]
    assert abs(sent[0] - sent[1]) <= 0.1 * sum(sent)


def test_lower_bound_counts_only_what_a_rank_lacks() -> None:
    source = meta("tiny", (2, 1, 1), (0, 1), ("param",))
    merged = meta("tiny", (1, 1, 1), (0,), ("param",))
    # Rank 0 held the first half of every split tensor and all of the replicated ones.
    split = sum(box_numel(box) * 4 for key, box in source.rank_boxes(1).items() if box != merged.rank_boxes(0)[key])
    assert lower_bound(source, merged) == split


# --- executor (one 8-rank world, many layout pairs) -----------------------------------

Case = tuple[str, tuple[str, ...], tuple[int, int, int], tuple[int, ...], tuple[int, int, int], tuple[int, ...], str]


def rank_sets(rng: random.Random, size_a: int, size_b: int, kind: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ranks = list(range(WORLD))
    if kind == "disjoint" and size_a + size_b <= WORLD:
        rng.shuffle(ranks)
        return tuple(ranks[:size_a]), tuple(ranks[size_a : size_a + size_b])
    if kind == "shuffled":
        return tuple(rng.sample(ranks, size_a)), tuple(rng.sample(ranks, size_b))
    return tuple(ranks[:size_a]), tuple(ranks[:size_b])  # same prefix: maximal overlap


def reshard_cases() -> list[Case]:
    rng = random.Random(SEED)
    cases: list[Case] = [
        ("tiny", STATE_FAMILIES, (2, 2, 1), (0, 1, 2, 3), (2, 2, 2), tuple(range(8)), "p2p"),  # dp growth
        ("tiny", STATE_FAMILIES, (1, 1, 1), (3,), (1, 1, 8), tuple(range(8)), "broadcast"),  # fan-out
        ("tiny-wide", STATE_FAMILIES, (8, 1, 1), tuple(range(8)), (1, 8, 1), tuple(range(8)), "p2p"),
        ("tiny-wide", ("param",), (2, 4, 1), tuple(range(8)), (4, 1, 2), (7, 6, 5, 4, 3, 2, 1, 0), "broadcast"),
    ]
    kinds = ("same", "shuffled", "disjoint")
    for index in range(20):
        model = ("tiny", "tiny-wide")[index % 2]
        families = (STATE_FAMILIES, ("param",))[index // 2 % 2]
        shape_a, shape_b = rng.choice(layouts(model)), rng.choice(layouts(model))
        ranks_a, ranks_b = rank_sets(rng, size(shape_a), size(shape_b), kinds[index % 3])
        cases.append((model, families, shape_a, ranks_a, shape_b, ranks_b, ("p2p", "broadcast")[index // 4 % 2]))
    return cases


def case_plans(case: Case) -> tuple[StateMeta, ReshardPlan, ReshardPlan]:
    model, families, shape_a, ranks_a, shape_b, ranks_b, _ = case
    source, target = meta(model, shape_a, ranks_a, families), meta(model, shape_b, ranks_b, families)
    return source, plan_reshard(source, target), plan_reshard(target, source)


def _round_trip_worker(rank: int, world_size: int, cases: list[Case]) -> list[tuple[bool, bool, int | None, int, int]]:
    results = []
    for number, case in enumerate(cases):
        source, there, back = case_plans(case)
        logical = random_logical_state(source, SEED + number)
        start = cut(source, logical, rank) if rank in source.boxes else {}
        step = 100 + number if rank in source.boxes else None
        middle = execute(there, rank, start, step, method=case[-1])  # type: ignore[arg-type]
        expected = cut(there.target, logical, rank) if rank in there.target.boxes else {}
        middle_ok = middle.tensors.keys() == expected.keys() and all(
            torch.equal(middle.tensors[key], expected[key]) for key in expected
        )
        end = execute(back, rank, middle.tensors, middle.step, method=case[-1])  # type: ignore[arg-type]
        end_ok = end.tensors.keys() == start.keys() and all(torch.equal(end.tensors[key], start[key]) for key in start)
        results.append((middle_ok, end_ok, end.step, middle.bytes_received, end.bytes_sent))
    return results


@pytest.mark.multiprocess
@pytest.mark.slow
def test_reshard_there_and_back_is_bitwise_over_many_layout_pairs() -> None:
    cases = reshard_cases()
    per_rank = spawn(_round_trip_worker, WORLD, cases)
    for number, case in enumerate(cases):
        source, there, back = case_plans(case)
        outcomes = [per_rank[rank][number] for rank in range(WORLD)]
        assert all(middle_ok for middle_ok, *_ in outcomes), case
        assert all(end_ok for _, end_ok, *_ in outcomes), case
        assert all(outcomes[rank][2] == 100 + number for rank in source.layout.ranks), case
        # The executor moves exactly what the plan says, and the plan meets the bound.
        assert sum(outcome[3] for outcome in outcomes) == there.bytes_moved == there.lower_bound, case
        assert sum(outcome[4] for outcome in outcomes) == back.bytes_moved == back.lower_bound, case

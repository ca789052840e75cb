"""The local-DAG builders take array passes over many replicas and per-replica passes over
a few (`ARRAY_MIN_REPLICAS`): both must build the very same primitives."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.solver.transition import local
from nereus.solver.transition.primitives import Primitive

pytestmark = pytest.mark.logic

_LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (4, 2), (2, 4), (8, 1), (1, 4)]


def _fields(primitives: list[Primitive]) -> list[tuple[object, ...]]:
    """Every field a builder sets, dict order included, and the seeded GPU set."""
    return [(*p, list(p.alloc), list(p.free), p.gpus) for p in primitives]


def _side(rng: random.Random, layout: tuple[int, int], num_replicas: int, pool: list[int]) -> local.Replicas:
    """`num_replicas` replicas of `layout` on distinct GPUs drawn from `pool`."""
    size = layout[0] * layout[1]
    gpus = rng.sample(pool, size * num_replicas)
    return layout, [tuple(gpus[i * size : (i + 1) * size]) for i in range(num_replicas)]


@st.composite
def _pairs(draw: st.DrawFn) -> tuple[local.Replicas, local.Replicas, int | None, bool]:
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    layout_a, layout_b = draw(st.sampled_from(_LAYOUTS)), draw(st.sampled_from(_LAYOUTS))
    num_a, num_b = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    # A small pool makes A and B share GPUs: replicas partly in place, partly moved.
    width = max(layout_a[0] * layout_a[1] * num_a, layout_b[0] * layout_b[1] * num_b)
    pool = list(range(width + draw(st.integers(0, width))))
    star_rounds = draw(st.sampled_from([None, local.STAR_ROUNDS]))
    return _side(rng, layout_a, num_a, pool), _side(rng, layout_b, num_b, pool), star_rounds, draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(_pairs())
def test_array_and_per_replica_passes_build_the_same_dag(
    pair: tuple[local.Replicas, local.Replicas, int | None, bool],
) -> None:
    side_a, side_b, star_rounds, unswap = pair
    built = []
    for array_min in (1, 10**9):  # every pass over arrays, then none
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(local, "ARRAY_MIN_REPLICAS", array_min)
            dag = local.replica_dag("x/training", 96.0, side_a, side_b, 3, star_rounds, unswap, node_size=4)
        built.append(_fields(dag))
    assert built[0] == built[1]


def test_all_sub_gpus_is_sub_gpus_of_each() -> None:
    rng = random.Random(7)
    for layout, inter in [((4, 2), (2, 1)), ((8, 4), (2, 2)), ((2, 6), (1, 3)), ((4, 16), (4, 8))]:
        _, replicas = _side(rng, layout, 5, list(range(1024)))
        expected = [sub for gpus in replicas for sub in local.sub_gpus(gpus, layout, inter)]
        assert local._all_sub_gpus(replicas, layout, inter) == expected

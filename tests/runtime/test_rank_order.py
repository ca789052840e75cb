"""A layout's coordinates follow its process groups' rank order, whatever order its ranks come in.

torch orders a process group's ranks ascending and DTensor, FSDP2 and every gather put group
rank i's part at coordinate i. A layout given its ranks in another order (an EMU listed
downwards, a transition's result) once computed wrong logits, log-probs and ZeRO-1 rows: these
tests hold the invariant (logic) and the outcome (2 ranks: a reversed layout computes what the
ascending one does).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.engine import Engine, EngineConfig
from nereus.runtime.model.initialization import init_logical_params
from nereus.runtime.state.shard_layout import RankLayout
from nereus.spec.presets import MODELS
from tests.runtime.test_runtime_parallel import OPTIMIZER, make_batches, objective_for

TINY = MODELS["tiny"]


def _groups(layout: RankLayout) -> list[list[int]]:
    """Every tp, cp and dp group of the layout, each in coordinate order."""
    at = layout.rank_at
    dims = range(layout.dp), range(layout.pp), range(layout.cp), range(layout.tp)
    tp = [[at(d, s, r, c) for r in dims[3]] for d in dims[0] for s in dims[1] for c in dims[2]]
    cp = [[at(d, s, r, c) for c in dims[2]] for d in dims[0] for s in dims[1] for r in dims[3]]
    dp = [[at(d, s, r, c) for d in dims[0]] for s in dims[1] for c in dims[2] for r in dims[3]]
    return tp + cp + dp


@pytest.mark.logic
@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([(1, 1, 1, 2), (2, 1, 1, 1), (2, 2, 1, 2), (1, 2, 2, 2), (2, 1, 2, 2), (1, 3, 1, 2), (2, 1, 3, 1)]),
    st.randoms(use_true_random=False),
)
def test_every_group_is_in_ascending_rank_order(dims: tuple[int, int, int, int], rng) -> None:
    """Replicas are shuffled whole (stage by stage, so no stages interleave) and every
    (replica, stage)'s ranks shuffled inside: each tp, cp and dp group comes out ascending, each
    stage keeps its ranks and each replica its rank set."""
    tp, pp, cp, dp = dims
    block = tp * cp
    ranks = list(range(tp * pp * cp * dp))
    replicas = [[ranks[(s * dp + d) * block : (s * dp + d + 1) * block] for s in range(pp)] for d in range(dp)]
    rng.shuffle(replicas)
    for replica in replicas:
        for stage in replica:
            rng.shuffle(stage)
    given_ranks = tuple(rank for replica in replicas for stage in replica for rank in stage)
    layout = RankLayout(tp, pp, dp, given_ranks, cp)
    assert layout.shards_in_group_order
    for group in _groups(layout):
        assert group == sorted(group), (given_ranks, layout.ranks)
    size = layout.replica_size
    given_sets = sorted(sorted(r for stage in replica for r in stage) for replica in replicas)
    assert sorted(sorted(layout.ranks[d * size : (d + 1) * size]) for d in range(dp)) == given_sets


@pytest.mark.logic
def test_a_pipeline_keeps_its_direction_and_interleaved_replicas_are_named() -> None:
    assert RankLayout(1, 2, 1, (1, 0)).ranks == (1, 0)  # the critic of the fused schedule runs 1 -> 0
    assert RankLayout(2, 2, 1, (3, 2, 1, 0)).ranks == (2, 3, 0, 1)
    assert RankLayout(1, 1, 2, (1, 0)).shards_in_group_order
    interleaved = RankLayout(1, 2, 2, (0, 3, 1, 2))  # replica 0 below replica 1 at stage 0, above at stage 1
    assert interleaved.ranks == (0, 3, 1, 2) and not interleaved.shards_in_group_order
    # cp: a position's dp x cp ranks must ascend replica-major (replica 0's cp ranks first)
    assert RankLayout(1, 1, 2, (0, 1, 2, 3), cp=2).shards_in_group_order
    crossed = RankLayout(1, 1, 2, (0, 2, 1, 3), cp=2)  # each replica's cp ranks ascend, but 2 > 1
    assert not crossed.shards_in_group_order
    assert [crossed.shard_index(r) for r in (0, 2, 1, 3)] == [0, 1, 2, 3]


def _reversed_worker(rank: int, world: int) -> dict[str, float]:
    logical = init_logical_params(TINY, "lm", seed=3)
    layouts = {
        "tp": lambda ranks: RankLayout(2, 1, 1, ranks),
        "cp": lambda ranks: RankLayout(1, 1, 1, ranks, cp=2),
        "dp-zero1": lambda ranks: RankLayout(1, 1, 2, ranks),
    }
    errors = {}
    for case, make in layouts.items():
        out = []
        for ranks in ((0, 1), (1, 0)):
            engine = Engine.create(TINY, "lm", make(ranks), EngineConfig(optimizer=OPTIMIZER, shard_across_dp=True))
            assert engine is not None
            engine.load_logical_params(logical)
            batch = make_batches("lm", 1)[0]
            rows = batch.tokens.shape[0]
            if case == "dp-zero1":
                half = rows // 2
                batch = batch.rows(0, half) if engine.groups.replica == 0 else batch.rows(half, rows)
            log_probs = engine.log_probs(batch, 1)
            engine.zero_grad()
            loss = engine.forward_backward(batch, objective_for("lm"), 1, None)
            engine.update()
            out.append((log_probs, loss, engine.whole_state(("param", "exp_avg"))))
        (lp_a, loss_a, state_a), (lp_b, loss_b, state_b) = out
        errors[f"{case} loss"] = abs(loss_a - loss_b)
        errors[f"{case} state"] = max(float((state_a[k] - state_b[k]).abs().max()) for k in state_a)
        if case != "dp-zero1":
            errors[f"{case} log-probs"] = float((lp_a - lp_b).abs().max())
    return errors


@pytest.mark.multiprocess
def test_a_layout_given_its_ranks_downwards_computes_what_the_ascending_one_does() -> None:
    for errors in spawn(_reversed_worker, 2):
        assert errors and all(error == 0.0 for error in errors.values()), errors

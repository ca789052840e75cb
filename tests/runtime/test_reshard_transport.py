"""The resharder's transports: same-host shared memory, process-group messages, the
automatic choice between them per pair of ranks, and resharding into caller buffers.

One spawned 4-rank gloo world runs every case A -> B -> A on both transports, once with
all ranks on one host and once with the ranks split over two pretend hosts (ranks 0-1
and 2-3 get different host tokens), where same-host pairs must share memory and the
others must fall back to gloo messages, bitwise identical either way. A third pass runs
"auto" with state arenas on every rank but rank 2: pieces a same-host peer sends from its
arena must be read straight out of it, rank 2's must still be staged.
"""

from __future__ import annotations

import os

import pytest
import torch

from nereus.runtime.comm import arena, shm
from nereus.runtime.comm.spawn import STREAMING_COPY_TUNABLE, TUNABLES_ENV, spawn
from nereus.runtime.state.reshard import execute
from nereus.runtime.state.reshard_plan import Hop, ReshardPlan, broadcast_rounds, plan_reshard
from nereus.runtime.state.shard_layout import STATE_FAMILIES, RankLayout
from nereus.runtime.state.sharded_state import StateMeta, cut, random_logical_state, state_meta
from nereus.spec.presets import MODELS

pytestmark = pytest.mark.one_rank

WORLD = 4
SEED = 11
TRANSPORTS = ("auto", "process_group")
#: Transports the world runs with: the two above, then "auto" with arenas (ARENA_RANKS).
MODES = (*TRANSPORTS, "auto+arena")
ARENA_RANKS = (0, 1, 3)
#: Host of every rank: all on one, or split in two.
HOSTS = {"one host": (0, 0, 0, 0), "two hosts": (0, 0, 1, 1)}

Case = tuple[str, tuple[str, ...], tuple[int, int, int], tuple[int, ...], tuple[int, int, int], tuple[int, ...], str]
CASES: list[Case] = [
    ("tiny", STATE_FAMILIES, (2, 1, 1), (0, 1), (1, 2, 1), (0, 1), "p2p"),
    ("tiny", STATE_FAMILIES, (2, 1, 1), (0, 1), (1, 1, 2), (0, 1), "p2p"),  # strided column pieces
    ("tiny", STATE_FAMILIES, (1, 2, 1), (0, 1), (2, 1, 2), (0, 1, 2, 3), "p2p"),  # grows onto the other host
    ("tiny", ("param",), (1, 1, 1), (1,), (1, 1, 4), (0, 1, 2, 3), "broadcast"),  # fan-out relayed across hosts
    ("tiny-wide", STATE_FAMILIES, (4, 1, 1), (0, 1, 2, 3), (2, 2, 1), (3, 2, 1, 0), "p2p"),
    ("tiny-wide", STATE_FAMILIES, (2, 2, 1), (2, 3, 0, 1), (1, 4, 1), (0, 1, 2, 3), "broadcast"),
]


def meta(model: str, shape: tuple[int, int, int], ranks: tuple[int, ...], families=STATE_FAMILIES) -> StateMeta:
    return state_meta(MODELS[model], "lm", RankLayout(*shape, ranks), families)


def case_plans(case: Case) -> tuple[StateMeta, ReshardPlan, ReshardPlan]:
    model, families, shape_a, ranks_a, shape_b, ranks_b, _ = case
    source, target = meta(model, shape_a, ranks_a, families), meta(model, shape_b, ranks_b, families)
    return source, plan_reshard(source, target), plan_reshard(target, source)


def hops(plan: ReshardPlan, method: str) -> list[Hop]:
    if method == "p2p":
        return [(None, transfer) for transfer in plan.moved()]
    return [hop for hops in broadcast_rounds(plan) for hop in hops]


def shared_bytes(
    plan: ReshardPlan, method: str, hosts: tuple[int, ...], senders: tuple[int, ...] = (0, 1, 2, 3)
) -> int:
    """Bytes that must go through shared memory (from `senders`): every hop between two ranks of one host."""
    total = 0
    for got, transfer in hops(plan, method):
        sender = transfer.src if got is None else got.dst
        total += transfer.nbytes if hosts[sender] == hosts[transfer.dst] and sender in senders else 0
    return total


def _pretend_host(host: int) -> None:
    shm._HOST_TOKEN = bytes([host + 1]) * shm.TOKEN_BYTES


Outcome = tuple[bool, bool, int, int, int, int, int]


def _transport_worker(rank: int, world_size: int) -> tuple[dict[tuple[str, str, int], Outcome], list[str]]:
    outcomes = {}
    for hosts_name, hosts in HOSTS.items():
        _pretend_host(hosts[rank])
        for mode in MODES:
            if mode == "auto+arena" and rank in ARENA_RANKS:
                arena.reserve(1 << 20)  # smaller than some states: the arena must grow
            arena.connect()
            for number, case in enumerate(CASES):
                outcomes[(hosts_name, mode, number)] = _there_and_back(rank, case, number, mode)
            arena.release()
    leftovers = sorted(path.name for path in shm.SHM_ROOT.glob(f"nereus-{os.getpid()}-*"))
    return outcomes, leftovers


def _there_and_back(rank: int, case: Case, number: int, mode: str) -> Outcome:
    source, there, back = case_plans(case)
    logical = random_logical_state(source, SEED + number)
    start = cut(source, logical, rank) if rank in source.boxes else {}
    state_arena = arena.current()
    if state_arena is not None:
        start = {key: state_arena.copy(tensor) for key, tensor in start.items()}
    step = 7 + number if rank in source.boxes else None
    method, transport = case[-1], mode.removesuffix("+arena")
    middle = execute(there, rank, start, step, method=method, transport=transport)  # type: ignore[arg-type]
    expected = cut(there.target, logical, rank) if rank in there.target.boxes else {}
    middle_ok = middle.tensors.keys() == expected.keys() and all(
        torch.equal(middle.tensors[key], expected[key]) for key in expected
    )
    end = execute(back, rank, middle.tensors, middle.step, method=method, transport=transport)  # type: ignore[arg-type]
    end_ok = end.tensors.keys() == start.keys() and all(torch.equal(end.tensors[key], start[key]) for key in start)
    end_ok &= end.step == step
    received = middle.bytes_received + end.bytes_received
    shared = middle.bytes_received_shared_memory, end.bytes_received_shared_memory
    return middle_ok, end_ok, received, *shared, middle.bytes_received_direct, end.bytes_received_direct


@pytest.mark.multiprocess
@pytest.mark.slow
def test_both_transports_reshard_there_and_back_bitwise_and_pick_shared_memory_per_host() -> None:
    per_rank = spawn(_transport_worker, WORLD)
    for hosts_name, hosts in HOSTS.items():
        for mode in MODES:
            for number, case in enumerate(CASES):
                _, there, back = case_plans(case)
                outcomes = [per_rank[rank][0][(hosts_name, mode, number)] for rank in range(WORLD)]
                label = (hosts_name, mode, case)
                assert all(outcome[0] and outcome[1] for outcome in outcomes), label
                assert sum(outcome[2] for outcome in outcomes) == there.bytes_moved + back.bytes_moved, label
                via_shm, direct = ([sum(outcome[i + j] for outcome in outcomes) for j in (0, 1)] for i in (3, 5))
                method = case[-1]
                if mode == "process_group":
                    assert via_shm == direct == [0, 0], label
                    continue
                assert via_shm == [shared_bytes(there, method, hosts), shared_bytes(back, method, hosts)], label
                senders = ARENA_RANKS if mode == "auto+arena" else ()
                expected = [shared_bytes(plan, method, hosts, senders) for plan in (there, back)]
                assert direct == expected, label
    # The split-host cases really mix both paths, arena runs mix direct and staged pieces,
    # and no segment file is left behind.
    assert 0 < shared_bytes(case_plans(CASES[2])[1], "p2p", HOSTS["two hosts"]) < case_plans(CASES[2])[1].bytes_moved
    there = case_plans(CASES[4])[1]
    assert (
        0 < shared_bytes(there, "p2p", HOSTS["one host"], ARENA_RANKS) < shared_bytes(there, "p2p", HOSTS["one host"])
    )
    assert all(leftovers == [] for _, leftovers in per_rank)


# --- pooled segments and caller buffers (one 2-rank world) ------------------------------


def _full_shared_memory(peer: int, nonce: bytes, nbytes: int) -> shm.Segment:
    raise OSError(28, "No space left on device")


def _reuse_worker(rank: int, world_size: int) -> dict[str, object]:
    # Every contiguous piece through libc's memmove here (the other world keeps torch's copy for small ones).
    shm.BULK_COPY_BYTES = 64
    source, target = meta("tiny", (2, 1, 1), (0, 1)), meta("tiny", (1, 1, 2), (0, 1))
    plan = plan_reshard(source, target)
    logical = random_logical_state(source, SEED)
    start, expected = cut(source, logical, rank), cut(target, logical, rank)
    first = execute(plan, rank, start, 3)
    pool_after_first = shm.pooled()
    # A repeated reshard into the previous result: the same segments, the same tensors, no new memory.
    previous = {key: tensor.clone().zero_() for key, tensor in first.tensors.items()}
    again = execute(plan, rank, start, 3, out=previous)
    in_place = all(again.tensors[key] is previous[key] for key in previous)
    equal = all(torch.equal(again.tensors[key], expected[key]) for key in expected)
    pool_after_again = shm.pooled()
    # A bigger reshard (all three families of the wider model) grows the segments; releasing drops them.
    wide_source, wide_target = meta("tiny-wide", (2, 1, 1), (0, 1)), meta("tiny-wide", (1, 1, 2), (0, 1))
    wide = cut(wide_source, random_logical_state(wide_source, SEED), rank)
    execute(plan_reshard(wide_source, wide_target), rank, wide, 3)
    pool_after_growth = shm.pooled()
    shm.release_segments()
    released = shm.pooled()
    after_release = execute(plan, rank, start, 3)
    # Arenas on both ranks, but rank 1 cannot map rank 0's (another PID namespace, say): rank 0
    # must stage what it sends to rank 1, while rank 1's pieces are read straight out of its arena.
    arena.reserve(1 << 20)
    if rank == 1:
        arena._peer_chunk = _unmappable  # type: ignore[assignment]
    readable_sources = arena.connect()
    in_arena = {key: arena.current().copy(tensor) for key, tensor in start.items()}  # type: ignore[union-attr]
    one_way = execute(plan, rank, in_arena, 3)
    arena.release()
    # Rank 0 cannot make a segment (a full /dev/shm): its pieces fall back to gloo messages.
    if rank == 0:
        shm.outgoing_segment = _full_shared_memory
    full = execute(plan, rank, start, 3)
    return {
        "one_way_ok": all(torch.equal(one_way.tensors[key], expected[key]) for key in expected),
        "one_way": (readable_sources, one_way.bytes_received_direct, one_way.bytes_received_shared_memory),
        "full_ok": all(torch.equal(full.tensors[key], expected[key]) for key in expected),
        "full_shared": (full.bytes_received_shared_memory, full.bytes_received),
        "first_ok": all(torch.equal(first.tensors[key], expected[key]) for key in expected),
        "again_ok": in_place and equal,
        "pool": (pool_after_first, pool_after_again, pool_after_growth, released),
        "after_release_ok": all(torch.equal(after_release.tensors[key], expected[key]) for key in expected),
        "shared": first.bytes_received_shared_memory == first.bytes_received > 0,
    }


def _unmappable(*args: object) -> torch.Tensor:
    raise PermissionError(13, "Permission denied")


@pytest.mark.multiprocess
def test_segments_are_pooled_out_buffers_filled_in_place_and_a_full_dev_shm_falls_back() -> None:
    outcomes = spawn(_reuse_worker, 2)
    # Rank 0 reads rank 1's arena directly; rank 1 could not map rank 0's, so it got staged pieces.
    (sources_0, direct_0, shared_0), (sources_1, direct_1, shared_1) = (outcome["one_way"] for outcome in outcomes)
    assert sources_0 == {1} and direct_0 == shared_0 > 0
    assert sources_1 == set() and direct_1 == 0 < shared_1
    for outcome in outcomes:
        assert outcome["one_way_ok"]
        assert outcome["first_ok"] and outcome["again_ok"] and outcome["after_release_ok"] and outcome["shared"]
        first, again, grown, released = outcome["pool"]
        assert len(first) == 2 and again == first  # one staging and one reading segment, reused
        assert all(new[1] > old[1] for new, old in zip(grown, first, strict=True))
        assert {name for name, _ in grown}.isdisjoint(name for name, _ in first)
        assert released == []
        assert outcome["full_ok"]
    # Rank 1 gets its pieces from rank 0, who had no segment; rank 0 still reads rank 1's segment.
    (shared_0, received_0), (shared_1, received_1) = (outcome["full_shared"] for outcome in outcomes)
    assert shared_0 == received_0 > 0 and shared_1 == 0 < received_1


# --- checks that need no process group --------------------------------------------------


def test_out_is_checked_before_anything_moves() -> None:
    source, target = meta("tiny", (1, 1, 1), (0,)), meta("tiny", (2, 1, 1), (0, 1))
    plan = plan_reshard(source, target)
    tensors = cut(source, random_logical_state(source, SEED), 0)
    fresh = {key: torch.empty_like(tensor) for key, tensor in cut(target, random_logical_state(target, 0), 0).items()}
    key = next(key for key, tensor in fresh.items() if tensor.shape != tensors[key].shape)
    aliased = {**fresh, key: tensors[key][tuple(slice(0, n) for n in fresh[key].shape)]}
    with pytest.raises(ValueError, match=f"out\\['{key}'\\] shares memory with the source tensor"):
        execute(plan, 0, tensors, 1, out=aliased)
    with pytest.raises(ValueError, match="has shape"):
        execute(plan, 0, tensors, 1, out={**fresh, key: torch.empty(3)})
    with pytest.raises(ValueError, match="is missing"):
        execute(plan, 0, tensors, 1, out={k: v for k, v in fresh.items() if k != key})
    with pytest.raises(ValueError, match="disagree"):
        execute(plan, 0, tensors, 1, out=fresh, device=torch.device("meta"))


def test_a_kept_tensor_may_be_its_own_out_buffer_and_nothing_moves() -> None:
    source = meta("tiny", (1, 1, 1), (0,))
    tensors = cut(source, random_logical_state(source, SEED), 0)
    result = execute(plan_reshard(source, source), 0, tensors, 5, out=dict(tensors))
    assert all(result.tensors[key] is tensors[key] for key in tensors)
    assert (result.step, result.bytes_sent, result.bytes_received) == (5, 0, 0)


def test_host_tokens_match_on_one_host_and_private_tokens_match_nothing() -> None:
    assert shm.host_token() == shm.host_token() and len(shm.host_token()) == shm.TOKEN_BYTES
    assert shm.private_token() != shm.private_token() != shm.host_token()
    name = f"nereus-{os.getpid()}-3-0123456789abcdef"
    assert shm.decode_name(shm.encode_name(name)) == name and len(shm.encode_name(name)) == shm.NAME_BYTES
    assert [shm.aligned(n) for n in (0, 1, 64, 65)] == [0, 64, 64, 128]


@pytest.mark.parametrize(
    ("dtype", "numel"),
    [(torch.float32, (shm.BULK_COPY_BYTES // 4) + 3), (torch.bfloat16, shm.BULK_COPY_BYTES), (torch.int64, 100)],
)
def test_copy_bulk_equals_copy_for_views_at_offsets_and_strided_or_mixed_pieces(dtype: torch.dtype, numel: int) -> None:
    generator = torch.Generator().manual_seed(SEED)
    source = torch.randint(-1000, 1000, (numel + 9,), generator=generator).to(dtype)
    target = torch.zeros(numel + 5, dtype=dtype)
    shm.copy_bulk(target[5:], source[9:])  # contiguous views that start inside their storage
    assert torch.equal(target[5:], source[9:]) and torch.equal(target[:5], torch.zeros(5, dtype=dtype))
    wide = torch.zeros(2 * numel, dtype=dtype).view(numel, 2)
    shm.copy_bulk(wide[:, 1], source[:numel])  # strided destination: torch's copy
    assert torch.equal(wide[:, 1], source[:numel]) and not wide[:, 0].any()
    floats = torch.zeros(numel, dtype=torch.float64)
    shm.copy_bulk(floats, source[:numel])  # another dtype: converted, as copy_ does
    assert torch.equal(floats, source[:numel].to(torch.float64))


def _tunables_worker(rank: int, world_size: int) -> str | None:
    return os.environ.get(TUNABLES_ENV)


@pytest.mark.multiprocess
def test_ranks_stream_bulk_copies_unless_the_user_set_glibc_tunables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TUNABLES_ENV, raising=False)
    assert spawn(_tunables_worker, 1) == [STREAMING_COPY_TUNABLE]
    assert TUNABLES_ENV not in os.environ  # the launcher's environment is restored
    monkeypatch.setenv(TUNABLES_ENV, "glibc.malloc.arena_max=2")
    assert spawn(_tunables_worker, 1) == ["glibc.malloc.arena_max=2"]

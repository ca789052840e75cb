"""Checkpoints: save at one layout, load at another bitwise; atomic saves; damaged ones refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from nereus.errors import NereusError
from nereus.runtime.comm.spawn import spawn
from nereus.runtime.state.checkpoint import (
    load_checkpoint,
    save_checkpoint,
    save_checkpoint_distributed,
    verify_checkpoint,
)
from nereus.runtime.state.checkpoint_index import INDEX_NAME, read_index
from nereus.runtime.state.shard_layout import STATE_FAMILIES, RankLayout, box_numel
from nereus.runtime.state.sharded_state import StateMeta, cut, gather, random_logical_state, state_meta
from nereus.spec.presets import MODELS

pytestmark = pytest.mark.one_rank

SEED = 11


def meta(model: str, tp: int, pp: int, dp: int, ranks: tuple[int, ...] | None = None, families=STATE_FAMILIES):
    ranks = tuple(range(tp * pp * dp)) if ranks is None else ranks
    return state_meta(MODELS[model], "lm", RankLayout(tp, pp, dp, ranks), families)


def saved(tmp_path: Path, source: StateMeta, step: int = 3) -> tuple[Path, dict[str, torch.Tensor]]:
    logical = random_logical_state(source, SEED)
    path = tmp_path / "ckpt"
    save_checkpoint(path, source, {rank: cut(source, logical, rank) for rank in source.layout.ranks}, step)
    return path, logical


def load_all(path: Path, layout: RankLayout, **options) -> tuple[StateMeta, dict[int, dict[str, torch.Tensor]]]:
    loaded = {rank: load_checkpoint(path, layout, rank, **options) for rank in layout.ranks}
    return loaded[layout.ranks[0]].meta, {rank: state.tensors for rank, state in loaded.items()}


PAIRS = [
    ("tiny", (2, 2, 2), (1, 1, 1)),
    ("tiny", (1, 1, 1), (4, 2, 1)),
    ("tiny", (1, 4, 2), (2, 1, 3)),
    ("tiny-wide", (8, 1, 1), (1, 8, 1)),
    ("tiny-wide", (2, 2, 2), (4, 1, 2)),
    ("tiny-wide", (1, 2, 4), (8, 1, 1)),
]


@pytest.mark.parametrize(("model", "saved_shape", "loaded_shape"), PAIRS)
def test_saved_at_one_layout_loads_bitwise_at_another(tmp_path: Path, model: str, saved_shape, loaded_shape) -> None:
    source = meta(model, *saved_shape)
    path, logical = saved(tmp_path, source, step=17)
    # Every distinct box is stored once: the shards hold exactly the logical state.
    index = read_index(path)
    stored = sum(box_numel(tuple(entry.box)) for shard in index.shards for entry in shard.entries)
    assert stored == sum(tensor.numel() for tensor in logical.values())
    size = loaded_shape[0] * loaded_shape[1] * loaded_shape[2]
    target_layout = RankLayout(*loaded_shape, tuple(reversed(range(5, 5 + size))))
    target, states = load_all(path, target_layout)
    back = gather(target, states)
    assert back.keys() == logical.keys()
    assert all(torch.equal(back[key], logical[key]) for key in logical)
    assert load_checkpoint(path, target_layout, target_layout.ranks[0]).step == 17


@pytest.mark.parametrize("loaded_shape", [(2, 2, 2), (1, 1, 1), (4, 1, 2)])
def test_zero1_rows_are_indexed_verified_and_load_bitwise_into_any_layout(tmp_path: Path, loaded_shape) -> None:
    """Moments split across dp=2 replicas (ZeRO-1) are stored as each replica's rows; the index
    names the split families, so the rows verify and load bitwise into any layout."""
    sharded = ("exp_avg", "exp_avg_sq")
    source = state_meta(MODELS["tiny"], "lm", RankLayout(2, 2, 2, tuple(range(8))), STATE_FAMILIES, dp_sharded=sharded)
    path, logical = saved(tmp_path, source)
    assert verify_checkpoint(path).dp_sharded == list(sharded)
    index = read_index(path)
    stored = sum(box_numel(tuple(entry.box)) for shard in index.shards for entry in shard.entries)
    assert stored == sum(tensor.numel() for tensor in logical.values())
    size = loaded_shape[0] * loaded_shape[1] * loaded_shape[2]
    target, states = load_all(path, RankLayout(*loaded_shape, tuple(range(3, 3 + size))))
    back = gather(target, states)
    assert back.keys() == logical.keys()
    assert all(torch.equal(back[key], logical[key]) for key in logical)


def test_an_index_without_zero1_rows_is_written_as_before(tmp_path: Path) -> None:
    path, _ = saved(tmp_path, meta("tiny", 1, 1, 2))
    assert "dp_sharded" not in (path / INDEX_NAME).read_text()
    assert read_index(path).dp_sharded == []


def test_a_subset_of_families_loads_and_only_the_needed_tensors_are_read(tmp_path: Path) -> None:
    source = meta("tiny", 1, 4, 1)
    path, logical = saved(tmp_path, source)
    layout = RankLayout(1, 4, 1, (0, 1, 2, 3))
    loaded = load_checkpoint(path, layout, 1, families=("param",))
    assert set(loaded.tensors) == {key for key in source.rank_boxes(1) if key.startswith("param/")}
    assert all(torch.equal(tensor, logical[key]) for key, tensor in loaded.tensors.items())
    # Stage 1 of 4 reads only its own layer's params, not the whole checkpoint.
    assert loaded.bytes_read == sum(tensor.numel() * 4 for tensor in loaded.tensors.values())
    assert load_checkpoint(path, layout, 9).tensors == {}


def test_save_is_atomic_and_never_overwrites(tmp_path: Path) -> None:
    source = meta("tiny", 2, 1, 1, families=("param",))
    path, logical = saved(tmp_path, source)
    with pytest.raises(NereusError, match="already exists"):
        save_checkpoint(path, source, {rank: cut(source, logical, rank) for rank in (0, 1)}, 4)
    states = {rank: cut(source, logical, rank) for rank in (0, 1)}
    states[1]["param/final_norm.weight"] = torch.zeros(7)
    with pytest.raises(ValueError, match="has shape"):
        save_checkpoint(tmp_path / "other", source, states, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no half-written folder left
    with pytest.raises(NereusError, match="no such folder"):
        save_checkpoint(tmp_path / "absent" / "ckpt", source, states, 4)


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def first_shard(path: Path) -> Path:
    return path / read_index(path).shards[0].file


def edit_index(path: Path, change) -> None:
    raw = json.loads((path / INDEX_NAME).read_text())
    change(raw)
    (path / INDEX_NAME).write_text(json.dumps(raw))


DAMAGE = {
    "flipped data byte": (lambda p: flip_byte(first_shard(p), -5), "fails its CRC-32 check"),
    "flipped header byte": (lambda p: flip_byte(first_shard(p), 12), "shard is corrupted"),
    "truncated shard": (lambda p: os.truncate(first_shard(p), 1000), "truncated"),
    "deleted shard": (lambda p: first_shard(p).unlink(), "missing shard"),
    "edited step": (lambda p: edit_index(p, lambda raw: raw.update(step=99)), "checksum mismatch"),
    "edited box": (
        lambda p: edit_index(p, lambda raw: raw["shards"][0]["entries"][0]["box"][0].__setitem__(1, 3)),
        "checksum mismatch",
    ),
    "broken json": (lambda p: (p / INDEX_NAME).write_text("{ not json"), "not valid JSON"),
    "deleted index": (lambda p: (p / INDEX_NAME).unlink(), "not a finished nereus checkpoint"),
    "unknown index field": (lambda p: edit_index(p, lambda raw: raw.update(extra=1)), "extra"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_refused_with_a_one_line_error(tmp_path: Path, damage: str) -> None:
    source = meta("tiny", 2, 2, 1)
    path, _ = saved(tmp_path, source)
    harm, message = DAMAGE[damage]
    harm(path)
    layout = RankLayout(1, 1, 1, (0,))  # one rank needs every stored tensor
    for check in (lambda: load_checkpoint(path, layout, 0), lambda: verify_checkpoint(path)):
        with pytest.raises(NereusError, match=message) as error:
            check()
        text = str(error.value)
        assert "\n" not in text and str(path) in text


FORGERIES = {
    "not a box of the saved layout": lambda entries: entries.__setitem__(
        0, entries[0].model_copy(update={"box": [(0, 3), (0, 64)]})
    ),
    "stored twice": lambda entries: entries.append(entries[0]),
    "do not hold all": lambda entries: entries.pop(0),
}


@pytest.mark.parametrize("problem", sorted(FORGERIES))
def test_a_forged_index_with_a_valid_checksum_is_still_checked(tmp_path: Path, problem: str) -> None:
    from nereus.runtime.state.checkpoint_index import CheckpointIndex, sealed_index

    path, _ = saved(tmp_path, meta("tiny", 2, 1, 1, families=("param",)))
    index = read_index(path)
    FORGERIES[problem](index.shards[0].entries)
    forged = sealed_index(CheckpointIndex.model_validate(index.model_dump()))
    (path / INDEX_NAME).write_text(forged.model_dump_json())
    with pytest.raises(NereusError, match=problem):
        read_index(path)


def test_a_mismatched_model_family_or_layout_is_refused(tmp_path: Path) -> None:
    path, _ = saved(tmp_path, meta("tiny", 1, 1, 1, families=("param",)))
    layout = RankLayout(1, 1, 1, (0,))
    with pytest.raises(NereusError, match="holds model tiny, not tiny-wide"):
        load_checkpoint(path, layout, 0, model=MODELS["tiny-wide"])
    with pytest.raises(NereusError, match="lm head, not a value head"):
        load_checkpoint(path, layout, 0, head="value")
    with pytest.raises(NereusError, match="has no exp_avg state"):
        load_checkpoint(path, layout, 0, families=("param", "exp_avg"))
    with pytest.raises(NereusError, match="cannot load"):
        load_checkpoint(path, RankLayout(1, 3, 1, (0, 1, 2)), 0)


# --- a real job: every rank writes its own shard ----------------------------------------


def _distributed_save_worker(rank: int, world_size: int, folder: str) -> tuple[bool, str]:
    source = meta("tiny", 2, 1, 2)
    logical = random_logical_state(source, SEED)
    path = Path(folder) / "ckpt"
    save_checkpoint_distributed(path, source, rank, cut(source, logical, rank), 5)
    target_layout = RankLayout(1, 2, 1, (3, 1))
    loaded = load_checkpoint(path, target_layout, rank)
    expected = cut(loaded.meta, logical, rank) if rank in target_layout.ranks else {}
    same = loaded.tensors.keys() == expected.keys() and all(
        torch.equal(loaded.tensors[k], expected[k]) for k in expected
    )
    try:
        save_checkpoint_distributed(path, source, rank, cut(source, logical, rank), 6)
    except NereusError as error:
        return same, str(error)
    return same, ""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_distributed_save_loads_into_another_layout(tmp_path: Path) -> None:
    outcomes = spawn(_distributed_save_worker, 4, str(tmp_path))
    assert all(same for same, _ in outcomes)
    assert all("already exists" in error for _, error in outcomes)  # every rank hears of the refusal
    index = verify_checkpoint(tmp_path / "ckpt")
    assert index.step == 5 and (index.tp, index.dp) == (2, 2)
    assert {shard.rank for shard in index.shards} == {0, 1, 2, 3}  # replicas share the writing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_rank_0_commits_only_shards_it_sees_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard another node reports written but the committing rank cannot see at full size
    (no shared storage, or a late network filesystem) stops the commit, naming the rank."""
    from nereus.runtime.state import checkpoint

    monkeypatch.setattr(checkpoint, "SHARD_VISIBLE_S", 0.2)
    record = checkpoint.ShardRecord(file="shard-00003.safetensors", rank=3, nbytes=8, crc32=0, entries=[])
    with pytest.raises(NereusError, match="rank 3 wrote it, but the committing rank does not see it whole"):
        checkpoint._check_visible(tmp_path, [record])
    (tmp_path / record.file).write_bytes(b"1234")  # half there
    with pytest.raises(NereusError, match="shard-00003"):
        checkpoint._check_visible(tmp_path, [record])
    (tmp_path / record.file).write_bytes(b"12345678")
    checkpoint._check_visible(tmp_path, [record])

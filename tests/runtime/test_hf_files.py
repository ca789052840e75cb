"""A Hugging Face folder's weights are checked against its config before anything loads:
a missing or truncated file, a missing tensor, a wrong shape: one error naming file and tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_helpers import as_hf_state, read_logical, runtime_name
from safetensors.torch import save_file

from nereus.errors import NereusError
from nereus.runtime.hf.files import check_weights
from nereus.runtime.hf.names import NAME_TABLE, hf_name
from nereus.runtime.model.initialization import init_logical_params
from nereus.runtime.state.shard_layout import param_infos
from nereus.spec.presets import MODELS

MODEL = MODELS["tiny"].model_copy(update={"num_layers": 2, "tied_embeddings": False, "qkv_bias": True})

pytestmark = pytest.mark.one_rank


def _save(folder: Path, sharded: bool) -> dict[str, torch.Tensor]:
    folder.mkdir()
    state = as_hf_state(init_logical_params(MODEL, "lm", seed=3, randomize_all=True))
    if not sharded:
        save_file(state, str(folder / "model.safetensors"))
        return state
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({name: state[name] for name in part}, str(folder / file))
    weight_map = {name: file for file, part in halves.items() for name in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return state


def test_every_runtime_name_round_trips_through_the_table() -> None:
    for info in param_infos(MODEL.model_copy(update={"qk_norm": True}), "lm") + param_infos(MODEL, "value"):
        assert runtime_name(hf_name(info.name)) == info.name
    assert len({theirs for _, theirs in NAME_TABLE}) == len(NAME_TABLE)
    assert runtime_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None


@pytest.mark.parametrize("sharded", [False, True])
def test_single_file_and_sharded_index_read_the_same(tmp_path: Path, sharded: bool) -> None:
    state = _save(tmp_path / "m", sharded)
    whole = read_logical(tmp_path / "m", MODEL, "lm")
    assert all(torch.equal(whole[runtime_name(name)], tensor) for name, tensor in state.items())  # type: ignore[index]


def test_missing_shard_file(tmp_path: Path) -> None:
    _save(tmp_path / "m", sharded=True)
    (tmp_path / "m" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(NereusError, match=r"model-00002-of-00002\.safetensors: cannot be read"):
        check_weights(tmp_path / "m", MODEL, "lm")


def test_truncated_file(tmp_path: Path) -> None:
    _save(tmp_path / "m", sharded=False)
    path = tmp_path / "m" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(NereusError, match=r"model\.safetensors: truncated: tensor .* ends past the end"):
        check_weights(tmp_path / "m", MODEL, "lm")


def test_wrong_shape_and_missing_tensor(tmp_path: Path) -> None:
    _save(tmp_path / "m", sharded=False)
    wider = MODEL.model_copy(update={"vocab_size": 128})  # a config whose vocabulary the weights lack
    with pytest.raises(NereusError, match=r"tensor model\.embed_tokens\.weight has shape \[64, 64\], config"):
        check_weights(tmp_path / "m", wider, "lm")
    deeper = MODEL.model_copy(update={"num_layers": 3})
    with pytest.raises(NereusError, match=r"tensor model\.layers\.2\.input_layernorm\.weight is missing"):
        check_weights(tmp_path / "m", deeper, "lm")


def test_no_weights_at_all(tmp_path: Path) -> None:
    with pytest.raises(NereusError, match=r"holds neither model\.safetensors nor"):
        check_weights(tmp_path, MODEL, "lm")


def test_a_value_head_may_be_missing_or_come_from_score(tmp_path: Path) -> None:
    _save(tmp_path / "m", sharded=False)
    assert "value_head.weight" not in check_weights(tmp_path / "m", MODEL, "value")

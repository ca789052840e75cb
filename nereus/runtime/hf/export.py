"""A run checkpoint's actor (or critic) as a Hugging Face folder.

The folder gets the input folder's config.json unchanged (a critic's names its
sequence-classification class and one label), the weights as safetensors in the dtype
each tensor had in the input (sharded with an index above `max_shard_bytes`), and every
other file of the input folder (tokenizer, generation config) copied. Weights stored in
float32 by the run and float32 in the input come back bitwise. It is written into a
temporary folder renamed into place: never half a folder.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from nereus.errors import NereusError
from nereus.runtime.hf.files import INDEX_FILE, SINGLE_FILE, checkpoint_tensors
from nereus.runtime.hf.names import hf_tensors
from nereus.runtime.state.checkpoint import load_checkpoint
from nereus.runtime.state.checkpoint_index import read_index
from nereus.runtime.state.shard_layout import RankLayout
from nereus.spec.hf_config import CONFIG_NAME

#: Shard size above which the weights are split over several files (transformers' default).
MAX_SHARD_BYTES = 5 * 10**9
#: Input files never copied: weights (the export writes its own) and pickled formats.
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
#: torch dtypes by safetensors dtype name (a constant table, never written).
_TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
#: Roles an export can write: what `nereus run` trains and starts from the folder (a constant table).
EXPORTED = {"actor": "lm", "critic": "value"}


@dataclass(frozen=True)
class Export:
    """What an export wrote."""

    folder: str
    checkpoint: str
    """The run checkpoint it read."""
    role: str
    num_tensors: int
    num_files: int
    """Safetensors files written."""
    copied: list[str]
    """Files copied from the input folder besides config.json."""


def run_checkpoint_and_source(run_dir: Path, step: int | None, role: str) -> tuple[Path, Path]:
    """The checkpoint folder of `run_dir` to export (step `step`, default the latest) and the
    Hugging Face folder `role` started from."""
    from nereus.spec.io import load_document
    from nereus.spec.plan import Plan
    from nereus.spec.run_folder import PLAN_NAME, checkpoint_folder, finished_checkpoints, latest_checkpoint

    checkpoint = latest_checkpoint(run_dir) if step is None else checkpoint_folder(run_dir, step)
    if checkpoint is None or not checkpoint.is_dir():
        steps = [path.name for path in finished_checkpoints(run_dir)]
        raise NereusError(
            f"{run_dir}: no checkpoint {'at all' if step is None else f'of step {step}'}"
            f" (it has {', '.join(steps) or 'none'}); run more steps or pick one of those"
        )
    plan_file = checkpoint / PLAN_NAME if (checkpoint / PLAN_NAME).is_file() else run_dir / PLAN_NAME
    plan = load_document(plan_file)
    assert isinstance(plan, Plan), plan_file
    if plan.weights is None or role not in plan.weights:
        raise NereusError(
            f"{plan_file}: weights: the run's {role} did not start from a Hugging Face folder; only such a "
            "model has a config.json and tokenizer to export with"
        )
    return checkpoint, Path(plan.weights[role])


def whole_params(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint, whole, by runtime name (one process)."""
    index = read_index(checkpoint)
    state = load_checkpoint(checkpoint, RankLayout(1, 1, 1, (0,)), 0, families=["param"]).tensors
    assert index.head in ("lm", "value")
    return {key.partition("/")[2]: tensor for key, tensor in state.items()}


def _config_text(source: Path, role: str) -> str:
    text = (source / CONFIG_NAME).read_text(encoding="utf-8")
    if role == "actor":
        return text
    config = json.loads(text)
    if any(name.endswith("ForSequenceClassification") for name in config.get("architectures", [])):
        return text  # the critic started from a value-head checkpoint: its config already says so
    # The critic is the same decoder with a one-output score head.
    kinds = [name.replace("ForCausalLM", "ForSequenceClassification") for name in config.get("architectures", [])]
    config.update(architectures=kinds, num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _write_weights(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> int:
    from safetensors.torch import save_file

    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, str(folder / SINGLE_FILE), metadata={"format": "pt"})
        return 1
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return len(shards)


def export_hf(
    checkpoint: Path, source: Path, out: Path, role: str = "actor", max_shard_bytes: int = MAX_SHARD_BYTES
) -> Export:
    """Write `role`'s model of a run checkpoint folder (step-N/) as a Hugging Face folder at
    `out`, taking config.json, dtypes and tokenizer files from `source`, the folder the run
    started from."""
    if role not in EXPORTED:
        raise NereusError(f"role: {role!r} cannot be exported; choose {' or '.join(EXPORTED)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise NereusError(f"{out}: already exists; give a new output folder")
    params = whole_params(checkpoint / role)
    input_dtypes = {name: entry.dtype for name, entry in checkpoint_tensors(source).items()}
    tensors = {}
    for name, whole in params.items():
        for key, tensor in hf_tensors(name, whole).items():
            tensors[key] = tensor.to(_TORCH_DTYPES[input_dtypes.get(key, "F32")]).contiguous()
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        (temporary / CONFIG_NAME).write_text(_config_text(source, role), encoding="utf-8")
        num_files = _write_weights(temporary, tensors, max_shard_bytes)
        copied = []
        for path in sorted(source.iterdir()):
            if path.is_file() and path.name not in (CONFIG_NAME, INDEX_FILE) and not path.name.endswith(_NOT_COPIED):
                shutil.copy2(path, temporary / path.name)
                copied.append(path.name)
        if out.exists():
            out.rmdir()
        temporary.rename(out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return Export(str(out), str(checkpoint), role, len(tensors), num_files, copied)

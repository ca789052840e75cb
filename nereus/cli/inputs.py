"""Resolving command-line names into documents: a preset name or a file path.

A value that names an existing file is read as that file; one that names nothing on disk
must be a preset, else one line says both (no such file or folder, and not a preset,
with the presets listed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from nereus.errors import NereusError
from nereus.spec.base import Document
from nereus.spec.cluster import Cluster
from nereus.spec.model import Model
from nereus.spec.workload import Workload

#: Most local ranks `--nproc` spawns on this machine (`nereus run`, `nereus profile`): one rank
#: per GPU or core of one host. Beyond it a run that plans for itself searched for minutes
#: (1,024 ranks: a minute) before it could spawn them.
MAX_LOCAL_RANKS = 256


def load_kind(path: str, kind: type[Document]) -> Document:
    """Load `path` and insist it is a `kind` document."""
    from nereus.spec.io import load_document

    document = load_document(path)
    if not isinstance(document, kind):
        raise NereusError(f"{path}: kind: expected {kind.__name__}, got {type(document).__name__}")
    return document


def preset_names(kind: type[Document]) -> str:
    """The presets of `kind`, as the one-line refusals list them."""
    from nereus.spec.presets import GPU_ALIASES, GPU_KINDS, MODELS, WORKLOAD_NAMES

    names = {
        Model: ", ".join(MODELS),
        Workload: ", ".join(WORKLOAD_NAMES),
        Cluster: f"{', '.join([*GPU_KINDS, *GPU_ALIASES])}, each optionally -NODESxGPUS",
    }
    return names[kind]


def preset_or_file(
    option: str, value: str, kind: type[Document], preset: Callable[[str], Document], folder_ok: bool = False
) -> Document:
    """`value` as a `kind` file when it names an existing file (a folder only when
    `folder_ok`: `preset` reads it), else as a preset; one line naming `option` otherwise."""
    from nereus.spec.presets import UnknownPreset

    path = Path(value)
    if path.is_dir() and not folder_ok:
        raise NereusError(f"{option} {value}: is a folder; give a {kind.__name__} YAML file or a preset name")
    if path.is_file() and not (kind is Model and path.name == "config.json"):
        return load_kind(value, kind)
    try:
        return preset(value)
    except UnknownPreset:
        if path.exists() or path.is_symlink():
            raise
        word = kind.__name__.lower()
        raise NereusError(
            f"{option} {value}: no such file or folder, and not a {word} preset (presets: {preset_names(kind)})"
        ) from None


def resolve_cluster(value: str, num_gpus: int | None, option: str = "--cluster") -> Cluster:
    from nereus.spec.presets import cluster_preset

    return preset_or_file(option, value, Cluster, lambda name: cluster_preset(name, num_gpus))  # type: ignore[return-value]


def resolve_model(value: str, option: str = "--model") -> Model:
    """A model preset, a Model YAML/JSON, or a Hugging Face config.json (file or folder)."""
    from nereus.spec.presets import model_preset

    return preset_or_file(option, value, Model, model_preset, folder_ok=True)  # type: ignore[return-value]


def resolve_workload(value: str, model: Model | None, option: str = "--workload") -> Workload:
    """A workload preset or file; `model`, when given, plays every role."""
    from nereus.spec.presets import workload_preset

    def preset(name: str) -> Workload:
        return workload_preset(name, model.name if model else "llama-3.1-8b")

    workload = preset_or_file(option, value, Workload, preset)
    from nereus.runtime.hf.run_setup import every_role_is

    return workload if model is None else every_role_is(workload, model.name)  # type: ignore[return-value,arg-type]

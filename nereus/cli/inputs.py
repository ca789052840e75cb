"""Resolving command-line names into documents: a preset name or a file path."""

from __future__ import annotations

from pathlib import Path

from nereus.errors import NereusError
from nereus.spec.base import Document
from nereus.spec.cluster import Cluster
from nereus.spec.model import Model
from nereus.spec.workload import Workload


def _looks_like_file(value: str) -> bool:
    return value.endswith((".yaml", ".yml", ".json")) or Path(value).is_file()


def load_kind(path: str, kind: type[Document]) -> Document:
    """Load `path` and insist it is a `kind` document."""
    from nereus.spec.io import load_document

    document = load_document(path)
    if not isinstance(document, kind):
        raise NereusError(f"{path}: kind: expected {kind.__name__}, got {type(document).__name__}")
    return document


def resolve_cluster(value: str, num_gpus: int | None) -> Cluster:
    from nereus.spec.presets import cluster_preset

    if _looks_like_file(value):
        return load_kind(value, Cluster)  # type: ignore[return-value]
    return cluster_preset(value, num_gpus)


def resolve_model(value: str) -> Model:
    from nereus.spec.presets import model_preset

    if value.endswith((".yaml", ".yml")) or (value.endswith(".json") and Path(value).name != "config.json"):
        return load_kind(value, Model)  # type: ignore[return-value]
    return model_preset(value)


def resolve_workload(value: str, model: Model | None) -> Workload:
    """A workload preset or file; `model`, when given, plays every role."""
    from nereus.spec.presets import workload_preset

    workload = (
        load_kind(value, Workload)
        if _looks_like_file(value)
        else workload_preset(value, model.name if model else "llama-3.1-8b")
    )
    from nereus.runtime.hf.run_setup import every_role_is

    return workload if model is None else every_role_is(workload, model.name)  # type: ignore[return-value,arg-type]

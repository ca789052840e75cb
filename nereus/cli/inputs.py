"""Resolving command-line names into documents: a preset name or a file path."""

from __future__ import annotations

from pathlib import Path

from nereus.errors import NereusError
from nereus.spec.base import Document
from nereus.spec.cluster import Cluster
from nereus.spec.model import Model
from nereus.spec.workload import ResponseLengths, Workload


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


def with_max_response(workload: Workload, max_tokens: int) -> Workload:
    """Set the generation cap (maximum response length) to `max_tokens`.

    The median and p99 scale by the same factor, so the distribution keeps its shape:
    this is the "sequence length" that grows over an RL run.
    """
    if max_tokens < 1:
        raise NereusError(f"--seq-len must be a positive number of tokens, got {max_tokens}")
    old = workload.response_len
    scale = max_tokens / old.max
    median = max(1, round(old.median * scale))
    lengths = ResponseLengths(median=median, p99=min(max_tokens, max(median, round(old.p99 * scale))), max=max_tokens)
    return workload.model_copy(update={"response_len": lengths})


def models_for(workload: Workload, given: Model | None) -> tuple[Model, ...]:
    """Every model the workload names: the given one, or presets by name."""
    from nereus.spec.presets import model_preset

    names = {name for name in workload.role_models().values() if name is not None}
    if given is not None and given.name in names:
        names.discard(given.name)
        return (given, *(model_preset(n) for n in sorted(names)))
    return tuple(model_preset(n) for n in sorted(names))

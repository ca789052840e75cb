"""Every document kind nereus reads and the semantic checks of each, in one table.

The table names classes and checks by dotted path (`module:attribute`) and imports them
the first time a document of that kind is read or checked. So the spec layer imports no
cost model or solver at module level, and whether a Plan gets its memory checks never
depends on what the caller happened to import before.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from nereus.spec.base import Document
    from nereus.spec.check import Problem


@dataclass(frozen=True)
class KindEntry:
    """One document kind: its class and its checks, each as `module:attribute`."""

    document: str
    """The pydantic class that validates a file of this kind."""
    checks: tuple[str, ...] = ()
    """Checks of the kind's own layer, run on every schema-valid document."""
    layered_checks: tuple[str, ...] = ()
    """Checks of a higher layer (the cost model's memory, the solver's replay). They assume a
    consistent document, so they run only when `checks` found no error."""
    file_checks: tuple[str, ...] = ()
    """Checks that also read the files the document names (paths relative to its own), each
    called with the document and its path. `nereus check` runs them when the other checks
    found no error; loading a document does not (the command that loads it decides which
    of those files it reads: `nereus run --plan` replaces a run config's plan)."""


_SPEC_CHECK = "nereus.spec.check"

#: The kinds this release reads, by their `kind:` value, in the order error messages list them.
REGISTRY: dict[str, KindEntry] = {
    "Cluster": KindEntry("nereus.spec.cluster:Cluster", (f"{_SPEC_CHECK}:cluster_problems",)),
    "Model": KindEntry("nereus.spec.model:Model", (f"{_SPEC_CHECK}:model_problems",)),
    "Workload": KindEntry("nereus.spec.workload:Workload", (f"{_SPEC_CHECK}:workload_problems",)),
    "Plan": KindEntry(
        "nereus.spec.plan:Plan", (f"{_SPEC_CHECK}:plan_problems",), ("nereus.cost.plan_cost:plan_cost_problems",)
    ),
    "Transition": KindEntry(
        "nereus.spec.transition:Transition",
        ("nereus.spec.transition:transition_structure_problems",),
        ("nereus.solver.transition.document:transition_problems",),
    ),
    "Calibration": KindEntry("nereus.cost.calibration:Calibration"),
    "Profile": KindEntry("nereus.cost.profile:Profile", ("nereus.cost.profile:profile_problems",)),
    "RunConfig": KindEntry(
        "nereus.spec.run_config:RunConfig", file_checks=("nereus.solver.admission:run_config_problems",)
    ),
    "Schedule": KindEntry(
        "nereus.solver.pipeline.document:Schedule", ("nereus.solver.pipeline.document:schedule_problems",)
    ),
    "Trace": KindEntry("nereus.spec.trace:Trace", ("nereus.spec.trace:trace_problems",)),
}

#: Every kind name, in the table's order (for messages and `nereus schema`).
KINDS: tuple[str, ...] = tuple(REGISTRY)


def _resolve(dotted: str) -> Any:
    module, _, attribute = dotted.partition(":")
    return getattr(importlib.import_module(module), attribute)


def document_class(kind: str) -> type[Document] | None:
    """The class of documents of `kind`, or None for a kind this release does not read."""
    entry = REGISTRY.get(kind)
    return None if entry is None else _resolve(entry.document)


def kind_of(document: Document) -> str:
    """The `kind:` value a document is written with."""
    return type(document).model_fields["kind"].default


def semantic_problems(document: Document) -> list[Problem]:
    """Every semantic problem of a schema-valid document, errors and warnings."""
    entry = REGISTRY.get(kind_of(document))
    if entry is None:
        return []
    problems = [problem for check in entry.checks for problem in _resolve(check)(document)]
    if not any(p.severity == "error" for p in problems):
        problems += [problem for check in entry.layered_checks for problem in _resolve(check)(document)]
    return problems


def file_problems(document: Document, path: Path) -> list[Problem]:
    """The problems `file_checks` find in a document read from `path` and the files it names."""
    entry = REGISTRY.get(kind_of(document))
    if entry is None:
        return []
    return [problem for check in entry.file_checks for problem in _resolve(check)(document, path)]

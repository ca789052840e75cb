"""A transition as a two-level outline: model-stages, then their primitives."""

from __future__ import annotations

from dataclasses import dataclass, field

from nereus.render import format_bytes, gpu_ranges, primitive_title, time_span
from nereus.spec.plan import StagePlan
from nereus.spec.transition import PrimitiveRecord, Transition


@dataclass
class StageBranch:
    """One model-stage of the outline: a heading and one line per primitive."""

    model_stage: str
    heading: str
    lines: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    """The kind of the primitive on each line (for colouring)."""


def layout_label(entry: StagePlan) -> str:
    """E.g. `tp=1 ep=2 pp=1 dp=2` (cp and ep named where above 1)."""
    cp = f" cp={entry.cp_label}" if entry.cp > 1 else ""
    cp += f" ep={entry.ep}" if entry.ep > 1 else ""
    return f"tp={entry.tp}{cp} pp={entry.pp} dp={entry.dp}"


def primitive_line(primitive: PrimitiveRecord) -> str:
    """E.g. `#6 merge tp=1 pp=1 -> tp=2 pp=1 | GPUs 0-1 | 0.301-0.401 s | deps #4`."""
    parts = [primitive_title(primitive), f"GPUs {gpu_ranges(primitive.gpus)}", time_span(primitive)]
    if primitive.kind == "extend" and len(primitive.adds) > 1:  # a batched Extend: copies side by side
        parts.insert(1, f"{len(primitive.adds)} replicas")
    moved = primitive.bytes_intra_node + primitive.bytes_inter_node
    if moved:
        parts.append(f"moves {format_bytes(moved)}")
    if primitive.depends_on:
        parts.append("deps " + ", ".join(f"#{d}" for d in primitive.depends_on))
    if primitive.ownership_deps:
        parts.append("waits for GPUs of " + ", ".join(f"#{d}" for d in primitive.ownership_deps))
    return " | ".join(parts)


def stage_branches(transition: Transition) -> list[StageBranch]:
    """Every model-stage of the target plan, in plan order, with its primitives."""
    by_stage: dict[str, list[PrimitiveRecord]] = {}
    for primitive in transition.primitives:
        by_stage.setdefault(primitive.model_stage, []).append(primitive)
    branches = []
    for entry in transition.target.stages:
        before = transition.source.stage_plan(entry.model_stage)
        primitives = by_stage.get(entry.model_stage, [])
        if not primitives:
            heading = f"{entry.model_stage}: unchanged ({layout_label(entry)})"
        else:
            start = min(p.start_s for p in primitives)
            end = max(p.end_s for p in primitives)
            heading = (
                f"{entry.model_stage}: {layout_label(before)} -> {layout_label(entry)} "
                f"({len(primitives)} primitives, {start:.3f}-{end:.3f} s)"
            )
        branch = StageBranch(entry.model_stage, heading)
        for primitive in primitives:
            branch.lines.append(primitive_line(primitive))
            branch.kinds.append(primitive.kind)
        branches.append(branch)
    return branches


def tree_text(transition: Transition) -> str:
    """The outline as plain indented text."""
    out = []
    for branch in stage_branches(transition):
        out.append(branch.heading)
        out += [f"  {line}" for line in branch.lines]
    return "\n".join(out) + "\n"

"""A transition DAG as Graphviz DOT: data edges solid, GPU-ownership edges dashed."""

from __future__ import annotations

from nereus.render import KIND_COLORS, gpu_ranges, primitive_title, time_span
from nereus.spec.transition import Transition

OWNERSHIP_COLOR = "#777777"


def _quote(text: str) -> str:
    """A DOT string literal; a newline becomes a centred line break."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def transition_dot(transition: Transition) -> str:
    """DOT text of the DAG, one cluster per model-stage, nodes coloured by kind."""
    summary = transition.summary
    title = (
        f"{transition.source.workload.name} on {transition.target.cluster.name}: "
        f"{len(transition.primitives)} primitives, makespan {summary.makespan_s:.3f} s"
        + ("" if summary.feasible else " (INFEASIBLE)")
        + "\nsolid: data dependency, dashed: GPU ownership; "
        + ", ".join(f"{kind} {color}" for kind, color in KIND_COLORS.items())
    )
    lines = [
        "digraph transition {",
        f"  graph [rankdir=LR, fontname=Helvetica, fontsize=11, labelloc=t, label={_quote(title)}];",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10];',
        "  edge [fontname=Helvetica, fontsize=9];",
    ]
    stages: dict[str, list[str]] = {}
    for p in transition.primitives:
        label = f"{primitive_title(p)}\nGPUs {gpu_ranges(p.gpus)}\n{time_span(p)}"
        stages.setdefault(p.model_stage, []).append(
            f"    p{p.id} [label={_quote(label)}, fillcolor={_quote(KIND_COLORS[p.kind])}];"
        )
    for i, (stage, nodes) in enumerate(stages.items()):
        lines += [f"  subgraph cluster_{i} {{", f"    label={_quote(stage)}; style=rounded; color=gray;", *nodes, "  }"]
    for p in transition.primitives:
        lines += [f"  p{dep} -> p{p.id};" for dep in p.depends_on]
        lines += [f'  p{dep} -> p{p.id} [style=dashed, color="{OWNERSHIP_COLOR}"];' for dep in p.ownership_deps]
    lines.append("}")
    return "\n".join(lines) + "\n"

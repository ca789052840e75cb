"""A pipeline schedule as a per-node timeline, PNG or SVG (matplotlib, imported only when drawing)."""

from __future__ import annotations

import io

from nereus.errors import NereusError
from nereus.render import new_figure
from nereus.spec.schedule import Schedule

#: Bar colour per (model position, op kind): models in ColorBrewer blues and oranges, F light, B dark.
MODEL_COLORS = (
    {"F": "#9ecae1", "B": "#3182bd", "W": "#6baed6"},
    {"F": "#fdae6b", "B": "#e6550d", "W": "#fd8d3c"},
    {"F": "#a1d99b", "B": "#31a354", "W": "#74c476"},
)


def schedule_gantt(schedule: Schedule, fmt: str = "png", dpi: int = 100) -> bytes:
    """PNG or SVG bytes: one row per node, one bar per op, labelled with its micro-batch."""
    if fmt not in ("png", "svg"):
        raise NereusError(f"a schedule Gantt chart is drawn as .png or .svg, got .{fmt}; pick one of those suffixes")
    colors = {m.name: MODEL_COLORS[i % len(MODEL_COLORS)] for i, m in enumerate(schedule.models)}
    makespan = schedule.summary.makespan or 1.0
    figure = new_figure((12, min(40.0, 1.5 + 0.45 * schedule.num_nodes)))
    from matplotlib.patches import Patch

    axes = figure.add_subplot()
    for record in schedule.nodes:
        for op in record.ops:
            width = op.end - op.start
            axes.barh(record.node, width, left=op.start, height=0.8, color=colors[op.model][op.kind],
                      edgecolor="black", linewidth=0.3)  # fmt: skip
            if width > makespan * 0.012:
                axes.text(op.start + width / 2, record.node, str(op.microbatch), ha="center", va="center", fontsize=6)
    axes.set_yticks(range(schedule.num_nodes), [f"node {n}" for n in range(schedule.num_nodes)])
    axes.invert_yaxis()
    unit = f" ({schedule.time_unit})" if schedule.time_unit else ""
    axes.set_xlabel("time" + unit)
    axes.set_xlim(0, makespan * 1.01)
    s = schedule.summary
    axes.set_title(
        f"makespan {s.makespan:.4g}{unit}, lower bound {s.lower_bound:.4g}, serial 1F1B {s.serial_1f1b_makespan:.4g}"
    )
    handles = [
        Patch(facecolor=colors[m.name][kind], edgecolor="black", label=f"{m.name} {kind}")
        for m in schedule.models
        for kind in (("F", "B", "W") if m.weight_grad else ("F", "B"))
    ]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format=fmt, dpi=dpi)
    return buffer.getvalue()

"""A transition as a per-GPU timeline PNG (matplotlib, imported only when drawing)."""

from __future__ import annotations

import io

from nereus.render import KIND_COLORS, new_figure
from nereus.spec.transition import Transition


def transition_gantt_png(transition: Transition, dpi: int = 100) -> bytes:
    """PNG bytes: one row per GPU, one bar per primitive on each GPU it occupies."""
    gpus = sorted({gpu for p in transition.primitives for gpu in p.gpus}) or list(
        range(transition.target.cluster.num_gpus)
    )
    row = {gpu: i for i, gpu in enumerate(gpus)}
    makespan = transition.summary.makespan_s or 1.0
    min_width = makespan * 0.004  # zero-length primitives (Destroy) stay visible
    figure = new_figure((10, min(60.0, 1.5 + 0.35 * len(gpus))))
    from matplotlib.patches import Patch

    axes = figure.add_subplot()
    for p in transition.primitives:
        width = max(p.end_s - p.start_s, min_width)
        for gpu in p.gpus:
            axes.barh(
                row[gpu], width, left=p.start_s, height=0.8, color=KIND_COLORS[p.kind], edgecolor="black", linewidth=0.4
            )
            if width > makespan * 0.04:
                axes.text(p.start_s + width / 2, row[gpu], f"#{p.id}", ha="center", va="center", fontsize=7)
    axes.set_yticks(range(len(gpus)), [f"GPU {gpu}" for gpu in gpus])
    axes.invert_yaxis()
    axes.set_xlabel("seconds since the transition began")
    axes.set_xlim(0, makespan * 1.02)
    title = f"{len(transition.primitives)} primitives, makespan {transition.summary.makespan_s:.3f} s"
    axes.set_title(title + ("" if transition.summary.feasible else " (infeasible)"))
    axes.legend(
        handles=[Patch(facecolor=color, edgecolor="black", label=kind) for kind, color in KIND_COLORS.items()],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        frameon=False,
    )
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()

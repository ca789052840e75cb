"""Writers for nereus documents: DOT, Gantt (matplotlib), Perfetto/Chrome-trace JSON.

Every renderer is a pure function from a document to text or bytes; nothing here
prints. matplotlib is imported only inside the Gantt renderer.
"""

from __future__ import annotations

from typing import Any

from nereus.errors import MissingDependency
from nereus.spec.transition import LayoutRecord, PrimitiveRecord
from nereus.units import format_bytes

#: Fill colour per primitive kind (ColorBrewer Set3), shared by every renderer.
KIND_COLORS: dict[str, str] = {
    "split": "#8dd3c7",
    "destroy": "#fb8072",
    "extend": "#80b1d3",
    "merge": "#fdb462",
}


def gpu_ranges(gpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    spans: list[list[int]] = []
    for gpu in sorted(set(gpus)):
        if spans and gpu == spans[-1][1] + 1:
            spans[-1][1] = gpu
        else:
            spans.append([gpu, gpu])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans) or "-"


def layout_text(layout: LayoutRecord) -> str:
    """LayoutRecord(tp=2, pp=1) -> "tp=2 pp=1"."""
    return f"tp={layout.tp} pp={layout.pp}"


def time_span(primitive: PrimitiveRecord) -> str:
    """Start and end, e.g. `0.100-0.201 s`."""
    return f"{primitive.start_s:.3f}-{primitive.end_s:.3f} s"


def primitive_title(primitive: PrimitiveRecord) -> str:
    """E.g. `#3 split tp=1 pp=2 -> tp=1 pp=1` (a destroy names one layout)."""
    if primitive.kind == "destroy":
        return f"#{primitive.id} destroy {layout_text(primitive.source_layout)}"
    return (
        f"#{primitive.id} {primitive.kind} {layout_text(primitive.source_layout)} -> "
        f"{layout_text(primitive.target_layout)}"
    )


__all__ = ["KIND_COLORS", "format_bytes", "gpu_ranges", "layout_text", "primitive_title", "time_span"]


def new_figure(figsize: tuple[float, float]) -> Any:
    """A matplotlib Figure on the Agg canvas (no display needed); MissingDependency when
    matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingDependency("drawing a figure", "matplotlib", "plot") from None
    figure = Figure(figsize=figsize)
    FigureCanvasAgg(figure)
    return figure

"""Simulated step latency over a trace, one line per policy (matplotlib, imported only when drawing)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from nereus.render import new_figure

if TYPE_CHECKING:
    from nereus.solver.simulate import SimulationResult

FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def simulation_plot_bytes(results: list[SimulationResult], fmt: str = "png", dpi: int = 100) -> bytes:
    """Top: step latency per policy, transitions (o) and restarts (x) marked. Bottom: GPUs and response cap."""
    figure = new_figure((10, 6))
    latency, drift = figure.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    for result in results:
        steps = [r.step for r in result.steps]
        values = [r.latency_s if r.latency_s is not None else float("nan") for r in result.steps]
        (line,) = latency.plot(
            steps, values, linewidth=1, label=f"{result.policy} ({result.mean_step_latency_s:.2f} s)"
        )
        by_step = dict(zip(steps, values, strict=True))
        for action, marker in (("transition", "o"), ("restart", "x")):
            marked = [d.step for d in result.decisions if d.action == action]
            latency.plot(marked, [by_step[s] for s in marked], marker, color=line.get_color(), markersize=4)
    latency.set_ylabel("step latency (s)")
    latency.set_title(f"{results[0].trace}: simulated (cost model), o = transition, x = restart")
    latency.legend(fontsize=8)
    first = results[0].steps
    drift.step([r.step for r in first], [r.gpus_available for r in first], where="post", color="black", label="GPUs")
    drift.set_ylabel("GPUs")
    drift.set_xlabel("step")
    tokens = drift.twinx()
    tokens.plot([r.step for r in first], [r.mean_response_tokens for r in first], color="tab:gray", linestyle="--")
    tokens.set_ylabel("mean response tokens")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format=fmt, dpi=dpi)
    return buffer.getvalue()

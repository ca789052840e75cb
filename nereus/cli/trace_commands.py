"""`nereus trace generate` and `nereus trace show`: drift traces for `nereus simulate`."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nereus.cli.outputs import check_output
from nereus.errors import NereusError
from nereus.spec.trace import MAX_STEPS

if TYPE_CHECKING:
    from nereus.solver.traces import GrowthConfig, SpotConfig
    from nereus.spec.trace import Trace

trace_app = typer.Typer(help="Drift traces: generate seeded ones, summarise one.", no_args_is_help=True)


class TraceKind(str, Enum):
    seq_growth = "seq-growth"
    spot = "spot"
    combined = "combined"
    growing_pool = "growing-pool"


def build_trace(
    kind: TraceKind, steps: int, gpus: int, seed: int, growth: GrowthConfig, spot: SpotConfig,
    end_gpus: int | None, tokens: int,
) -> Trace:  # fmt: skip
    """The generator `kind` names; its ValueErrors become one-line user errors."""
    from nereus.solver import traces

    try:
        if kind is TraceKind.seq_growth:
            return traces.sequence_growth_trace(steps, gpus, growth, seed)
        if kind is TraceKind.spot:
            return traces.spot_trace(steps, gpus, tokens, spot, seed)
        if kind is TraceKind.combined:
            return traces.combined_trace(steps, gpus, growth, spot, seed)
        if end_gpus is None:
            raise NereusError("--end-gpus: growing-pool needs the final pool size; add --end-gpus N")
        return traces.growing_pool_trace(steps, gpus, end_gpus, growth, seed)
    except ValueError as exc:
        raise NereusError(f"trace generate {kind.value}: {exc}") from None


@trace_app.command("generate")
def generate(
    kind: Annotated[TraceKind, typer.Argument(help="seq-growth, spot, combined or growing-pool.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Trace file to write (YAML or .json).")],
    steps: Annotated[int, typer.Option("--steps", min=2, max=MAX_STEPS, help="RL steps the trace covers.")] = 1000,
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs available at step 0.")] = 16,
    seed: Annotated[int, typer.Option("--seed", help="Random seed (same seed, same trace).")] = 0,
    start_tokens: Annotated[int, typer.Option("--start-tokens", min=1, help="Response-length cap at step 0.")] = 500,
    end_tokens: Annotated[int, typer.Option("--end-tokens", min=1, help="Response-length cap at the end.")] = 8000,
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Fixed response-length cap of a spot trace.")] = 2000,
    changes: Annotated[int, typer.Option("--changes", min=1, help="Availability changes (spot, combined).")] = 12,
    hours: Annotated[
        float, typer.Option("--hours", min=0.01, help="Wall time the steps span (spot, combined).")
    ] = 10.0,
    block_gpus: Annotated[int, typer.Option("--block-gpus", min=1, help="GPUs per availability change.")] = 4,
    min_gpus: Annotated[
        int | None, typer.Option("--min-gpus", min=1, help="Fewest GPUs a spot pool drops to [half the pool].")
    ] = None,
    end_gpus: Annotated[int | None, typer.Option("--end-gpus", min=1, help="Final pool of growing-pool.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary instead of text.")] = False,
) -> None:
    """Generate a seeded drift trace and write it atomically."""
    from nereus.solver.traces import GrowthConfig, SpotConfig
    from nereus.spec.io import save_document

    check_output(out, "--out")
    growth = GrowthConfig(start_tokens=start_tokens, end_tokens=end_tokens)
    spot = SpotConfig(hours=hours, num_changes=changes, block_gpus=block_gpus, min_gpus=min_gpus)
    trace = build_trace(kind, steps, gpus, seed, growth, spot, end_gpus, tokens)
    save_document(trace, out)
    _report(trace, out, as_json)


@trace_app.command("show")
def show(
    file: Annotated[Path, typer.Argument(help="A Trace file.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary instead of text.")] = False,
) -> None:
    """Summarise a trace: steps, pool changes, response lengths."""
    from nereus.cli.inputs import load_kind
    from nereus.spec.trace import Trace

    trace = load_kind(str(file), Trace)
    _report(trace, file, as_json)  # type: ignore[arg-type]


def trace_summary(trace: Trace) -> dict[str, object]:
    """Counts and ranges of a trace's drift, as plain data."""
    from nereus.spec.trace import trace_conditions

    states = list(trace_conditions(trace))
    pool = [e for e in trace.events if e.gpus is not None]
    return {
        "name": trace.name,
        "description": trace.description,
        "num_steps": trace.num_steps,
        "num_events": len(trace.events),
        "num_pool_changes": len(pool),
        "num_announced": sum(1 for e in pool if e.notice_steps),
        "gpus_min": min(s.gpus for s in states),
        "gpus_max": max(s.gpus for s in states),
        "max_tokens_first": states[0].response_len.max,
        "max_tokens_last": states[-1].response_len.max,
        "efficiency_min": min(s.efficiency for s in states),
        "efficiency_max": max(s.efficiency for s in states),
    }


def _report(trace: Trace, path: Path, as_json: bool) -> None:
    summary = trace_summary(trace)
    if as_json:
        typer.echo(json.dumps({"file": str(path), **summary}, indent=2))
        return
    typer.echo(f"{path}: {summary['name']}, {summary['num_steps']} steps, {summary['num_events']} events")
    typer.echo(f"  {summary['description']}")
    typer.echo(
        f"  GPUs {summary['gpus_min']}..{summary['gpus_max']}, {summary['num_pool_changes']} pool changes "
        f"({summary['num_announced']} announced); response cap {summary['max_tokens_first']} -> "
        f"{summary['max_tokens_last']} tokens; efficiency {summary['efficiency_min']:g}..{summary['efficiency_max']:g}"
    )


def register(app: typer.Typer) -> None:
    app.add_typer(trace_app, name="trace", help="Drift traces: generate seeded ones, summarise one.")

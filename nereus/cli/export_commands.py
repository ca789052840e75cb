"""`nereus export`: a trained run's models in other tools' formats."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

export_app = typer.Typer(help="Write a run checkpoint's models in another tool's format.", no_args_is_help=True)


@export_app.command("hf")
def export_hf_command(
    run_dir: Annotated[Path, typer.Argument(help="A run folder (the --out of `nereus run`).", file_okay=False)],
    out: Annotated[Path, typer.Option("-o", "--out", help="Hugging Face folder to write (must be new or empty).")],
    step: Annotated[
        int | None, typer.Option("--step", min=0, help="Checkpoint step to export (default: the latest).")
    ] = None,
    role: Annotated[str, typer.Option("--model", help="Which trained model: actor or critic.")] = "actor",
    as_json: Annotated[bool, typer.Option("--json", help="Print what was written as JSON.")] = False,
) -> None:
    """Write the actor (or critic) of a run that started from a Hugging Face folder as one."""
    from nereus.runtime.hf.export import export_hf, run_checkpoint_and_source

    checkpoint, source = run_checkpoint_and_source(run_dir, step, role)
    result = export_hf(checkpoint, source, out, role)
    if as_json:
        typer.echo(json.dumps(dataclasses.asdict(result), indent=1))
    else:
        typer.echo(
            f"wrote {result.folder}: {result.role} from {result.checkpoint}, {result.num_tensors} tensors in "
            f"{result.num_files} safetensors file(s); copied {', '.join(result.copied) or 'no other files'}"
        )


def register(app: typer.Typer) -> None:
    app.add_typer(export_app, name="export")

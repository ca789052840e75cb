"""`nereus export`: a plan as the configuration of another trainer (verl, OpenRLHF), and a
trained run's model as a Hugging Face folder."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from nereus.cli.outputs import check_output, check_output_folder
from nereus.errors import NereusError

if TYPE_CHECKING:
    from nereus.interop.common import Export

export_app = typer.Typer(
    help="Write a plan as another trainer's configuration, or a run's model as a Hugging Face folder.",
    no_args_is_help=True,
)

PlanArgument = Annotated[Path, typer.Argument(help="The Plan file (from `nereus plan -o`).")]
OutputOption = Annotated[
    Path | None, typer.Option("-o", "--output", help="Write the configuration to this file instead of stdout.")
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print settings, differences and predicted step times as JSON.")
]


def _load_plan(path: Path) -> object:
    from nereus.cli.inputs import load_kind
    from nereus.spec.plan import Plan

    return load_kind(str(path), Plan)


def _emit(export: Export, text: str, output: Path | None, as_json: bool) -> None:
    """The configuration to `output` (atomically) or stdout; the warning block to stderr."""
    from nereus.spec.io import write_text_atomic

    if as_json:
        payload = {
            "trainer": export.trainer,
            "version": export.version,
            "settings": export.settings,
            "differences": [{"planned": d.planned, "exported": d.exported} for d in export.differences],
            "memory_problems": export.memory_problems,
            "planned_step_s": export.planned_step_s,
            "exported_step_s": export.exported_step_s,
        }
        typer.echo(json.dumps(payload, indent=2))
    elif output is None:
        typer.echo(text, nl=False)
    if output is not None:  # first: a write that fails is the one line a failed command prints
        write_text_atomic(output, text)
    for line in export.warning_lines():
        typer.echo(f"warning: {line}" if not line.startswith(" ") else line, err=True)
    if output is not None:
        typer.echo(f"wrote {output}", err=True)


@export_app.command("verl")
def export_verl(
    plan: PlanArgument,
    output: OutputOption = None,
    output_format: Annotated[
        Literal["yaml", "overrides"],
        typer.Option("--format", help="yaml: a config file; overrides: Hydra key=value lines for the command line."),
    ] = "overrides",
    backend: Annotated[
        Literal["megatron", "fsdp"],
        typer.Option(
            "--backend",
            help="megatron: ppo_megatron_trainer (tp, pp, context_parallel_size); fsdp: ppo_trainer "
            "(ulysses_sequence_parallel_size, no tp or pp in training).",
        ),
    ] = "megatron",
    as_json: JsonOption = False,
) -> None:
    """The plan as verl PPO trainer settings (Megatron or FSDP); what verl cannot express is listed on stderr."""
    from nereus.interop import verl

    check_output(output, "-o")
    try:
        export = verl.export_verl(_load_plan(plan), backend)  # type: ignore[arg-type]
    except ValueError as exc:
        raise NereusError(f"{plan}: {exc}") from None
    text = verl.as_yaml(export) if output_format == "yaml" else verl.as_overrides(export)
    _emit(export, text, output, as_json)


@export_app.command("openrlhf")
def export_openrlhf(plan: PlanArgument, output: OutputOption = None, as_json: JsonOption = False) -> None:
    """The plan as OpenRLHF PPO trainer flags; what OpenRLHF cannot express is listed on stderr."""
    from nereus.interop import openrlhf

    check_output(output, "-o")
    try:
        export = openrlhf.export_openrlhf(_load_plan(plan))  # type: ignore[arg-type]
    except ValueError as exc:
        raise NereusError(f"{plan}: {exc}") from None
    _emit(export, openrlhf.as_command_line(export), output, as_json)


@export_app.command("hf")
def export_hf_command(
    run_dir: Annotated[Path, typer.Argument(help="A run folder (the --out of `nereus run`).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Hugging Face folder to write (new or empty).")],
    step: Annotated[
        int | None, typer.Option("--step", min=0, help="Checkpoint step to export (default: the latest).")
    ] = None,
    role: Annotated[str, typer.Option("--model", help="Which trained model: actor or critic.")] = "actor",
    as_json: Annotated[bool, typer.Option("--json", help="Print what was written as JSON.")] = False,
) -> None:
    """A run checkpoint's actor (or critic) as a Hugging Face folder (the run must have started from one)."""
    from nereus.runtime.hf.export import export_hf, run_checkpoint_and_source

    check_output_folder(output, "-o", new=True)
    checkpoint, source = run_checkpoint_and_source(run_dir, step, role)
    result = export_hf(checkpoint, source, output, role)
    if as_json:
        typer.echo(json.dumps(dataclasses.asdict(result), indent=1))
    else:
        typer.echo(
            f"wrote {result.folder}: {result.role} from {result.checkpoint}, {result.num_tensors} tensors in "
            f"{result.num_files} safetensors file(s); copied {', '.join(result.copied) or 'no other files'}"
        )


def register(app: typer.Typer) -> None:
    app.add_typer(
        export_app,
        name="export",
        help="Write a plan as another trainer's configuration (verl, OpenRLHF), or a run's model as a HF folder.",
    )

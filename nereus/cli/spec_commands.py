"""`nereus check`, `nereus schema`, `nereus preset`: the file-format commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from nereus.errors import NereusError

if TYPE_CHECKING:
    from nereus.spec.base import Document
    from nereus.spec.check import CheckResult, Finding


CheckFormat = Literal["human", "json", "github"]


def check(
    files: Annotated[
        list[Path],
        typer.Argument(
            help="nereus files (YAML or JSON) to validate.",
        ),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with every result.")] = False,
    output_format: Annotated[
        CheckFormat,
        typer.Option(
            "--format",
            help="human: FILE:LINE:COL lines; json: as --json; github: GitHub Actions ::error/::warning annotations.",
        ),
    ] = "human",
    warnings_as_errors: Annotated[bool, typer.Option("--strict", help="Treat warnings as errors (exit 1).")] = False,
) -> None:
    """Validate files: schema and semantics. Exit 0 valid, 1 invalid, 2 usage error."""
    from nereus.spec.check import check_file

    results = [check_file(path) for path in files]
    failed = [r for r in results if not r.ok or (warnings_as_errors and r.warnings)]
    if as_json or output_format == "json":
        payload = {"ok": not failed, "files": [_result_data(r) for r in results]}
        typer.echo(json.dumps(payload, indent=2))
    elif output_format == "github":
        for r in results:
            for finding in r.findings:
                typer.echo(github_annotation(finding))
    else:
        for r in results:
            status = "ok" if r.ok else "invalid"
            typer.echo(f"{r.file}: {status}" + (f" ({r.kind})" if r.kind else ""))
            for line in r.errors + r.warnings:
                typer.echo(f"  {line}")
    if failed:
        raise typer.Exit(1)


def _result_data(r: CheckResult) -> dict[str, Any]:
    problems = [
        {
            "severity": f.severity,
            "field": f.field_path,
            "line": f.line,
            "column": f.column,
            "message": f.text.removeprefix(f"{r.file}: "),
        }
        for f in r.findings
    ]
    data = {"file": r.file, "kind": r.kind, "ok": r.ok, "errors": r.errors, "warnings": r.warnings}
    return {**data, "problems": problems}


def github_annotation(finding: Finding) -> str:
    """One GitHub Actions workflow command (`::error file=F,line=L,col=C::message`); the
    message and properties are escaped as the runner expects."""

    def escape(text: str, properties: bool = False) -> str:
        text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
        return text.replace(":", "%3A").replace(",", "%2C") if properties else text

    fields = [f"file={escape(finding.file, True)}"]
    if finding.line is not None:
        fields += [f"line={finding.line}", f"col={finding.column}"]
    fields.append("title=nereus check")
    message = finding.text.removeprefix(f"{finding.file}: ")
    return f"::{finding.severity} {','.join(fields)}::{escape(message)}"


def schema(
    kind: Annotated[str, typer.Argument(help="Document kind, e.g. Plan, Cluster, Model, Workload.")],
) -> None:
    """Print the JSON Schema of a document kind."""
    from nereus.spec.registry import KINDS, document_class

    name = {name.lower(): name for name in KINDS}.get(kind.lower())
    match = document_class(name) if name is not None else None
    if match is None:
        raise NereusError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    typer.echo(json.dumps(match.model_json_schema(), indent=2))


preset_app = typer.Typer(help="List and print the built-in clusters, models and workloads.", no_args_is_help=True)


@preset_app.command("list")
def preset_list(
    as_json: Annotated[bool, typer.Option("--json", help="Print the names as JSON.")] = False,
) -> None:
    """List preset names by kind."""
    from nereus.spec import presets

    names = {
        "clusters": [*presets.GPU_KINDS],
        "models": [*presets.MODELS],
        "workloads": [*presets.WORKLOAD_NAMES],
    }
    if as_json:
        typer.echo(json.dumps(names, indent=2))
        return
    for kind, values in names.items():
        typer.echo(f"{kind}: {', '.join(values)}")
    typer.echo("clusters take a size: NAME-NODESxGPUS (h100-sxm-8x8) or --gpus N")


@preset_app.command("show")
def preset_show(
    name: Annotated[str, typer.Argument(help="A cluster, model or workload preset name.")],
    gpus: Annotated[int | None, typer.Option("--gpus", min=1, help="Cluster size for a bare GPU name.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of YAML.")] = False,
) -> None:
    """Print a preset as a document you can save, edit and pass back."""
    from nereus.spec import presets
    from nereus.spec.io import to_json, to_yaml

    document: Document
    if name.lower() in presets.MODELS:
        document = presets.model_preset(name)
    elif name in presets.WORKLOAD_NAMES:
        document = presets.workload_preset(name)
    else:
        document = presets.cluster_preset(name, gpus)
    typer.echo(to_json(document) if as_json else to_yaml(document), nl=False)


def register(app: typer.Typer) -> None:
    app.command(help="Validate nereus files (schema + semantics); exit 0 valid, 1 invalid.")(check)
    app.command(help="Print the JSON Schema of a document kind.")(schema)
    app.add_typer(preset_app, name="preset", help="List and print built-in presets.")

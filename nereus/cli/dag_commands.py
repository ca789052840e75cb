"""`nereus dag build` and `nereus dag show`: transition DAGs between two plans."""

from __future__ import annotations

import inspect
import shutil
import subprocess
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from nereus.cli.outputs import check_output
from nereus.errors import NereusError, SpecError

if TYPE_CHECKING:
    from nereus.solver.transition.schedule import TransitionResult
    from nereus.spec.plan import Plan
    from nereus.spec.transition import ExactRecord, Transition

dag_app = typer.Typer(help="Transition DAGs between two plans: build one, show one.", no_args_is_help=True)

#: Terminal colour per primitive kind (the renderers' KIND_COLORS, in rich's names).
KIND_STYLES = {"split": "cyan", "destroy": "red", "extend": "blue", "merge": "yellow"}


class ExactSolver(str, Enum):
    cpsat = "cpsat"
    scip = "scip"


class ShowFormat(str, Enum):
    tree = "tree"
    dot = "dot"
    svg = "svg"
    json = "json"
    perfetto = "perfetto"


def _load_plan(path: Path) -> Plan:
    from nereus.cli.inputs import load_kind
    from nereus.spec.plan import Plan

    return load_kind(str(path), Plan)  # type: ignore[return-value]


def _comparable(plan_a: Plan, plan_b: Plan, path_a: Path, path_b: Path) -> tuple[Plan, Plan]:
    """The two plans on the cluster their transition runs on (`transition.pair.plan_pair`),
    refusals naming both files; a sub-pool is said in one line on stderr."""
    from nereus.solver.transition.pair import plan_pair

    pair = plan_pair(plan_a, plan_b, (str(path_a), str(path_b)))
    if pair.sub_pool is not None:
        typer.echo(pair.sub_pool.describe(), err=True)
    return pair.source, pair.target


def _solve_exact(solver: ExactSolver, result: TransitionResult, time_limit_s: float, workers: int) -> Any:
    """Run an exact backend on the heuristic's primitives; one-line errors when missing."""
    try:
        from nereus.solver.transition import exact
    except ImportError as exc:
        if exc.name == "nereus.solver.transition.exact":
            raise NereusError(f"--exact {solver.value}: this nereus has no exact transition solvers") from None
        raise NereusError(f"--exact {solver.value} needs {exc.name}; pip install 'nereus[exact]'") from None
    solve = getattr(exact, f"solve_{solver.value}", None)
    if solve is None:
        raise NereusError(f"--exact {solver.value}: this nereus has no solve_{solver.value}")
    kwargs = {"workers": workers} if "workers" in inspect.signature(solve).parameters else {}
    try:
        return solve(
            result.primitives,
            result.initial_bytes,
            result.capacity_bytes,
            time_limit_s,
            schedule=result.schedule,
            **kwargs,
        )
    except ImportError as exc:
        raise NereusError(f"--exact {solver.value} needs {exc.name}; pip install 'nereus[exact]'") from None


@dag_app.command("build")
def build(
    plan_a: Annotated[Path, typer.Argument(help="The plan the job runs now (Plan YAML/JSON).")],
    plan_b: Annotated[Path, typer.Argument(help="The plan to move to (same cluster and model-stages).")],
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the Transition document (YAML, or JSON by suffix).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the Transition document as JSON.")] = False,
    exact: Annotated[
        list[ExactSolver] | None,
        typer.Option(
            "--exact", metavar="cpsat|scip", help="Also schedule the primitives exactly with this solver (repeatable)."
        ),
    ] = None,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0.001, help="Seconds per exact solver.")] = 10.0,
    workers: Annotated[int, typer.Option("--workers", min=1, help="Search threads per exact solver.")] = 8,
    calibration: Annotated[
        Path | None, typer.Option("--calibration", help="Calibration YAML (link efficiencies, memory headroom).")
    ] = None,
) -> None:
    """Build the scheduled transition DAG that turns plan A into plan B.

    Exit 0 when the transition has a safe order; exit 1 when it has none (its blocking
    cycle is printed, and -o still writes the file so `dag show` can render it).
    """
    from nereus.cli.inputs import load_kind
    from nereus.cost.calibration import Calibration
    from nereus.solver.transition.document import to_document
    from nereus.solver.transition.schedule import build_transition
    from nereus.spec.io import save_document, to_json

    check_output(output, "-o")
    the_a, the_b = _load_plan(plan_a), _load_plan(plan_b)
    the_a, the_b = _comparable(the_a, the_b, plan_a, plan_b)
    the_calibration = load_kind(str(calibration), Calibration) if calibration else Calibration()
    result = build_transition(the_a, the_b, the_calibration)  # type: ignore[arg-type]
    exact_results = []
    if exact and result.feasible and result.primitives:
        for solver in dict.fromkeys(exact):
            with _status(f"solving exactly with {solver.value} (up to {time_limit:g} s)"):
                exact_results.append(_solve_exact(solver, result, time_limit, workers))
    document = to_document(the_a, the_b, result, exact_results or None)
    if output:
        save_document(document, output)
    if as_json:
        typer.echo(to_json(document))
    else:
        _print_summary(document, plan_a, plan_b, output, skipped_exact=bool(exact) and not exact_results)
    if not result.feasible:
        raise NereusError(
            f"no safe order from {plan_a} to {plan_b}: {'; '.join(result.blocking_cycle)}"
            + (f" (wrote {output} anyway)" if output else "")
        )


def _status(message: str) -> Any:
    from contextlib import nullcontext

    from rich.console import Console

    console = Console(stderr=True)
    return console.status(message) if console.is_terminal else nullcontext()


def _print_summary(
    document: Transition, path_a: Path, path_b: Path, output: Path | None, *, skipped_exact: bool
) -> None:
    from rich.console import Console
    from rich.table import Table

    from nereus.render import format_bytes
    from nereus.render.tree import layout_label, stage_branches

    console = Console(width=120)
    t, s = document, document.summary
    console.print(f"transition {path_a} -> {path_b} ({t.target.workload.name} on {t.target.cluster.name})")
    if not t.primitives:
        console.print("the plans place every model-stage alike: nothing to move")
        return
    table = Table(title_justify="left")
    for column in ("model-stage", "from", "to", "split", "destroy", "extend", "merge", "time (s)"):
        table.add_column(column, justify="right" if column in KIND_STYLES else "left")
    unchanged = 0
    for branch in stage_branches(t):
        primitives = [p for p in t.primitives if p.model_stage == branch.model_stage]
        if not primitives:
            unchanged += 1
            continue
        a, b = t.source.stage_plan(branch.model_stage), t.target.stage_plan(branch.model_stage)
        table.add_row(
            branch.model_stage,
            layout_label(a),
            layout_label(b),
            *(str(sum(p.kind == kind for p in primitives)) for kind in KIND_STYLES),
            f"{min(p.start_s for p in primitives):.3f}-{max(p.end_s for p in primitives):.3f}",
        )
    console.print(table)
    counts = ", ".join(f"{kind} {sum(p.kind == kind for p in t.primitives)}" for kind in KIND_STYLES)
    console.print(
        f"primitives: {len(t.primitives)} ({counts})" + (f"; {unchanged} model-stages unchanged" if unchanged else "")
    )
    console.print(f"makespan: {s.makespan_s:.3f} s")
    ratio = f", {s.bytes_moved / s.lower_bound_bytes:.2f}x" if s.lower_bound_bytes else ""
    console.print(
        f"bytes moved: {format_bytes(s.bytes_moved)} (lower bound {format_bytes(s.lower_bound_bytes)}{ratio}); "
        f"intra-node {format_bytes(s.bytes_by_link.intra_node)}, inter-node {format_bytes(s.bytes_by_link.inter_node)}"
    )
    if s.peak_extra_bytes:
        peak = max(s.peak_extra_bytes, key=lambda e: e.bytes)
        where = f"on GPU {peak.gpu}" if peak.bytes > 0 else "(no GPU ever holds more than under plan A)"
        console.print(
            f"peak extra memory: {format_bytes(peak.bytes)} {where}; room for model state "
            f"{format_bytes(s.capacity_bytes)} per GPU (the usable capacity less the workspace)"
        )
    if s.feasible:
        console.print("feasible: yes (every allocation fits in the scheduled order)")
    else:
        console.print("feasible: [bold red]no[/]; blocking:")
        for line in s.blocking_cycle:
            console.print(f"  {line}", markup=False)
    for record in t.exact or []:
        console.print(_exact_line(record, s.makespan_s), markup=False)
    if skipped_exact:
        console.print("exact solvers skipped: the heuristic found no safe order to compare with")
    if output:
        console.print(f"wrote {output}", markup=False)


def _exact_line(record: ExactRecord, heuristic_s: float) -> str:
    parts = [f"exact {record.solver}: {record.status}"]
    if record.makespan_s is not None:
        parts.append(f"makespan {record.makespan_s:.3f} s")
        if record.makespan_s > 0:
            gap = 100 * (heuristic_s / record.makespan_s - 1)
            if abs(gap) < 0.05:
                parts.append("list scheduler matches it")
            else:
                parts.append(f"list scheduler {abs(gap):.1f}% {'longer' if gap > 0 else 'shorter'}")
    if record.bound_s is not None:
        parts.append(f"bound {record.bound_s:.3f} s")
    parts.append(f"{record.wall_s:.2f} s of {record.time_limit_s:g} s")
    return ", ".join(parts)


def _load_transition(path: Path) -> Transition:
    """Schema plus structural checks (edges, GPUs, plans); no rebuild, so any file renders."""
    from nereus.spec.io import load_document
    from nereus.spec.transition import Transition, transition_structure_problems

    document = load_document(path, check=False)
    if not isinstance(document, Transition):
        raise NereusError(f"{path}: kind: expected Transition, got {type(document).__name__}")
    errors = [p.format(str(path)) for p in transition_structure_problems(document) if p.severity == "error"]
    if errors:
        raise SpecError(errors)
    return document


@dag_app.command("show")
def show(
    transition_file: Annotated[Path, typer.Argument(help="A Transition YAML/JSON file (from `nereus dag build -o`).")],
    fmt: Annotated[
        ShowFormat,
        typer.Option(
            "--format",
            help="tree: outline by model-stage; dot: Graphviz; svg: Graphviz rendered by `dot`; "
            "json: the document; perfetto: Chrome trace-event JSON.",
        ),
    ] = ShowFormat.tree,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write to this file instead of stdout.")] = None,
    gantt: Annotated[
        Path | None, typer.Option("--gantt", help="Also draw a per-GPU timeline PNG here (needs matplotlib).")
    ] = None,
) -> None:
    """Render a transition DAG as a tree, DOT, SVG, JSON or a Perfetto trace.

    svg needs Graphviz's `dot` on PATH; without it the DOT text is written next to the
    output (or the input) with a .dot suffix, a note goes to stderr, and the exit is 0.
    """
    from nereus.spec.io import to_json, write_bytes_atomic, write_text_atomic

    check_output(output, "-o")
    check_output(gantt, "--gantt")
    document = _load_transition(transition_file)
    if fmt is ShowFormat.tree:
        from nereus.render.tree import tree_text

        if output:
            write_text_atomic(output, tree_text(document))
        else:
            _print_tree(document, transition_file)
    elif fmt is ShowFormat.svg:
        _show_svg(document, transition_file, output)
    else:
        text = _text(document, fmt) if fmt is not ShowFormat.json else to_json(document) + "\n"
        if output:
            write_text_atomic(output, text)
        else:
            typer.echo(text, nl=False)
    if gantt:
        from nereus.render.gantt import transition_gantt_png

        write_bytes_atomic(gantt, transition_gantt_png(document))
        typer.echo(f"wrote {gantt}", err=True)


def _text(document: Transition, fmt: ShowFormat) -> str:
    if fmt is ShowFormat.dot:
        from nereus.render.dot import transition_dot

        return transition_dot(document)
    from nereus.render.perfetto import transition_trace

    return transition_trace(document) + "\n"


def _show_svg(document: Transition, source: Path, output: Path | None) -> None:
    from nereus.render.dot import transition_dot
    from nereus.spec.io import write_bytes_atomic, write_text_atomic

    dot_text = transition_dot(document)
    dot = shutil.which("dot")
    if dot is None:
        dot_path = (output or source).with_suffix(".dot")
        write_text_atomic(dot_path, dot_text)
        typer.echo(
            f"Graphviz `dot` is not on PATH, so no SVG; wrote the DOT text to {dot_path} "
            f"(install graphviz, or render it with `dot -Tsvg {dot_path} -o {dot_path.with_suffix('.svg')}`)",
            err=True,
        )
        return
    run = subprocess.run([dot, "-Tsvg"], input=dot_text.encode(), capture_output=True, check=False, timeout=300)
    if run.returncode:
        detail = (run.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[0]
        raise NereusError(f"`dot -Tsvg` failed (exit {run.returncode}): {detail}")
    if output:
        write_bytes_atomic(output, run.stdout)
    else:
        typer.echo(run.stdout.decode(errors="replace"), nl=False)


def _print_tree(document: Transition, source: Path) -> None:
    from rich.console import Console
    from rich.text import Text
    from rich.tree import Tree

    from nereus.render.tree import stage_branches

    s = document.summary
    title = (
        f"{source}: {document.target.workload.name} on {document.target.cluster.name}, "
        f"{len(document.primitives)} primitives, makespan {s.makespan_s:.3f} s"
        + ("" if s.feasible else f", INFEASIBLE: {'; '.join(s.blocking_cycle)}")
    )
    tree = Tree(Text(title, style="bold"))
    branches = stage_branches(document)
    widest = max(
        [len(title), *(len(b.heading) + 4 for b in branches), *(len(x) + 8 for b in branches for x in b.lines)]
    )
    for branch in branches:
        node = tree.add(Text(branch.heading, style="" if branch.lines else "dim"))
        for line, kind in zip(branch.lines, branch.kinds, strict=True):
            node.add(Text(line, style=KIND_STYLES[kind]))
    Console(width=widest + 1).print(tree)


def register(app: typer.Typer) -> None:
    app.add_typer(dag_app, name="dag", help="Transition DAGs between two plans (`dag build A B`, `dag show T`).")

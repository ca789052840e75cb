"""The typer application, its global options and the user-error boundary."""

from __future__ import annotations

import errno
import sys
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from nereus import __version__
from nereus.errors import ArgumentError, NereusError

#: The command-line flag of each library argument an `ArgumentError` names.
ARGUMENT_FLAGS = {
    "activation_cap": "--act-cap",
    "device": "--device",
    "first_step": "--from-step",
    "from_previous": "--resume-from-previous",
    "num_batches": "--batches",
    "num_ranks": "--nproc",
    "num_steps": "--steps",
    "out": "--out",
    "plan_path": "--plan",
    "resume": "`nereus run --resume`",
    "seeds": "--seeds",
    "time_limit_s": "--time-limit",
    "trace_path": "--trace",
    "vllm": "--vllm",
}


#: OSErrors that are the machine's state, not a bug in nereus, and what to do about each:
#: one `error:` line naming the file, exit 1 (the writers never leave a half-written file).
MACHINE_ERRORS = {
    errno.ENOSPC: "free some space or write elsewhere",
    errno.EDQUOT: "free some space or write elsewhere",
    errno.EROFS: "write elsewhere",
    errno.EACCES: "write elsewhere or change its permissions",
    errno.EPERM: "write elsewhere or change its permissions",
    errno.EISDIR: "give a file name",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.ENAMETOOLONG: "give a shorter name",
}


def machine_error(exc: OSError) -> str | None:
    """The one line for an OSError in MACHINE_ERRORS, or None (a bug: shown as one)."""
    if exc.errno not in MACHINE_ERRORS:
        return None
    where = exc.filename if exc.filename is not None else "a file"
    return f"{where}: {exc.strerror}; {MACHINE_ERRORS[exc.errno]}"


class _Options:
    """Global flags, set by the callback before any command runs."""

    debug = False


class NereusGroup(TyperGroup):
    """Turns user errors into one line on stderr and exit code 1 (no traceback)."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except NereusError as exc:
            if _Options.debug:
                raise
            shown = exc.render(ARGUMENT_FLAGS) if isinstance(exc, ArgumentError) else str(exc)
            for line in getattr(exc, "problems", [shown]):
                typer.echo(f"error: {line}", err=True)
            raise typer.Exit(getattr(exc, "exit_code", 1)) from None
        except BrokenPipeError:  # output piped into `head`: stop quietly
            sys.stderr.close()
            raise typer.Exit(0) from None
        except Exception as exc:
            # Usage errors and exits are typer's (or click's) own: let them through.
            if _Options.debug or type(exc).__module__.split(".")[0] in ("typer", "click"):
                raise
            line = machine_error(exc) if isinstance(exc, OSError) else None
            if line is not None:  # a full disk, a read-only folder: the machine, not nereus
                typer.echo(f"error: {line}", err=True)
                raise typer.Exit(1) from None
            # A bug in nereus, not a user error: still no traceback without --debug.
            typer.echo(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", err=True)
            raise typer.Exit(3) from None


app = typer.Typer(
    cls=NereusGroup,
    name="nereus",
    help="Adaptive parallelism and stage fusion for RL post-training of LLMs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"nereus {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show Python tracebacks for errors.")] = False,
) -> None:
    """Adaptive parallelism and stage fusion for RL post-training of LLMs."""
    _Options.debug = debug


def register_commands() -> None:
    """Attach every command module to `app` (imports stay light: no torch)."""
    from nereus.cli import (
        dag_commands,
        export_commands,
        plan_commands,
        profile_commands,
        report_commands,
        run_commands,
        schedule_commands,
        simulate_commands,
        spec_commands,
        trace_commands,
    )

    modules = (
        spec_commands,
        plan_commands,
        dag_commands,
        export_commands,
        schedule_commands,
        trace_commands,
        simulate_commands,
        run_commands,
        profile_commands,
        report_commands,
    )
    for module in modules:
        module.register(app)


register_commands()


def main() -> None:
    """Console-script entry point."""
    sys.exit(app())

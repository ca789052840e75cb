"""`nereus profile` (measure this machine) and `nereus fit` (calibrate the cost model to runs)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from nereus.cli.inputs import MAX_LOCAL_RANKS
from nereus.cli.outputs import check_output
from nereus.cli.progress import progress_bar
from nereus.errors import NereusError

if TYPE_CHECKING:
    from nereus.cost.calibration import Calibration
    from nereus.cost.fit import ErrorReport, FitResult, RunRecord
    from nereus.cost.profile import Profile
    from nereus.spec.model import Model

#: Models profiled when neither --model nor --plan names any: small enough for a CPU.
DEFAULT_PROFILE_MODELS = ("tiny", "tiny-wide")


def _profile_models(models: list[str] | None, plan: Path | None) -> tuple[Model, ...]:
    from nereus.cli.inputs import load_kind, resolve_model
    from nereus.spec.plan import Plan

    chosen = [resolve_model(name) for name in models or []]
    if plan is not None:
        chosen += load_kind(str(plan), Plan).models  # type: ignore[attr-defined]
    if not chosen:
        chosen = [resolve_model(name) for name in DEFAULT_PROFILE_MODELS]
    return tuple({m.name: m for m in chosen}.values())


def profile(
    output: Annotated[Path, typer.Option("-o", "--output", help="Write the Profile to this YAML/JSON file.")],
    nproc: Annotated[
        int, typer.Option("--nproc", min=1, max=MAX_LOCAL_RANKS, help="Local ranks for the collectives (1 skips them).")
    ] = 2,
    device: Annotated[Literal["cpu", "cuda"], typer.Option(help="Measure the CPU (gloo) or the GPUs (NCCL).")] = "cpu",
    quick: Annotated[bool, typer.Option("--quick", help="Fewer, shorter measurements (under a minute).")] = False,
    model: Annotated[
        list[str] | None,
        typer.Option("--model", help="Model preset or YAML whose layer shapes to time (repeatable)."),
    ] = None,
    plan: Annotated[Path | None, typer.Option(help="Time the layer shapes of this plan's models.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the profile as JSON.")] = False,
    vllm: Annotated[
        bool,
        typer.Option(
            "--vllm", help="Also start a tiny vLLM engine in-process and time its start-up, weight load, sleep/wake."
        ),
    ] = False,
) -> None:
    """Measure GEMMs, attention, memory bandwidth, collectives and communicator set-up here.

    Models default to the tiny presets. `nereus plan --profile FILE` plans for the measured
    machine instead of a preset cluster; `nereus fit --profile FILE` starts from its communicator
    set-up and, with --vllm, its vLLM engine times.
    """
    from nereus.runtime.observe.profiling import ProfileConfig, run_profile
    from nereus.spec.io import save_document, to_data

    check_output(output, "-o")
    config = ProfileConfig(_profile_models(model, plan), num_ranks=nproc, device=device, quick=quick, vllm=vllm)
    started = time.perf_counter()
    with progress_bar("profiling") as progress:
        try:
            measured = run_profile(config, progress)
        except ValueError as exc:
            raise NereusError(str(exc)) from None
    wall_s = time.perf_counter() - started
    save_document(measured, output)
    if as_json:
        typer.echo(json.dumps({"profile": to_data(measured), "wall_s": wall_s, "output": str(output)}, indent=2))
        return
    _print_profile(measured, wall_s, output)


def _print_profile(measured: Profile, wall_s: float, output: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=110)
    console.print(
        f"{measured.device_name}: {measured.num_ranks} ranks x {measured.threads_per_rank} thread, "
        f"{measured.backend}, {measured.dtype}"
    )
    best = max(measured.gemm, key=lambda g: g.flops_per_s)
    worst = min(measured.gemm, key=lambda g: g.flops_per_s)
    console.print(
        f"GEMM      {best.flops_per_s / 1e9:8.1f} GFLOP/s best (m={best.m} k={best.k} n={best.n}), "
        f"{worst.flops_per_s / 1e9:.1f} worst (m={worst.m} k={worst.k} n={worst.n}), {len(measured.gemm)} shapes"
    )
    for a in measured.attention:
        console.print(
            f"attention {a.flops_per_s / 1e9:8.1f} GFLOP/s (b={a.batch} h={a.heads} s={a.seq_len} d={a.head_dim})"
        )
    console.print(f"memory    {measured.memory_bytes_per_s / 1e9:8.1f} GB/s copy")
    if measured.host_adam_params_per_s is not None:
        console.print(f"host adam {measured.host_adam_params_per_s / 1e9:8.2f} G params/s (AdamW step, every thread)")
    if measured.collectives:
        table = Table(title="collectives", title_justify="left")
        for column in ("op", "ranks", "latency (us)", "bandwidth (GB/s)", "largest (MiB)", "its time (ms)"):
            table.add_column(column, justify="left" if column == "op" else "right")
        for c in measured.collectives:
            largest = c.sizes[-1]
            table.add_row(
                c.op,
                str(c.num_ranks),
                f"{c.latency_s * 1e6:.0f}",
                f"{c.bytes_per_s / 1e9:.2f}",
                f"{largest.bytes / 2**20:.0f}",
                f"{largest.seconds * 1e3:.2f}",
            )
        console.print(table)
    if measured.communicator_setup_s is not None:
        console.print(f"new communicator: {measured.communicator_setup_s * 1e3:.1f} ms")
    engine = measured.vllm
    if engine is not None:
        sleep = "no sleep mode"
        if engine.sleep_s is not None and engine.wake_s is not None:
            sleep = f"sleep {engine.sleep_s:.2f} s, wake {engine.wake_s:.2f} s"
        console.print(
            f"vLLM {engine.vllm_version} engine: start {engine.engine_start_s:.1f} s, weight load "
            f"{engine.weight_load_s * 1e3:.1f} ms ({engine.weight_load_bytes_per_s / 1e9:.2f} GB/s), {sleep}, "
            f"{engine.tokens_per_s:.0f} tokens/s ({engine.model_params / 1e6:.2f}M-parameter model)"
        )
    console.print(f"wrote {output} in {wall_s:.1f} s")


def fit(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            help="Output folders of `nereus run` (plan.yaml, metrics.jsonl), or the trainer logs of --from."
        ),
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="Write the Calibration to this YAML/JSON file.")],
    profile_file: Annotated[
        Path | None,
        typer.Option("--profile", help="Price the runs on this Profile's machine (as `nereus plan --profile` will)."),
    ] = None,
    start: Annotated[
        Path | None, typer.Option("--calibration", help="Calibration to start from (default: the built-in one).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the fit and its errors as JSON.")] = False,
    source: Annotated[
        Literal["nereus", "verl", "openrlhf"],
        typer.Option(
            "--from", help="Whose runs: nereus run folders, verl JSON-lines metrics, or OpenRLHF stdout logs."
        ),
    ] = "nereus",
    plans: Annotated[
        list[Path] | None,
        typer.Option("--plan", help="With --from verl|openrlhf: the plan each log ran (one for all, or one per log)."),
    ] = None,
) -> None:
    """Fit the cost model's efficiencies to measured per-model-stage step times (least squares).

    The first 2 steps of every run are warm-up and are dropped. With runs of two or more
    plans, each plan's runs are also predicted by a fit on the other plans' runs (held-out
    error; never trained and tested on the same plan). Use the result with
    `nereus plan --calibration FILE` (and the same --profile).
    """
    from nereus.cli.inputs import load_kind
    from nereus.cost.calibration import Calibration
    from nereus.cost.fit import fit_calibration, held_out_errors, run_errors
    from nereus.cost.profile import Profile, cluster_from_profile
    from nereus.cost.vllm_engine import with_measured_engine
    from nereus.spec.io import save_document, to_data

    check_output(output, "-o")
    the_start = load_kind(str(start), Calibration) if start else Calibration()
    assert isinstance(the_start, Calibration)
    cluster = None
    try:
        if profile_file is not None:
            the_profile = load_kind(str(profile_file), Profile)
            assert isinstance(the_profile, Profile)
            cluster = cluster_from_profile(the_profile, str(profile_file))
            if the_profile.communicator_setup_s is not None:
                the_start = the_start.model_copy(update={"communicator_setup_s": the_profile.communicator_setup_s})
            the_start = with_measured_engine(the_start, the_profile.vllm)
        runs = _read_runs(source, run_dirs, plans or [])
        with progress_bar("fitting") as progress:
            result = fit_calibration(runs, the_start, cluster, progress)
            held_out = held_out_errors(runs, the_start, cluster)
    except ValueError as exc:
        raise NereusError(str(exc)) from None
    calibration = result.calibration
    in_sample = run_errors(runs, calibration, cluster)
    save_document(calibration, output)
    if as_json:
        payload = {
            "calibration": to_data(calibration),
            "fitted": result.fitted,
            "identified": result.identified,
            "not_identified": result.not_identified,
            "relative_standard_error": result.relative_error,
            "in_sample": in_sample.summary(),
            "held_out": held_out.summary() if held_out else None,
        }
        typer.echo(json.dumps(payload, indent=2, default=_nan_to_none))
        return
    _print_fit(result, the_start, in_sample, held_out, output)


def _read_runs(source: str, paths: list[Path], plans: list[Path]) -> list[RunRecord]:
    from nereus.cli.inputs import load_kind
    from nereus.cost.fit import read_run
    from nereus.interop.logs import read_trainer_runs
    from nereus.spec.plan import Plan

    if source == "nereus":
        if plans:
            raise NereusError("--plan: nereus run folders hold their plan; drop --plan or add --from verl|openrlhf")
        return [read_run(run_dir) for run_dir in paths]
    if not plans:
        raise NereusError(f"--from {source} needs --plan PLAN.yaml: the plan the logged run used")
    loaded = [load_kind(str(path), Plan) for path in plans]
    return read_trainer_runs(source, paths, loaded)  # type: ignore[arg-type]


def _nan_to_none(value: object) -> object:
    return None if isinstance(value, float) and math.isnan(value) else str(value)


def _print_fit(
    result: FitResult, start: Calibration, in_sample: ErrorReport, held_out: ErrorReport | None, output: Path
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=110)
    calibration = result.calibration
    known = [
        f"{name} {getattr(calibration, name):.4g} ±{result.relative_error[name]:.1%}" for name in result.identified
    ]
    console.print("identified (± relative standard error): " + (", ".join(known) or "none"))
    if result.not_identified:
        leaning = [f"{name} {getattr(calibration, name):.4g}" for name in result.not_identified]
        console.print("not identified by these runs, pulled towards the starting calibration: " + ", ".join(leaning))
    console.print(f"pools of a phase run concurrently: {calibration.concurrent_pools}")
    table = Table(title="mean absolute error (medians per run)", title_justify="left")
    for column in ("model-stage", "in-sample", "held-out plans"):
        table.add_column(column, justify="left" if column == "model-stage" else "right")
    for key in [*in_sample.keys(), "step"]:
        other = f"{held_out.mape(key):.1%}" if held_out else "-"
        table.add_row(key, f"{in_sample.mape(key):.1%}", other)
    console.print(table)
    if held_out:
        console.print(f"step, held-out plans: max error {held_out.step_max:.1%} over {len(held_out.runs)} runs")
    else:
        console.print("held-out error needs runs of at least two different plans")
    console.print(f"wrote {output}")


def register(app: typer.Typer) -> None:
    app.command("profile")(profile)
    app.command("fit")(fit)

"""Careless input to every command: random option values and random or mutated files.

Each command runs in-process (CliRunner) under a bound on the CPU time it spends
(CALL_LIMIT_S, enforced with a profiling timer so a spinning command fails the test instead of
stalling it, however loaded the machine) and a far wider wall-clock bound for one that blocks
(WALL_LIMIT_S). Whatever it is given, it must
end with exit 0 (the input happened to be valid), 1 (one `error:` line on stderr; `check`
reports on stdout) or 2 (a usage error), never a traceback or an internal error (exit 3), and
a failed command leaves no output file behind. `run` and `profile` stop where the work would
begin (their launch is replaced by a sentinel), so only their input checking is exercised.

Examples per command are in EXAMPLES; the whole file takes about a minute on one core.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cli_helpers import invoke, one_error_line
from tests.run_helpers import write_config

pytestmark = pytest.mark.cli

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES_DIR = ROOT / "examples"
DATA = ROOT / "tests" / "data"
#: CPU seconds one command may spend on careless input before it counts as hung: a hang bound, not
#: a speed check (speed lives in benchmarks/). CPU time, not wall time, so that the bound does not
#: depend on how loaded the machine is (the other xdist worker's ranks share its cores). Measured:
#: every bounded call of three runs of this file (561) took under 1 s; of 1,600 careless `plan`
#: calls, all but `--top 15756` (40 s: now refused, `plan_commands.MAX_TOP`) under 7 s; the
#: slowest careless plan found by hand (a model file with a dimension of 10**30, so that nothing
#: fits up to 65536 GPUs and every doubled count is priced) about 3 s of CPU.
CALL_LIMIT_S = 30
#: Wall-clock seconds before a command that blocks (spends no CPU) counts as hung.
WALL_LIMIT_S = 300
#: Hypothesis examples per command (kept modest: the file stays near a minute on one core).
EXAMPLES = {
    "check": 25,
    "plan": 8,
    "plan explain": 10,
    "dag build": 8,
    "dag show": 15,
    "schedule fuse": 10,
    "schedule migrate": 8,
    "simulate": 8,
    "trace generate": 15,
    "trace show": 15,
    "profile": 10,
    "fit": 10,
    "report": 10,
    "run": 10,
    "export verl": 10,
    "export openrlhf": 10,
}


class Hung(BaseException):
    """A command ran past CALL_LIMIT_S or WALL_LIMIT_S (a BaseException: no handler in nereus swallows it)."""


class Accepted(BaseException):
    """The command accepted its input and reached the expensive part (run, profile)."""


@contextmanager
def time_limit(cpu_seconds: int, wall_seconds: int = WALL_LIMIT_S) -> Iterator[None]:
    """Raise Hung in the block once the process has spent `cpu_seconds` of CPU in it (SIGPROF),
    or `wall_seconds` have passed (SIGALRM)."""

    def expire(signum: int, frame: Any) -> None:
        spent = f"{cpu_seconds} s of CPU" if signum == signal.SIGPROF else f"{wall_seconds} s"
        raise Hung(f"over {spent}")

    previous = {sig: signal.signal(sig, expire) for sig in (signal.SIGPROF, signal.SIGALRM)}
    signal.setitimer(signal.ITIMER_PROF, cpu_seconds)
    signal.setitimer(signal.ITIMER_REAL, wall_seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_the_hang_bound_counts_cpu_time_and_wall_time() -> None:
    with pytest.raises(Hung, match="over 1 s of CPU"), time_limit(1):
        while True:
            pass
    with pytest.raises(Hung, match=r"over 1 s$"), time_limit(30, wall_seconds=1):
        time.sleep(5)  # blocking spends no CPU: the wall-clock bound ends it
    with time_limit(1):
        time.sleep(1.5)  # a wait that spends no CPU is not a hang under the CPU bound


# ---- careless files ----

JUNK_VALUES: list[Any] = [-1, 0, -0.5, 1e308, 10**30, "", "x", None, [], {}, True, "nan", 3.5, "-1"]


@dataclass(frozen=True)
class FileArg:
    """A file to materialise: `content` (None: a path that does not exist; b"/" a folder).
    With `argv` False it is only put beside the others (a file a config names)."""

    name: str
    content: bytes | None
    argv: bool = True


@dataclass(frozen=True)
class RunFolderArg:
    """A copy of the module's finished run folder with one of its files damaged (or none)."""

    pick: int
    how: str
    """keep, delete, flip, truncate, garbage, empty, or value (replace a YAML/JSON value)."""
    junk: Any
    name: str = "run"


#: The finished run folder RunFolderArg copies (set by the `run_folder` fixture).
RUN_FOLDER: list[Path] = []


def _leaves(data: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(data, dict):
        return [path] + [leaf for key, value in data.items() for leaf in _leaves(value, (*path, key))]
    if isinstance(data, list):
        return [path] + [leaf for i, value in enumerate(data) for leaf in _leaves(value, (*path, i))]
    return [path]


def _mutate_structure(text: str, pick: int, junk: Any, delete: bool) -> bytes:
    data = yaml.safe_load(text)
    leaves = [leaf for leaf in _leaves(data) if leaf]
    if not leaves:
        return yaml.safe_dump(junk).encode()
    where = leaves[pick % len(leaves)]
    parent = data
    for key in where[:-1]:
        parent = parent[key]
    if delete:
        del parent[where[-1]]
    else:
        parent[where[-1]] = junk
    return yaml.safe_dump(data).encode()


def _mutate_bytes(raw: bytes, pick: int, how: str) -> bytes:
    if not raw:
        return b"\xff"
    at = pick % len(raw)
    if how == "flip":
        return raw[:at] + bytes([raw[at] ^ 0xA5]) + raw[at + 1 :]
    if how == "truncate":
        return raw[:at]
    return b"\x00\x81garbage:\n  - [" if how == "garbage" else b""


def careless_file(source: Path, name: str | None = None, others: tuple[Path, ...] = ()) -> st.SearchStrategy[FileArg]:
    """`source` as given, mutated (a value replaced or deleted, a byte flipped, truncated,
    garbage, empty), another kind of file, a folder, or no file at all."""
    name = name or source.name
    raw = source.read_bytes()
    structural = st.builds(
        lambda pick, junk, delete: FileArg(name, _mutate_structure(raw.decode(), pick, junk, delete)),
        st.integers(0, 10**6),
        st.sampled_from(JUNK_VALUES),
        st.booleans(),
    )
    damaged = st.builds(
        lambda pick, how: FileArg(name, _mutate_bytes(raw, pick, how)),
        st.integers(0, 10**6),
        st.sampled_from(["flip", "truncate", "garbage", "empty"]),
    )
    elsewhere = [FileArg(name, other.read_bytes()) for other in others]
    fixed = st.sampled_from([FileArg(name, raw), FileArg(name, None), FileArg(name, b"/"), *elsewhere])
    return st.one_of(structural, structural, damaged, fixed)


def materialise(arg: Any, folder: Path) -> str | None:
    if isinstance(arg, RunFolderArg):
        return str(_damaged_run(arg, folder / arg.name))
    if not isinstance(arg, FileArg):
        return str(arg)
    path = folder / arg.name
    if arg.content == b"/":
        path.mkdir(exist_ok=True)
    elif arg.content is not None:
        path.write_bytes(arg.content)
    return str(path) if arg.argv else None


def _numbered(arg: Any, index: int) -> Any:
    if isinstance(arg, FileArg) and arg.argv:
        return FileArg(f"{index}-{arg.name}", arg.content)
    if isinstance(arg, RunFolderArg):
        return RunFolderArg(arg.pick, arg.how, arg.junk, f"run-{index}")
    return arg


def _damaged_run(arg: RunFolderArg, target: Path) -> Path:
    shutil.copytree(RUN_FOLDER[0], target)
    files = sorted(path for path in target.rglob("*") if path.is_file())
    victim = files[arg.pick % len(files)]
    if arg.how == "delete":
        victim.unlink()
    elif arg.how == "value" and victim.suffix in (".yaml", ".json"):
        victim.write_bytes(_mutate_structure(victim.read_text(), arg.pick // len(files), arg.junk, False))
    elif arg.how != "keep":
        victim.write_bytes(_mutate_bytes(victim.read_bytes(), arg.pick // len(files), arg.how))
    return target


def run_folder() -> st.SearchStrategy[RunFolderArg]:
    hows = ["keep", "delete", "flip", "truncate", "garbage", "empty", "value", "value"]
    return st.builds(RunFolderArg, st.integers(0, 10**6), st.sampled_from(hows), st.sampled_from(JUNK_VALUES))


def junk_text() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(["-1", "0", "1", "nan", "inf", "1e309", "", " ", "x,y", "8,", ",4", "4,4", "0.001"]),
        st.integers(-(10**6), 10**6).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.text(max_size=8),
    )


def options(**choices: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """Any subset of the options, each with a careless value; `--flag=True` means a bare flag."""
    pairs = [st.tuples(st.just(f"--{name.replace('_', '-')}"), value) for name, value in choices.items()]
    chosen = st.lists(st.one_of(*pairs), max_size=len(pairs)) if pairs else st.just([])
    return chosen.map(
        lambda items: [part for flag, value in items for part in ([flag] if value is True else [flag, value])]
    )


# ---- the oracle ----


def run_carelessly(command: list[str], args: list[Any], output: str | None = None) -> None:
    """Invoke `nereus COMMAND ARGS` on materialised files and check how it ended."""
    with tempfile.TemporaryDirectory(prefix="careless-") as name:
        folder = Path(name)
        named = [_numbered(arg, i) for i, arg in enumerate(args)]  # an option given twice gets two files
        argv = [*command, *(part for part in (materialise(arg, folder) for arg in named) if part is not None)]
        out = folder / output if output else None
        if out is not None:
            argv += ["-o", str(out)]
        before = set(folder.iterdir())
        try:
            with time_limit(CALL_LIMIT_S):
                result = invoke(*argv)
        except Accepted:
            return
        shown = f"nereus {' '.join(argv)} -> exit {result.exit_code}\n{result.output}"
        assert result.exit_code in (0, 1, 2), shown
        assert "Traceback" not in result.output and "internal error" not in result.output, shown
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise AssertionError(shown) from result.exception
        if result.exit_code == 1 and command != ["check"]:
            assert any(line.startswith("error: ") for line in result.stderr.splitlines()), shown
        if result.exit_code != 0 and "no safe order" not in result.stderr:  # dag build writes an infeasible DAG
            assert set(folder.iterdir()) == before, f"{shown}\nleft behind: {set(folder.iterdir()) - before}"


def careless(command: str, strategy: st.SearchStrategy[list[Any]], output: str | None = None) -> Callable[..., None]:
    """A hypothesis test of `command` over argument lists drawn from `strategy`."""

    @settings(
        max_examples=EXAMPLES[command],
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(args=strategy)
    def test(args: list[Any]) -> None:
        run_carelessly(command.split(), args, output)

    return test


PLAN = EXAMPLES_DIR / "plan-tiny-ppo-4rank.yaml"
PLAN_B = EXAMPLES_DIR / "plan-tiny-ppo-4rank-relaid.yaml"
TRANSITION = EXAMPLES_DIR / "transition-tiny-ppo-4rank.yaml"
WORKLOAD = EXAMPLES_DIR / "workload-ppo.yaml"
CLUSTER = EXAMPLES_DIR / "cluster-h100-2x8.yaml"
MODEL = EXAMPLES_DIR / "model-llama-3.1-8b.yaml"
TRACE = DATA / "trace-spot-2rank.yaml"
KINDS = (PLAN, WORKLOAD, TRACE, TRANSITION)


def plan_file(name: str = "plan.yaml", source: Path = PLAN) -> st.SearchStrategy[FileArg]:
    return careless_file(source, name, (WORKLOAD, TRANSITION))


test_check = careless(
    "check",
    st.tuples(careless_file(PLAN, others=KINDS), careless_file(TRACE, "t.yaml"), options(strict=st.just(True))).map(
        lambda t: [t[0], t[1], *t[2]]
    ),
)
test_plan = careless(
    "plan",
    options(
        gpus=junk_text(),
        cluster=st.one_of(st.sampled_from(["h100", "a100-80gb-4x8", "nope"]), careless_file(CLUSTER, "c.yaml")),
        model=st.one_of(st.sampled_from(["llama-3.1-8b", "tiny", "nope"]), careless_file(MODEL, "m.yaml")),
        workload=st.one_of(st.sampled_from(["ppo", "grpo", "x"]), careless_file(WORKLOAD, "w.yaml")),
        seq_len=junk_text(),
        top=junk_text(),
        json=st.just(True),
    ),
    output="best.yaml",
)
test_plan_explain = careless(
    "plan explain", st.tuples(plan_file(), options(json=st.just(True))).map(lambda t: [t[0], *t[1]])
)
test_dag_build = careless(
    "dag build",
    st.tuples(
        plan_file("a.yaml"), plan_file("b.yaml", PLAN_B), options(json=st.just(True), time_limit=junk_text())
    ).map(lambda t: [t[0], t[1], *t[2]]),
    output="t.yaml",
)
test_dag_show = careless(
    "dag show",
    st.tuples(
        careless_file(TRANSITION, "t.yaml", (PLAN,)),
        options(format=st.sampled_from(["tree", "dot", "json", "perfetto", "png", ""])),
    ).map(lambda t: [t[0], *t[1]]),
    output="shown.txt",
)
test_schedule_fuse = careless(
    "schedule fuse",
    st.one_of(
        st.tuples(plan_file(), options(act_cap=junk_text(), p2p_latency=junk_text())).map(
            lambda t: ["--plan", t[0], *t[1]]
        ),
        options(stages=junk_text(), microbatches=junk_text(), fwd=junk_text(), bwd=junk_text(), act=junk_text()),
    ).map(lambda args: ["--time-limit", "0.05", "--seeds", "1", *args]),
    output="s.yaml",
)
test_schedule_migrate = careless(
    "schedule migrate",
    st.tuples(plan_file(), options(batches=st.sampled_from(["0", "1", "-3", "x"]), seed=junk_text())).map(
        lambda t: ["--plan", t[0], *t[1]]
    ),
)
test_trace_generate = careless(
    "trace generate",
    st.tuples(
        st.sampled_from(["spot", "seq-growth", "combined", "growing-pool", "nope"]),
        options(
            steps=st.sampled_from(["2", "30", "0", "-5", "x", "1e3"]),
            gpus=junk_text(),
            start_tokens=junk_text(),
            end_tokens=junk_text(),
            changes=junk_text(),
            hours=junk_text(),
            block_gpus=junk_text(),
            min_gpus=junk_text(),
            end_gpus=junk_text(),
        ),
    ).map(lambda t: [t[0], "--steps", "30", *t[1]]),
    output="trace.yaml",
)
test_simulate = careless(
    "simulate",
    st.tuples(
        careless_file(TRACE, "t.yaml", (PLAN,)),
        plan_file("p.yaml", DATA / "plan-tiny-ppo-2rank.yaml"),
        options(
            policy=st.sampled_from(["nereus", "fixed", "dynarl", "periodic:2", "periodic:0", "x"]),
            compare=st.just(True),
            noise=junk_text(),
            seed=junk_text(),
            json=st.just(True),
            log=st.just(FileArg("log.json", None)),
        ),
    ).map(lambda t: [t[0], "--plan", t[1], *t[2]]),
)
test_export_verl = careless(
    "export verl",
    st.tuples(plan_file(), options(format=st.sampled_from(["yaml", "overrides", "toml"]), json=st.just(True))).map(
        lambda t: [t[0], *t[1]]
    ),
    output="verl.yaml",
)
test_export_openrlhf = careless(
    "export openrlhf",
    st.tuples(plan_file(), options(json=st.just(True))).map(lambda t: [t[0], *t[1]]),
    output="openrlhf.txt",
)
test_trace_show = careless(
    "trace show",
    st.tuples(careless_file(TRACE, "t.yaml", (PLAN,)), options(json=st.just(True))).map(lambda t: [t[0], *t[1]]),
)


def stop_before_work(patch: pytest.MonkeyPatch) -> None:
    """`run` and `profile` raise Accepted where the ranks would start."""

    def accepted(*args: Any, **kwargs: Any) -> Any:
        raise Accepted

    patch.setattr("nereus.runtime.run.launch.launch", accepted)
    patch.setattr("nereus.runtime.observe.profiling.run_profile", accepted)


_profile = careless(
    "profile",
    options(
        nproc=junk_text(),
        device=st.sampled_from(["cpu", "cuda", "tpu"]),
        model=st.one_of(st.sampled_from(["tiny", "nope"]), careless_file(MODEL, "m.yaml")),
        plan=plan_file(),
    ),
    output="profile.yaml",
)


def test_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    stop_before_work(monkeypatch)
    _profile()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real 3-step run folder (report, fit and run --resume get damaged copies of it)."""
    folder = tmp_path_factory.mktemp("run")
    config = write_config(folder, num_steps=3, checkpoint_every=3)
    result = invoke("run", config, "--out", folder / "out")
    assert result.exit_code == 0, result.output
    RUN_FOLDER[:] = [folder / "out"]
    yield folder / "out"
    RUN_FOLDER.clear()


RUN_CONFIG = yaml.safe_dump(
    {"kind": "RunConfig", "version": 1, "plan": "plan.yaml", "num_steps": 3, "rl": {"max_new_tokens": 4}}
).encode()
_config = Path(tempfile.mkdtemp(prefix="careless-config-")) / "run.yaml"
_config.write_bytes(RUN_CONFIG)
_run = careless(
    "run",
    st.one_of(
        st.tuples(
            careless_file(_config, "run.yaml", (PLAN,)),
            options(
                plan=plan_file("p.yaml", DATA / "plan-tiny-ppo-2rank.yaml"),
                nproc=junk_text(),
                steps=junk_text(),
                trace=careless_file(TRACE, "t.yaml"),
                policy=st.sampled_from(["nereus", "fixed", "periodic:0", "periodic:x", "nope"]),
            ),
        ).map(lambda t: [FileArg("plan.yaml", (DATA / "plan-tiny-ppo-2rank.yaml").read_bytes(), False), t[0], *t[1]]),
        st.tuples(run_folder(), options(steps=junk_text(), nproc=junk_text(), resume_from_previous=st.just(True))).map(
            lambda t: ["--resume", t[0], *t[1]]
        ),
    ),
)
_report = careless(
    "report",
    st.tuples(run_folder(), options(from_step=junk_text(), json=st.just(True))).map(lambda t: [t[0], *t[1]]),
)
_fit = careless(
    "fit",
    st.tuples(run_folder(), options(json=st.just(True), calibration=careless_file(MODEL, "c.yaml"))).map(
        lambda t: [t[0], *t[1]]
    ),
    output="calibration.yaml",
)


@pytest.mark.multiprocess
def test_run(finished_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stop_before_work(monkeypatch)
    _run()


@pytest.mark.multiprocess
def test_report(finished_run: Path) -> None:
    _report()


@pytest.mark.multiprocess
def test_fit(finished_run: Path) -> None:
    _fit()


# ---- regressions the careless inputs found ----


@pytest.mark.multiprocess
def test_report_and_resume_name_a_file_that_is_not_utf8(finished_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(finished_run, out)
    (out / "metrics.jsonl").write_bytes(b"\x93" + (out / "metrics.jsonl").read_bytes())
    line = one_error_line(invoke("report", out))
    assert line.endswith("metrics.jsonl: not UTF-8 text (bad byte at offset 0); the file is damaged"), line
    line = one_error_line(invoke("run", "--resume", out, "--steps", "5"))
    assert "metrics.jsonl: not UTF-8 text" in line, line
    (out / "metrics.jsonl").write_bytes((finished_run / "metrics.jsonl").read_bytes())
    rank_log = out / "timeline" / "rank-0.jsonl"
    rank_log.write_bytes(b"\x93" + rank_log.read_bytes())
    assert "rank-0.jsonl: not UTF-8 text" in one_error_line(invoke("report", out))


def test_migrate_refuses_a_negative_seed_as_a_usage_error() -> None:
    result = invoke("schedule", "migrate", "--plan", PLAN, "--seed", "-1")
    assert result.exit_code == 2 and "Traceback" not in result.output

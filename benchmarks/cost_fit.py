"""How well does the calibrated cost model predict real RL steps? (issue 9)

Sweeps distinct (plan, workload size) points of the tiny PPO workload on 2 CPU ranks with
one thread each, `nereus run ... --steps 8` per point (subprocess), after `nereus profile
--quick` measured the machine. The cost model is fitted (`nereus fit`'s library) on the runs
of half the plans and predicts the step latency of the other half's runs: mean and maximum
absolute percentage error. Then the planner, with the calibrated model on the profiled
cluster, picks a plan for each workload size; that plan is run too and compared with the
fastest measured plan of the sweep at that size.

The workload is tiny-ppo with a rule-based reward (`reward: null`): the runtime scores
responses by rule, so no reward model should be priced. Prints a table, writes
benchmarks/results/cost_fit.json. About 10 minutes on 2 idle cores (more under load).

    .venv/bin/python benchmarks/cost_fit.py [--steps 8] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _record import Started, begin, write_result

from nereus.spec.stages import (
    ACTOR_GENERATION,
    ACTOR_INFERENCE,
    ACTOR_TRAINING,
    CRITIC_INFERENCE,
    CRITIC_TRAINING,
    REFERENCE_INFERENCE,
    is_trained,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "cost_fit.json"
NEREUS = [str(Path(sys.executable).parent / "nereus")]

#: Layouts per model-stage: (tp, pp, dp, emus, micro_batches); pools "all" = [0, 1] unless split.
COLOCATED = ("all", [0, 1])
Layout = tuple[int, int, int, list[list[int]], int]
TP2: Layout = (2, 1, 1, [[0, 1]], 1)
PP2: Layout = (1, 2, 1, [[0, 1]], 2)
DP2: Layout = (1, 1, 2, [[0], [1]], 1)
STAGES = (
    ACTOR_GENERATION,
    ACTOR_INFERENCE,
    REFERENCE_INFERENCE,
    CRITIC_INFERENCE,
    ACTOR_TRAINING,
    CRITIC_TRAINING,
)


def _with_micro(layout: Layout, micro_batches: int) -> Layout:
    return (*layout[:4], micro_batches)


def _uniform(layout: Layout, training_micro: int = 1) -> dict[str, Layout]:
    return {name: _with_micro(layout, training_micro) if is_trained(name) else layout for name in STAGES}


def sweep_layouts() -> dict[str, dict[str, Any]]:
    """Named plans: per model-stage layout and pool (None: the shared pool of both ranks)."""
    on0: Layout = (1, 1, 1, [[0]], 1)
    on1: Layout = (1, 1, 1, [[1]], 1)
    mixed = {
        ACTOR_GENERATION: TP2,
        ACTOR_INFERENCE: DP2,
        REFERENCE_INFERENCE: PP2,
        CRITIC_INFERENCE: TP2,
        ACTOR_TRAINING: PP2,
        CRITIC_TRAINING: DP2,
    }
    return {
        "all-tp2": {"layouts": _uniform(TP2)},
        "all-dp2": {"layouts": _uniform(DP2)},
        "all-pp2": {"layouts": _uniform(PP2, 2)},
        "gen-dp2-rest-tp2": {"layouts": {**_uniform(TP2), ACTOR_GENERATION: DP2}},
        "gen-dp2-train-pp2": {"layouts": {**_uniform(DP2), ACTOR_TRAINING: PP2, CRITIC_TRAINING: PP2}},
        "mixed": {"layouts": mixed},
        "dp2-micro4": {"layouts": {name: _with_micro(DP2, 4) for name in STAGES}},
        "tp2-train-micro4": {"layouts": _uniform(TP2, 4)},
        "split-gen0-train1": {
            "layouts": {
                ACTOR_GENERATION: on0,
                ACTOR_INFERENCE: on0,
                REFERENCE_INFERENCE: on0,
                CRITIC_INFERENCE: on1,
                ACTOR_TRAINING: on1,
                CRITIC_TRAINING: on1,
            },
            "pools": {"gen": [0], "train": [1]},
        },
        "split-actor0-critic1": {
            "layouts": {
                ACTOR_GENERATION: on0,
                ACTOR_INFERENCE: on0,
                REFERENCE_INFERENCE: on1,
                CRITIC_INFERENCE: on1,
                ACTOR_TRAINING: on0,
                CRITIC_TRAINING: on1,
            },
            "pools": {"gen": [0], "train": [1]},
        },
    }


#: Workload sizes: (prompts per step, max new tokens, mini-batches).
SIZES = ((8, 8, 1), (16, 12, 2), (24, 16, 2))
#: Points run a second time at the end, to measure how repeatable a measurement is here.
REPEATS = 4
#: Sizes each plan runs at (by index into SIZES): every plan at two sizes.
PLAN_SIZES = (0, 1), (1, 2), (0, 2)


def workload(prompts: int, new_tokens: int, mini_batches: int) -> dict[str, Any]:
    return {
        "kind": "Workload",
        "version": 1,
        "name": "tiny-ppo",
        "algorithm": "ppo",
        "actor": "tiny",
        "critic": "tiny",
        "reference": "tiny",
        "reward": None,
        "prompts_per_step": prompts,
        "samples_per_prompt": 1,
        "prompt_len": 16,
        "response_len": {"median": new_tokens, "p99": new_tokens, "max": new_tokens},
        "mini_batches": mini_batches,
        "micro_batch_size": 8,
        "dtype": "fp32",
    }


def make_plan(name: str, size: tuple[int, int, int], cluster: Any) -> Any:
    from nereus.spec.plan import Plan
    from nereus.spec.presets import model_preset

    spec = sweep_layouts()[name]
    pools = spec.get("pools")
    pool_list = [{"name": n, "gpus": g} for n, g in pools.items()] if pools else [{"name": "all", "gpus": [0, 1]}]
    stages = []
    for stage_name, (tp, pp, dp, emus, micro) in spec["layouts"].items():
        pool = next(p["name"] for p in pool_list if emus[0][0] in p["gpus"])
        stages.append(
            {
                "model_stage": stage_name,
                "pool": pool,
                "tp": tp,
                "pp": pp,
                "dp": dp,
                "emus": emus,
                "micro_batches": micro,
            }
        )
    return Plan.model_validate(
        {
            "kind": "Plan",
            "version": 1,
            "cluster": cluster.model_dump(mode="json"),
            "models": [model_preset("tiny").model_dump(mode="json")],
            "workload": workload(*size),
            "pools": pool_list,
            "stages": stages,
        }
    )


def run_point(plan: Any, new_tokens: int, steps: int, folder: Path) -> Path:
    """`nereus run` one plan for `steps` steps into folder/run; returns the run directory."""
    from nereus.spec.io import save_document

    folder.mkdir(parents=True, exist_ok=True)
    plan_path = folder / "plan.yaml"
    save_document(plan, plan_path)
    config = folder / "config.yaml"
    config.write_text(
        f"kind: RunConfig\nversion: 1\nnum_steps: {steps}\nrl:\n  task: sort\n  max_new_tokens: {new_tokens}\n"
    )
    out = folder / "run"
    command = [*NEREUS, "run", str(config), "--plan", str(plan_path), "--nproc", "2", "--steps", str(steps)]
    done = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return out


def profile(folder: Path) -> Path:
    path = folder / "profile.yaml"
    command = [*NEREUS, "profile", "--quick", "--nproc", "2", "-o", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return path


def planner_pick(size: tuple[int, int, int], cluster: Any, calibration: Any) -> Any:
    """The planner's plan for the sweep workload at `size` on the profiled cluster."""
    from nereus.solver.plan_search import PlanRequest
    from nereus.solver.planner import make_plan as plan_search
    from nereus.spec.presets import model_preset
    from nereus.spec.workload import Workload

    the_workload = Workload.model_validate(workload(*size))
    request = PlanRequest(cluster, (model_preset("tiny"),), the_workload, 2, calibration)
    return plan_search(request).best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="RL steps per run (the first 2 are warm-up)")
    parser.add_argument("--keep", type=Path, help="keep the run folders here (default: a temporary folder)")
    args = parser.parse_args()
    recording = begin()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="nereus-cost-fit-"))
    sys.exit(sweep(folder, args.steps, recording))


def sweep(folder: Path, steps: int, recording: Started) -> int:
    from nereus.cost.calibration import Calibration
    from nereus.cost.fit import fit_runs, read_run, run_errors
    from nereus.cost.profile import Profile, cluster_from_profile
    from nereus.spec.io import load_document

    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    profile_path = profile(folder)
    the_profile = load_document(profile_path)
    assert isinstance(the_profile, Profile)
    cluster = cluster_from_profile(the_profile, str(profile_path), 2)
    names = list(sweep_layouts())
    runs: dict[tuple[str, int], Any] = {}
    load: list[float] = []
    for i, name in enumerate(names):
        for size_index in PLAN_SIZES[i % len(PLAN_SIZES)]:
            size = SIZES[size_index]
            point = folder / f"{name}-s{size_index}"
            load.append(os.getloadavg()[0])
            runs[name, size_index] = read_run(run_point(make_plan(name, size, cluster), size[1], steps, point))
            print(f"  ran {name} at size {size_index} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    repeatability = rerun(list(runs.items())[:REPEATS], cluster, steps, folder)
    train_names, test_names = names[0::2], names[1::2]
    train = [run for (name, _), run in runs.items() if name in train_names]
    test = [run for (name, _), run in runs.items() if name in test_names]
    calibration, fitted = fit_runs(train, Calibration(), cluster)
    held_out = run_errors(test, calibration, cluster)
    in_sample = run_errors(train, calibration, cluster)
    uncalibrated = run_errors(test, Calibration(), cluster)
    picks: list[dict[str, Any]] = []
    for size_index, size in enumerate(SIZES):
        chosen = planner_pick(size, cluster, calibration)
        point = folder / f"planner-s{size_index}"
        measured_pick = read_run(run_point(chosen, size[1], steps, point))
        pick_error = run_errors([measured_pick], calibration, cluster).runs[0]
        sweep_at_size = {name: r for (name, s), r in runs.items() if s == size_index}
        measured = {
            name: run_errors([r], calibration, cluster).runs[0].measured["step"] for name, r in sweep_at_size.items()
        }
        fastest = min(measured, key=lambda n: measured[n])
        picks.append(
            {
                "size": dict(zip(("prompts_per_step", "max_new_tokens", "mini_batches"), size, strict=True)),
                "planner_layouts": {e.model_stage: [e.tp, e.pp, e.dp, e.micro_batches] for e in chosen.stages},
                "planner_pools": [p.name for p in chosen.pools],
                "planner_measured_step_s": pick_error.measured["step"],
                "planner_predicted_step_s": pick_error.predicted["step"],
                "fastest_sweep_plan": fastest,
                "fastest_sweep_step_s": measured[fastest],
                "ratio": pick_error.measured["step"] / measured[fastest],
            }
        )
    result = {
        "points": len(runs),
        "plans": names,
        "train_plans": train_names,
        "test_plans": test_names,
        "steps_per_run": steps,
        "warmup_steps_dropped": 2,
        "profile": {"peak_gemm_flops": the_profile.peak_flops, "p2p_latency_s": cluster.intra_node.latency_s},
        "fitted": fitted,
        "calibration": calibration.model_dump(mode="json"),
        "held_out": held_out.summary(),
        "in_sample": in_sample.summary(),
        "uncalibrated_held_out": {"step_mape": uncalibrated.step_mape, "step_max_ape": uncalibrated.step_max},
        "planner": picks,
        "repeatability": repeatability,
        "load_average_1min": {"min": min(load), "median": statistics.median(load), "max": max(load)},
        "wall_s": time.perf_counter() - started,
    }
    step_s = {f"{name}-s{size}": [s.step_seconds for s in run.steps] for (name, size), run in runs.items()}
    write_result(RESULTS, result, recording, {"step_s_after_warmup": step_s})
    print_table(result, held_out)
    ok = held_out.step_mape <= 0.10 and all(p["ratio"] <= 1.05 for p in picks)
    return 0 if ok else 1


def rerun(points: list[tuple[tuple[str, int], Any]], cluster: Any, steps: int, folder: Path) -> dict[str, Any]:
    """Run the first points again: how far the same point's median step time moves between
    two runs on this machine (the noise floor no cost model can beat)."""
    from nereus.cost.calibration import Calibration
    from nereus.cost.fit import read_run, run_errors

    changes = {}
    for (name, size_index), first in points:
        size = SIZES[size_index]
        again = read_run(
            run_point(make_plan(name, size, cluster), size[1], steps, folder / f"again-{name}-s{size_index}")
        )
        before = run_errors([first], Calibration(), cluster).runs[0].measured["step"]
        after = run_errors([again], Calibration(), cluster).runs[0].measured["step"]
        changes[f"{name}-s{size_index}"] = after / before - 1
    values = [abs(v) for v in changes.values()]
    return {"change": changes, "mean_abs_change": statistics.fmean(values), "max_abs_change": max(values)}


def print_table(result: dict[str, Any], held_out: Any) -> None:
    print(f"{'held-out run':<44} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    for run in held_out.runs:
        name = Path(run.source).parent.name
        print(f"{name:<44} {run.measured['step']:>10.3f} {run.predicted['step']:>11.3f} {run.error('step'):>+7.1%}")
    summary = result["held_out"]
    print(
        f"step latency on held-out plans: MAPE {summary['step_mape']:.1%}, max {summary['step_max_ape']:.1%} "
        f"(uncalibrated: MAPE {result['uncalibrated_held_out']['step_mape']:.1%}); "
        f"in-sample MAPE {result['in_sample']['step_mape']:.1%}"
    )
    print("model-stage MAPE (held out): " + ", ".join(f"{k} {v:.0%}" for k, v in summary["model_stage_mape"].items()))
    for pick in result["planner"]:
        print(
            f"size {pick['size']}: planner's plan {pick['planner_measured_step_s']:.3f} s measured vs fastest swept "
            f"{pick['fastest_sweep_plan']} {pick['fastest_sweep_step_s']:.3f} s: ratio {pick['ratio']:.3f}"
        )
    again = result["repeatability"]
    print(
        f"same point run twice: median step time moved {again['mean_abs_change']:.1%} on average, "
        f"{again['max_abs_change']:.1%} at most ({len(again['change'])} points); 1-min load average "
        f"{result['load_average_1min']['median']:.1f} on {os.cpu_count()} cores"
    )
    print(f"{result['points']} points, {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

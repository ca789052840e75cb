"""Benchmark (measured, not simulated): `nereus run` under a sequence-growth trace, the
adaptive policy against the fixed initial plan, on 2 CPU ranks with one thread each.

The tiny PPO workload runs `--steps` RL steps with `lengths_from_trace` and `stop_at_eos:
false`: every response of a step is exactly the trace's `response_len.max`, which steps
through `--lengths` in equal segments of the run (default 4 -> 48 tokens). Every policy
starts from the same plan: the planner's best for the first length on 2 ranks, under the
starting calibration (the default one, or `--calibration FILE` from `nereus fit`). Every
policy runs with online calibration (the cost model refitted after every step), as
`nereus run` does by default; `fixed` keeps the initial layouts. `--no-fixed-calibration`
runs `fixed` without it, the stricter baseline: it never replans, so it need not pay for
the refits. `adaptive_bound.py` measures the most any policy could gain here.

Reported per policy: the mean wall time per step over the whole run (first model-stage
span to the end of the last step, from DIR/timeline: transitions, controller and
checkpoints included), the mean of the steps' own times, transitions and their share of
the run's wall time, the plans used, and the reward of the last steps (same seeds: the
curves should stay close). Prints a table and writes benchmarks/results/adaptive_run.json.

    .venv/bin/python benchmarks/adaptive_run.py [--steps 30] [--lengths 4 8 16 24 32 48] [--policies fixed nereus]
        [--calibration calibration.yaml --profile profile.yaml] [--no-fixed-calibration] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from _record import begin, write_result

from nereus.cost.calibration import Calibration
from nereus.cost.profile import Profile, cluster_from_profile
from nereus.runtime.run.launch import launch
from nereus.runtime.run.run_setup import RunSetup
from nereus.solver.admission import plan_problems
from nereus.solver.layouts import RUNTIME_CHOICES
from nereus.solver.plan_search import PlanRequest
from nereus.solver.planner import make_plan
from nereus.solver.policy.replan import layout_summary
from nereus.spec.cluster import Cluster
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig, RunConfig
from nereus.spec.run_folder import read_metrics, read_spans
from nereus.spec.trace import Trace, TraceEvent
from nereus.spec.workload import ResponseLengths

ROOT = Path(__file__).resolve().parent.parent
BASE_PLAN = ROOT / "tests" / "data" / "plan-tiny-ppo-2rank.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "adaptive_run.json"
NUM_RANKS = 2
#: The longest response of each equal segment of the run: 4 -> 48 tokens, 12x.
GROWTH = (4, 8, 16, 24, 32, 48)


def lengths(tokens: int) -> ResponseLengths:
    return ResponseLengths(median=tokens, p99=tokens, max=tokens)


def growth_trace(num_steps: int, growth: tuple[int, ...] = GROWTH) -> Trace:
    """The pool stays at 2 ranks; the longest response steps through `growth`, one equal
    segment of the run each."""
    events = [
        TraceEvent(step=round(k * num_steps / len(growth)), response_len=lengths(tokens))
        for k, tokens in enumerate(growth)
        if k
    ]
    return Trace(
        name="seq-growth-2rank",
        description=f"tiny PPO on 2 ranks: the longest response grows {growth[0]} -> {growth[-1]} tokens",
        num_steps=num_steps,
        gpus=NUM_RANKS,
        response_len=lengths(growth[0]),
        events=events,
    )


def planned(
    calibration: Calibration,
    cluster: Cluster | None = None,
    tokens: int = GROWTH[0],
    top_k: int = 1,
    base: Plan | None = None,
) -> list[Plan]:
    """The planner's `top_k` best plans, best first, for responses of `tokens` on 2 ranks (of
    `cluster`, default the base plan's), with only the memory-saving choices `nereus run` executes;
    `base`: the plan whose models and workload are planned (default BASE_PLAN)."""
    if base is None:
        base = load_document(BASE_PLAN)
        assert isinstance(base, Plan)
    workload = base.workload.model_copy(update={"response_len": lengths(tokens)})
    request = PlanRequest(
        cluster or base.cluster, tuple(base.models), workload, NUM_RANKS, calibration, choices=RUNTIME_CHOICES
    )
    result = make_plan(request, top_k=top_k)
    # The runs keep the base workload's batch shapes; the trace drives the lengths.
    return [plan.model_copy(update={"workload": base.workload}) for plan in [result.best, *result.alternatives]]


def initial_plan(
    calibration: Calibration, cluster: Cluster | None = None, tokens: int = GROWTH[0], base: Plan | None = None
) -> Plan:
    """The planner's best plan for responses of `tokens` (see `planned`)."""
    return planned(calibration, cluster, tokens, base=base)[0]


def run_policy(
    policy: str,
    plan: Plan,
    trace: Trace,
    calibration: Calibration | None,
    num_steps: int,
    out: Path,
    fixed_calibrates: bool = True,
) -> dict[str, Any]:
    """Run `policy` from `plan` through `trace` into the run folder `out`; its summary."""
    rl = RLConfig(task="sort", seed=0, stop_at_eos=False)  # every response exactly the trace's length
    config = RunConfig(
        rl=rl,
        num_steps=num_steps,
        checkpoint_every=num_steps,
        policy=policy,
        lengths_from_trace=True,
        trace="t",
        online_calibration=policy != "fixed" or fixed_calibrates,
    )
    problems = plan_problems(plan, NUM_RANKS, rl)
    assert not problems, problems
    setup = RunSetup(config, plan, NUM_RANKS, out, 0, None, False, (), trace, calibration)
    launch(setup)
    return summarise(policy, out)


def summarise(policy: str, out: Path) -> dict[str, Any]:
    records = read_metrics(out)
    spans = read_spans(out)
    wall = max(s.end for s in spans) - min(s.start for s in spans)
    moves = [
        {"step": r["step"], "action": action, "seconds": r["stage_seconds"][action]}
        for r in records
        for action in ("transition", "restart")
        if action in r["stage_seconds"]
    ]
    decisions = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    plans = [d["decision"]["target_layout"] for d in decisions if d["decision"]["action"] in ("transition", "restart")]
    # Every move the policy decided (forced or voluntary), with its reason and what it was priced at.
    decided = [
        {
            "step": d["decision"]["step"],
            **{k: d["decision"][k] for k in ("action", "path", "reason", "transition_cost_s", "savings_per_step_s")},
            "runtime": d.get("runtime"),
        }
        for d in decisions
        if d["decision"]["action"] != "keep"
    ]
    moved_s = sum(m["seconds"] for m in moves)
    return {
        "policy": policy,
        "num_steps": len(records),
        "wall_s": wall,
        "mean_step_wall_s": wall / len(records),
        "mean_step_s": statistics.mean(r["step_seconds"] for r in records),
        "transitions": moves,
        "transition_share": moved_s / wall,
        "targets": plans,
        "decisions": decided,
        "response_len_max": [r["response_len_max"] for r in records],
        "step_seconds": [r["step_seconds"] for r in records],
        "predicted_step_seconds": [r["predicted_step_seconds"] for r in records],
        "rewards": [r["reward"] for r in records],
    }


def print_repeat(repeat: int, results: list[dict[str, Any]]) -> None:
    fixed = next((r for r in results if r["policy"] == "fixed"), results[0])
    print(f"repeat {repeat}")
    print(f"{'policy':<12}{'s/step (wall)':>14}{'s/step (steps)':>15}{'vs fixed':>10}{'moves':>7}{'move share':>12}")
    for r in results:
        change = 1 - r["mean_step_wall_s"] / fixed["mean_step_wall_s"]
        print(
            f"{r['policy']:<12}{r['mean_step_wall_s']:>14.3f}{r['mean_step_s']:>15.3f}{100 * change:>9.1f}%"
            f"{len(r['transitions']):>7}{100 * r['transition_share']:>11.1f}%"
        )


def summarise_repeats(policies: list[str], repeats: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per policy: the median wall time per step, and each repeat's change against `fixed`
    (lower is better: 1 - policy / fixed, the first policy when `fixed` did not run)."""
    base = "fixed" if "fixed" in policies else policies[0]
    summary = {}
    for k, policy in enumerate(policies):
        walls = [results[k]["mean_step_wall_s"] for results in repeats]
        changes = [
            1 - results[k]["mean_step_wall_s"] / results[policies.index(base)]["mean_step_wall_s"]
            for results in repeats
        ]
        summary[policy] = {
            "median_step_wall_s": statistics.median(walls),
            "step_wall_s": walls,
            "change_vs_fixed": changes,
            "median_change_vs_fixed": statistics.median(changes),
            "transitions": [len(results[k]["transitions"]) for results in repeats],
            "transition_share": [results[k]["transition_share"] for results in repeats],
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="RL steps per policy")
    parser.add_argument("--policies", nargs="+", default=["fixed", "nereus"], help="policies to compare")
    parser.add_argument("--calibration", type=Path, help="starting Calibration YAML (`nereus fit`)")
    parser.add_argument(
        "--profile", type=Path, help="plan on this Profile's cluster (`nereus profile`; use with its --calibration)"
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=list(GROWTH), help="response length of each equal segment of the run"
    )
    parser.add_argument("--repeats", type=int, default=1, help="run every policy this many times, alternating")
    parser.add_argument(
        "--fixed-calibration",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the fixed policy with online calibration, as `nereus run` does by default",
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="where to write the results JSON")
    args = parser.parse_args()
    recording = begin()
    calibration = load_document(args.calibration) if args.calibration else None
    assert calibration is None or isinstance(calibration, Calibration)
    cluster = None
    if args.profile:
        profile = load_document(args.profile)
        assert isinstance(profile, Profile)
        cluster = cluster_from_profile(profile, str(args.profile), NUM_RANKS)
    trace = growth_trace(args.steps, tuple(args.lengths))
    plan = initial_plan(calibration or Calibration(), cluster, args.lengths[0])
    print(f"initial plan (planner's best for {args.lengths[0]} tokens): {layout_summary(plan)}")
    repeats: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="nereus-adaptive-") as folder:
        # Policies alternate within each repeat, so slow spells of this shared machine hit both.
        for repeat in range(args.repeats):
            where = Path(folder) / f"repeat-{repeat}"
            run = partial(run_policy, trace=trace, calibration=calibration, num_steps=args.steps)
            repeats.append(
                [
                    run(p, plan, out=where / p.replace(":", "-"), fixed_calibrates=args.fixed_calibration)
                    for p in args.policies
                ]
            )
            print_repeat(repeat, repeats[-1])
    summary = summarise_repeats(args.policies, repeats)
    for policy, row in summary.items():
        print(
            f"{policy}: median {row['median_step_wall_s']:.3f} s/step (wall) over {args.repeats} repeats; "
            f"vs fixed per repeat {', '.join(f'{100 * c:+.1f}%' for c in row['change_vs_fixed'])}, "
            f"median {100 * row['median_change_vs_fixed']:+.1f}%"
        )
    record = {
        "benchmark": "adaptive_run",
        "measured": True,
        "workload": f"tiny PPO, {plan.workload.prompts_per_step} prompts, sort task, lengths_from_trace",
        "num_ranks": NUM_RANKS,
        "threads_per_rank": 1,
        "trace": trace.model_dump(mode="json"),
        "initial_plan": layout_summary(plan),
        "calibration": str(args.calibration) if args.calibration else "default",
        "profile": str(args.profile) if args.profile else None,
        "fixed_online_calibration": args.fixed_calibration,
        "machine": platform.platform(),
        "repeats": args.repeats,
        "summary": summary,
        "results": repeats,
    }
    walls = {p: [results[k]["mean_step_wall_s"] for results in repeats] for k, p in enumerate(args.policies)}
    write_result(args.output, record, recording, {"mean_step_wall_s_by_policy": walls})


if __name__ == "__main__":
    main()

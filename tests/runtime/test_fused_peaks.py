"""What the fused executor holds, against what its schedule predicts.

On 2 ranks (tiny model, pp=2), two fused schedules of the same pipelines run: the fastest
the search finds, and the search's schedule under a tighter activation cap. Per rank, the
most micro-batches the executor's lanes hold for a backward (forwarded, not yet
backwarded) must equal the schedule evaluator's peak for that node, and the schedule with
the lower peak must hold fewer micro-batches and fewer autograd-saved bytes. The run-time
schedule of a plan is the plan-capped search, deterministic under its work budget.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.fused_pipeline import (
    ActivationPeak,
    FusedPart,
    SavedBytes,
    activation_peak,
    fused_train_step,
    schedule_peaks,
)
from nereus.runtime.model.fused_schedule import (
    SEARCH_ITERATIONS,
    SEARCH_ITERATIONS_PER_OP,
    fused_schedule,
    search_iterations,
)
from nereus.runtime.model.losses import NextTokenLoss, ValueLoss
from nereus.runtime.run.plans import plan_schedule
from nereus.solver.pipeline.document import to_document
from nereus.solver.pipeline.from_plan import PlanPipelines, plan_pipelines
from nereus.solver.pipeline.model import ModelTimes
from nereus.solver.pipeline.search import SearchConfig, search_fused
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.schedule import Schedule
from tests.runtime.test_fused_pipeline import engines, make_batch, two_rank_plan

pytestmark = pytest.mark.one_rank

MICROBATCHES = 4


def schedules() -> dict[str, Schedule]:
    """The fastest fused schedule of 2 stages x 4 micro-batches per model, and the search's
    schedule under a cap of 2 activations per node (slower, leaner)."""
    actor = ModelTimes.uniform("actor", 2, MICROBATCHES, forward=1.0, backward=2.0)
    critic = ModelTimes.uniform("critic", 2, MICROBATCHES, forward=0.5, backward=1.0)
    config = SearchConfig(time_limit_s=60, seeds=1, max_iterations=2000)
    return {
        "fastest": to_document(search_fused(actor, critic, config)),
        "capped": to_document(search_fused(actor, critic, config, activation_cap=2.0)),
    }


def held_by_rank(rank: int, world: int, runs: dict[str, Schedule]) -> dict[str, Any]:
    """Per schedule: this rank's node, its measured peak, and what it held after the last op."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, schedule in runs.items():
        actor, critic = engines(1, 2, 1, world)
        assert actor is not None and critic is not None
        parts = [
            FusedPart("actor", actor, make_batch("lm", 1), NextTokenLoss()),
            FusedPart("critic", critic, make_batch("value", 2), ValueLoss()),
        ]
        _, timings = fused_train_step(parts, schedule)
        node = actor.groups.pp_rank  # actor stage s runs on node s
        last = timings[-1]
        out[name] = (node, activation_peak(timings, schedule, node), sum(n for _, n in last.live), last.saved_bytes)
    return out


@pytest.mark.multiprocess
def test_the_executor_holds_what_the_schedule_predicts_and_a_leaner_schedule_holds_less() -> None:
    runs = schedules()
    predicted = {name: schedule_peaks(schedule) for name, schedule in runs.items()}
    # The capped schedule is leaner on every node (and slower: the cap costs latency).
    assert all(lean < fat for lean, fat in zip(predicted["capped"], predicted["fastest"], strict=True))
    assert runs["capped"].summary.makespan > runs["fastest"].summary.makespan
    for outcome in spawn(held_by_rank, 2, runs):
        for name, (node, peak, left, left_bytes) in outcome.items():
            assert isinstance(peak, ActivationPeak)
            # One activation unit per micro-batch: the held count is the evaluator's peak.
            assert peak.activation == pytest.approx(predicted[name][node]), (name, node, peak)
            assert peak.microbatches == round(predicted[name][node]), (name, node, peak)
            assert (left, left_bytes) == (0, 0), (name, node, "every backward released its activations")
        (node, lean, _, _), (_, fat, _, _) = outcome["capped"], outcome["fastest"]
        assert lean.microbatches < fat.microbatches, (node, lean, fat)
        assert 0 < lean.saved_bytes < fat.saved_bytes, (node, lean, fat)


def test_saved_bytes_counts_what_autograd_holds_until_the_backward() -> None:
    layer = torch.nn.Linear(16, 16)
    saved = SavedBytes(layer.parameters())
    x = torch.randn(8, 16, requires_grad=True)
    with saved.hooks():
        hidden = torch.tanh(layer(x))  # saves x (the weight is excluded) and tanh's output
        loss = (hidden * hidden).sum()  # saves hidden (already counted: same storage)
        held = saved.bytes
        assert held == 2 * 8 * 16 * 4
        loss.backward()
    assert saved.bytes == 0 and not saved.refs


def test_the_run_time_schedule_is_the_plan_capped_search_and_is_deterministic() -> None:
    plan = two_rank_plan(fused=True)
    pipelines = plan_pipelines(plan)
    schedule = fused_schedule(plan)
    assert schedule.activation_cap == pytest.approx(pipelines.activation_cap) and pipelines.activation_cap > 0
    # A second search returns the very same op order.
    again = fused_schedule(plan)
    assert again is not schedule
    assert [node.ops for node in again.nodes] == [node.ops for node in schedule.nodes]
    # It is `search_fused` under the plan's cap with the work budget.
    config = SearchConfig(time_limit_s=3600, seeds=1, max_iterations=search_iterations(pipelines))
    cap = pipelines.activation_cap
    direct = to_document(search_fused(pipelines.actor, pipelines.critic, config, activation_cap=cap))
    assert [node.ops for node in direct.nodes] == [node.ops for node in schedule.nodes]
    assert schedule.summary.peak_memory == pytest.approx(max(schedule_peaks(schedule)))


ROOT = Path(__file__).resolve().parents[2]
INTRA_PLAN = "examples/plan-tiny-ppo-2rank-intra.yaml"
SCHEDULE_DIGEST = f"""
import hashlib
from nereus.runtime.model.fused_schedule import fused_schedule
from nereus.spec.io import load_document
ops = [node.ops for node in fused_schedule(load_document({INTRA_PLAN!r})).nodes]
print(hashlib.sha256(repr(ops).encode()).hexdigest())
"""


def test_every_process_searches_the_same_schedule() -> None:
    """Each rank searches in its own process, whose string hashing differs from this one's."""
    plan = load_document(ROOT / INTRA_PLAN)
    assert isinstance(plan, Plan) and plan.fusion.intra_stage
    ops = [node.ops for node in fused_schedule(plan).nodes]
    env = {**os.environ, "PYTHONHASHSEED": "1"}
    done = subprocess.run([sys.executable, "-c", SCHEDULE_DIGEST], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == hashlib.sha256(repr(ops).encode()).hexdigest()


def test_a_run_is_set_up_with_its_fused_schedule_searched_once(tmp_path: Path) -> None:
    """The launcher searches the schedule and hands it to the ranks in the setup."""
    from nereus.runtime.run.resolve import new_run

    setup = new_run(ROOT / "examples/run-ppo.yaml", ROOT / INTRA_PLAN, out=tmp_path / "run")
    assert setup.fused_schedule is not None
    assert [node.ops for node in setup.fused_schedule.nodes] == [node.ops for node in fused_schedule(setup.plan).nodes]
    unfused = setup.plan.model_copy(update={"fusion": setup.plan.fusion.model_copy(update={"intra_stage": False})})
    assert plan_schedule(unfused) is None


def test_the_work_budget_grows_with_the_pipeline_within_its_bounds() -> None:
    def budget(stages: int, microbatches: int) -> int:
        actor = ModelTimes.uniform("actor", stages, microbatches, 1.0, 2.0)
        critic = ModelTimes.uniform("critic", stages, microbatches, 0.5, 1.0)
        return search_iterations(PlanPipelines(actor, critic, 1, 1, 1, 1.0))

    low, high = SEARCH_ITERATIONS
    assert budget(1, 1) == low
    assert budget(4, 8) == SEARCH_ITERATIONS_PER_OP * 2 * (2 * 4 * 8)
    assert budget(16, 64) == high

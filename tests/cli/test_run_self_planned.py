"""`nereus run` plans for itself with every memory choice: a run without a plan, its resume
replanner and its controller search recompute, token budgets, ZeRO-1, KV budgets, full sharding
and both offloads (the runtime executes them all); the controller moves into such a plan by a
live transition that keeps the logical state bitwise; live moves into and out of full sharding
keep it too; and the choices `nereus plan` makes for Llama-3.1-8B PPO on 8 H100s run on a tiny
model on 2 CPU ranks.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from nereus.cost.calibration import Calibration
from nereus.cost.fit import engineless_stages
from nereus.errors import NereusError
from nereus.runtime.hf.run_setup import HfSources, plans_for_folder
from nereus.runtime.run.plans import replan
from nereus.solver.layouts import RUNTIME_CHOICES, MemoryChoices, runtime_choices
from nereus.solver.plan_search import PlanRequest
from nereus.solver.planner import make_plan
from nereus.solver.policy import Observation, Replanner, make_policy
from nereus.spec.io import load_document
from nereus.spec.plan import Fusion, Plan, StagePlan
from nereus.spec.run_config import RLConfig
from nereus.spec.run_folder import finished_checkpoints, read_metrics
from nereus.spec.workload import ResponseLengths
from tests.cli_helpers import invoke
from tests.run_helpers import PLAN_2RANK, write_config

#: Emulated memory per rank: at 8 sampled responses of 256 tokens per prompt, only plans that
#: recompute activations fit (without recompute the planner finds none).
CAPACITY = 7 * 2**20
SAMPLES_PER_PROMPT = 8
SHORT, LONG = 8, 256


def lengths(tokens: int) -> ResponseLengths:
    return ResponseLengths(median=tokens, p99=tokens, max=tokens)


def memory_bound(capacity: int = CAPACITY) -> Plan:
    """The 2-rank tiny PPO plan on ranks of `capacity` bytes, 8 samples per prompt, short responses."""
    base = load_document(PLAN_2RANK)
    assert isinstance(base, Plan)
    gpu = base.cluster.gpu.model_copy(update={"memory_bytes": capacity})
    cluster = base.cluster.model_copy(update={"gpu": gpu, "name": "cpu-1x2-capped"})
    workload = base.workload.model_copy(
        update={"samples_per_prompt": SAMPLES_PER_PROMPT, "response_len": lengths(SHORT)}
    )
    return base.model_copy(update={"cluster": cluster, "workload": workload, "predictions": None})


def runtime_plan(base: Plan, choices: MemoryChoices = RUNTIME_CHOICES) -> Plan:
    request = PlanRequest(base.cluster, tuple(base.models), base.workload, 2, Calibration(), choices)
    return make_plan(request).best


#: Whether a plan entry makes each memory choice, in the planner's order (an entry leaving `zero1`
#: to the workload's optimizer counts as not choosing it: the runtime follows the optimizer either way).
CHOICES: dict[str, Callable[[StagePlan], bool]] = {
    "recompute": lambda e: e.recompute != "none",
    "token_budget": lambda e: e.token_budget is not None,
    "zero1": lambda e: bool(e.zero1),
    "offload": lambda e: e.offload,
    "kv_budget": lambda e: e.kv_budget_bytes is not None,
    "full_shard": lambda e: e.full_shard,
    "train_offload": lambda e: e.train_offload != "none",
}


def uses(entry: StagePlan) -> list[str]:
    return [name for name, used in CHOICES.items() if used(entry)]


#: The runtime's choices with neither recompute nor offload: at `CAPACITY` and 256-token
#: responses nothing fits then.
NO_SAVING = dataclasses.replace(RUNTIME_CHOICES, recompute=("none",), offload=(False,), train_offload=("none",))
#: The runtime's choices without offload: only recompute makes the batch fit.
NO_OFFLOAD = dataclasses.replace(RUNTIME_CHOICES, offload=(False,), train_offload=("none",))


def saves(entry: StagePlan) -> bool:
    """Whether a plan entry recomputes or offloads (what lets the long responses fit)."""
    return entry.recompute != "none" or entry.offload or entry.train_offload != "none"


@pytest.mark.logic
def test_the_runtime_s_own_search_space_is_every_memory_choice() -> None:
    # Every memory choice and cp as by default; ep = 1 (`admission.expert_parallel_problems`).
    assert dataclasses.replace(MemoryChoices(), expert_parallel=(False,)) == RUNTIME_CHOICES
    # Intra-stage fusion fixes the training micro-batch counts: only token budgets are left out.
    fused = runtime_choices(Fusion(intra_stage=True))
    assert fused == dataclasses.replace(RUNTIME_CHOICES, token_budget=(False,))
    assert runtime_choices(Fusion(inter_stage=True)) == RUNTIME_CHOICES


@pytest.mark.logic
def test_a_run_without_a_plan_and_a_resume_onto_other_ranks_plan_with_memory_choices() -> None:
    """Where only recompute or offload lets the batch fit, the plans a run makes for itself (from
    a folder, no plan given) and a resume's replan onto 2 ranks use one of them; without both
    none fits, and with offload pinned off they recompute."""
    tight = memory_bound()
    long = tight.workload.model_copy(update={"response_len": lengths(LONG)})
    stored = tight.model_copy(update={"workload": long})
    with pytest.raises(NereusError, match="no memory-feasible plan"):
        runtime_plan(stored, NO_SAVING)
    assert any(entry.recompute != "none" for entry in runtime_plan(stored, NO_OFFLOAD).stages)
    resumed = replan(stored, 2)
    assert any(saves(entry) for entry in resumed.stages)
    folder = HfSources(stored.models[0], {"actor": Path("/nowhere")})
    planned = plans_for_folder(folder, long, stored.cluster, 2)
    assert planned and all(any(saves(e) for e in plan.stages) for plan in planned)
    # Under intra-stage fusion (the run config's block) no plan packs to a token budget.
    fused = plans_for_folder(folder, long, stored.cluster, 2, Fusion(intra_stage=True))
    assert all(entry.token_budget is None for plan in fused for entry in plan.stages)


@pytest.mark.logic
def test_the_controller_s_replanner_moves_into_recompute_or_offload_where_only_they_fit() -> None:
    """The controller's policy, with the runtime's own choices: the responses grow from 8 to 256
    tokens and the layout it runs overflows; the move it makes recomputes or offloads. Pinned to
    neither, no plan fits and the run would stop."""
    initial = runtime_plan(memory_bound())
    engineless = engineless_stages(initial, RLConfig(task="sort"))
    actions = {}
    for name, choices in (("own", runtime_choices(initial.fusion)), ("pinned", NO_SAVING)):
        policy = make_policy("nereus", initial, Replanner(initial, choices=choices, engineless=engineless))
        decision = policy.decide(Observation(step=3, gpus=2, response_len=lengths(LONG), steps_remaining=1))
        actions[name] = (decision.action, policy.plan)
    action, target = actions["own"]
    assert action in ("transition", "restart") and target is not None
    assert any(saves(entry) for entry in target.stages)
    assert actions["pinned"][0] == "suspend"


def controller_run(folder: Path) -> Path:
    """A 4-step controlled run from the runtime's own plan for short responses at `CAPACITY`;
    the responses grow to 256 tokens at step 2 (the trace, exactly: no EOS)."""
    plan = runtime_plan(memory_bound())
    (folder / "plan.yaml").write_text(yaml.safe_dump(plan.model_dump(mode="json", exclude_none=True)))
    trace = {
        "kind": "Trace",
        "version": 1,
        "name": "growth",
        "num_steps": 4,
        "gpus": 2,
        "response_len": lengths(SHORT).model_dump(),
        "events": [{"step": 2, "response_len": lengths(LONG).model_dump()}],
    }
    (folder / "trace.yaml").write_text(yaml.safe_dump(trace))
    config = {
        "kind": "RunConfig",
        "version": 1,
        "plan": "plan.yaml",
        "num_steps": 4,
        "checkpoint_every": 4,
        "trace": "trace.yaml",
        "policy": "nereus",
        "lengths_from_trace": True,
        "online_calibration": False,
        "verify_transitions": True,
        "rl": {"task": "sort", "seed": 0, "stop_at_eos": False},
    }
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    return folder / "run.yaml"


@pytest.mark.cli
@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_controller_moves_live_into_a_memory_saving_plan_with_the_state_bitwise(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = invoke("run", controller_run(tmp_path), "--out", out)
    assert result.exit_code == 0, result.output
    decisions = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    moves = [d for d in decisions if d["decision"]["action"] != "keep"]
    assert moves and all(d["decision"]["action"] == "transition" for d in moves), decisions
    assert all("runtime" not in d for d in moves)  # the runtime ran every move the policy chose
    spans = [json.loads(line) for line in (out / "timeline" / "rank-0.jsonl").read_text().splitlines()]
    checks = [s["args"] for s in spans if s["name"] == "verify state"]
    assert len(checks) == len(moves) and all(check["equal"] for check in checks)
    final = load_document(finished_checkpoints(out)[-1] / "plan.yaml")
    assert isinstance(final, Plan)
    assert any(saves(entry) for entry in final.stages), final.stages
    assert len(read_metrics(out)) == 4


@pytest.mark.cli
@pytest.mark.multiprocess
@pytest.mark.slow
def test_live_moves_into_and_out_of_full_sharding_keep_the_state_bitwise(
    plain_three_step_run: Path, tmp_path: Path
) -> None:
    """2 ranks: the critic (training and inference, dp=2) and the actor's inference are fully
    sharded from step 1 and whole again from step 2; the runtime checks every move bitwise,
    and the run then goes on as the run that never sharded (to the reduction order's rounding)."""
    plan = yaml.safe_load(PLAN_2RANK.read_text())
    plan.pop("predictions", None)
    sharded = ("critic/training", "critic/inference", "actor/inference")
    full = {**plan, "stages": [{**e, "full_shard": e["model_stage"] in sharded} for e in plan["stages"]]}
    (tmp_path / "full.yaml").write_text(yaml.safe_dump(full))
    (tmp_path / "whole.yaml").write_text(yaml.safe_dump(plan))
    switches = [{"step": 1, "plan": "full.yaml"}, {"step": 2, "plan": "whole.yaml"}]
    config = write_config(tmp_path, num_steps=3, checkpoint_every=3, plan_switches=switches, verify_transitions=True)
    out = tmp_path / "out"
    result = invoke("run", config, "--out", out)
    assert result.exit_code == 0, result.output
    spans = [json.loads(line) for line in (out / "timeline" / "rank-0.jsonl").read_text().splitlines()]
    checks = [s["args"] for s in spans if s["name"] == "verify state"]
    assert len(checks) == 2 and all(check["equal"] for check in checks)
    for a, b in zip(read_metrics(out), read_metrics(plain_three_step_run), strict=True):
        assert abs(a["reward"] - b["reward"]) <= 0.02
        for field in ("kl", "actor_loss", "critic_loss"):
            assert a[field] == pytest.approx(b[field], rel=1e-3, abs=1e-5), (a["step"], field)


#: The acceptance set-up: `nereus plan --gpus 8 --cluster h100 --model llama-3.1-8b --workload ppo`.
ACCEPTANCE = ("plan", "--gpus", "8", "--cluster", "h100", "--model", "llama-3.1-8b", "--workload", "ppo")


def kv_bytes(plan: Plan, entry: StagePlan, sequences: int) -> int:
    """Bytes per GPU of `sequences` maximum-length sequences' KV cache in `entry`'s layout (whole blocks)."""
    from nereus.cost.kv_pool import BLOCK_TOKENS, KV_ELEMENT_BYTES
    from nereus.cost.stage import kv_bytes_per_token

    w = plan.workload
    blocks = -(-(w.prompt_len + w.response_len.max) // BLOCK_TOKENS)
    model = plan.model(w.model_name(entry.role))
    return sequences * blocks * BLOCK_TOKENS * kv_bytes_per_token(model, entry.tp, entry.pp, KV_ELEMENT_BYTES)


def on_tiny(big: Plan, tiny: Plan) -> Plan:
    """`tiny` with every memory choice each model-stage makes in `big`: the same recompute level,
    ZeRO-1, full sharding and offloads; a token budget of as many maximum-length rows as `big`'s
    holds; a KV budget holding the same share of a replica's sequences (at least one)."""
    stages = []
    for entry in tiny.stages:
        chosen = big.stage_plan(entry.model_stage)
        values: dict[str, Any] = {}
        if chosen.token_budget is not None:
            rows = chosen.token_budget // (big.workload.prompt_len + big.workload.response_len.max)
            values["token_budget"] = max(1, rows) * (tiny.workload.prompt_len + tiny.workload.response_len.max)
        if chosen.kv_budget_bytes is not None:
            share = chosen.kv_budget_bytes / kv_bytes(big, chosen, -(-big.workload.samples_per_step // chosen.dp))
            sequences = -(-tiny.workload.samples_per_step // entry.dp)
            values["kv_budget_bytes"] = max(kv_bytes(tiny, entry, 1), int(share * kv_bytes(tiny, entry, sequences)))
        values |= {"recompute": chosen.recompute, "zero1": chosen.zero1, "full_shard": chosen.full_shard}
        values |= {"offload": chosen.offload, "train_offload": chosen.train_offload}
        stages.append(entry.model_copy(update=values))
    return tiny.model_copy(update={"stages": stages, "predictions": None})


@pytest.mark.cli
@pytest.mark.multiprocess
def test_the_choices_nereus_plan_makes_for_8b_ppo_on_8_h100s_run_on_a_tiny_model(tmp_path: Path) -> None:
    result = invoke(*ACCEPTANCE, "-o", tmp_path / "p.yaml")
    assert result.exit_code == 0, result.output
    big = load_document(tmp_path / "p.yaml")
    assert isinstance(big, Plan)
    made = {(entry.model_stage, name) for entry in big.stages for name in uses(entry)}
    assert made  # the 8B plan needs memory choices
    # The tiny plan: every model-stage on both ranks (dp=2), so ZeRO-1 and full sharding split.
    base = yaml.safe_load(PLAN_2RANK.read_text())
    base.pop("predictions", None)
    base["stages"] = [{**e, "tp": 1, "pp": 1, "dp": 2, "emus": [[0], [1]]} for e in base["stages"]]
    tiny = Plan.model_validate(base)
    applied = on_tiny(big, tiny)
    assert {(entry.model_stage, name) for entry in applied.stages for name in uses(entry)} == made
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(applied.model_dump(mode="json", exclude_none=True)))
    config = write_config(tmp_path, num_steps=2, checkpoint_every=2)
    out = tmp_path / "out"
    run = invoke("run", config, "--plan", tmp_path / "tiny.yaml", "--out", out)
    assert run.exit_code == 0, run.output
    stored = load_document(out / "plan.yaml")
    assert isinstance(stored, Plan)
    assert {(entry.model_stage, name) for entry in stored.stages for name in uses(entry)} == made
    records = read_metrics(out)
    assert len(records) == 2 and all(r["actor_loss"] == r["actor_loss"] for r in records)  # finite


@pytest.mark.logic
def test_a_fully_sharded_stage_with_replicas_out_of_gpu_order_is_refused() -> None:
    """FSDP2 places replica d's rows on the d-th rank of its dp group: a plan (or a replan the
    controller would move to) listing them otherwise is refused before any engine is built."""
    from nereus.solver.admission import plan_problems

    plan = yaml.safe_load(PLAN_2RANK.read_text())
    plan.pop("predictions", None)
    critic = next(e for e in plan["stages"] if e["model_stage"] == "critic/training")
    critic |= {"full_shard": True, "emus": [[1], [0]]}
    problems = plan_problems(Plan.model_validate(plan), 2, RLConfig(task="sort"))
    assert any("critic/training: full_shard" in p and "ascending GPU order" in p for p in problems), problems
    critic["emus"] = [[0], [1]]
    assert not plan_problems(Plan.model_validate(plan), 2, RLConfig(task="sort"))

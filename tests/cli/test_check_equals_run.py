"""`nereus check run.yaml` refuses exactly what `nereus run run.yaml` refuses before it spawns
a rank, over a corpus of careless run configs (and the plans they name).

Both run in-process: `check` as it is, `run` up to where the ranks would start (its launch is
replaced by a sentinel, as in test_careless_input.py), so only its admission is exercised.
Each case is a config written as `write_config` writes it (a 2-rank PPO plan beside it), with
some fields changed and the plan optionally edited or replaced.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cli_helpers import invoke
from tests.run_helpers import write_config

pytestmark = pytest.mark.cli

ROOT = Path(__file__).resolve().parent.parent.parent
GRPO_PLAN = ROOT / "examples" / "plan-tiny-grpo-4rank.yaml"
TRACE = ROOT / "tests" / "data" / "trace-spot-2rank.yaml"
MATH_TRAIN = ROOT / "tests" / "data" / "math-train.jsonl"

PlanEdit = Callable[[dict[str, Any]], None]


class Accepted(BaseException):
    """`nereus run` accepted its input and reached the launch of its ranks."""


@dataclass(frozen=True)
class Case:
    """One run config of the corpus and whether `nereus run` accepts it."""

    name: str
    accepted: bool
    """What `nereus run` does with it (the test checks that as well: a case that stops being
    refused by both would no longer test the refusal)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """RunConfig fields set over write_config's (None: removed)."""
    plan: PlanEdit | None = None
    """An edit of the plan file's data."""
    plan_source: Path | None = None
    """Another plan to copy beside the config instead of the 2-rank PPO one."""
    without_tensorboard: bool = False
    """Run both as if the tensorboard package were not installed."""


def stage(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda plan: next(s for s in plan["stages"] if s["model_stage"] == name)


def set_stage(name: str, **values: Any) -> PlanEdit:
    return lambda plan: stage(name)(plan).update(values)


def set_workload(**values: Any) -> PlanEdit:
    return lambda plan: plan["workload"].update(values)


def drop_critic(plan: dict[str, Any]) -> None:
    plan["workload"].pop("critic", None)
    plan["stages"] = [s for s in plan["stages"] if not s["model_stage"].startswith("critic/")]


def stretched_positions(plan: dict[str, Any]) -> None:
    """Responses past the tiny model's 2048 positions, which a linear RoPE factor of 2 stretches to 4096."""
    plan["workload"]["response_len"] = {"median": 8, "p99": 40, "max": 2100}
    for model in plan["models"]:
        model["rope_scaling"] = {"type": "linear", "factor": 2.0}


def critic_stages_only(plan: dict[str, Any]) -> None:
    """A GRPO workload under the PPO plan's stages (critic ones included)."""
    plan["workload"].update(algorithm="grpo", samples_per_prompt=2)
    plan["workload"].pop("critic", None)


CASES = [
    Case("valid", True),
    Case("valid-grpo", True, plan_source=GRPO_PLAN),
    Case("grpo-with-one-sample-per-prompt", False, plan=set_workload(samples_per_prompt=1), plan_source=GRPO_PLAN),
    Case("ppo-without-critic", False, plan=drop_critic),
    Case("grpo-with-critic-stages", False, plan=critic_stages_only),
    Case("tensorboard-installed", importlib.util.find_spec("tensorboard") is not None, {"log": {"tensorboard": True}}),
    Case("tensorboard-missing", False, {"log": {"tensorboard": True}}, without_tensorboard=True),
    Case("sft-steps-with-data", False, {"data": {"train": str(MATH_TRAIN)}, "rl": {"task": "sort", "sft_steps": 2}}),
    Case("sft-steps-on-the-task", True, {"rl": {"task": "sort", "sft_steps": 2, "sft_batch": 8}}),
    Case("sft-batch-below-the-layout", False, {"rl": {"task": "sort", "sft_steps": 2, "sft_batch": 1}}),
    Case("world-beyond-the-cluster", False, plan=set_stage("actor/generation", emus=[[0], [3]])),
    Case("world-with-an-idle-rank", True, plan=lambda p: p["cluster"].update(gpus_per_node=4)),
    Case("critic-model-without-model", False, {"critic_model": "critic-folder"}),
    Case("reward-model-with-a-rule-reward", False, {"model": "no-such-folder", "reward_model": "reward-folder"}),
    Case(
        "plan-switches-beside-a-trace",
        False,
        {"trace": str(TRACE), "plan_switches": [{"step": 1, "plan": "plan.yaml"}]},
    ),
    Case("lengths-from-trace-without-trace", False, {"lengths_from_trace": True}),
    Case("plan-file-missing", False, {"plan": "no-such-plan.yaml"}),
    Case("no-plan-and-no-model", False, {"plan": None}),
    Case("plan-names-a-trace", False, {"plan": str(TRACE)}),
    Case("rank-memory-too-small", False, {"rl": {"task": "sort", "rank_memory_bytes": 1000}}),
    Case("offload", True, plan=set_stage("actor/training", offload=True)),
    Case("train-offload", True, plan=set_stage("actor/training", train_offload="optimizer")),
    Case(
        "train-offload-params-at-dp-1", False, plan=set_stage("actor/training", train_offload="params", full_shard=True)
    ),
    Case("recompute", True, plan=set_stage("critic/training", recompute="full")),
    Case("recompute-selective", True, plan=set_stage("actor/training", recompute="selective")),
    Case("token-budget", True, plan=set_stage("actor/training", token_budget=4096)),
    Case("token-budget-below-one-row", False, plan=set_stage("actor/training", token_budget=8)),
    Case("full-shard", True, plan=set_stage("actor/training", full_shard=True)),
    Case("zero1", True, plan=set_stage("actor/training", zero1=True)),
    Case("kv-budget", True, plan=set_stage("actor/generation", kv_budget_bytes=1 << 30)),
    Case("kv-budget-below-one-sequence", False, plan=set_stage("actor/generation", kv_budget_bytes=1000)),
    Case("fp16", False, plan=set_workload(dtype="fp16")),
    Case("too-many-micro-batches", False, plan=set_stage("actor/inference", micro_batches=64)),
    Case("inter-stage-fusion-on-one-generation-replica", False, {"fusion": {"inter_stage": True}}),
    Case("intra-stage-fusion-without-mirrored-critic", False, {"fusion": {"intra_stage": True}}),
    Case("sequence-beyond-max-positions", False, plan=set_workload(response_len={"median": 8, "p99": 40, "max": 2100})),
    Case("linear-rope-scaling-extends-the-positions", True, plan=stretched_positions),
]


def write_case(case: Case, folder: Path) -> Path:
    config = write_config(folder)
    if case.plan_source is not None:
        shutil.copy(case.plan_source, folder / "plan.yaml")
    if case.plan is not None:
        plan = yaml.safe_load((folder / "plan.yaml").read_text())
        plan.pop("predictions", None)
        case.plan(plan)
        (folder / "plan.yaml").write_text(yaml.safe_dump(plan))
    document = yaml.safe_load(config.read_text())
    for name, value in case.fields.items():
        if value is None:
            document.pop(name, None)
        else:
            document[name] = value
    config.write_text(yaml.safe_dump(document))
    return config


def run_accepts(config: Path, out: Path) -> tuple[bool, str]:
    try:
        result = invoke("run", config, "--out", out)
    except Accepted:
        return True, ""
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    return False, result.stderr.strip()


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_check_refuses_exactly_what_run_refuses(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def accepted(*args: Any, **kwargs: Any) -> Any:
        raise Accepted

    monkeypatch.setattr("nereus.runtime.run.launch.launch", accepted)
    if case.without_tensorboard:
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name, *a)
        )
    config = write_case(case, tmp_path)
    run, why = run_accepts(config, tmp_path / "out")
    checked = invoke("check", config)
    assert checked.exit_code in (0, 1) and "Traceback" not in checked.output, checked.output
    assert run == case.accepted, f"nereus run: {why or 'accepted'}"
    assert (checked.exit_code == 0) == run, f"nereus run: {why or 'accepted'}\nnereus check: {checked.output}"


def test_checking_a_run_config_and_its_plan_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from nereus.spec.check import check_file\n"
        f"result = check_file({str(ROOT / 'examples' / 'run-ppo.yaml')!r})\n"
        "print(result.ok, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["True", "False"]

"""`nereus run` with context parallelism (2 CPU ranks, the 2-rank PPO plan, and that plan made
GRPO with one mini-batch, whose old log-probs come from the training forward): actor/training,
actor/inference and critic/training each one replica cut over cp=2 ranks run the steps, and
the run is the one with those model-stages on one rank (cp=1) up to rounding: the same
rewards, losses and gradient norms, and checkpoints of the same logical state (1e-5; AdamW's
eps at 1e-4, so that an element whose gradient is zero in one run and rounding noise in the
other does not take a step of lr in one of them only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nereus.spec.run_folder import finished_checkpoints, read_metrics
from tests.cli_helpers import invoke
from tests.run_helpers import write_config

pytestmark = [pytest.mark.cli, pytest.mark.multiprocess]

CUT = ("actor/training", "actor/inference", "critic/training")
TOL = 1e-5


def planned_run(folder: Path, cp: int, algorithm: str) -> Path:
    """The 2-rank run of `algorithm` with the CUT model-stages on one replica of cp ranks."""
    folder.mkdir()
    rl = {"task": "sort", "seed": 3, "max_new_tokens": 6, "adam_eps": 1e-4}
    config = write_config(folder, num_steps=2, rl=rl)
    plan = yaml.safe_load((folder / "plan.yaml").read_text())
    plan.pop("predictions", None)
    if algorithm == "grpo":  # critic-free, one update per batch: old log-probs from the training forward
        plan["workload"].pop("critic")
        plan["workload"].update(algorithm="grpo", samples_per_prompt=4, prompts_per_step=8, mini_batches=1)
        plan["stages"] = [s for s in plan["stages"] if not s["model_stage"].startswith("critic/")]
    for entry in plan["stages"]:
        if entry["model_stage"] in CUT:
            entry.update(tp=1, pp=1, cp=cp, dp=1, emus=[list(range(cp))])
    (folder / "plan.yaml").write_text(yaml.safe_dump(plan))
    result = invoke("run", config, "--out", folder / "out")
    assert result.exit_code == 0, result.output
    return folder / "out"


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_a_cp2_run_finishes_and_matches_the_cp1_run(tmp_path: Path, algorithm: str) -> None:
    from nereus.runtime.state.checkpoint import load_checkpoint
    from nereus.runtime.state.shard_layout import RankLayout

    cut, whole = planned_run(tmp_path / "cp2", 2, algorithm), planned_run(tmp_path / "cp1", 1, algorithm)
    stored = yaml.safe_load((cut / "plan.yaml").read_text())
    cut_stages = {s["model_stage"]: s.get("cp", 1) for s in stored["stages"] if s["model_stage"] in CUT}
    assert cut_stages == dict.fromkeys(CUT if algorithm == "ppo" else CUT[:2], 2)
    records, expected = read_metrics(cut), read_metrics(whole)
    assert [r["step"] for r in records] == [r["step"] for r in expected] == [0, 1]
    for mine, theirs in zip(records, expected, strict=True):
        for key in ("reward", "kl", "actor_loss", "critic_loss"):
            if theirs[key] is None:
                assert mine[key] is None, key
            else:
                assert mine[key] == pytest.approx(theirs[key], abs=TOL), key
        for name, norm in theirs["grad_norm"].items():
            assert mine["grad_norm"][name] == pytest.approx(norm, rel=TOL), name
    folders = finished_checkpoints(cut)
    assert folders and [f.name for f in folders] == [f.name for f in finished_checkpoints(whole)]
    one = RankLayout(1, 1, 1, (0,))
    for role in ("actor", "critic") if algorithm == "ppo" else ("actor",):
        mine = load_checkpoint(folders[-1] / role, one, 0).tensors
        theirs = load_checkpoint(whole / "checkpoints" / folders[-1].name / role, one, 0).tensors
        assert mine.keys() == theirs.keys()
        assert max(float((mine[k] - theirs[k]).abs().max()) for k in mine) < TOL, role

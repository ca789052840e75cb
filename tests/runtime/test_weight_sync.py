"""The RL weight sync writes into the target engines' live parameters, bitwise as before.

`sync_weights` used to reshard into fresh tensors and copy them into the target engine;
now the resharder fills the target's parameter tensors in place. On a 2-rank gloo world,
for a colocated plan (every model-stage on both ranks in another layout) and a split one
(generation on rank 0, training on rank 1), the synced parameters must equal bitwise what
a fresh reshard of the same plan yields, sit in the same storage as before the sync, and
the target must take the trainer's optimizer step and drop stale gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_rl_step import CONFIG, two_rank_plan

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.rl import update as rl_update
from nereus.runtime.rl.stages import ModelStageRuntime, build_stages, engine_state
from nereus.runtime.rl.update import sync_plans, sync_weights
from nereus.runtime.state import reshard
from nereus.runtime.state.reshard import ReshardResult, execute
from nereus.runtime.state.sharded_state import random_logical_state, state_meta
from nereus.spec.plan import Plan

pytestmark = pytest.mark.one_rank

TRAINED_STEP = 7


def _train_stand_in(stage: ModelStageRuntime, seed: int) -> None:
    """Give a training stage new weights (the same logical values on every replica) and a step."""
    if stage.engine is None:
        return
    meta = state_meta(stage.model, stage.head, stage.layout, ("param",))
    logical = random_logical_state(meta, seed)
    stage.engine.load_logical_params({key.partition("/")[2]: tensor for key, tensor in logical.items()})
    stage.engine.optimizer.step_count = TRAINED_STEP


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32)


def _recording_results(results: list[ReshardResult]) -> None:
    """Make the weight sync's resharder, and its copy between model-stages of one layout
    (`copy_kept`), append what they return to `results` (this rank only)."""

    def recording(move: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> ReshardResult:
            result = move(*args, **kwargs)
            results.append(result)
            return result

        return run

    rl_update.execute = recording(reshard.execute)  # type: ignore[assignment]
    rl_update.copy_kept = recording(_COPY_KEPT)  # type: ignore[assignment]


_COPY_KEPT = rl_update.copy_kept


def _check_plan(rank: int, plan: Plan) -> dict[str, Any]:
    stages = build_stages(plan, CONFIG)
    syncs = sync_plans(stages)
    for number, (source, _, _) in enumerate(syncs):
        _train_stand_in(source, seed=100 + number)
    before: dict[str, dict[str, tuple[int, torch.Tensor]]] = {}
    for _, target, _ in syncs:
        if target.engine is not None:
            live = engine_state(target.engine, ("param",))
            before[target.plan.model_stage] = {key: (t.data_ptr(), t.clone()) for key, t in live.items()}
            for param in target.engine.params.values():
                param.grad = torch.ones_like(param)  # stale: the sync drops it, as the fresh path did
    results: list[ReshardResult] = []
    _recording_results(results)
    sync_weights(syncs)
    outcome: dict[str, Any] = {}
    for (source, target, plan_of_sync), result in zip(syncs, results, strict=True):
        tensors = engine_state(source.engine, ("param",)) if source.engine is not None else {}
        step = source.engine.optimizer_step if source.engine is not None else None
        fresh = execute(plan_of_sync, rank, tensors, step)  # the previous path's result, from the same plan
        if target.engine is None:
            continue
        live = engine_state(target.engine, ("param",))
        old = before[target.plan.model_stage]
        outcome[target.plan.model_stage] = {
            "bitwise": all(torch.equal(_bits(live[key]), _bits(fresh.tensors[key])) for key in fresh.tensors),
            "same_storage": all(live[key].data_ptr() == old[key][0] for key in live),
            # The resharder wrote straight into them: no fresh result copied over afterwards.
            "filled_in_place": all(result.tensors[key].data_ptr() == old[key][0] for key in live),
            "changed": any(not torch.equal(live[key], old[key][1]) for key in live),
            "step": target.engine.optimizer_step,
            "grads_dropped": all(param.grad is None for param in target.engine.params.values()),
        }
    return outcome


def _worker(rank: int, world_size: int, plans: list[Plan]) -> list[dict[str, Any]]:
    return [_check_plan(rank, plan) for plan in plans]


@pytest.mark.multiprocess
def test_weight_sync_fills_live_parameters_bitwise_as_a_fresh_reshard() -> None:
    plans = [two_rank_plan("ppo"), two_rank_plan("grpo", split=True)]
    per_rank = spawn(_worker, 2, plans)
    colocated = [outcomes[0] for outcomes in per_rank]
    for outcome in colocated:
        assert set(outcome) == {"actor/generation", "actor/inference", "critic/inference"}
    split = [outcomes[1] for outcomes in per_rank]
    assert set(split[0]) == {"actor/generation"} and set(split[1]) == {"actor/inference"}
    for outcomes in colocated + split:
        for stage, checks in outcomes.items():
            assert checks == {
                "bitwise": True,
                "same_storage": True,
                "filled_in_place": True,
                "changed": True,
                "step": TRAINED_STEP,
                "grads_dropped": True,
            }, stage

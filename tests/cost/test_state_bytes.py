"""The cost model's state bytes against the runtime's exact shard count.

`replica_state_bytes` prices a replica's state by the cost model's rule (parameters in the
workload's dtype; in training gradients, AdamW moments and fp32 masters of 16-bit weights);
`state_bytes_by_rank` sums the runtime's shards tensor by tensor. Where nothing is split
(tp = pp = 1, no ZeRO-1) the two must be the very same number.
"""

from __future__ import annotations

import pytest
from repo_paths import EXAMPLES

from nereus.cost.calibration import DEFAULT_CALIBRATION
from nereus.cost.plan_cost import replica_state_bytes
from nereus.solver.admission import state_bytes_by_rank
from nereus.spec.io import load_document
from nereus.spec.plan import Plan
from nereus.spec.run_config import RLConfig

pytestmark = pytest.mark.logic


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_unsplit_replica_holds_the_cost_models_state_bytes(dtype: str) -> None:
    plan = load_document(EXAMPLES / "plan-tiny-ppo-4rank.yaml")
    assert isinstance(plan, Plan)
    emus = [[rank] for rank in range(plan.cluster.num_gpus)]
    stages = [
        e.model_copy(update={"tp": 1, "pp": 1, "dp": len(emus), "emus": emus, "zero1": False}) for e in plan.stages
    ]
    workload = plan.workload.model_copy(update={"dtype": dtype})
    plan = plan.model_copy(update={"workload": workload, "stages": stages, "predictions": None})
    config = RLConfig(task="sort")
    held = state_bytes_by_rank(plan, config)
    priced = sum(
        replica_state_bytes(plan, e.model_stage, DEFAULT_CALIBRATION) for e in plan.stages if config.runs_engine(e.role)
    )
    assert held == dict.fromkeys(range(plan.cluster.num_gpus), priced)

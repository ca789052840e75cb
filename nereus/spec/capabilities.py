"""What `nereus run` computes in: the workload dtypes it runs.

Every memory-saving choice a plan entry can make (recompute, token budgets, ZeRO-1, offload,
KV budgets, full sharding, training-time offload) is executed; the runtime's own search space
is `nereus.solver.layouts.runtime_choices`, and what it refuses of a plan is
`nereus.solver.admission`.
"""

from __future__ import annotations

#: Workload dtypes the runtime computes in, with the torch dtype of each (16-bit weights keep
#: fp32 masters; fp16 is not run: it needs loss scaling).
RUNTIME_DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16"}

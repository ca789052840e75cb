"""Transition DAGs between two plans: EMUs, local DAGs, the global DAG and its schedule."""

from nereus.solver.transition.local import intermediate_layout, local_dag, match_replicas, sub_replicas
from nereus.solver.transition.primitives import Emu, Primitive, Schedule, box_fraction, priced
from nereus.solver.transition.schedule import TransitionResult, build_transition, plan_emus

__all__ = [
    "Emu",
    "Primitive",
    "Schedule",
    "TransitionResult",
    "box_fraction",
    "build_transition",
    "intermediate_layout",
    "local_dag",
    "match_replicas",
    "plan_emus",
    "priced",
    "sub_replicas",
]

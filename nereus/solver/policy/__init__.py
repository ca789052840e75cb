"""The adaptation policy: monitor drift, replan, admit transitions (urgent or by payback).

The runtime controller and the drift simulator call the same `decide(observation)`.
"""

from nereus.solver.policy.log import record_from_data, record_to_data, replay
from nereus.solver.policy.monitor import Monitor
from nereus.solver.policy.policies import (
    POLICY_NAMES,
    AdaptationPolicy,
    DecisionRecord,
    DynaRLPolicy,
    FixedPolicy,
    NereusPolicy,
    PeriodicPolicy,
    admits,
    make_policy,
)
from nereus.solver.policy.replan import Replanner, TransitionVerdict, layout_summary, plan_key
from nereus.solver.policy.state import PolicyState, policy_state, restore_policy
from nereus.solver.policy.types import Decision, Observation, PolicyConfig

__all__ = [
    "POLICY_NAMES",
    "AdaptationPolicy",
    "Decision",
    "DecisionRecord",
    "DynaRLPolicy",
    "FixedPolicy",
    "Monitor",
    "NereusPolicy",
    "Observation",
    "PeriodicPolicy",
    "PolicyConfig",
    "PolicyState",
    "Replanner",
    "TransitionVerdict",
    "admits",
    "layout_summary",
    "make_policy",
    "plan_key",
    "policy_state",
    "record_from_data",
    "record_to_data",
    "replay",
    "restore_policy",
]

"""The decision log as plain data (JSON), and replaying it through a fresh policy."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from nereus.solver.policy.policies import AdaptationPolicy, DecisionRecord
from nereus.solver.policy.types import Decision, Observation
from nereus.spec.workload import ResponseLengths


def record_to_data(record: DecisionRecord) -> dict[str, Any]:
    """One log entry as JSON-ready data."""
    observation = dataclasses.asdict(record.observation)
    observation["response_len"] = record.observation.response_len.model_dump()
    decision = dataclasses.asdict(record.decision)
    decision["triggers"] = list(record.decision.triggers)
    return {"observation": observation, "decision": decision}


def record_from_data(data: dict[str, Any]) -> DecisionRecord:
    """A log entry read back (the inverse of `record_to_data`)."""
    observation = dict(data["observation"])
    observation["response_len"] = ResponseLengths.model_validate(observation["response_len"])
    decision = dict(data["decision"])
    decision["triggers"] = tuple(decision["triggers"])
    return DecisionRecord(Observation(**observation), Decision(**decision))


def replay(records: list[DecisionRecord], make: Callable[[], AdaptationPolicy]) -> list[str]:
    """Feed the logged observations to a fresh policy; one line per decision that differs."""
    policy = make()
    mismatches = []
    for record in records:
        again = policy.decide(record.observation)
        if again != record.decision:
            fields = [
                f.name
                for f in dataclasses.fields(Decision)
                if getattr(again, f.name) != getattr(record.decision, f.name)
            ]
            mismatches.append(f"step {record.observation.step}: {', '.join(fields)} differ")
    return mismatches

"""Which pairs of plans a transition joins, and the cluster it runs on.

A transition keeps the workload and runs on one cluster. Two plans on clusters that differ
only in node count (a pool that grows or shrinks: the same GPU kind, node shape and links)
both move onto the larger one, whose first nodes are the smaller one (GPU ids agree).
Anything else is refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nereus.errors import NereusError

if TYPE_CHECKING:
    from nereus.spec.cluster import Cluster
    from nereus.spec.plan import Plan


@dataclass(frozen=True)
class SubPool:
    """The smaller of two clusters that differ only in node count, inside the larger one."""

    smaller: Cluster
    larger: Cluster

    def describe(self) -> str:
        """One line saying where the transition runs."""
        small, large = self.smaller, self.larger
        return (
            f"sub-pool: {small.name} ({small.num_gpus} GPUs) is the first {small.num_nodes} of the "
            f"{large.num_nodes} nodes of {large.name}; the transition runs on {large.name}"
        )


@dataclass(frozen=True)
class PlanPair:
    """The two plans of a transition, both on the cluster it runs on."""

    source: Plan
    target: Plan
    sub_pool: SubPool | None = None
    """Set when the plans' clusters differed only in node count (both now on the larger)."""


def plan_pair(source: Plan, target: Plan, names: tuple[str, str] = ("plan A", "plan B")) -> PlanPair:
    """The two plans on one cluster, or a NereusError naming both (`names`, e.g. their files):
    clusters that differ in more than node count, or plans that run other model-stages."""
    from nereus.spec.cluster import cluster_mismatch, larger_pool

    name_a, name_b = names
    a, b = source.cluster, target.cluster
    sub_pool = None
    if a != b:
        larger = larger_pool(a, b)
        if larger is None:
            fields = ", ".join(cluster_mismatch(a, b))
            what = f"{a.name} vs {b.name}" if a.name != b.name else f"both named {a.name} but described differently"
            what += f": {fields} differ" if fields else ""
            raise NereusError(
                f"{name_a} and {name_b} are plans for different clusters ({what}); "
                "a transition runs on one cluster, or on two that differ only in node count"
            )
        sub_pool = SubPool(b if larger is a else a, larger)
        source, target = (plan.model_copy(update={"cluster": larger}) for plan in (source, target))
    stages_a, stages_b = {e.model_stage for e in source.stages}, {e.model_stage for e in target.stages}
    if stages_a != stages_b:
        only = [f"{name} only in {name_a if name in stages_a else name_b}" for name in sorted(stages_a ^ stages_b)]
        raise NereusError(
            f"{name_a} and {name_b} run different model-stages ({'; '.join(only)}); "
            "plan both for the same workload (a transition keeps the workload)"
        )
    return PlanPair(source, target, sub_pool)

"""The run configuration, under the runtime's name for it: the schema itself is the spec
layer's (`nereus.spec.run_config`), so tools that only read run folders need no runtime."""

from nereus.spec.run_config import PlanSwitch, RLConfig, RunConfig

__all__ = ["PlanSwitch", "RLConfig", "RunConfig"]

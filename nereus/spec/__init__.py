"""File formats: strict pydantic documents, presets, YAML/JSON I/O and checks."""

from nereus.spec.base import FORMAT_VERSION, Document
from nereus.spec.check import CheckResult, Problem, check_file, semantic_problems
from nereus.spec.cluster import Cluster, GpuKind, Link
from nereus.spec.io import KINDS, load_document, save_document, to_data, to_json, to_yaml
from nereus.spec.model import Model
from nereus.spec.plan import Plan, Pool, Predictions, StagePlan, StagePrediction
from nereus.spec.stages import model_stage
from nereus.spec.workload import ResponseLengths, Workload, model_stages

__all__ = [
    "FORMAT_VERSION",
    "KINDS",
    "CheckResult",
    "Cluster",
    "Document",
    "GpuKind",
    "Link",
    "Model",
    "Plan",
    "Pool",
    "Predictions",
    "Problem",
    "ResponseLengths",
    "StagePlan",
    "StagePrediction",
    "Workload",
    "check_file",
    "load_document",
    "model_stage",
    "model_stages",
    "save_document",
    "semantic_problems",
    "to_data",
    "to_json",
    "to_yaml",
]

"""Observability.

- `memory`: a rank's measured peak memory (per step and model-stage) and the predicted peaks.
- `timeline`: the run's span log, one file per rank.
- `profiling`: the hardware profiler behind `nereus profile`.
"""

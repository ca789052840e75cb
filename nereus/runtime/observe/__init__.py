"""Observability: measured peak memory, the span timeline, and the hardware profiler behind `nereus profile`."""

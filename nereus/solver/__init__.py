"""Offline optimizers: plan search (and later transition DAGs, schedules, policies)."""

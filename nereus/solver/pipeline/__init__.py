"""Pipeline schedules: the fused actor-critic schedule, its baselines, bounds and exact model."""

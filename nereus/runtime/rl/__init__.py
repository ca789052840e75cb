"""RL post-training on the runtime engine: algorithms, objectives, tasks and the plan-driven step."""

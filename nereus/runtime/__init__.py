"""The torch.distributed engine: models, sharded state, resharding, checkpoints, launch.

torch is imported only inside this package, and only by the modules that need it
(`shard_layout` is pure Python so the solver and the CLI can read the sharding contract).
"""

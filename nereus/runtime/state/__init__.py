"""Sharded state: the sharding contract, shard metadata, resharding by box overlap, checkpoints, EMU transitions."""

"""Sharded state.

- `shard_layout`: the sharding contract, which box of every parameter each rank holds (pure Python).
- `sharded_state`: shard metadata of a model's state on a layout, cutting and gathering it.
- `reshard_plan`: which pieces move where between two layouts, and in which rounds (pure Python).
- `piece_exchange`: how a round's pieces travel (process-group messages, shared memory, arenas).
- `reshard`: `execute`, a reshard on every rank.
- `checkpoint`: checkpoints, one safetensors shard per writing rank, loadable into any layout.
- `transition_executor`: the EMU executor, a transition DAG's primitives on live state.
"""

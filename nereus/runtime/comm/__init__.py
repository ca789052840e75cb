"""Communication: the rank's world, launching ranks, keeping them alive, and moving bytes between them.

- `world`: this rank's device and backend (gloo or NCCL), its node, joining a torchrun job,
  the collective timeout.
- `spawn`: starting N local ranks (tests, benchmarks, `nereus run` without torchrun).
- `heartbeat` and `guard`: liveness of a joined job's ranks; naming and ending a silent one.
- `collectives`: the one collectives interface every caller uses (all-reduce, all-gather,
  broadcast, reduce-scatter, object collectives, barrier, subgroups), on the process group.
- `host_group`: the CPU ranks' process-group backend, gloo with shared-memory collectives.
- `shm`: shared-memory segments and the host token that decides who shares memory.
- `arena`: a rank's state arena, CPU tensors its same-host peers read directly when resharding.
"""

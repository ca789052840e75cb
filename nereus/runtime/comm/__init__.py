"""Communication: devices, backends and process launch, collectives, and the shared-memory fast path on one host."""

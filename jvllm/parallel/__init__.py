"""Tensor parallelism: the device mesh, per-parameter sharding rules, sharded loading."""

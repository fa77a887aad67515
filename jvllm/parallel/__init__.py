"""Tensor parallelism: the device mesh, per-parameter sharding rules, sharded loading.

Imports nothing from the rest of jvllm: `jvllm.models` and `jvllm.runner` import it.
"""

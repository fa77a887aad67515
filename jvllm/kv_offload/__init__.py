"""KV blocks below the host tier: the file-system tier and the connector interface.

`config` reads vLLM's `kv_transfer_config` (and jvllm's `--kv-offload-dir`),
`fs_store` owns the block file format, `connector` the small interface a lower tier
or a transfer implements, `fs_worker` the runner-side threads that move blocks between
host memory and files, `setup` wires them into an engine. Nothing here imports jax.
"""

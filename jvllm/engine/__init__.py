"""Host-side engine: requests, KV block accounting and scheduling; never imports jax.

Everything here is plain Python bookkeeping that decides what the device runs next.
Only `jvllm.runner` moves data to and from the device.
"""

"""Flax model definitions, the architecture registry and the checkpoint loader.

Imports go one way: `loader` -> `orbax_checkpoint` -> `spec`; `loader` -> `registry`
-> `llama`; all of them may import `jvllm.parallel` and `jvllm.layers`, which never
import this package.
"""

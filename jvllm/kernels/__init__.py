"""Attention kernels over the paged KV cache (installed as `jvllm.kernels`).

`reference` is pure jax.numpy: the CPU path and the ground truth for every
GPU kernel. GPU kernels import their toolchains lazily, only on the GPU path.
"""

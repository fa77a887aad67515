"""Kernel tests run the Triton kernels in Triton's CPU interpreter unless torch sees a GPU.

`triton.jit` reads TRITON_INTERPRET when it decorates a kernel, that is when
`jvllm.kernels.triton_attention` is first imported, so it is set here, before any test
module of this folder imports the kernels. On a GPU the same tests launch compiled
kernels on CUDA tensors instead.
"""

from __future__ import annotations

import os


def _torch_sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if "TRITON_INTERPRET" not in os.environ and not _torch_sees_cuda():
    os.environ["TRITON_INTERPRET"] = "1"

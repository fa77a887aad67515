"""The experts' grouped-matmul kernel and its padded layout against a per-expert matmul:
under Triton's interpreter on CPU tensors (conftest), or compiled where torch sees a GPU.
The padded buffer's unused rows and the output start as NaN where they must not be read
(inputs) or must all be written (output)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jvllm.kernels import triton_grouped_matmul as tg
from jvllm.kernels.jax_triton_grouped_matmul import padded_layout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_kernel(rows: np.ndarray, w: np.ndarray, experts: np.ndarray, num_experts: int):
    """rows [P, K] sorted by `experts` [P] (num_experts: none) -> [P, N] via the kernel."""
    sizes = np.bincount(experts[experts < num_experts], minlength=num_experts)
    dest, block_expert = (
        np.asarray(a) for a in padded_layout(jnp.asarray(experts), jnp.asarray(sizes, jnp.int32))
    )
    padded = block_expert.shape[0] * tg.BLOCK_M
    x = np.zeros((padded, rows.shape[1]), np.float32)
    keep = dest < padded
    x[dest[keep]] = rows[keep]
    out = torch.full((padded, w.shape[1]), float("nan"), device=DEVICE)
    args = [torch.tensor(a, device=DEVICE) for a in (x, w, block_expert)]
    n, k = w.shape[1], w.shape[2]
    tg.grouped_matmul_kernel[tg.grid(block_expert.shape[0], n)](
        *args,
        out,
        N=n,
        K=k,
        BLOCK_M=tg.BLOCK_M,
        BLOCK_N=tg.BLOCK_N,
        BLOCK_K=tg.BLOCK_K,
        PRECISION=tg.precision("float32"),
    )
    out = out.cpu().numpy()
    assert not np.isnan(out).any()  # every tile written, the empty ones with zeros
    return np.where(keep[:, None], out[np.minimum(dest, padded - 1)], 0.0), block_expert


@pytest.mark.parametrize("num_pairs,num_experts,n,k", [(5, 4, 24, 40), (40, 8, 64, 80)])
def test_each_row_meets_only_its_experts_weights(num_pairs, num_experts, n, k):
    rng = np.random.default_rng(num_pairs)
    experts = np.sort(rng.integers(0, num_experts + 1, num_pairs)).astype(np.int32)
    rows = rng.normal(size=(num_pairs, k)).astype(np.float32)
    w = rng.normal(size=(num_experts, n, k)).astype(np.float32)
    got, block_expert = run_kernel(rows, w, experts, num_experts)
    want = np.stack(
        [rows[i] @ w[e].T if e < num_experts else np.zeros(n) for i, e in enumerate(experts)]
    )
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    used = set(experts[experts < num_experts].tolist())
    assert set(block_expert[block_expert >= 0].tolist()) == used  # no other expert read


def test_layout_pads_each_group_to_whole_tiles():
    experts = jnp.asarray([0, 0, 2, 2, 2, 4], jnp.int32)  # 4 = a pair of no local expert
    dest, block_expert = padded_layout(experts, jnp.asarray([2, 0, 3, 0], jnp.int32), 2)
    assert dest.tolist() == [0, 1, 2, 3, 4, 14]  # 14: past the 7 tiles of 2 rows
    assert block_expert.tolist() == [0, 2, 2, -1, -1, -1, -1]

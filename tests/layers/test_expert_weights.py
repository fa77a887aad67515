"""Quantized experts in the grouped expert MLP: the tile loop and ragged_dot, with a
scale per (expert, output channel) or one per expert, against the dense reference on the
float weights the quantized ones stand for."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.layers.expert_weights import QuantizedExperts
from jvllm.layers.moe import dense_expert_mlp_reference, grouped_expert_mlp
from jvllm.models.quantization import quantize
from tests.layers.test_moe import expert_weights, hidden, random_routing


def quantized(weights: list[jax.Array], storage: str, per_tensor: bool):
    """Each `[E, N, K]` weight quantized per (expert, output channel), or per expert with
    one scale; and the float32 weights they stand for (numpy, independent of jvllm)."""
    out, floats = [], []
    for w in weights:
        w = np.asarray(w, np.float32)
        if per_tensor:  # one scale per expert: its largest magnitude over every channel
            peak = np.abs(w).max(axis=(1, 2))[:, None]  # [E, 1]
            q, scale = quantize_with(w, peak, storage), peak / qmax(storage)
        else:
            q, scale = quantize(w, storage)  # [E, N, K], [E, N]
        floats.append(np.asarray(q, np.float32) * scale[:, :, None])
        out.append(QuantizedExperts(jnp.asarray(q), jnp.asarray(scale, jnp.float32)))
    return out, [jnp.asarray(f) for f in floats]


def qmax(storage: str) -> float:
    return 127.0 if storage == "int8" else 448.0


def quantize_with(w: np.ndarray, peak: np.ndarray, storage: str) -> np.ndarray:
    """w [E, N, K] at one scale per expert, peak [E, 1] / qmax."""
    import ml_dtypes

    scaled = w / (peak / qmax(storage))[:, :, None]
    if storage == "int8":
        return np.clip(np.rint(scaled), -127, 127).astype(np.int8)
    return scaled.astype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("method", ["loop", "ragged_dot"])
@pytest.mark.parametrize("storage", ["int8", "fp8"])
@pytest.mark.parametrize("per_tensor", [False, True], ids=["channel", "tensor"])
def test_quantized_experts_match_the_dense_reference(method, storage, per_tensor):
    weights, floats = quantized(expert_weights(8), storage, per_tensor)
    assert weights[0].scale.shape == (8, 1 if per_tensor else weights[0].shape[1])
    x = hidden(33)
    fn = jax.jit(grouped_expert_mlp, static_argnames="cpu_method")
    for seed in range(2):
        routing = random_routing(33, 8, 3, seed)
        got = fn(x, routing, *weights, cpu_method=method)
        want = dense_expert_mlp_reference(x, routing, *floats)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["loop", "ragged_dot"])
def test_quantized_expert_slices_sum_to_the_whole(method):
    """Expert parallel: each half of the experts, with its own scale rows, computes its
    pairs; the halves add up to every expert at once."""
    weights, floats = quantized(expert_weights(8), "int8", False)
    x, routing = hidden(20), random_routing(20, 8, 2, 3)
    half = lambda w, s: QuantizedExperts(w.weight[s], w.scale[s])  # noqa: E731
    parts = [
        grouped_expert_mlp(x, routing, *(half(w, s) for w in weights), first, cpu_method=method)
        for first, s in ((0, slice(0, 4)), (4, slice(4, 8)))
    ]
    want = dense_expert_mlp_reference(x, routing, *floats)
    np.testing.assert_allclose(parts[0] + parts[1], want, rtol=1e-5, atol=1e-5)

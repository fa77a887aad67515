"""The grouped (ragged_dot) expert MLP against the dense one-hot reference, and routing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.layers.moe import (
    Routing,
    dense_expert_mlp_reference,
    grouped_expert_mlp,
    route,
)

H, INTER = 16, 12


def expert_weights(num_experts: int, seed: int = 0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shapes = [(num_experts, INTER, H), (num_experts, INTER, H), (num_experts, H, INTER)]
    return [jnp.asarray(rng.normal(size=s) * 0.3, dtype) for s in shapes]


def random_routing(tokens: int, num_experts: int, k: int, seed: int) -> Routing:
    logits = np.random.default_rng(seed).normal(size=(tokens, num_experts)) * 2
    return route(jnp.asarray(logits, jnp.float32), k, renormalize=seed % 2 == 0)


def hidden(tokens: int, seed: int = 1, dtype=jnp.float32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(tokens, H)), dtype)


@pytest.mark.parametrize("tokens,num_experts,k", [(1, 4, 1), (5, 4, 2), (33, 8, 3), (64, 8, 8)])
def test_grouped_matches_dense_reference(tokens, num_experts, k):
    weights = expert_weights(num_experts)
    x = hidden(tokens)
    for seed in range(3):
        routing = random_routing(tokens, num_experts, k, seed)
        got = jax.jit(grouped_expert_mlp)(x, routing, *weights)
        want = dense_expert_mlp_reference(x, routing, *weights)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_every_token_on_one_expert_leaves_other_groups_empty():
    weights = expert_weights(4)
    x = hidden(9)
    routing = Routing(jnp.ones((9, 1), jnp.float32), jnp.full((9, 1), 2, jnp.int32))
    got = grouped_expert_mlp(x, routing, *weights)
    np.testing.assert_allclose(got, dense_expert_mlp_reference(x, routing, *weights), atol=1e-5)
    assert float(jnp.abs(got).min(axis=1).max()) > 0  # every token got expert 2's output


def test_local_expert_slices_sum_to_the_whole():
    """What each expert-parallel device computes: its experts' pairs, the rest zero."""
    weights = expert_weights(8)
    x = hidden(20)
    routing = random_routing(20, 8, 2, seed=4)
    whole = grouped_expert_mlp(x, routing, *weights)
    parts = [
        grouped_expert_mlp(x, routing, *(w[lo : lo + 2] for w in weights), first_expert=lo)
        for lo in range(0, 8, 2)
    ]
    np.testing.assert_allclose(sum(parts), whole, rtol=1e-5, atol=1e-5)
    assert all(float(jnp.abs(p).max()) > 0 for p in parts)


def test_one_program_whatever_the_routing():
    weights = expert_weights(8)
    x = hidden(16)
    traces = []

    def traced(*args):
        traces.append(1)  # runs only when jit traces (and so compiles) anew
        return grouped_expert_mlp(*args)

    fn = jax.jit(traced)
    for seed in range(4):
        fn(x, random_routing(16, 8, 2, seed=2 * seed), *weights).block_until_ready()
    skewed = Routing(jnp.full((16, 2), 0.5, jnp.float32), jnp.zeros((16, 2), jnp.int32))
    fn(x, skewed, *weights).block_until_ready()
    assert len(traces) == 1


def test_route_renormalises_or_keeps_softmax_weights():
    logits = jnp.asarray([[0.0, 1.0, 2.0, 3.0], [5.0, 0.0, 0.0, 0.0]], jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    raw = route(logits, 2, renormalize=False)
    assert raw.experts.tolist() == [[3, 2], [0, 1]]
    np.testing.assert_allclose(raw.weights[0], probs[0, [3, 2]], rtol=1e-6)
    normed = route(logits, 2, renormalize=True)
    np.testing.assert_allclose(normed.weights.sum(-1), [1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(normed.weights[0], probs[0, [3, 2]] / probs[0, [3, 2]].sum())


def test_route_breaks_ties_toward_the_lower_expert():
    """Deterministic for exact ties. (torch.topk on CPU orders ties its own way, e.g.
    [2, 4] of five equal values: only identical router logits tie exactly.)"""
    logits = jnp.asarray([[1.0, 2.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]], jnp.float32)
    assert route(logits, 2, renormalize=False).experts.tolist() == [[1, 2], [0, 1]]


def test_bfloat16_close_to_float32():
    f32 = expert_weights(4)
    routing = random_routing(24, 4, 2, seed=0)
    x = hidden(24)
    want = grouped_expert_mlp(x, routing, *f32)
    got = grouped_expert_mlp(
        x.astype(jnp.bfloat16), routing, *(w.astype(jnp.bfloat16) for w in f32)
    )
    assert got.dtype == jnp.bfloat16
    scale = float(jnp.abs(want).max())
    assert float(jnp.abs(got.astype(jnp.float32) - want).max()) < 0.03 * scale


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU and jax-triton")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_triton_backend_matches_the_dense_reference_on_a_gpu(dtype):
    """The Triton grouped matmul with its padded layout, jitted, on the GPU."""
    weights = expert_weights(8, dtype=dtype)
    x = hidden(40, dtype=dtype)
    fn = jax.jit(grouped_expert_mlp, static_argnames="backend")
    for seed in range(3):
        routing = random_routing(40, 8, 2, seed)
        got = fn(x, routing, *weights, backend="triton").astype(jnp.float32)
        with jax.default_matmul_precision("highest"):  # no TF32 in the reference's einsums
            want = dense_expert_mlp_reference(x, routing, *weights).astype(jnp.float32)
        tol = 1e-4 if dtype == jnp.float32 else 3e-2
        assert float(jnp.abs(got - want).max()) <= tol * max(1.0, float(jnp.abs(want).max()))

"""The grouped expert MLP (the CPU tile loop and ragged_dot) against the dense one-hot
reference, the loop's program, and routing."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.layers.grouped_matmul import tiled_expert_mlp
from jvllm.layers.moe import (
    CPU_METHODS,
    Routing,
    cpu_tile_for,
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


@pytest.mark.parametrize("method", CPU_METHODS)
@pytest.mark.parametrize("tokens,num_experts,k", [(1, 4, 1), (5, 4, 2), (33, 8, 3), (64, 8, 8)])
def test_grouped_matches_dense_reference(tokens, num_experts, k, method):
    weights = expert_weights(num_experts)
    x = hidden(tokens)
    fn = jax.jit(grouped_expert_mlp, static_argnames="cpu_method")
    for seed in range(3):
        routing = random_routing(tokens, num_experts, k, seed)
        got = fn(x, routing, *weights, cpu_method=method)
        want = dense_expert_mlp_reference(x, routing, *weights)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", CPU_METHODS)
def test_every_token_on_one_expert_leaves_other_groups_empty(method):
    weights = expert_weights(4)
    x = hidden(9)
    routing = Routing(jnp.ones((9, 1), jnp.float32), jnp.full((9, 1), 2, jnp.int32))
    got = grouped_expert_mlp(x, routing, *weights, cpu_method=method)
    np.testing.assert_allclose(got, dense_expert_mlp_reference(x, routing, *weights), atol=1e-5)
    assert float(jnp.abs(got).min(axis=1).max()) > 0  # every token got expert 2's output


@pytest.mark.parametrize("method", CPU_METHODS)
def test_local_expert_slices_sum_to_the_whole(method):
    """What each expert-parallel device computes: its experts' pairs, the rest zero."""
    weights = expert_weights(8)
    x = hidden(20)
    routing = random_routing(20, 8, 2, seed=4)
    whole = grouped_expert_mlp(x, routing, *weights, cpu_method=method)
    parts = [
        grouped_expert_mlp(
            x, routing, *(w[lo : lo + 2] for w in weights), first_expert=lo, cpu_method=method
        )
        for lo in range(0, 8, 2)
    ]
    for lo, part in zip(range(0, 8, 2), parts, strict=True):
        elsewhere = (routing.experts < lo) | (routing.experts >= lo + 2)
        zeroed = Routing(jnp.where(elsewhere, 0.0, routing.weights), routing.experts)
        want = dense_expert_mlp_reference(x, zeroed, *weights)
        np.testing.assert_allclose(part, want, rtol=1e-5, atol=1e-5)
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


def per_row_reference(rows, experts, w_gate, w_up, w_down):
    """Each row through its own expert's MLP, one row at a time (numpy, float64)."""
    rows, w_gate, w_up, w_down = (np.asarray(a, np.float64) for a in (rows, w_gate, w_up, w_down))
    out = np.zeros_like(rows)
    for r, e in enumerate(experts):
        gate, up = w_gate[e] @ rows[r], w_up[e] @ rows[r]
        out[r] = w_down[e] @ (gate / (1 + np.exp(-gate)) * up)
    return out


@pytest.mark.parametrize("tile", [1, 4, 8, 16])
@pytest.mark.parametrize("sizes", [[5, 0, 0, 13, 1, 0, 7, 3], [0, 0, 29, 0, 0, 0, 0, 0], [0] * 8])
def test_tile_loop_runs_each_group_through_its_expert(sizes, tile):
    """Empty groups, one group holding everything, row counts no tile size divides, and
    rows past every group (pairs routed to another device), which are left unspecified."""
    weights = expert_weights(8, seed=3)
    rows = np.random.default_rng(5).normal(size=(sum(sizes) + 6, H)).astype(np.float32)
    experts = np.repeat(np.arange(8), sizes)
    fn = jax.jit(tiled_expert_mlp, static_argnames="tile")
    got = fn(jnp.asarray(rows), *weights, jnp.asarray(sizes, jnp.int32), tile=tile)
    assert got.shape == rows.shape
    want = per_row_reference(rows[: len(experts)], experts, *weights)
    np.testing.assert_allclose(got[: len(experts)], want, rtol=1e-5, atol=1e-5)


def dot_operand_shapes(lowered_text: str) -> set[tuple[str, str]]:
    """The (lhs, rhs) operand types of every dot_general in a lowered StableHLO module."""
    pattern = r"stablehlo\.dot_general.*: \(tensor<([0-9x]+)x\w+>, tensor<([0-9x]+)x\w+>\)"
    return set(re.findall(pattern, lowered_text))


def test_tile_loop_program_multiplies_one_expert_per_dot():
    """No dot over every expert: each multiplies a [tile, K] block by one expert's [N, K]
    (ragged_dot on a CPU lowers to [E, M, K] x [E, N, K]: the check can tell them apart)."""
    num_experts, h, inter, tokens, k = 8, 24, 12, 64, 2
    rng = np.random.default_rng(0)
    shapes = [(num_experts, inter, h), (num_experts, inter, h), (num_experts, h, inter)]
    weights = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
    x = jnp.asarray(rng.normal(size=(tokens, h)), jnp.float32)
    routing = random_routing(tokens, num_experts, k, seed=0)
    tile = cpu_tile_for(tokens * k, num_experts)
    assert tile == 16
    fn = jax.jit(grouped_expert_mlp, static_argnames="cpu_method")
    for method in ("auto", "loop"):  # "auto" lowered for this CPU takes the loop
        loop = fn.lower(x, routing, *weights, cpu_method=method)
        assert dot_operand_shapes(loop.as_text()) == {("16x24", "12x24"), ("16x12", "24x12")}
        compiled = loop.compile().as_text()
        compiled_dots = re.findall(r"= f32\[(\d+),\d+\]\{1,0\} dot\(", compiled)
        assert compiled_dots and set(compiled_dots) == {"16"}
    ragged = fn.lower(x, routing, *weights, cpu_method="ragged_dot").as_text()
    assert ("8x128x24", "8x12x24") in dot_operand_shapes(ragged)


def test_auto_lowered_for_a_gpu_keeps_ragged_dot():
    """Off a CPU, "auto" leaves the grouping to XLA's ragged_dot (no tile loop), which the
    deviceless GPU checks measure; the GPU itself serves with the Triton kernel."""
    weights = expert_weights(8)
    traced = jax.jit(grouped_expert_mlp).trace(hidden(16), random_routing(16, 8, 2, 0), *weights)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count('"chlo.ragged_dot"') == 3 and "stablehlo.while" not in text


def test_unknown_cpu_method_is_named():
    weights = expert_weights(4)
    with pytest.raises(ValueError, match="'dense'"):
        grouped_expert_mlp(hidden(2), random_routing(2, 4, 1, 0), *weights, cpu_method="dense")


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

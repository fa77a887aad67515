"""FP8 W8A8 layers: the float8 matmul a GPU build uses and the cast-up arithmetic the
CPU keeps, both against numpy in float64 on ml_dtypes' float8 rounding; the float8 dot
is in the program only where it is asked for, and only GPUs ask for it."""

from __future__ import annotations

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jvllm.models.llama import Linear
from jvllm.models.quantization import FloatWeights, with_fp8_matmul

F8 = ml_dtypes.float8_e4m3fn
QMAX = float(ml_dtypes.finfo(F8).max)


def layer_inputs(strategy: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((24, 64)).astype(np.float32) * rng.uniform(0.1, 3, (24, 1))
    w = (rng.standard_normal((48, 64)) * 2).astype(F8)
    shape = (1,) if strategy == "tensor" else (48, 1)
    scale = rng.uniform(0.01, 0.05, shape).astype(np.float32)
    input_scale = np.array([np.abs(x).max() / QMAX * 0.8], np.float32)  # clamps a few
    return x, w, scale, input_scale


def numpy_reference(x, w, scale, input_scale, activations: str) -> np.ndarray:
    if activations == "token":
        sx = np.maximum(np.abs(x).max(axis=1, keepdims=True) / QMAX, 1e-12)
    else:
        sx = input_scale.astype(np.float64)
    xq = np.clip(x / sx, -QMAX, QMAX).astype(np.float32).astype(F8).astype(np.float64)
    sw = scale.reshape(-1) if scale.size > 1 else scale[0]
    return (xq @ w.astype(np.float64).T) * sx * sw


def run_layer(scheme: FloatWeights, x, w, scale, input_scale) -> tuple[np.ndarray, str]:
    layer = Linear(48, False, jnp.float32, scheme)
    params = {"weight": jnp.asarray(w), "weight_scale": jnp.asarray(scale)}
    if scheme.activations == "tensor":
        params["input_scale"] = jnp.asarray(input_scale)
    fn = jax.jit(lambda p, x: layer.apply({"params": p}, x))
    return np.asarray(fn(params, x)), fn.lower(params, x).as_text()


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("activations", ["token", "tensor"])
@pytest.mark.parametrize("fp8_matmul", [False, True])
def test_both_paths_match_numpy(strategy, activations, fp8_matmul):
    x, w, scale, input_scale = layer_inputs(strategy)
    scheme = FloatWeights(strategy, activations, fp8_matmul)
    got, program = run_layer(scheme, x, w, scale, input_scale)
    want = numpy_reference(x, w, scale, input_scale, activations)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    float8_dots = re.findall(r"stablehlo.dot_general.*\(tensor<[\dx]+xf8E4M3FN>", program)
    assert len(float8_dots) == (1 if fp8_matmul else 0), program


def test_only_a_gpu_multiplies_in_float8():
    w8a8 = FloatWeights("channel", "token")
    gpu, cpu = SimpleNamespace(platform="gpu"), SimpleNamespace(platform="cpu")
    assert with_fp8_matmul(w8a8, gpu).fp8_matmul
    assert not with_fp8_matmul(w8a8, cpu).fp8_matmul
    weight_only = FloatWeights("channel", None)  # float inputs: nothing to multiply in fp8
    assert not with_fp8_matmul(weight_only, gpu).fp8_matmul
    assert with_fp8_matmul("int8", gpu) == "int8"

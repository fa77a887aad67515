"""Places checkpoint tensors onto a tensor-parallel mesh, one device slice at a time.

Each device's slice is cut from the memory-mapped tensor, converted to the target
dtype and transferred on its own, so no device (and no host buffer in the target
dtype) ever holds a whole sharded tensor. KV projections of a model with fewer KV
heads than devices are repeated head by head first (see `mesh.kv_replication`). With
pipeline stages, the same parameter of the stages' layers is one array with a leading
`pp` axis (`place_stacked`): stage s's devices hold only its own layer's slices.
Imports `mesh` only: the model loader calls this module, never the reverse.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jvllm.parallel.mesh import (
    PP_AXIS,
    ModelShapes,
    is_per_tensor,
    kv_replication,
    partition_spec,
    pp_size,
    tp_size,
)


def to_numpy_dtype(dtype: jnp.dtype) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def repeat_kv_heads(array: np.ndarray, repeats: int, head_dim: int) -> np.ndarray:
    """[Hkv * D, ...] -> [Hkv * repeats * D, ...], each head repeated in place."""
    heads = array.reshape(-1, head_dim, *array.shape[1:])
    return np.repeat(heads, repeats, axis=0).reshape(-1, *array.shape[1:])


class ShardedPlacer:
    """`place(name, array, dtype)` for `load_model` on a mesh."""

    def __init__(self, mesh: Mesh, spec: ModelShapes) -> None:
        self.mesh = mesh
        self.spec = spec  # the checkpoint's own spec, before KV replication
        self.tp = tp_size(mesh)
        self.pp = pp_size(mesh)

    def expected_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint shape a model parameter of `shape` comes from."""
        repeats = kv_replication(self.spec, self.tp)
        if repeats > 1 and self._is_kv(name, shape):
            return (shape[0] // repeats, *shape[1:])
        return shape

    def __call__(
        self, name: str, array: np.ndarray, dtype: jnp.dtype, memory_kind: str | None = None
    ) -> jax.Array:
        """The parameter's slices on their devices (in `memory_kind` memory if given)."""
        array = self._replicate_kv(name, array)
        spec = partition_spec(name, array.shape, self.spec, self.tp, self.pp)
        sharding = NamedSharding(self.mesh, spec, memory_kind=memory_kind)
        target = to_numpy_dtype(dtype)
        return jax.make_array_from_callback(
            array.shape, sharding, lambda index: np.ascontiguousarray(array[index], dtype=target)
        )

    def place_stacked(self, name: str, arrays: list[np.ndarray], dtype: jnp.dtype) -> jax.Array:
        """One parameter of every stage's layer (`arrays[s]`: stage s's, named `name` as
        stage 0's) as a `[pp, ...]` array split on `pp`; each stage's devices get only
        their layer's slices."""
        arrays = [self._replicate_kv(name, a) for a in arrays]
        shape = (len(arrays), *arrays[0].shape)
        spec = partition_spec(name, arrays[0].shape, self.spec, self.tp, self.pp)
        sharding = NamedSharding(self.mesh, P(PP_AXIS, *spec))
        target = to_numpy_dtype(dtype)

        def piece(index: tuple[slice, ...]) -> np.ndarray:
            stages = range(*index[0].indices(len(arrays)))
            return np.stack([np.asarray(arrays[s][index[1:]], dtype=target) for s in stages])

        return jax.make_array_from_callback(shape, sharding, piece)

    def _replicate_kv(self, name: str, array: np.ndarray) -> np.ndarray:
        repeats = kv_replication(self.spec, self.tp)
        if repeats > 1 and self._is_kv(name, array.shape):
            return repeat_kv_heads(array, repeats, self.spec.head_dim)
        return array

    def _is_kv(self, name: str, shape: tuple[int, ...]) -> bool:
        """A tensor laid out by KV head: a k/v projection's, or an OLMoE k_norm's scale
        over the whole key projection (the norm's mean is unchanged by repeating heads)."""
        whole_k_norm = getattr(self.spec, "qk_norm_over_projection", False)
        return _is_kv_projection(name, shape) or (whole_k_norm and name.endswith(".k_norm.weight"))


def _is_kv_projection(name: str, shape: tuple[int, ...]) -> bool:
    """A k/v projection tensor whose first axis is its outputs (a packed layer's
    weight_g_idx runs over its inputs; a per-tensor scale over nothing)."""
    kv = ".k_proj." in name or ".v_proj." in name
    return kv and not name.endswith(".weight_g_idx") and not is_per_tensor(name, shape)

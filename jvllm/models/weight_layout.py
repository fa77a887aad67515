"""Weights rearranged after loading for the device that runs them (vLLM's
`process_weights_after_loading`).

Checkpoints store each linear weight `[out, in]`, and the loaders, quantized formats and
tensor-parallel placement all keep that layout. On a CPU, XLA's matmuls read `[in, out]`
faster: the `peer` bench model's decode forward at 16 and 48 rows took 5-15% less wall
and CPU time with every float linear weight and the lm_head turned. So a loaded
single-device, unquantized model on a CPU is turned once here, and its spec says so
(`transposed_weights`). Embeddings (looked up by row, and the lm_head of tied models)
keep `[V, H]`. Not owned here: which weights exist and how they are read (`loader.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from jvllm.models.loader import LoadedModel
from jvllm.models.quantization import QUANTIZED_LAYERS
from jvllm.models.spec import ModelSpec


def transposes_weights(spec: ModelSpec, mesh: Mesh | None, num_offloaded_layers: int = 0) -> bool:
    """One CPU device, float weights, none kept in host memory. (A mesh splits weights by
    their `[out, in]` axes; quantized formats carry per-output scales in their own
    layouts; on a GPU the gain is unmeasured, so the checkpoint's layout stays.)"""
    on_cpu = jax.local_devices()[0].platform == "cpu"
    return on_cpu and mesh is None and spec.quantization is None and num_offloaded_layers == 0


def process_weights_after_loading(loaded: LoadedModel) -> LoadedModel:
    """`loaded` with each decoder layer's linear weights and the untied lm_head held
    `[in, out]`; every other parameter as it was."""
    assert not loaded.spec.transposed_weights

    def turn(path: tuple, leaf: jax.Array) -> jax.Array:
        names = [getattr(key, "key", None) for key in path]
        linear = len(names) >= 2 and names[-2] in QUANTIZED_LAYERS and names[-1] == "weight"
        if not (linear or names == ["lm_head", "weight"]):
            return leaf
        # On a CPU the array's memory is the host's: one numpy copy, no program compiled.
        turned = np.ascontiguousarray(np.asarray(leaf).T)
        return jax.device_put(turned, leaf.sharding)

    spec = dataclasses.replace(loaded.spec, transposed_weights=True)
    params = jax.tree_util.tree_map_with_path(turn, loaded.params)
    return dataclasses.replace(
        loaded, spec=spec, module=loaded.module.clone(spec=spec), params=params
    )

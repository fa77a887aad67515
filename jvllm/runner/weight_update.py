"""Swapping a runner's parameters in place, and releasing and restoring its device memory.

Owns `DeviceMemory`: new weights for a live `ModelRunner` (vLLM's `update_weights`), from
a checkpoint directory, (Hugging Face name, array) pairs or the engine's own parameter
tree, each tensor brought to the engine's layout (KV heads repeated under tensor
parallelism, linear weights turned where the runner holds them `[in, out]`), its dtype
and its sharding, then swapped for the old one, whose buffer is freed at once: the peak
is the weights plus one tensor. Shapes, dtypes and shardings never change, so every
compiled program runs the new weights as they are (no recompilation). Also owns sleep
and wake-up (vLLM's levels): the weights copied to host memory (level 1) or dropped
(level 2), the KV cache and the step's device buffers dropped, and all of it rebuilt
through the runner's own allocation paths on `wake_up`.

Not owned: the prefix cache (the engine resets it), when a swap may happen (the front
ends pause first), the name scheme (`models.spec.hf_name`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.models.expert_tensors import ExpertCheckpoint
from jvllm.models.loader import LoadedModel, Params
from jvllm.models.quantization import QUANTIZED_LAYERS
from jvllm.models.safetensors_index import SafetensorsIndex
from jvllm.models.spec import hf_name
from jvllm.parallel.mesh import pp_size, tp_size

# Checkpoint tensors the model recomputes (as the loader ignores them).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The step's device buffers other than the weights and the KV cache (`ModelRunner`).
_STEP_BUFFERS = ("last_sampled", "logits_buffer", "allow_all", "draft_probs")
WAKE_UP_TAGS = ("weights", "kv_cache")

Path_ = tuple[str, ...]


def _flat(params: Params, prefix: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    for key, value in params.items():
        if isinstance(value, Mapping):
            yield from _flat(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _set(params: Params, path: Path_, value: Any) -> None:
    node = params
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _copy_tree(params: Params) -> Params:
    return {k: _copy_tree(v) if isinstance(v, Mapping) else v for k, v in params.items()}


def _is_linear(path: Path_) -> bool:
    linear = len(path) >= 2 and path[-2] in QUANTIZED_LAYERS and path[-1] == "weight"
    return linear or path == ("lm_head", "weight")


def _repeat_kv(x: Any, repeats: int, head_dim: int) -> Any:
    """[Hkv * D, ...] -> [Hkv * repeats * D, ...], each head repeated in place."""
    xp = jnp if isinstance(x, jax.Array) else np
    heads = x.reshape(-1, head_dim, *x.shape[1:])
    return xp.repeat(heads, repeats, axis=0).reshape(-1, *x.shape[1:])


def _live(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.is_deleted()


class DeviceMemory:
    """The weights and device buffers of one runner, swapped, released and restored."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.sleep_level = 0  # 0: awake
        self._host_params: dict[Path_, np.ndarray] = {}  # level 1: the weights, on the host
        self._kv_released = False
        self._buffers: dict[str, tuple[tuple[int, ...], np.dtype]] = {}

    # -- weights --

    def _model(self, draft: bool) -> LoadedModel:
        if not draft:
            return self.runner.model
        if self.runner.drafter is None:
            raise ValueError("update_weights(draft=True): the engine has no draft model")
        return self.runner.drafter.model

    def _store(self, model: LoadedModel, params: Params, draft: bool) -> None:
        new = dataclasses.replace(model, params=params)
        if draft:
            self.runner.drafter.model = new
        else:
            self.runner.model = new

    def get_weights(self, draft: bool = False) -> Params:
        """The engine's parameter tree (its layout, dtypes and shardings); the arrays stay
        valid until the next update or sleep replaces them."""
        self._check_weights_present()
        return _copy_tree(self._model(draft).params)

    def update_weights(
        self,
        weights: str | Path | Params | Iterable[tuple[str, Any]],
        draft: bool = False,
    ) -> int:
        """Swaps in new weights; returns how many tensors were replaced. `weights`: a
        checkpoint directory, (Hugging Face name, numpy or jax array) pairs in the
        checkpoint's layout, or a tree shaped as `get_weights()`'s (the engine's
        layout). Tensors not given keep their values."""
        model = self._model(draft)
        mesh = self.runner.mesh
        if model.vision is not None:  # its tower, projector and image cache stay as loaded
            raise ValueError(
                "update_weights covers text-only models; this one is a vision-language model"
            )
        if model.spec.quantization is not None or pp_size(mesh) > 1:
            raise ValueError(
                "update_weights supports float weights without pipeline stages; this engine "
                f"has quantization={model.spec.quantization!r}, "
                f"pipeline_parallel_size={pp_size(mesh)}"
            )
        params = _copy_tree(model.params)
        targets = dict(_flat(params))
        if isinstance(weights, Mapping):
            pairs = self._tree_pairs(weights, targets)
        elif isinstance(weights, str | Path):
            pairs = self._directory_pairs(Path(weights), model, targets)
        else:
            pairs = self._named_pairs(weights, model, targets)
        count = 0
        try:
            for path, array in pairs:
                old = targets[path]
                if array is old:
                    continue  # the engine's own array, handed back unchanged
                new = self._place(path, array, old)
                _set(params, path, new)
                targets[path] = new
                if _live(old):
                    old.delete()  # freed now: the peak is the weights plus one tensor
                self._host_params.pop((draft, *path), None)
                count += 1
        finally:
            # A bad tensor midway leaves the ones before it swapped in, never a freed one.
            self._store(model, params, draft)
        return count

    def _place(self, path: Path_, array: Any, old: Any) -> jax.Array:
        """`array` (engine layout) checked against the parameter it replaces, in its
        dtype, on its sharding; a copy the engine owns (never the caller's buffer)."""
        if tuple(array.shape) != tuple(old.shape):
            raise ValueError(
                f"update_weights: {hf_name(path)!r} has shape {tuple(array.shape)}, the "
                f"engine's parameter has {tuple(old.shape)}"
            )
        if isinstance(array, jax.Array):
            if array.dtype != old.dtype:
                array = array.astype(old.dtype)  # on the array's own devices
            # Device to device onto the engine's sharding: no host round trip.
            return jax.device_put(array, old.sharding, may_alias=False)
        host = np.asarray(array)
        target = np.dtype(old.dtype)
        if host.dtype != target:
            host = host.astype(target)
        return jax.device_put(host, old.sharding)

    def _tree_pairs(self, tree: Params, targets: dict[Path_, Any]) -> Iterator[tuple[Path_, Any]]:
        for path, array in _flat(tree):
            if path not in targets:
                raise ValueError(
                    f"update_weights: the tree has {'/'.join(path)!r}, which is not a "
                    "parameter of the engine's model (pass a tree shaped as get_weights()'s)"
                )
            yield path, array

    def _named_pairs(
        self, pairs: Iterable[tuple[str, Any]], model: LoadedModel, targets: dict[Path_, Any]
    ) -> Iterator[tuple[Path_, Any]]:
        by_name = {hf_name(p): p for p in targets}
        for item in pairs:
            if not (isinstance(item, tuple | list) and len(item) == 2):
                raise TypeError(
                    "update_weights takes a checkpoint directory, a parameter tree, or an "
                    f"iterable of (name, array) pairs; got an item of type {type(item).__name__}"
                )
            name, array = item
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and model.spec.tie_word_embeddings:
                continue  # tied: the embedding is the head
            path = by_name.get(name)
            if path is None:
                raise ValueError(
                    f"update_weights: {name!r} is not a tensor of this "
                    f"{model.spec.architecture} checkpoint (e.g. {sorted(by_name)[:3]})"
                )
            yield path, self._engine_layout(path, array, model)

    def _directory_pairs(
        self, model_dir: Path, model: LoadedModel, targets: dict[Path_, Any]
    ) -> Iterator[tuple[Path_, Any]]:
        if not model_dir.is_dir():
            raise FileNotFoundError(f"update_weights: {str(model_dir)!r} is not a directory")
        index: SafetensorsIndex | ExpertCheckpoint = SafetensorsIndex(model_dir)
        if model.spec.moe is not None:
            index = ExpertCheckpoint(index, model.spec)
        for path in targets:
            name = hf_name(path)
            if name not in index:
                raise ValueError(f"update_weights: {model_dir} has no tensor {name!r}")
            yield path, self._engine_layout(path, index.array(name), model)

    def _engine_layout(self, path: Path_, array: Any, model: LoadedModel) -> Any:
        """A checkpoint-layout tensor as the runner holds it: KV heads repeated to one per
        device, linear weights `[in, out]` where the spec says they are turned."""
        if not isinstance(array, jax.Array):
            array = np.asarray(array)
        tp = tp_size(self.runner.mesh)
        checkpoint_heads = int(model.hf_config.get("num_key_value_heads", model.spec.num_kv_heads))
        repeats = tp // checkpoint_heads if checkpoint_heads < tp else 1
        name = hf_name(path)
        if repeats > 1 and (".k_proj." in name or ".v_proj." in name):
            array = _repeat_kv(array, repeats, model.spec.head_dim)
        if model.spec.transposed_weights and _is_linear(path):
            array = array.T
        return array

    # -- sleep and wake-up --

    def sleep(self, level: int) -> None:
        """Level 1: weights copied to host memory, KV cache dropped; level 2: both
        dropped (`update_weights` brings weights back)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.sleep_level:
            raise RuntimeError(f"already asleep (level {self.sleep_level}); call wake_up() first")
        runner = self.runner
        jax.block_until_ready(runner.caches)  # nothing queued still reads what goes
        self._release_kv()
        models = [False] + ([True] if runner.drafter is not None else [])
        for draft in models:
            model = self._model(draft)
            params = _copy_tree(model.params)
            for path, leaf in _flat(params):
                if level == 1:
                    self._host_params[(draft, *path)] = np.asarray(jax.device_get(leaf))
                spec = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
                _set(params, path, spec)
                if _live(leaf):
                    leaf.delete()
            self._store(model, params, draft)
        self.sleep_level = level

    def release_kv_cache(self) -> None:
        """The KV cache and the step's buffers dropped, the weights kept
        (`wake_up(tags=["kv_cache"])` brings them back)."""
        if not self._kv_released:
            jax.block_until_ready(self.runner.caches)
            self._release_kv()

    def _release_kv(self) -> None:
        runner = self.runner
        for name in _STEP_BUFFERS:
            buffer = getattr(runner, name)
            if buffer is not None:
                self._buffers[name] = (buffer.shape, np.dtype(buffer.dtype))
                buffer.delete()
                setattr(runner, name, None)
        for k, v in runner.caches:
            k.delete()
            v.delete()
        runner.caches = []
        runner.features = None
        runner.proposed = None  # the last proposal's drafts (`draft_feed`)
        runner._last_forward = None
        self._kv_released = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restores what `tags` names (default: everything): the weights (from host
        memory after level 1; after level 2, zeros until `update_weights`) and the KV
        cache with the step's buffers, all zeroed."""
        tags = list(WAKE_UP_TAGS if tags is None else tags)
        unknown = set(tags) - set(WAKE_UP_TAGS) - {"scheduling"}
        if unknown:
            raise ValueError(f"wake_up tags must be among {WAKE_UP_TAGS}; got {sorted(unknown)}")
        if "weights" in tags:
            self._restore_weights()
        if "kv_cache" in tags and self._kv_released:
            runner = self.runner
            runner.caches = runner._allocate_cache(runner.num_blocks)
            for name, (shape, dtype) in self._buffers.items():
                fill = -1 if name == "allow_all" else 0  # allow_all: every token allowed
                setattr(runner, name, runner._device_array(np.full(shape, fill, dtype)))
            self._kv_released = False
        if not self._kv_released and not self.missing_weights():
            self.sleep_level = 0

    def _restore_weights(self) -> None:
        models = [False] + ([True] if self.runner.drafter is not None else [])
        for draft in models:
            model = self._model(draft)
            params = _copy_tree(model.params)
            for path, leaf in _flat(params):
                if isinstance(leaf, jax.ShapeDtypeStruct):
                    host = self._host_params.pop((draft, *path), None)
                    if host is None:
                        host = np.zeros(leaf.shape, leaf.dtype)
                    _set(params, path, jax.device_put(host, leaf.sharding))
            self._store(model, params, draft)

    def missing_weights(self) -> list[str]:
        """Names of the parameters that hold no device buffer (dropped by sleep)."""
        return [
            hf_name(p)
            for p, leaf in _flat(self.runner.model.params)
            if isinstance(leaf, jax.ShapeDtypeStruct)
        ]

    def _check_weights_present(self) -> None:
        missing = self.missing_weights()
        if missing:
            raise RuntimeError(
                f"the engine's weights were released by sleep(level={self.sleep_level}) "
                f"({len(missing)} tensors, e.g. {missing[0]!r}); call wake_up() or "
                "update_weights() first"
            )

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def check_awake(self) -> None:
        """Raises unless the weights and the KV cache are on the device."""
        self._check_weights_present()
        if self._kv_released:
            raise RuntimeError(
                "the KV cache was released by sleep(); call wake_up() (or "
                "wake_up(tags=['kv_cache'])) before generating"
            )

"""Loads a local Hugging Face checkpoint directory into Flax parameters on device.

Owns config.json parsing, dtype resolution, and the name/shape check of every
tensor against the Flax module's abstract parameters. Each tensor goes from its
memory map straight to the target dtype and onto the device, one at a time.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from jvllm.layers.attention import AttentionMetadata, KVCache
from jvllm.models import orbax_checkpoint
from jvllm.models.expert_quantization import check_expert_split, expert_scheme, scale_name
from jvllm.models.expert_tensors import ExpertCheckpoint, StackedExperts
from jvllm.models.fused_tensors import FUSED_ARCHITECTURES, FusedProjections
from jvllm.models.llava import vision_for
from jvllm.models.packed_formats import check_split, checkpoint_scheme
from jvllm.models.packed_tensors import PackedCheckpoint
from jvllm.models.quantization import (
    PackedWeights,
    check_quantization,
    quantize,
    with_fp8_matmul,
)
from jvllm.models.qwen2_5_vl import vision_for as qwen_vision_for
from jvllm.models.registry import model_class, read_spec
from jvllm.models.safetensors_index import SafetensorsIndex
from jvllm.models.spec import ModelSpec, hf_name
from jvllm.parallel.loading import ShardedPlacer, to_numpy_dtype
from jvllm.parallel.mesh import check_divisible, check_stages, kv_replication, pp_size, tp_size

_DTYPE_NAMES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}
# Buffers some checkpoints carry that the model recomputes.
# (weight_shape: compressed-tensors stores each packed weight's unpacked shape.)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".weight_shape")

Params = dict[str, Any]
# Where offloaded weights live between steps (JAX's memory kinds).
HOST_MEMORY = "pinned_host"


@dataclass(frozen=True)
class LoadedModel:
    spec: ModelSpec
    module: nn.Module
    params: Params
    dtype: jnp.dtype
    hf_config: dict[str, Any]
    # Decoder layers 0..n-1 keep their weights in pinned host memory (cpu_offload_gb).
    num_offloaded_layers: int = 0
    # A vision-language model's vision side and its parameters (`models/llava.py`).
    vision: tuple[Any, Params] | None = None

    @property
    def weight_bytes(self) -> int:
        """Bytes of every parameter (all devices' shards together)."""
        return sum(int(x.nbytes) for x in jax.tree.leaves(self.params))

    def bytes_per_device(self) -> dict[jax.Device, int]:
        """Bytes of the parameter slices each local device holds."""
        held: dict[jax.Device, int] = {}
        for leaf in jax.tree.leaves(self.params):
            for shard in leaf.addressable_shards:
                held[shard.device] = held.get(shard.device, 0) + int(shard.data.nbytes)
        return held


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} is missing: not a Hugging Face checkpoint")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: invalid JSON ({e.msg}, line {e.lineno})") from None


def resolve_dtype(dtype: str, spec: ModelSpec) -> jnp.dtype:
    """`auto` keeps the checkpoint's own dtype (float32 when config.json names none)."""
    if dtype == "auto":
        dtype = spec.torch_dtype or "float32"
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPE_NAMES)}; got {dtype!r}")
    return jnp.dtype(_DTYPE_NAMES[dtype])


def trace_inputs(spec: ModelSpec, dtype: jnp.dtype) -> tuple[list[KVCache], AttentionMetadata]:
    """A one-token, one-block cache and batch: enough to trace a module's parameters."""
    heads, k_dim, v_dim = spec.kv_cache_dims
    cache = (jnp.zeros((2, 1, heads, k_dim), dtype), jnp.zeros((2, 1, heads, v_dim), dtype))
    meta = AttentionMetadata(
        slot_mapping=jnp.zeros(1, jnp.int32),
        query_start_loc=jnp.array([0, 1], jnp.int32),
        seq_lens=jnp.ones(1, jnp.int32),
        block_tables=jnp.zeros((1, 1), jnp.int32),
    )
    return [cache] * spec.num_layers, meta


def abstract_params(module: nn.Module, spec: ModelSpec) -> Params:
    """Parameter shapes and dtypes, traced without allocating anything."""
    caches, meta = trace_inputs(spec, module.dtype)
    tokens = jnp.zeros(1, jnp.int32)
    # Trace the forward and the logits head, so lm_head's parameters exist too.
    everything = lambda m, *args: m.logits(m(*args)[0])
    init = lambda: module.init(jax.random.key(0), tokens, tokens, caches, meta, method=everything)
    return jax.eval_shape(init)["params"]


def sharded_spec(spec: ModelSpec, tp: int, device: jax.Device | None = None) -> ModelSpec:
    """The spec the model is built with: KV heads replicated up to `tp` when fewer; on
    `device`'s kind of hardware (FP8 matmuls on a GPU, `with_fp8_matmul`)."""
    quantization = spec.quantization
    if device is not None:
        quantization = with_fp8_matmul(quantization, device)
    return dataclasses.replace(
        spec, num_kv_heads=spec.num_kv_heads * kv_replication(spec, tp), quantization=quantization
    )


def load_model(
    model_dir: str | Path,
    dtype: str = "auto",
    attention_backend: str = "reference",
    mesh: Mesh | None = None,
    quantization: str | None = None,
    offload_bytes: int = 0,
    expert_parallel: bool = False,
    max_model_len: int | None = None,
) -> LoadedModel:
    """Loads and places every parameter; on a mesh each device gets only its slices.

    `model_dir` is a Hugging Face safetensors checkpoint or a `jvllm convert` output.
    `quantization` ("int8", "fp8") quantizes the linear weights on the host as they load.
    `offload_bytes` (vLLM's cpu_offload_gb, per device): the first decoder layers whose
    weights fit in it stay in pinned host memory; the step copies them in as it runs.
    `expert_parallel` (vLLM's enable_expert_parallel): a mixture-of-experts model's
    experts are split whole over the `tp` devices instead of on their intermediate axis.
    `max_model_len` (None: max_position_embeddings) picks LongRoPE's factors.
    """
    model_dir = Path(model_dir)
    check_quantization(quantization)
    hf_config = read_config(model_dir)
    scheme: Any = quantization
    base_spec = read_spec(hf_config)
    cls = model_class(base_spec.architecture)  # unsupported architectures fail before any I/O
    config = hf_config.get("quantization_config")
    # A format the model class reads itself (gpt-oss's MXFP4 experts, dequantized at load).
    if config is not None and config.get("quant_method") not in getattr(cls, "reads_quant", ()):
        scheme = checkpoint_scheme(str(model_dir), config, quantization)
    spec = dataclasses.replace(
        base_spec,
        quantization=scheme,
        expert_parallel=expert_parallel,
        max_model_len=max_model_len,
    )
    if pp_size(mesh) > 1 and spec.mla is not None:
        raise ValueError(
            f"pipeline_parallel_size={pp_size(mesh)} does not support {spec.architecture} yet"
        )
    check_experts(spec, mesh)
    converted = orbax_checkpoint.is_orbax_checkpoint(model_dir)
    if converted and quantization is not None:
        raise ValueError(
            f"{model_dir}: quantization at load reads safetensors checkpoints, not a "
            "`jvllm convert` output; load the original checkpoint"
        )
    if dtype == "auto" and converted:
        dtype = orbax_checkpoint.saved_dtype(model_dir)
    target = resolve_dtype(dtype, spec)
    tp, pp = tp_size(mesh), pp_size(mesh)
    if pp > 1 and not getattr(cls, "supports_pipeline", True):
        raise ValueError(f"{spec.architecture} does not support pipeline_parallel_size={pp} (1)")
    if mesh is not None:
        check_divisible(spec, tp)
        check_stages(spec.num_layers, pp)
    if pp > 1 and (converted or offload_bytes):
        what = "a `jvllm convert` output" if converted else "cpu_offload_gb"
        raise ValueError(
            f"pipeline_parallel_size={pp} loads safetensors checkpoints without offloading; "
            f"{what} is not supported with pipeline stages"
        )
    check_split(str(model_dir), spec, scheme, tp)
    device = jax.local_devices()[0] if mesh is None else mesh.devices.flat[0]
    built_spec = sharded_spec(spec, tp, device)
    module = cls(spec=built_spec, dtype=target, backend=attention_backend, mesh=mesh)
    abstract = abstract_params(module, built_spec)
    num_offloaded = offloaded_layer_count(abstract, offload_bytes, tp)
    offloaded = lambda path: _layer_index(path) in range(num_offloaded)
    if converted:
        flat = orbax_checkpoint.restore(model_dir, dict(_flatten(abstract)), spec, mesh)
        for path in flat:
            if offloaded(path):
                host = flat[path].sharding.with_memory_kind(HOST_MEMORY)
                flat[path] = jax.device_put(flat[path], host)
        params = _unflatten(flat)
    else:
        params = read_params(model_dir, abstract, spec, mesh, offloaded=offloaded)
    vision = vision_for(model_dir, spec, hf_config, target, mesh)
    vision = vision or qwen_vision_for(model_dir, spec, hf_config, target, mesh)
    return LoadedModel(built_spec, module, params, target, hf_config, num_offloaded, vision)


def check_experts(spec: ModelSpec, mesh: Mesh | None) -> None:
    """Rejects what the mixture-of-experts layer does not cover."""
    if spec.moe is None:
        if spec.expert_parallel:
            raise ValueError(
                f"enable_expert_parallel needs a mixture-of-experts model; "
                f"{spec.architecture} has no experts"
            )
        return
    scheme = expert_scheme(spec.quantization, spec.architecture)  # raises if experts cannot
    check_expert_split(scheme, tp_size(mesh), spec.expert_parallel, spec.architecture)
    pp = pp_size(mesh)
    if pp > 1 and spec.num_layers % pp == 0:
        per_stage = spec.num_layers // pp
        for j in range(per_stage):
            kinds = {spec.is_sparse_layer(stage * per_stage + j) for stage in range(pp)}
            if len(kinds) > 1:
                raise ValueError(
                    f"pipeline_parallel_size={pp} needs every stage's layer {j} to be alike, "
                    f"but the sparse layers are {list(spec.moe.sparse_layers)} "
                    "(decoder_sparse_step, mlp_only_layers); choose another stage count"
                )


def _layer_index(path: tuple[str, ...]) -> int | None:
    """i for a parameter of decoder layer i (`model.layers_i...`), else None."""
    if len(path) > 1 and path[0] == "model" and path[1].startswith("layers_"):
        return int(path[1].removeprefix("layers_"))
    return None


def offloaded_layer_count(abstract: Params, budget_bytes: int, tp: int) -> int:
    """How many decoder layers, from the first, fit their weights (per device, each
    split `tp` ways) in `budget_bytes`."""
    per_layer: dict[int, float] = {}
    for path, leaf in _flatten(abstract):
        index = _layer_index(path)
        if index is not None:
            nbytes = int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize / tp
            per_layer[index] = per_layer.get(index, 0.0) + nbytes
    count, used = 0, 0.0
    for index in sorted(per_layer):
        if used + per_layer[index] > budget_bytes:
            break
        used += per_layer[index]
        count += 1
    return count


def read_params(
    model_dir: Path,
    abstract_tree: Params,
    spec: ModelSpec,
    mesh: Mesh | None,
    ignored: frozenset[str] = frozenset(),
    offloaded: Callable[[tuple[str, ...]], bool] = lambda path: False,
) -> Params:
    """Every parameter of `abstract_tree` from the safetensors in `model_dir`, placed
    (quantized at load where `spec` says so; in pinned host memory where `offloaded`
    says so of its path); a checkpoint tensor the model does not use is an error, but
    for the names in `ignored`."""
    abstract = dict(_flatten(abstract_tree))
    placer = ShardedPlacer(mesh, spec) if mesh is not None else None
    # Each parameter's shape in the checkpoint (before any KV-head replication).
    wanted = {
        hf_name(p): placer.expected_shape(hf_name(p), a.shape) if placer else a.shape
        for p, a in abstract.items()
    }
    index: SafetensorsIndex | PackedCheckpoint | ExpertCheckpoint = SafetensorsIndex(model_dir)
    if isinstance(spec.quantization, PackedWeights):
        index = PackedCheckpoint(index, spec.quantization, wanted)
    own_index = getattr(model_class(spec.architecture), "checkpoint_index", None)
    if own_index is not None:  # a model that names its tensors itself (gpt-oss)
        index = own_index(index, spec)
    elif spec.moe is not None:
        index = ExpertCheckpoint(index, spec)
    if spec.architecture in FUSED_ARCHITECTURES:
        index = FusedProjections(index, spec)
    host = SingleDeviceSharding(jax.local_devices()[0], memory_kind=HOST_MEMORY)
    flat: dict[tuple[str, ...], jax.Array] = {}
    used: set[str] = set()
    pp = placer.pp if placer is not None else 1
    per_stage = spec.num_layers // pp
    # Pipeline stages: stage s's layer s * per_stage + j waits here until every stage's
    # layer j has been read, then the group is placed as layer j's `[pp, ...]` array.
    stage_groups: dict[tuple[str, ...], list[np.ndarray | None]] = {}

    def place(path: tuple[str, ...], array: np.ndarray, dtype: jnp.dtype) -> None:
        used.add(hf_name(path))
        layer = _layer_index(path)
        if placer is not None and pp > 1 and layer is not None:
            local = (path[0], f"layers_{layer % per_stage}", *path[2:])
            group = stage_groups.setdefault(local, [None] * pp)
            group[layer // per_stage] = array
            if all(a is not None for a in group):
                flat[local] = placer.place_stacked(hf_name(local), group, dtype)
                del stage_groups[local]
            return
        kind = HOST_MEMORY if offloaded(path) else None
        if placer is not None:
            flat[path] = placer(hf_name(path), array, dtype, memory_kind=kind)
        else:
            flat[path] = jax.device_put(_convert(array, dtype), host if kind else None)

    for path, shaped in abstract.items():
        if path[-1].endswith("_scale") and isinstance(spec.quantization, str):
            continue  # quantized at load: made with its weight, below
        name = hf_name(path)
        if name not in index:
            raise ValueError(
                f"{model_dir}: checkpoint has no tensor {index.describe(name, wanted[name])}"
            )
        array = index.array(name)
        if array.shape == () and wanted[name] == (1,):
            array = array.reshape(1)  # a per-tensor scale some writers store as a scalar
        if array.shape != wanted[name]:
            raise ValueError(
                f"{index.file(name)}: tensor {name!r} has shape {array.shape}, "
                f"expected {wanted[name]} from config.json"
            )
        scale_path = (*path[:-1], scale_name(path[-1]))
        if scale_path in abstract and isinstance(spec.quantization, str):
            array, scale = quantize(array, spec.quantization)  # on the host
            place(scale_path, scale, jnp.float32)
        place(path, array, shaped.dtype)
    assert not stage_groups, sorted(stage_groups)[:4]
    _check_unused(model_dir, index.names() - used - ignored, spec)
    return _unflatten(flat)


def _convert(array: np.ndarray | StackedExperts, dtype: jnp.dtype) -> np.ndarray:
    target = to_numpy_dtype(dtype)
    array = np.asarray(array)
    return array if array.dtype == target else array.astype(target)


def _check_unused(model_dir: Path, unused: set[str], spec: ModelSpec) -> None:
    unused = {n for n in unused if not n.endswith(_IGNORED_SUFFIXES)}
    # DeepSeek-V3's and GLM-4.5's multi-token prediction layers (layers.61.*, layers.92.*)
    if spec.mla is not None or getattr(spec.variant, "has_mtp_layers", False):
        unused = {n for n in unused if (_layer_of_name(n) or 0) < spec.num_layers}
    if spec.tie_word_embeddings:
        unused.discard("lm_head.weight")  # some tied checkpoints store the copy anyway
    if unused:
        raise ValueError(
            f"{model_dir}: checkpoint has tensors the {spec.architecture} model does not use: "
            f"{sorted(unused)[:8]}"
        )


def _layer_of_name(name: str) -> int | None:
    """L of a checkpoint name `model.layers.L...`, else None."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return None


def _flatten(tree: Params, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _flatten(value, prefix + (key,))
        else:
            out.append((prefix + (key,), value))
    return out


def _unflatten(flat: dict[tuple[str, ...], Any]) -> Params:
    tree: Params = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree

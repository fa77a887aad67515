"""Saving loaded parameters as an orbax checkpoint, and restoring them sharded.

Owns the on-disk layout of a converted model directory:

    OUT/config.json, tokenizer files   copied from the source checkpoint
    OUT/jvllm_checkpoint.json          {"format": "orbax", "dtype": ...}
    OUT/params/                        orbax StandardCheckpointer tree (Flax names)

Parameters are stored in the checkpoint's own layout (KV heads never replicated),
so one converted directory restores on any tensor-parallel size, each device
reading only its own slices.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jvllm.models.spec import ModelSpec, hf_name
from jvllm.parallel.mesh import kv_replication, partition_spec

MARKER = "jvllm_checkpoint.json"
_COPIED_SUFFIXES = (".json", ".jinja", ".model", ".txt")

Path_ = tuple[str, ...]


def is_orbax_checkpoint(model_dir: Path) -> bool:
    return (Path(model_dir) / MARKER).exists()


def saved_dtype(model_dir: Path) -> str:
    return json.loads((Path(model_dir) / MARKER).read_text())["dtype"]


def save(
    flat: dict[Path_, jax.Array],
    spec: ModelSpec,
    tp: int,
    dtype: jnp.dtype,
    source: Path,
    out: Path,
) -> None:
    """flat: parameter path -> array as loaded on a `tp`-way mesh; spec: the checkpoint's."""
    import orbax.checkpoint as ocp

    out = Path(out).resolve()
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(source).iterdir():
        if f.is_file() and f.suffix in _COPIED_SUFFIXES and not f.name.endswith(".index.json"):
            shutil.copy(f, out / f.name)
    repeats = kv_replication(spec, tp)
    tree = {
        hf_name(p): _first_copy_of_heads(x, repeats, spec.head_dim) if _is_kv(hf_name(p)) else x
        for p, x in flat.items()
    }
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out / "params", tree)
    (out / MARKER).write_text(json.dumps({"format": "orbax", "dtype": jnp.dtype(dtype).name}))


def restore(
    model_dir: Path,
    abstract: dict[Path_, jax.ShapeDtypeStruct],
    spec: ModelSpec,
    mesh: Mesh | None,
) -> dict[Path_, jax.Array]:
    """Restores into `abstract` (path -> the model's parameter shapes for this mesh)."""
    import orbax.checkpoint as ocp

    tp = 1 if mesh is None else mesh.devices.size
    repeats = kv_replication(spec, tp)
    saved = jnp.dtype(saved_dtype(model_dir))
    names = {p: hf_name(p) for p in abstract}
    targets = {}
    for p, shaped in abstract.items():
        name, shape = names[p], shaped.shape
        pspec = partition_spec(name, shape, spec, tp)
        if repeats > 1 and _is_kv(name):
            # Too few heads to split: read them whole, repeat them on device below.
            shape, pspec = (shape[0] // repeats, *shape[1:]), PartitionSpec()
        targets[name] = jax.ShapeDtypeStruct(shape, saved, sharding=_sharding(mesh, pspec))
    with ocp.StandardCheckpointer() as ckpt:
        tree = ckpt.restore(Path(model_dir).resolve() / "params", targets)
    out = {}
    for p, shaped in abstract.items():
        x = tree[names[p]]
        if repeats > 1 and _is_kv(names[p]):
            x = _repeat_heads(x, repeats, spec.head_dim)
            x = jax.device_put(x, _sharding(mesh, partition_spec(names[p], x.shape, spec, tp)))
        out[p] = x.astype(shaped.dtype) if x.dtype != shaped.dtype else x
    return out


def _sharding(mesh: Mesh | None, pspec: PartitionSpec) -> jax.sharding.Sharding:
    if mesh is None:
        return SingleDeviceSharding(jax.local_devices()[0])
    return NamedSharding(mesh, pspec)


def _first_copy_of_heads(x: jax.Array, repeats: int, head_dim: int) -> jax.Array:
    """[H * r * D, ...] with each head repeated r times -> [H * D, ...]."""
    if repeats == 1:
        return x
    heads = x.reshape(-1, repeats, head_dim, *x.shape[1:])
    return heads[:, 0].reshape(-1, *x.shape[1:])


def _repeat_heads(x: jax.Array, repeats: int, head_dim: int) -> jax.Array:
    heads = x.reshape(-1, head_dim, *x.shape[1:])
    return jnp.repeat(heads, repeats, axis=0).reshape(-1, *x.shape[1:])


def _is_kv(name: str) -> bool:
    return ".k_proj." in name or ".v_proj." in name

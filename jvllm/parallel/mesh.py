"""The device mesh (`tp`, and `pp` stages before it) and the sharding rules of every
parameter.

Owns which axis of which tensor is split across the `tp` mesh axis (Megatron
style): q/k/v and gate/up are column-parallel (split on output features, i.e.
heads), o_proj and down_proj row-parallel (split on input features), the KV
cache on its KV-head axis. Embedding and lm_head are vocab-parallel when the
vocabulary divides evenly, else replicated: vocab-parallel saves V*H/N memory per
device at the price of one all-gather of the logits. A mixture-of-experts layer's stacked
experts `[E, out, in]` split on their intermediate axis like a dense MLP, or, with
expert parallelism, whole experts on the expert axis; its router stays replicated.
When a model has fewer KV heads than devices, each KV head is replicated
`tp / num_kv_heads` times (as vLLM does), so every device still holds whole heads. A
scale of a whole tensor (FP8 per-tensor weight and static input scales) is replicated
whichever way its layer splits.

With pipeline parallelism the mesh is `pp x tp`: decoder layers are split into `pp`
stages (see `jvllm.parallel.pipeline`), and the embedding and lm_head are vocab-parallel
over all `pp * tp` devices when the vocabulary divides, so every device's share of the
weights falls as 1 / (pp * tp).

Imports go one way: `jvllm.models` imports this package, never the reverse, so the
rules read a model's shapes through the `ModelShapes` protocol (`ModelSpec` fits it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "tp"
PP_AXIS = "pp"

# Activations and caches as seen by attention: heads on the tp axis.
HEADS = P(None, AXIS, None)  # [T, H, D]
# [N, BS, Hkv, D]. No trailing None: a jitted step returns the cache with this exact
# spec, and a spec spelled otherwise (equal in meaning) is a second compiled program.
CACHE = P(None, None, AXIS)


class ModelShapes(Protocol):
    """The sizes the sharding rules split (`jvllm.models.spec.ModelSpec` has them)."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


def make_mesh(
    tensor_parallel_size: int,
    devices: Sequence[jax.Device] | None = None,
    pipeline_parallel_size: int = 1,
) -> Mesh:
    """A `tp` mesh, or `pp x tp` with pipeline stages (stage s: devices s*tp..s*tp+tp-1)."""
    devices = list(jax.devices() if devices is None else devices)
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if len(devices) < tp * pp:
        what = f"tensor_parallel_size={tp}"
        if pp > 1:
            what = f"pipeline_parallel_size={pp} x {what}"
        raise ValueError(
            f"{what} needs {tp * pp} devices, but only {len(devices)} are visible "
            f"({devices[0].platform})"
        )
    # Auto axes: XLA's sharding propagation places the collectives (the all-reduce
    # after row-parallel layers, the gather from a vocab-parallel embedding).
    if pp == 1:
        return Mesh(np.array(devices[:tp]), (AXIS,), axis_types=(AxisType.Auto,))
    chosen = np.array(devices[: tp * pp]).reshape(pp, tp)
    return Mesh(chosen, (PP_AXIS, AXIS), axis_types=(AxisType.Auto, AxisType.Auto))


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(mesh.shape[AXIS])


def pp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(dict(mesh.shape).get(PP_AXIS, 1))


def vocab_axes(vocab_size: int, tp: int, pp: int = 1) -> tuple[str, ...]:
    """The mesh axes a vocabulary-sized axis is split over: every device when the
    vocabulary divides `pp * tp`, else `tp` alone when it divides that, else none."""
    if pp > 1 and vocab_size % (pp * tp) == 0:
        return (PP_AXIS, AXIS)
    if tp > 1 and vocab_size % tp == 0:
        return (AXIS,)
    return ()


def check_stages(num_layers: int, pp: int) -> None:
    if num_layers % pp:
        raise ValueError(
            f"pipeline_parallel_size={pp} must divide num_hidden_layers={num_layers}: "
            "every stage holds the same number of layers"
        )


def check_divisible(spec: ModelShapes, tp: int) -> None:
    """Rejects a model whose heads or MLP cannot be split `tp` ways."""
    problems = []
    if spec.num_heads % tp:
        problems.append(f"num_attention_heads={spec.num_heads}")
    if spec.intermediate_size % tp:
        problems.append(f"intermediate_size={spec.intermediate_size}")
    moe = getattr(spec, "moe", None)
    if moe is not None and getattr(spec, "expert_parallel", False):
        if moe.num_experts % tp:
            problems.append(f"num_experts={moe.num_experts} (expert parallel)")
    elif moe is not None:
        for name in ("intermediate_size", "shared_expert_intermediate_size"):
            if getattr(moe, name) % tp:
                problems.append(f"the experts' {name}={getattr(moe, name)}")
    kv = spec.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        problems.append(f"num_key_value_heads={kv}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide {', '.join(problems)} "
            "(KV heads may instead be fewer than and divide tensor_parallel_size)"
        )


def kv_replication(spec: ModelShapes, tp: int) -> int:
    """How many times each checkpoint KV head is repeated to give every device one."""
    return tp // spec.num_kv_heads if spec.num_kv_heads < tp else 1


def is_per_tensor(name: str, shape: tuple[int, ...]) -> bool:
    """A scale that stands for a whole tensor (an FP8 per-tensor `weight_scale` [1] or a
    static `input_scale`): every part of a split layer keeps it, and KV-head replication
    leaves it alone."""
    scale = name.endswith(".input_scale") or name.endswith(".weight_scale")
    return scale and int(np.prod(shape)) == 1 and len(shape) <= 1


def partition_spec(name: str, shape: tuple[int, ...], spec: ModelShapes, tp: int, pp: int = 1) -> P:
    """The PartitionSpec of one parameter of `shape`, by its Hugging Face name (one
    layer's own; a pipeline stacks its layers' copies on a leading `pp` axis)."""
    leaf = name.split(".")[-2] if shape else ""
    if leaf in ("embed_tokens", "lm_head"):
        axes = vocab_axes(spec.vocab_size, tp, pp)
        return P(axes, None) if axes else P()
    if tp == 1 or is_per_tensor(name, shape):
        return P()
    ndim = len(shape)
    if leaf == "experts" and ndim == 2:  # per-expert biases [E, out] (gpt-oss)
        if getattr(spec, "expert_parallel", False):
            return P(AXIS, None)
        # The down bias is added once, after the experts' partial sums are reduced.
        return P() if name.endswith(".down_proj_bias") else P(None, AXIS)
    if leaf == "experts":  # stacked [E, out, in]: whole experts, or their I axis, split
        if getattr(spec, "expert_parallel", False):
            return P(AXIS, *[None] * (ndim - 1))
        if name.endswith("_scale"):  # [E, out] or [E, 1]: split with gate/up's outputs
            return P(None, AXIS) if shape[1] > 1 and not name.endswith(".down_proj_scale") else P()
        return P(None, None, AXIS) if name.endswith(".down_proj") else P(None, AXIS, None)
    # q_b_proj, kv_b_proj: latent attention's per-head up-projections.
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
    # A packed layer's weight_g_idx [in] names each input's group: it follows the inputs.
    g_idx = name.endswith(".weight_g_idx")
    if leaf in column:
        return P() if g_idx else P(AXIS, None) if ndim == 2 else P(AXIS)
    if leaf in ("o_proj", "down_proj"):
        if g_idx:
            return P(AXIS)
        # With activation order a device's inputs may fall in any group: each keeps
        # every group's scale and zero point [out, groups].
        if getattr(getattr(spec, "quantization", None), "act_order", False):
            return P(None, AXIS) if name.endswith(".weight_packed") else P()
        # A row-parallel bias is added once; a [out, 1] scale per row (quantized
        # weights) applies whole to every input split.
        return P(None, AXIS) if ndim == 2 and shape[1] > 1 else P()
    return P()  # norms


def cache_sharding(mesh: Mesh | None, split_heads: bool = True) -> NamedSharding | None:
    """One KV layer's sharding: heads on `tp` (replicated unless `split_heads`: a latent
    cache's one shared head); with stages, a leading `pp` axis."""
    if mesh is None:
        return None
    if not split_heads:
        return NamedSharding(mesh, P(PP_AXIS) if pp_size(mesh) > 1 else P())
    if pp_size(mesh) == 1:
        return NamedSharding(mesh, CACHE)
    # Spelled as a program returns it: a size-1 tp axis is dropped from the spec.
    return NamedSharding(mesh, P(PP_AXIS, *CACHE) if tp_size(mesh) > 1 else P(PP_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())

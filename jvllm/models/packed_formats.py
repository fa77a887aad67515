"""Quantized checkpoints: GPTQ, AWQ and compressed-tensors packed ints, block FP8.

Owns recognising a checkpoint's `quantization_config` (`checkpoint_scheme`) and the
checks that its groups or blocks fit the model and the tensor-parallel split.
`packed_tensors.py` converts the tensors of each packed layout below to the device one;
block FP8 checkpoints (`weight` float8, `weight_scale_inv` [ceil(out/b0), ceil(in/b1)])
load as stored.

The layouts, per linear layer of `out` x `in` features, `b` bits, `G` groups:
- compressed-tensors (the device layout): `weight_packed` [out, in*b/32] packed along
  the input, `weight_scale` [out, G], `weight_zero_point` [out*b/32, G] packed along
  the output (here unpacked to int8 [out, G]), `weight_g_idx` [in].
- GPTQ: `qweight` [in*b/32, out] packed along the input (its transpose is the device
  layout), `qzeros` [G, out*b/32] unsigned (stored minus one unless checkpoint_format
  is gptq_v2), `scales` [G, out], `g_idx` [in] with desc_act.
- AWQ (GEMM): `qweight` [in, out*b/32] packed along the output, nibbles interleaved
  (word slot i holds column (0, 2, 4, 6, 1, 3, 5, 7)[i] of its 8), `qzeros`
  [G, out*b/32] likewise, `scales` [G, out].
It does not own the dequantization (`quantization.py`) or the placement (`loader.py`).
"""

from __future__ import annotations

from typing import Any

from jvllm.models.quantization import (
    BlockFloatWeights,
    FloatWeights,
    PackedWeights,
    packed_weights,
)
from jvllm.models.spec import ModelSpec

QUANT_METHODS = ("compressed-tensors", "gptq", "awq", "fp8")
GPTQ_BITS = (4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")  # checkpoint_format: zero points minus one, or as they are


def checkpoint_scheme(
    where: str, config: dict[str, Any], requested: str | None
) -> PackedWeights | FloatWeights | BlockFloatWeights:
    """The scheme of a quantized checkpoint's quantization_config."""
    method = config.get("quant_method")
    # vLLM's quantization="fp8" names an fp8 checkpoint's own method as well.
    if requested is not None and (requested, method) != ("fp8", "fp8"):
        raise ValueError(
            f"{where}: a {method!r} quantized checkpoint cannot be quantized again "
            f"(quantization={requested!r}); leave quantization unset"
        )
    if method == "gptq":
        return gptq_scheme(config, where)
    if method == "awq":
        return awq_scheme(config, where)
    if method == "fp8":
        return fp8_scheme(config, where)
    if method != "compressed-tensors":
        raise ValueError(
            f"{where}: quant_method {method!r} is not supported; supported: "
            f"{', '.join(QUANT_METHODS)} (and float checkpoints, which quantization='int8' "
            "or 'fp8' quantizes at load)"
        )
    ignored = config.get("ignore") or []
    if not any("lm_head" in i for i in ignored):
        raise ValueError(f"{where}: a quantized lm_head is not supported")
    return packed_weights(config, where)


def _group_size(config: dict[str, Any], keys: tuple[str, ...], where: str) -> int | None:
    """A positive group size, or None for -1 (one group per output channel)."""
    value = next((config[k] for k in keys if config.get(k) is not None), 128)
    if value == -1:
        return None
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: group_size must be a positive integer or -1; got {value!r}")
    return value


def gptq_scheme(config: dict[str, Any], where: str) -> PackedWeights:
    bits = config.get("bits")
    if bits not in GPTQ_BITS:
        raise ValueError(f"{where}: GPTQ bits={bits!r} is not supported; supported: {GPTQ_BITS}")
    fmt = config.get("checkpoint_format") or "gptq"
    if fmt not in GPTQ_FORMATS:
        raise ValueError(
            f"{where}: GPTQ checkpoint_format {fmt!r} is not supported; supported: "
            f"{', '.join(GPTQ_FORMATS)}"
        )
    for option in ("lm_head", "dynamic"):
        if config.get(option):
            raise ValueError(
                f"{where}: GPTQ {option}={config[option]!r} (a quantized lm_head, per-module "
                "overrides) is not supported; supported: every decoder linear layer alike"
            )
    group_size = _group_size(config, ("group_size",), where)
    # With one group per channel, activation order changes nothing (as vLLM treats it).
    act_order = bool(config.get("desc_act")) and group_size is not None
    zero_points = not config.get("sym", True)
    return PackedWeights(bits, group_size, zero_points, act_order, fmt)


def awq_scheme(config: dict[str, Any], where: str) -> PackedWeights:
    bits = config.get("bits", config.get("w_bit"))
    version = str(config.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ValueError(
            f"{where}: AWQ bits={bits!r} version={version!r} is not supported; supported: "
            "4 bits, version 'gemm'"
        )
    kept = [m for m in config.get("modules_to_not_convert") or [] if m != "lm_head"]
    if kept:
        raise ValueError(
            f"{where}: AWQ modules_to_not_convert={kept} (float layers among packed ones) "
            "is not supported; supported: every decoder linear layer packed"
        )
    group_size = _group_size(config, ("group_size", "q_group_size"), where)
    return PackedWeights(4, group_size, bool(config.get("zero_point", True)), False, "awq")


def fp8_scheme(config: dict[str, Any], where: str) -> BlockFloatWeights:
    block = config.get("weight_block_size")
    fmt, activations = config.get("fmt", "e4m3"), config.get("activation_scheme", "dynamic")
    valid = (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    )
    if not valid or fmt != "e4m3" or activations != "dynamic":
        raise ValueError(
            f"{where}: fp8 checkpoint with weight_block_size={block!r}, fmt={fmt!r}, "
            f"activation_scheme={activations!r} is not supported; supported: e4m3 weights "
            "scaled by [rows, columns] blocks, dynamic activations (kept in the model dtype)"
        )
    skipped = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
    if any("layers." in m for m in skipped):
        raise ValueError(
            f"{where}: fp8 float layers among the decoder's ({skipped[:4]}) are not supported"
        )
    return BlockFloatWeights((block[0], block[1]))


def check_split(where: str, spec: ModelSpec, scheme: Any, tp: int) -> None:
    """ValueError where a checkpoint's groups or blocks do not fit the model or its
    `tp`-way split (nothing to check for float or per-channel schemes)."""
    if isinstance(scheme, PackedWeights):
        check_packed_shapes(where, spec, scheme, tp)
    elif isinstance(scheme, BlockFloatWeights):
        check_block_split(where, spec, scheme, tp)


def check_block_split(where: str, spec: ModelSpec, scheme: BlockFloatWeights, tp: int) -> None:
    """Each device needs whole blocks: of outputs in column-parallel layers, of inputs in
    row-parallel ones."""
    if tp == 1:
        return
    if spec.num_kv_heads < tp:
        raise ValueError(
            f"{where}: fp8 block checkpoints with fewer KV heads ({spec.num_kv_heads}) than "
            f"tensor_parallel_size={tp} are not supported"
        )
    attention = spec.num_heads * spec.head_dim
    splits = [
        ("q_proj", "outputs", attention, 0),
        ("k_proj", "outputs", spec.num_kv_heads * spec.head_dim, 0),
        ("gate_proj", "outputs", spec.intermediate_size, 0),
        ("o_proj", "inputs", attention, 1),
        ("down_proj", "inputs", spec.intermediate_size, 1),
    ]
    for name, what, size, axis in splits:
        if (size // tp) % scheme.block[axis]:
            raise ValueError(
                f"{where}: tensor_parallel_size={tp} splits {name}'s {size} {what} into "
                f"{size // tp}, not a multiple of the weight block's {scheme.block[axis]}"
            )


def check_packed_shapes(where: str, spec: ModelSpec, scheme: PackedWeights, tp: int) -> None:
    """Every layer's inputs split into whole groups and whole int32 words; row-parallel
    layers (split on their inputs) need that on each device's part too."""
    per_word = 32 // scheme.bits
    row = {"o_proj": spec.num_heads * spec.head_dim, "down_proj": spec.intermediate_size}
    unit = f"the group size {scheme.group_size} (and of {per_word} values per int32 word)"
    for name, in_features in {"q_proj": spec.hidden_size, **row}.items():
        whole = max(scheme.group_size or 1, per_word)
        if in_features % whole:
            raise ValueError(
                f"{where}: {name}'s {in_features} input features are not a multiple of {unit}"
            )
        part = in_features // tp
        # Activation order: each device gathers from every group's scale (replicated).
        if name in row and part % (per_word if scheme.act_order else whole):
            raise ValueError(
                f"{where}: tensor_parallel_size={tp} splits {name}'s {in_features} input "
                f"features into {part}, not a multiple of {unit}"
            )

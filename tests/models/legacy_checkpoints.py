"""GPTQ and AWQ checkpoints written from compressed-tensors' integers, for the tests.

No GPTQ or AWQ writer installs beside this project's pins (gptqmodel 7.7 needs torch >=
2.14.1 and 7.6 pins numpy 2.2.6; AutoAWQ is archived), so `write_legacy` lays out the
integers, scales and zero points that compressed-tensors quantized and packed (read
back with its own unpacker) as the GPTQ and AWQ formats specify. With activation order
it first permutes the MLP's intermediate features and each value head's channels, a
symmetry of the model, so that g_idx is far from i // group_size while the model
computes the same function. A case is (layout, bits, group size or None per channel,
symmetric, activation order).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from safetensors.torch import load_file, save_file

Case = tuple[str, int, int | None, bool, bool]
# layer prefix -> signed `q` [out, in], `scale` [out, G], signed `zero` [out, G], `g_idx`
Layers = dict[str, dict[str, np.ndarray]]
LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AWQ GEMM: word slot i holds column AWQ_ORDER[i]


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ packing of unsigned values `[n, m]` -> int32 `[n * bits / 32, m]`: each word
    holds 32 / bits consecutive rows, the first in its lowest bits."""
    per_word = 32 // bits
    rows = values.astype(np.uint32).reshape(-1, per_word, values.shape[1])
    words = np.zeros((rows.shape[0], rows.shape[2]), np.uint32)
    for k in range(per_word):
        words |= rows[:, k, :] << np.uint32(bits * k)
    return words.view(np.int32)


def awq_pack(values: np.ndarray) -> np.ndarray:
    """AWQ GEMM packing of 4-bit unsigned values `[n, m]` -> int32 `[n, m / 8]`."""
    interleaved = values.reshape(values.shape[0], -1, 8)[:, :, AWQ_ORDER]
    return pack_rows(interleaved.reshape(-1, 8).T, 4).reshape(values.shape[0], -1)


def ct_integers(ct_dir: Path, bits: int) -> Layers:
    """Each packed layer's integers, scales and zero points as compressed-tensors itself
    unpacks them."""
    tensors = load_file(str(ct_dir / "model.safetensors"))
    layers = {}
    for name in tensors:
        if not name.endswith(".weight_packed"):
            continue
        prefix = name.removesuffix(".weight_packed")
        shape = torch.Size(tensors[f"{prefix}.weight_shape"].tolist())
        scale = tensors[f"{prefix}.weight_scale"]
        zero = tensors.get(f"{prefix}.weight_zero_point")
        layers[prefix] = dict(
            q=unpack_from_int32(tensors[name], bits, shape).numpy().astype(np.int32),
            scale=scale.numpy(),
            zero=np.zeros(scale.shape, np.int32)
            if zero is None
            else unpack_from_int32(zero, bits, scale.shape, packed_dim=0).numpy().astype(np.int32),
        )
    return layers


def set_dequantized_weights(hf: Any, ct_dir: Path, args: QuantizationArgs) -> set[str]:
    """Sets each packed linear weight of the Transformers model `hf` to what
    compressed-tensors dequantizes from `ct_dir`'s integers; returns their prefixes."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    layers = ct_integers(ct_dir, args.num_bits)
    for prefix, layer in layers.items():
        q, scale, zero = (torch.from_numpy(layer[k]) for k in ("q", "scale", "zero"))
        weight = dequantize(q.to(torch.int8), scale, zero.to(torch.int8), args)
        hf.get_submodule(prefix).weight.data.copy_(weight)
    return set(layers)


def act_order(layers: Layers, group_size: int, num_heads: int, num_kv_heads: int) -> None:
    """Permutes the MLP's intermediate features and the value heads' channels (a symmetry
    of the model: rows of gate/up/v, inputs of down/o) and gives every layer its g_idx."""
    rng = np.random.default_rng(0)
    for layer in layers.values():
        layer["g_idx"] = np.arange(layer["q"].shape[1]) // group_size
    for i in sorted({int(p.split(".")[2]) for p in layers}):
        pre = f"model.layers.{i}."
        features = rng.permutation(layers[pre + "mlp.down_proj"]["q"].shape[1])
        head_dim = layers[pre + "self_attn.o_proj"]["q"].shape[1] // num_heads
        channels = rng.permutation(head_dim)  # the same within every head
        q_heads = (np.arange(num_heads)[:, None] * head_dim + channels).ravel()
        kv_heads = (np.arange(num_kv_heads)[:, None] * head_dim + channels).ravel()
        for name, rows in [("mlp.gate_proj", features), ("mlp.up_proj", features),
                           ("self_attn.v_proj", kv_heads)]:  # fmt: skip
            for key in ("q", "scale", "zero"):
                layers[pre + name][key] = layers[pre + name][key][rows]
        for name, inputs in [("mlp.down_proj", features), ("self_attn.o_proj", q_heads)]:
            layer = layers[pre + name]
            layer["q"], layer["g_idx"] = layer["q"][:, inputs], inputs // group_size


def legacy_tensors(layers: Layers, layout: str, bits: int) -> dict[str, np.ndarray]:
    """The GPTQ (`layout` gptq or gptq_v2) or AWQ tensors of `layers`."""
    offset, out = 1 << (bits - 1), {}
    for prefix, layer in layers.items():
        q, zero = layer["q"] + offset, layer["zero"] + offset  # unsigned, as both formats
        out[f"{prefix}.scales"] = np.ascontiguousarray(layer["scale"].T)  # [G, out]
        if layout == "awq":
            out[f"{prefix}.qweight"] = awq_pack(q.T)  # [in, out / 8]
            out[f"{prefix}.qzeros"] = awq_pack(zero.T)  # [G, out / 8]
            continue
        assert zero.min() >= 1  # GPTQ v1 stores zero - 1 and cannot hold a zero of 0
        stored = zero - 1 if layout == "gptq" else zero
        out[f"{prefix}.qweight"] = pack_rows(q.T, bits)  # [in * bits / 32, out]
        out[f"{prefix}.qzeros"] = np.ascontiguousarray(pack_rows(stored, bits).T)
        g_idx = layer.get("g_idx", np.arange(q.shape[1]) // (q.shape[1] // zero.shape[1]))
        out[f"{prefix}.g_idx"] = g_idx.astype(np.int32)
    return out


def quant_config(
    layout: str, bits: int, group_size: int | None, sym: bool, desc: bool
) -> dict[str, Any]:
    """config.json's quantization_config as the GPTQ and AWQ tools write it."""
    if layout == "awq":
        return dict(quant_method="awq", bits=bits, group_size=group_size, zero_point=not sym,
                    version="gemm", modules_to_not_convert=None)  # fmt: skip
    return dict(quant_method="gptq", bits=bits, group_size=group_size or -1, desc_act=desc,
                sym=sym, lm_head=False, checkpoint_format=layout)  # fmt: skip


def write_legacy(ct_dir: Path, dst: Path, case: Case) -> None:
    """The GPTQ or AWQ checkpoint of `case` holding the integers of `ct_dir`."""
    layout, bits, group_size, _, desc = case
    config = json.loads((ct_dir / "config.json").read_text())
    layers = ct_integers(ct_dir, bits)
    if desc:
        act_order(layers, group_size, config["num_attention_heads"], config["num_key_value_heads"])
    # Embeddings, norms and lm_head as they are; the linear layers in the legacy layout.
    tensors = {
        name: tensor
        for name, tensor in load_file(str(ct_dir / "model.safetensors")).items()
        if name.split(".")[-2] not in LAYERS
    }
    for name, array in legacy_tensors(layers, layout, bits).items():
        tensors[name] = torch.from_numpy(array)
    shutil.copytree(ct_dir, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(dst / "model.safetensors"))
    config["quantization_config"] = quant_config(*case)
    (dst / "config.json").write_text(json.dumps(config))


def ct_args(case: Case) -> QuantizationArgs:
    """compressed-tensors' quantization arguments for the integers of `case`."""
    _, bits, group_size, sym, _ = case
    strategy = "group" if group_size else "channel"
    return QuantizationArgs(
        num_bits=bits, type="int", symmetric=sym, strategy=strategy, group_size=group_size
    )

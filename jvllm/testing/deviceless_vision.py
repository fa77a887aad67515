"""The deviceless check of the vision towers: LLaVA's and Qwen2.5-VL's encoders compiled
for an NVIDIA H200 without a GPU.

Owns building the vision side's abstract parameters from a LLaVA config (no checkpoint:
`ShapeDtypeStruct`s on a compile-only device, as `jvllm.testing.deviceless` places a
language model's) and compiling the runner's encoder program (`LlavaVision.encode`) for
a batch of images, reporting its memory as XLA:GPU states it; the same for a
Qwen2.5-VL-7B-shaped tower (`QwenVision.encode`, one image of a given size). Not owned:
the language model's programs (`jvllm.testing.deviceless`). Needs the CUDA PJRT plugin
(tests/gpu_compile installs it).

    JAX_PLATFORMS=cpu PYTHONPATH=~/.cache/jvllm/deviceless/jax-0.10.2-py311 \\
        python -m jvllm.testing.deviceless_vision tests/gpu_compile/h200.txtpb OUT.json
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jvllm.models.clip_vision import CLIPVisionSpec
from jvllm.models.llava import LlavaVision
from jvllm.models.qwen2_5_vl import QwenVision
from jvllm.models.qwen_vision import QwenVisionSpec
from jvllm.testing.deviceless import Target

# LLaVA-1.5-7B's: CLIP ViT-L/14 at 336 pixels (576 image tokens), a 4096-wide Llama.
LLAVA_7B = {
    "vision_config": dict(
        model_type="clip_vision_model",
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
    ),
    "text_config": dict(hidden_size=4096),
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "projector_hidden_act": "gelu",
}


def vision_param_shapes(cfg: dict[str, Any]) -> dict[str, dict[str, tuple[int, ...]]]:
    """Every tensor of the vision tower and projector, by the names `load_vision` gives."""
    v = cfg["vision_config"]
    d, inner, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    positions = (v["image_size"] // p) ** 2 + 1
    vision: dict[str, tuple[int, ...]] = {
        "embeddings.patch_embedding.weight": (d, 3, p, p),
        "embeddings.class_embedding": (d,),
        "embeddings.position_embedding.weight": (positions, d),
        "pre_layrnorm.weight": (d,),
        "pre_layrnorm.bias": (d,),
    }
    for i in range(v["num_hidden_layers"]):
        pre = f"encoder.layers.{i}"
        for norm in ("layer_norm1", "layer_norm2"):
            vision |= {f"{pre}.{norm}.weight": (d,), f"{pre}.{norm}.bias": (d,)}
        for m in ("q", "k", "v", "out"):
            vision |= {
                f"{pre}.self_attn.{m}_proj.weight": (d, d),
                f"{pre}.self_attn.{m}_proj.bias": (d,),
            }
        vision |= {f"{pre}.mlp.fc1.weight": (inner, d), f"{pre}.mlp.fc1.bias": (inner,)}
        vision |= {f"{pre}.mlp.fc2.weight": (d, inner), f"{pre}.mlp.fc2.bias": (d,)}
    layer = cfg["vision_feature_layer"]
    width = d * (len(layer) if isinstance(layer, list) else 1)
    h = cfg["text_config"]["hidden_size"]
    projector = {
        "linear_1.weight": (h, width),
        "linear_1.bias": (h,),
        "linear_2.weight": (h, h),
        "linear_2.bias": (h,),
    }
    return {"vision": vision, "projector": projector}


def check_vision_tower(
    cfg: dict[str, Any], target: Target, num_images: int = 1, dtype: Any = jnp.bfloat16
) -> dict[str, Any]:
    """The encoder program compiled for one device of `target`: its memory."""
    device = target.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    shapes = vision_param_shapes(cfg)
    params = {
        part: {k: jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for k, s in tree.items()}
        for part, tree in shapes.items()
    }
    layer = cfg["vision_feature_layer"]
    vision = LlavaVision(
        CLIPVisionSpec.from_config(cfg["vision_config"]),
        tuple(layer) if isinstance(layer, list) else (int(layer),),
        cfg["vision_feature_select_strategy"],
        cfg["projector_hidden_act"],
        jnp.dtype(dtype),
    )
    size = cfg["vision_config"]["image_size"]
    pixels = jax.ShapeDtypeStruct((num_images, 3, size, size), jnp.float32, sharding=sharding)
    lowered = jax.jit(vision.encode).lower(params, pixels)
    compiled = lowered.compile()
    out = jax.eval_shape(vision.encode, params, pixels)
    memory = compiled.memory_analysis()
    return {
        "program": "vision_encode",
        "num_images": num_images,
        "dtype": jnp.dtype(dtype).name,
        "output_shape": list(out.shape),
        "tokens_per_image": vision.tokens_per_image(),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "platform": device.platform,
        "device_kind": device.device_kind,
    }


# Qwen2.5-VL-7B's tower: 32 blocks of width 1280, windows of 112 pixels, 3584 out.
QWEN2_5_VL_7B = QwenVisionSpec(
    hidden_size=1280,
    num_heads=16,
    depth=32,
    intermediate_size=3420,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=112,
    fullatt_block_indexes=(7, 15, 23, 31),
    out_hidden_size=3584,
)


def qwen_vision_shapes(s: QwenVisionSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower, by the names `qwen2_5_vl.load_vision` gives."""
    d, inner, p = s.hidden_size, s.intermediate_size, s.patch_size
    merged = d * s.merge_unit
    shapes = {"patch_embed.proj.weight": (d, s.in_channels, s.temporal_patch_size, p, p)}
    for i in range(s.depth):
        pre = f"blocks.{i}"
        shapes |= {f"{pre}.norm1.weight": (d,), f"{pre}.norm2.weight": (d,)}
        shapes |= {f"{pre}.attn.qkv.weight": (3 * d, d), f"{pre}.attn.qkv.bias": (3 * d,)}
        shapes |= {f"{pre}.attn.proj.weight": (d, d), f"{pre}.attn.proj.bias": (d,)}
        for m in ("gate_proj", "up_proj"):
            shapes |= {f"{pre}.mlp.{m}.weight": (inner, d), f"{pre}.mlp.{m}.bias": (inner,)}
        shapes |= {f"{pre}.mlp.down_proj.weight": (d, inner), f"{pre}.mlp.down_proj.bias": (d,)}
    shapes |= {"merger.ln_q.weight": (d,), "merger.mlp.0.weight": (merged, merged)}
    shapes |= {"merger.mlp.0.bias": (merged,), "merger.mlp.2.bias": (s.out_hidden_size,)}
    return shapes | {"merger.mlp.2.weight": (s.out_hidden_size, merged)}


def check_qwen_vision_tower(
    spec: QwenVisionSpec, target: Target, size: tuple[int, int], dtype: Any = jnp.bfloat16
) -> dict[str, Any]:
    """The encoder program of one `size` (height, width) image, compiled for one device
    of `target` (size a multiple of patch * merge): its memory."""
    sharding = jax.sharding.SingleDeviceSharding(target.devices()[0])
    params = {
        k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        for k, shape in qwen_vision_shapes(spec).items()
    }
    grid = (1, size[0] // spec.patch_size, size[1] // spec.patch_size)
    width = spec.in_channels * spec.temporal_patch_size * spec.patch_size**2
    pixels = jax.ShapeDtypeStruct((1, grid[1] * grid[2], width), jnp.float32, sharding=sharding)
    vision = QwenVision(spec, jnp.dtype(dtype))
    compiled = jax.jit(vision.encode, static_argnames="grid").lower(params, pixels, grid).compile()
    memory = compiled.memory_analysis()
    out = jax.eval_shape(functools.partial(vision.encode, grid=grid), params, pixels)
    return {
        "program": "vision_encode",
        "image_size": list(size),
        "patch_grid": list(grid),
        "dtype": jnp.dtype(dtype).name,
        "output_shape": list(out.shape),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
    }


def _rows(check: Any, cases: tuple, key: str) -> list[dict[str, Any]]:
    rows = []
    for case in cases:
        try:
            rows.append(check(case))
        except jax.errors.JaxRuntimeError as e:  # an XLA:GPU compile failure is a finding
            rows.append({"program": "vision_encode", key: case, "error": str(e)[:400]})
    return rows


def main(argv: list[str]) -> None:
    target = Target.read(Path(argv[0]))
    rows = _rows(lambda n: check_vision_tower(LLAVA_7B, target, n), (1, 2, 8), "num_images")
    qwen = _rows(
        lambda hw: check_qwen_vision_tower(QWEN2_5_VL_7B, target, hw),
        ((448, 448), (812, 476), (1092, 1932)),
        "image_size",
    )
    report = {
        "llava_1_5_7b_vision": rows,
        "qwen2_5_vl_7b_vision": qwen,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    Path(argv[1]).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])

"""The deviceless check of a vision tower: LLaVA's encoder compiled for an NVIDIA H200
without a GPU.

Owns building the vision side's abstract parameters from a LLaVA config (no checkpoint:
`ShapeDtypeStruct`s on a compile-only device, as `jvllm.testing.deviceless` places a
language model's) and compiling the runner's encoder program (`LlavaVision.encode`) for
a batch of images, reporting its memory as XLA:GPU states it. Not owned:
the language model's programs (`jvllm.testing.deviceless`). Needs the CUDA PJRT plugin
(tests/gpu_compile installs it).

    JAX_PLATFORMS=cpu PYTHONPATH=~/.cache/jvllm/deviceless/jax-0.10.2-py311 \\
        python -m jvllm.testing.deviceless_vision tests/gpu_compile/h200.txtpb OUT.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jvllm.models.clip_vision import CLIPVisionSpec
from jvllm.models.llava import LlavaVision
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


def main(argv: list[str]) -> None:
    target = Target.read(Path(argv[0]))
    rows = []
    for n in (1, 2, 8):
        try:
            rows.append(check_vision_tower(LLAVA_7B, target, n))
        except jax.errors.JaxRuntimeError as e:  # an XLA:GPU compile failure is a finding
            rows.append({"program": "vision_encode", "num_images": n, "error": str(e)[:400]})
    report = {"llava_1_5_7b_vision": rows, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    Path(argv[1]).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])

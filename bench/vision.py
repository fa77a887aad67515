"""Image requests per second: jvllm against Transformers' `generate`, on one random
LLaVA checkpoint (a CLIP tower and a Llama language model, float32), or with
`--model qwen2_5_vl` a random Qwen2.5-VL (its window-attention tower, a Qwen2 language
model with M-RoPE).

Builds the checkpoint with Transformers' own classes (`jvllm.testing.vision_checkpoints`,
`jvllm.testing.qwen_vl_checkpoints`; sizes below), then serves `--num-prompts`
chat-free prompts, each with its own random image and a few words, greedy,
`--max-tokens` new tokens each with EOS ignored: through jvllm's `LLM.generate` (all at
once, after a warm-up batch of other images) and through Transformers' model's
`generate` one request at a time (the reference's batch of one; Transformers pads a
batch, which changes nothing of the per-image work). It checks that the first `--check`
requests' tokens are equal, and reports requests per second for both and their ratio.
The machine may be shared: the figures are noisy.

    python bench/vision.py
    python bench/vision.py --num-prompts 4 --max-tokens 8
    python bench/vision.py --model qwen2_5_vl
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import common

TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8)
VISION = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4)
IMAGE_SIZE, PATCH_SIZE = 56, 14  # 16 image tokens a request
# Qwen2.5-VL: the same language model's size (M-RoPE over its 32-wide heads), a tower as
# wide as the CLIP one; 56x56 images in patches of 4 merged 2 x 2: 49 image tokens.
QWEN_TEXT = {**TEXT, "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6]}}
QWEN_VISION = dict(
    hidden_size=128, intermediate_size=256, depth=4, num_heads=4, out_hidden_size=256
)
IMAGE_TOKEN = {"llava": "<image>", "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>"}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models-dir", type=Path, default=common.DEFAULT_MODELS_DIR)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--check", type=int, default=4)
    p.add_argument("--model", choices=sorted(IMAGE_TOKEN), default="llava")
    p.add_argument("--output", type=Path, default=None, help="default: results/vision*.json")
    args = p.parse_args(argv)
    name = "vision.json" if args.model == "llava" else f"vision_{args.model}.json"
    args.output = args.output or common.RESULTS_DIR / name
    return args


def images(n: int, seed: int) -> list[Any]:
    from PIL import Image

    rng = np.random.RandomState(seed)
    shape = (IMAGE_SIZE + 8, IMAGE_SIZE + 8, 3)
    return [Image.fromarray(rng.randint(0, 255, shape, dtype=np.uint8)) for _ in range(n)]


def prompt_text(i: int, model: str = "llava") -> str:
    return f"w{5 + i % 50} w{7 + i % 40} {IMAGE_TOKEN[model]} w{9 + i % 30} w11 w12"


def run_jvllm(path: Path, args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    from jvllm import LLM, SamplingParams

    llm = LLM(str(path), max_model_len=256, max_num_seqs=args.num_prompts, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def batch(pics: list[Any]) -> list[dict]:
        return [
            {"prompt": prompt_text(i, args.model), "multi_modal_data": {"image": pic}}
            for i, pic in enumerate(pics)
        ]

    llm.generate(batch(images(args.num_prompts, seed=99)), params, use_tqdm=False)  # warm-up
    pics = images(args.num_prompts, seed=0)
    start = time.perf_counter()
    outs = llm.generate(batch(pics), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return args.num_prompts / elapsed, [o.outputs[0].token_ids for o in outs]


def run_hf(path: Path, args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    import torch

    model, processor = hf_model(path, args.model)
    kwargs = dict(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False)
    with torch.no_grad():  # warm-up: the first generate pays one-time costs
        text = prompt_text(0, args.model)
        inputs = processor(text=text, images=images(1, seed=98), return_tensors="pt")
        model.generate(**inputs, **kwargs)
    pics = images(args.num_prompts, seed=0)
    tokens, start = [], time.perf_counter()
    with torch.no_grad():
        for i, pic in enumerate(pics):
            text = prompt_text(i, args.model)
            inputs = processor(text=text, images=[pic], return_tensors="pt")
            out = model.generate(**inputs, **kwargs)
            tokens.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return args.num_prompts / (time.perf_counter() - start), tokens


def hf_model(path: Path, model: str) -> tuple[Any, Any]:
    """Transformers' model and processor of the checkpoint."""
    if model == "qwen2_5_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration

        from jvllm.testing.qwen_vl_checkpoints import transformers_processor

        hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).eval()
        return hf, transformers_processor(path)
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(path).eval()
    return hf, AutoProcessor.from_pretrained(path)


def checkpoint(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The benchmark's checkpoint (built on first use) and its sizes."""
    if args.model == "qwen2_5_vl":
        from jvllm.testing.qwen_vl_checkpoints import make_qwen2_5_vl_checkpoint

        path = args.models_dir / "bench-qwen2_5_vl"
        if not (path / "model.safetensors").exists():
            make_qwen2_5_vl_checkpoint(path, 0, 127, QWEN_TEXT, QWEN_VISION, IMAGE_SIZE**2)
        return path, dict(text=QWEN_TEXT, vision=QWEN_VISION, image_size=IMAGE_SIZE)
    from jvllm.testing.vision_checkpoints import make_llava_checkpoint

    path = args.models_dir / "bench-llava"
    if not (path / "model.safetensors").exists():
        make_llava_checkpoint(path, 0, IMAGE_SIZE, PATCH_SIZE, 127, TEXT, VISION)
    return path, dict(text=TEXT, vision=VISION, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    path, sizes = checkpoint(args)
    result = common.envelope(__file__, argv)
    jv_rate, jv_tokens = run_jvllm(path, args)
    hf_rate, hf_tokens = run_hf(path, args)
    # min_new_tokens bans EOS in Transformers as ignore_eos does in jvllm.
    pairs = zip(jv_tokens[: args.check], hf_tokens[: args.check], strict=True)
    equal = sum(a == b for a, b in pairs)
    result.update(
        model=dict(name=args.model, **sizes),
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        jvllm_requests_per_s=round(jv_rate, 3),
        hf_requests_per_s=round(hf_rate, 3),
        speedup=round(jv_rate / hf_rate, 2),
        greedy_equal=f"{equal}/{min(args.check, args.num_prompts)}",
    )
    rows = [["jvllm", jv_rate], ["transformers", hf_rate]]
    print(common.format_table(["engine", "image requests/s"], rows))
    print(f"speedup {jv_rate / hf_rate:.2f}x; greedy tokens equal: {result['greedy_equal']}")
    common.write_result(args.output, result)


if __name__ == "__main__":
    main()

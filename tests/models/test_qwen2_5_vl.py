"""Qwen2.5-VL against Transformers' own Qwen2_5_VLForConditionalGeneration: the vision
tower's image features, M-RoPE positions equal to `get_rope_index`, greedy tokens with
one and two images a prompt (images of two sizes), a text-only prompt, chunked prefill
across image tokens, and a warm prefix cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jvllm import LLM, SamplingParams
from jvllm.testing.qwen_vl_checkpoints import (
    IMAGE_PLACEHOLDER,
    make_qwen2_5_vl_checkpoint,
    transformers_processor,
)

MAX_TOKENS = 6
IMG = IMAGE_PLACEHOLDER


def _image(seed: int, size: tuple[int, int] = (40, 24)) -> Image.Image:
    w, h = size
    pixels = np.random.RandomState(seed).randint(0, 255, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def hf(qwen_dir: Path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir).eval()
    return model, transformers_processor(qwen_dir)


@pytest.fixture(scope="module")
def llm(qwen_dir: Path) -> LLM:
    # 32-token steps: prompts with 15- and 16-token images are prefilled in chunks that
    # cut through image tokens.
    return LLM(
        str(qwen_dir),
        max_model_len=160,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        limit_mm_per_prompt={"image": 2},
        seed=0,
    )


def hf_inputs(hf, text: str, images: list[Image.Image]):
    return hf[1](text=text, images=images or None, return_tensors="pt")


def hf_greedy(hf, text: str, images: list[Image.Image]) -> list[int]:
    import torch

    inputs = hf_inputs(hf, text, images)
    with torch.no_grad():
        out = hf[0].generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def generate(llm: LLM, text: str, images: list[Image.Image]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    prompt = {"prompt": text, "multi_modal_data": {"image": images}} if images else text
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_vision_tower_equals_transformers_image_features(llm: LLM, hf):
    """The runner's encoder program on the processor's patches of one image: window
    attention (a 5 x 3 token grid cut into 2 x 2 windows, the last row and column
    padded), full-attention blocks, rotary, merger."""
    import torch

    image = _image(4)
    inputs = hf_inputs(hf, IMG, [image])
    with torch.no_grad():
        (want,) = (
            hf[0]
            .model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
            .pooler_output
        )
    prompt = {"prompt": IMG, "multi_modal_data": {"image": [image]}}
    _, _, (feature,) = llm.engine.mm_processor.process(prompt)
    assert feature.token_grid == (1, 3, 5)
    got = llm.engine.runner.encoder.embeddings(feature)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)


def test_mrope_positions_equal_get_rope_index(llm: LLM, hf):
    """Whole prompt and every slice of it (chunks, prefix hits), and the decode delta."""
    from jvllm.models.qwen2_5_vl import mrope_positions

    model, _ = hf
    text = f"w5 {IMG} w7 w8 {IMG} w10"
    images = [_image(1), _image(2, (30, 30))]
    inputs = hf_inputs(hf, text, images)
    want, delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    want = want[:, 0].numpy()
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    _, ids, features = llm.engine.mm_processor.process(prompt)
    assert ids == inputs["input_ids"][0].tolist()
    n = len(ids)
    np.testing.assert_array_equal(mrope_positions(features, 0, n), want)
    for start, stop in [(0, 7), (7, 21), (3, 30), (21, n)]:
        np.testing.assert_array_equal(
            mrope_positions(features, start, stop - start), want[:, start:stop]
        )
    decode = mrope_positions(features, n, 3)
    np.testing.assert_array_equal(decode, np.arange(n, n + 3) + int(delta[0, 0]) + np.zeros((3, 1)))


CASES = [
    (f"w5 w6 {IMG} w9 w10 w11", [0]),
    (f"w5 {IMG} w7 w8 w9 {IMG} w12 w13 w14 w15", [1, 2]),
    ("w5 w6 w7 w8 w9", []),
]


@pytest.mark.parametrize("text,seeds", CASES, ids=["one_image", "two_images", "text_only"])
def test_greedy_tokens_equal_transformers(llm: LLM, hf, text: str, seeds: list[int]):
    images = [_image(s, (40, 24) if s % 2 else (32, 32)) for s in seeds]
    want = hf_greedy(hf, text, images)
    assert generate(llm, text, images) == want
    # Again, from a warm prefix cache and encoder cache.
    assert generate(llm, text, images) == want


def test_same_text_another_image_shares_no_image_block(llm: LLM, hf):
    text = f"w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 {IMG} w30 w31"
    first, second = [_image(10)], [_image(11)]
    got_first = generate(llm, text, first)
    assert got_first == hf_greedy(hf, text, first)
    kv = llm.engine.scheduler.kv_cache_manager
    hits = kv.prefix_cache_hits
    got_second = generate(llm, text, second)
    assert got_second == hf_greedy(hf, text, second)
    assert got_first != got_second
    assert kv.prefix_cache_hits - hits == 16  # the text's block only
    hits = kv.prefix_cache_hits
    assert generate(llm, text, second) == got_second
    assert kv.prefix_cache_hits - hits == 32  # same text, same image: both blocks


def test_same_patches_on_another_grid_share_no_image_block(llm: LLM, hf):
    """Two white images with the same patch count and patches (64 x 16: a 2 x 8 grid;
    32 x 32: 4 x 4) differ only in their grid, hence in their M-RoPE positions."""
    text = f"w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 {IMG} w30 w31"
    wide = Image.new("RGB", (64, 16), (255, 255, 255))
    square = Image.new("RGB", (32, 32), (255, 255, 255))
    generate(llm, text, [wide])
    kv = llm.engine.scheduler.kv_cache_manager
    hits = kv.prefix_cache_hits
    assert generate(llm, text, [square]) == hf_greedy(hf, text, [square])
    assert kv.prefix_cache_hits - hits == 16  # the text's block only


def test_adjacent_images_of_two_sizes_are_cut_by_their_grids(llm: LLM, hf):
    """One run of placeholders for two images of 16 and 12 tokens (Transformers'
    processor expands it; its model takes one vision_start per image, so the cut is
    checked against the processor's grids and the request is served)."""
    text = "w5 <|vision_start|><|image_pad|><|image_pad|><|vision_end|> w6"
    images = [_image(20, (32, 32)), _image(21, (48, 16))]
    inputs = hf_inputs(hf, text, images)
    ids = inputs["input_ids"][0].tolist()
    first = ids.index(hf[1].image_token_id)
    sizes = [t * h * w // 4 for t, h, w in inputs["image_grid_thw"].tolist()]
    assert sizes == [16, 12]
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    _, got_ids, features = llm.engine.mm_processor.process(prompt)
    assert got_ids == ids
    assert [(f.offset, f.length) for f in features] == [(first, 16), (first + 16, 12)]
    assert len(generate(llm, text, images)) == MAX_TOKENS


def test_bad_image_input_is_a_clear_error(llm: LLM):
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        images = [_image(0)] * 3
        llm.generate(
            [{"prompt": f"w5 {IMG} {IMG} {IMG}", "multi_modal_data": {"image": images}}], params
        )
    with pytest.raises(ValueError, match="does not fit its images"):
        llm.generate([{"prompt": "w5 w6", "multi_modal_data": {"image": _image(0)}}], params)
    assert generate(llm, f"w5 {IMG} w6", [_image(3)])  # the engine keeps serving


def test_chat_with_image_parts_equals_transformers(llm: LLM, hf):
    image = _image(7)
    parts = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "w8 w9"}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out = llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)
    template = [{"role": "user", "content": [{"type": "image"}, parts[1]]}]
    text = hf[1].tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, text, [image])


def test_a_draft_model_is_refused(llm: LLM):
    """Draft models and speculator heads take 1-D rotary positions: n-gram only."""
    from jvllm.runner.drafter import make_drafter

    loaded = llm.engine.runner.model
    with pytest.raises(ValueError, match="n-gram speculation only"):
        make_drafter(loaded, loaded, 2, 16)

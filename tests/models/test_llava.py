"""LLaVA against Transformers' own LlavaForConditionalGeneration: greedy tokens with one
and two images a prompt, chunked prefill across image tokens, a warm prefix cache, and
bad image input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jvllm import LLM, SamplingParams
from jvllm.engine.multimodal import load_image_url
from jvllm.sampling_params import BeamSearchParams
from jvllm.testing.vision_checkpoints import make_llava_checkpoint

MAX_TOKENS = 6


def _image(seed: int, size: int = 30) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 255, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def hf(llava_dir: Path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(llava_dir).eval()
    return model, AutoProcessor.from_pretrained(llava_dir)


@pytest.fixture(scope="module")
def llm(llava_dir: Path) -> LLM:
    # 32-token steps: a prompt with two 16-token images is prefilled in chunks that cut
    # through image tokens.
    return LLM(
        str(llava_dir),
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        limit_mm_per_prompt={"image": 2},
        seed=0,
    )


def hf_greedy(hf, text: str, images: list[Image.Image]) -> list[int]:
    import torch

    model, processor = hf
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def generate(llm: LLM, text: str, images: list[Image.Image]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


CASES = [
    ("w5 w6 <image> w9 w10 w11", [0]),
    ("w5 <image> w7 w8 w9 <image> w12 w13 w14 w15", [1, 2]),
]


@pytest.mark.parametrize("text,seeds", CASES, ids=["one_image", "two_images"])
def test_greedy_tokens_equal_transformers(llm: LLM, hf, text: str, seeds: list[int]):
    images = [_image(s) for s in seeds]
    want = hf_greedy(hf, text, images)
    assert generate(llm, text, images) == want
    # Again, from a warm prefix cache and encoder cache.
    assert generate(llm, text, images) == want


def test_same_text_another_image_shares_no_image_block(llm: LLM, hf):
    text = "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 <image> w30 w31"
    first, second = [_image(10)], [_image(11)]
    got_first = generate(llm, text, first)
    assert got_first == hf_greedy(hf, text, first)
    kv = llm.engine.scheduler.kv_cache_manager
    hits = kv.prefix_cache_hits
    got_second = generate(llm, text, second)
    assert got_second == hf_greedy(hf, text, second)
    assert got_first != got_second
    # The 16 text tokens' block is shared; the block of the image's tokens is not.
    assert kv.prefix_cache_hits - hits == 16
    hits = kv.prefix_cache_hits
    assert generate(llm, text, second) == got_second
    assert kv.prefix_cache_hits - hits == 32  # same text, same image: both blocks


def test_bad_image_input_is_a_clear_error(llm: LLM):
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        llm.generate(
            [
                {
                    "prompt": "w5 <image> <image> <image>",
                    "multi_modal_data": {"image": [_image(0)] * 3},
                }
            ],
            params,
        )
    with pytest.raises(ValueError, match="is not allowed"):
        load_image_url("http://example.com/cat.png")
    with pytest.raises(ValueError, match="cannot be decoded"):
        llm.generate(
            [{"prompt": "w5 <image>", "multi_modal_data": {"image": b"not a png"}}], params
        )
    with pytest.raises(ValueError, match="does not fit its images"):
        llm.generate([{"prompt": "w5 w6", "multi_modal_data": {"image": _image(0)}}], params)
    with pytest.raises(ValueError, match="beam search does not take images"):
        prompt = {"prompt": "w5 <image>", "multi_modal_data": {"image": _image(0)}}
        llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=2))
    # The engine keeps serving.
    assert generate(llm, "w5 <image> w6", [_image(3)])


def test_weight_updates_are_refused_for_a_vision_language_model(llm: LLM, llava_dir: Path):
    """Its tower, projector and cached image embeddings would stay as loaded."""
    with pytest.raises(ValueError, match="vision-language"):
        llm.update_weights(str(llava_dir))


def test_a_data_url_image_is_the_same_image(llm: LLM, hf):
    import base64
    import io

    buf = io.BytesIO()
    _image(5).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    text = "w5 <image> w6 w7"
    assert generate(llm, text, [load_image_url(url)]) == hf_greedy(hf, text, [_image(5)])


def test_an_image_for_a_text_only_model_is_refused():
    from jvllm.engine.multimodal import check_text_only

    with pytest.raises(ValueError, match="text only"):
        check_text_only({"prompt": "hi", "multi_modal_data": {"image": _image(0)}})


def test_chat_with_image_parts_equals_transformers(llm: LLM, hf):
    image = _image(7)
    parts = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "w8 w9"}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out = llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)
    _, processor = hf
    template = [{"role": "user", "content": [{"type": "image"}, parts[1]]}]
    text = processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, text, [image])


@pytest.mark.slow
def test_tensor_parallel_two_equals_transformers(llava_dir: Path, hf):
    """The language model split over two CPU devices, the vision side replicated."""
    llm2 = LLM(str(llava_dir), tensor_parallel_size=2, max_model_len=128, max_num_seqs=4, seed=0)
    text, images = CASES[1][0], [_image(s) for s in CASES[1][1]]
    assert generate(llm2, text, images) == hf_greedy(hf, text, images)


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_vision_side_equals_transformers_image_features(tmp_path: Path, tower: str):
    """The encoder program alone (tower, feature layer, select strategy, projector)."""
    import jax.numpy as jnp
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from jvllm.models.llava import load_vision

    path = make_llava_checkpoint(tmp_path / tower, seed=3, vision_model=tower)
    model = LlavaForConditionalGeneration.from_pretrained(path).eval()
    pixels = AutoProcessor.from_pretrained(path)(
        text="<image> <image>", images=[_image(4), _image(5)], return_tensors="np"
    )["pixel_values"]
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=torch.from_numpy(pixels))
    want = np.stack([f.numpy() for f in want.pooler_output])
    vision, params = load_vision(path, model.config.to_dict(), jnp.float32)
    got = np.asarray(vision.encode(params, pixels))
    assert got.shape == want.shape == (2, vision.tokens_per_image(), 64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

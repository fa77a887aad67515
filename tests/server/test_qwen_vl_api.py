"""Qwen2.5-VL over the OpenAI API: `image_url` content parts (images of two sizes) through
the official `openai` client against a real `jvllm serve` of a tiny Qwen2.5-VL, greedy
tokens equal to Transformers' (one and two images, again from a warm prefix cache), and
a bad image a 400 while the server goes on serving."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from jvllm.testing.qwen_vl_checkpoints import make_qwen2_5_vl_checkpoint, transformers_processor
from tests.server import API_KEY, ServerProcess, auth_headers
from tests.server.test_vision_api import data_url, image_part

MODEL = "tiny-qwen-vl"
NEW_TOKENS = 5


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    w, h = size
    pixels = np.random.RandomState(seed).randint(0, 255, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("served-qwen-vl"))


@pytest.fixture(scope="module")
def env(qwen_dir):
    server = ServerProcess(
        [
            str(qwen_dir), "--api-key", API_KEY, "--served-model-name", MODEL,
            "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
            "--limit-mm-per-prompt", '{"image": 2}', "--return-tokens-as-token-ids",
        ]
    )  # fmt: skip
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        yield SimpleNamespace(url=server.url, client=client)
    finally:
        server.stop()


def hf_chat_greedy(qwen_dir, messages: list[dict], images: list[Image.Image]) -> list[int]:
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    processor = transformers_processor(qwen_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir).eval()
    text = processor.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def chat_tokens(env, content: list[dict]) -> list[int]:
    out = env.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        logprobs=True,
    )
    return [int(t.token.removeprefix("token_id:")) for t in out.choices[0].logprobs.content]


def test_image_url_chat_equals_transformers(env, qwen_dir):
    images = [_image(1, (40, 24)), _image(2, (32, 32))]
    one = [image_part(data_url(images[0])), {"type": "text", "text": "w5 w6 w7"}]
    two = [{"type": "text", "text": "w9"}, *(image_part(data_url(i)) for i in images)]
    for content, used in ((one, images[:1]), (two, images)):
        hf_content = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
        want = hf_chat_greedy(qwen_dir, [{"role": "user", "content": hf_content}], used)
        assert chat_tokens(env, content) == want
        assert chat_tokens(env, content) == want  # again: warm prefix and encoder caches


def test_bad_image_is_a_400_and_the_server_keeps_serving(env):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [image_part(data_url(_image(0, (32, 32))))] * 3}],
        "max_tokens": 2,
    }
    url, headers = env.url + "/v1/chat/completions", auth_headers()
    r = httpx.post(url, json=body, headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    assert "limit_mm_per_prompt" in r.json()["error"]["message"]
    body["messages"][0]["content"] = body["messages"][0]["content"][:1]
    ok = httpx.post(url, json=body, headers=headers, timeout=60)
    assert ok.status_code == 200, ok.text

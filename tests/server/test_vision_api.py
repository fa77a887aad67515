"""Images over the OpenAI API: `image_url` content parts with data URLs through the
official `openai` client against a real `jvllm serve` of a tiny LLaVA, greedy tokens
equal to Transformers' (one and two images, the same request again from a warm prefix
cache), and bad images each a 400 naming the problem while the server goes on serving."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from jvllm.testing.vision_checkpoints import make_llava_checkpoint
from tests.server import API_KEY, ServerProcess, auth_headers

MODEL = "tiny-llava"
NEW_TOKENS = 5


def _image(seed: int) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 255, (30, 30, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_llava_checkpoint(tmp_path_factory.mktemp("served-llava"))


@pytest.fixture(scope="module")
def env(llava_dir):
    server = ServerProcess(
        [
            str(llava_dir), "--api-key", API_KEY, "--served-model-name", MODEL,
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


def hf_chat_greedy(llava_dir, messages: list[dict], images: list[Image.Image]) -> list[int]:
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(llava_dir)
    model = LlavaForConditionalGeneration.from_pretrained(llava_dir).eval()
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
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


def test_image_url_chat_equals_transformers(env, llava_dir):
    images = [_image(1), _image(2)]
    one = [image_part(data_url(images[0])), {"type": "text", "text": "w5 w6 w7"}]
    two = [{"type": "text", "text": "w9"}, *(image_part(data_url(i)) for i in images)]
    for content, used in ((one, images[:1]), (two, images)):
        hf_content = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
        want = hf_chat_greedy(llava_dir, [{"role": "user", "content": hf_content}], used)
        assert chat_tokens(env, content) == want
        assert chat_tokens(env, content) == want  # again: warm prefix and encoder caches


def post_chat(env, content: list[dict]) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(
        env.url + "/v1/chat/completions", json=body, headers=auth_headers(), timeout=60
    )


@pytest.mark.parametrize(
    "content,says",
    [
        ([image_part("http://example.com/cat.png")], "example.com"),
        ([image_part("data:image/png;base64,bm90IGFuIGltYWdl")], "cannot be decoded"),
        ([image_part("data:image/png;base64,%%%")], "invalid base64"),
        ([image_part(data_url(_image(0)))] * 3, "limit_mm_per_prompt"),
    ],
    ids=["http-url", "undecodable", "bad-base64", "too-many"],
)
def test_bad_image_is_a_400_and_the_server_keeps_serving(env, content, says):
    r = post_chat(env, [*content, {"type": "text", "text": "w5"}])
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    ok = post_chat(env, [image_part(data_url(_image(3))), {"type": "text", "text": "w5"}])
    assert ok.status_code == 200, ok.text

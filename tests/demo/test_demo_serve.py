"""The README's first command: `jvllm serve` with no model serves the demo, and its
chat answer is English (most words are words of the training corpus); the Responses and
Messages APIs, through their official clients, give the same greedy answer."""

from __future__ import annotations

import re
import time

import anthropic
import httpx
import openai

from jvllm.demo import DEMO_NAME, corpus_words
from tests.server import ServerProcess


def test_serve_without_model_answers_in_english():
    started = time.monotonic()
    server = ServerProcess([])
    try:
        server.wait_ready(timeout=600)
        # Reported, never asserted: the start-up time the README states.
        print(f"demo server ready in {time.monotonic() - started:.1f} s")
        card = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert card["id"] == DEMO_NAME and "fortune cookies" in card["description"]
        body = {
            "model": DEMO_NAME,
            "messages": [{"role": "user", "content": "Hello! Who are you?"}],
            "max_tokens": 40,
            "temperature": 0,
        }
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
        text = reply["choices"][0]["message"]["content"]
        words = re.findall(r"[a-z]+(?:'[a-z]+)?", text.lower())
        assert len(words) >= 5, text
        assert sum(w in corpus_words() for w in words) >= 0.8 * len(words), text
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        response = client.responses.create(
            model=DEMO_NAME,
            input=body["messages"][0]["content"],
            max_output_tokens=40,
            temperature=0,
        )
        assert response.output_text == text
        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        kwargs = dict(messages=body["messages"], extra_body={"temperature": 0})
        with claude.messages.stream(model=DEMO_NAME, max_tokens=40, **kwargs) as stream:
            assert "".join(stream.text_stream) == text
    finally:
        server.stop()

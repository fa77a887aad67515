"""Constrained decoding through the official `openai` client against a real `jvllm serve`:
response_format (json_schema, json_object), vLLM's structured_outputs extra body,
streamed and not, n=3, logit_bias, allowed_token_ids and bad_words; the bad inputs
each with their 400; a grammar over the compile time limit refused while the server
keeps serving."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from tests.server import API_KEY, SMALL_ENGINE, ServerProcess, auth_headers, wait_idle

MODEL = "tiny-llama"
C, H = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "describe a user as JSON"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA}}
# Compiles in well over the test server's 0.05 s limit.
HUGE_SCHEMA = {
    "type": "object",
    "properties": {
        f"p{i}": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]}
        for i in range(20000)
    },
}


@pytest.fixture(scope="module")
def env(checkpoints):
    args = [str(checkpoints["llama"]), "--api-key", API_KEY, "--served-model-name", MODEL]
    server = ServerProcess(
        [*args, *SMALL_ENGINE, "--grammar-compile-timeout", "0.05", "--return-tokens-as-token-ids"]
    )
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        # The first compile also builds the tokenizer's grammar tables: not under test.
        post(server.url, C, {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": "a"}})
        yield SimpleNamespace(url=server.url, client=client)
    finally:
        server.stop()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, headers=auth_headers(), timeout=60)


def test_response_format_json_schema_streamed_equals_full_and_validates(env) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0, seed=0)
    full = env.client.chat.completions.create(response_format=RESPONSE_FORMAT, **kwargs)
    chunks = env.client.chat.completions.create(
        response_format=RESPONSE_FORMAT, stream=True, **kwargs
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].finish_reason == "stop"
    assert streamed == full.choices[0].message.content
    jsonschema.validate(json.loads(streamed), SCHEMA)


def test_n3_sampled_all_validate(env) -> None:
    out = env.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        n=3,
        temperature=1.0,
        seed=7,
        response_format=RESPONSE_FORMAT,
    )
    assert len(out.choices) == 3
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_and_extra_body_regex_and_choice(env) -> None:
    obj = env.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        seed=1,
        response_format={"type": "json_object"},
        extra_body={"bad_words": ["}}"]},
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    regex = r"[a-z]{2,6}@[a-z]{2,6}\.(com|org)"
    stream = env.client.completions.create(
        model=MODEL,
        prompt="email: ",
        max_tokens=40,
        seed=2,
        stream=True,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch(regex, text), text
    choice = env.client.completions.create(
        model=MODEL,
        prompt="pick: ",
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert choice.choices[0].text in ("left", "right")


def test_logit_bias_forces_and_allowed_token_ids_hold(env) -> None:
    forced = env.client.completions.create(
        model=MODEL, prompt="hello", max_tokens=6, temperature=0, logprobs=0, logit_bias={"77": 100}
    )
    assert forced.choices[0].logprobs.tokens == ["token_id:77"] * 6
    allowed = list(range(100, 140))
    body = {"prompt": "hello", "max_tokens": 12, "seed": 3, "logprobs": 0}
    out = post(env.url, C, body | {"allowed_token_ids": allowed}).json()
    ids = [int(t.removeprefix("token_id:")) for t in out["choices"][0]["logprobs"]["tokens"]]
    assert len(ids) == 12 and set(ids) <= set(allowed)


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        (C, {"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "unclosed"),
        (C, {"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs", "nope"),
        (C, {"structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs", "foo"),
        (C, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one"),
        (C, {"structured_outputs": {"pattern": "a"}}, None, "pattern"),
        (H, {"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        (H, {"response_format": {"type": "xml"}}, None, "type"),
        (
            H,
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
            "not both",
        ),
        (C, {"guided_json": {"type": "object"}}, "guided_json", "structured_outputs.json"),
        (C, {"guided_regex": "a+"}, "guided_regex", "structured_outputs.regex"),
        (C, {"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        (C, {"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        (C, {"logit_bias": {"999999": 1}}, "logit_bias", "vocabulary"),
        (C, {"allowed_token_ids": [999999]}, "allowed_token_ids", "vocabulary"),
        (C, {"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
        (H, {"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            H,
            {"tools": [{"type": "function", "function": {"name": "f"}}]},
            "tool_choice",
            "--enable-auto-tool-choice",
        ),
        (C, {"structured_outputs": {"json": HUGE_SCHEMA}}, "structured_outputs", "to compile"),
    ],
)
def test_bad_constraints_get_400_naming_the_field(env, path, body, param, words) -> None:
    extra = {"messages": MESSAGES} if path == H else {"prompt": "hello"}
    response = post(env.url, path, {"max_tokens": 4, **extra, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param
    # The server keeps serving, and holds nothing of the refused request.
    ok = post(env.url, C, {"prompt": "hello", "max_tokens": 2})
    assert ok.status_code == 200
    wait_idle(env.url)

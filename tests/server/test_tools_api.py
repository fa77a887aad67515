"""Tool calling through the official `openai` client against a real `jvllm serve`
(`--enable-auto-tool-choice --tool-call-parser hermes`): named, required and auto
choices; streamed deltas reassembled by the client library's own stream state into the
same calls as the whole response; arguments validated against each tool's schema;
multi-turn messages with tool calls and results; the bad choices each with a 400."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.server import API_KEY, SMALL_ENGINE, ServerProcess, auth_headers, wait_idle

MODEL = "tiny-llama"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "description": "now", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "what is the weather in paris?"}]
# Steers a random model into the Hermes format, to exercise the auto parser end to end.
HERMES_REGEX = (
    r'Sure\. <tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}'
    r"\n</tool_call>"
)


@pytest.fixture(scope="module")
def env(checkpoints):
    args = [str(checkpoints["llama"]), "--api-key", API_KEY, "--served-model-name", MODEL]
    auto = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    # The tools listed in the prompt take ~600 tokens of the test tokenizer.
    server = ServerProcess([*args, *SMALL_ENGINE, *auto, "--max-model-len", "1024"])
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        yield SimpleNamespace(url=server.url, client=client)
    finally:
        server.stop()


def both(env, **kwargs):
    """The whole response, and the streamed one as the client library reassembles it."""
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, **{"max_tokens": 120, **kwargs})
    full = env.client.chat.completions.create(**kwargs)
    state = ChatCompletionStreamState()
    for chunk in env.client.chat.completions.create(stream=True, **kwargs):
        state.handle_chunk(chunk)
    return full, state.get_final_completion()


def calls_of(completion) -> list[tuple[str, dict]]:
    calls = completion.choices[0].message.tool_calls or []
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_named_choice_calls_that_function_with_valid_arguments(env) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    full, streamed = both(env, tool_choice=choice, temperature=0)
    assert calls_of(full) == calls_of(streamed)
    ((name, arguments),) = calls_of(full)
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER)
    assert full.choices[0].finish_reason == "stop"  # OpenAI's for a named choice
    assert full.choices[0].message.tool_calls[0].id.startswith("chatcmpl-tool-")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_choice_makes_valid_calls(env, parallel) -> None:
    full, streamed = both(env, tool_choice="required", temperature=0, parallel_tool_calls=parallel)
    assert calls_of(full) == calls_of(streamed)
    assert calls_of(full) and (parallel or len(calls_of(full)) == 1)
    for name, arguments in calls_of(full):
        jsonschema.validate(arguments, SCHEMAS[name])
    assert full.choices[0].finish_reason == streamed.choices[0].finish_reason == "tool_calls"
    sampled = env.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=3, seed=4
    )
    for c in sampled.choices:
        assert c.message.tool_calls
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_choice_parses_hermes_calls(env) -> None:
    steer = {"structured_outputs": {"regex": HERMES_REGEX}}
    full, streamed = both(env, temperature=0, extra_body=steer)
    assert calls_of(full) == calls_of(streamed)
    ((name, arguments),) = calls_of(full)
    assert name == "get_time" and arguments["zone"] in ("UTC", "CET")
    assert full.choices[0].message.content == streamed.choices[0].message.content == "Sure. "
    assert full.choices[0].finish_reason == "tool_calls"


def test_auto_choice_without_a_call_is_plain_content(env) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=16)
    full = env.client.chat.completions.create(**kwargs)
    # (The library's stream state refuses a "length" finish: the deltas are joined here.)
    chunks = list(env.client.chat.completions.create(stream=True, **kwargs))
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert not full.choices[0].message.tool_calls
    assert full.choices[0].message.content == streamed
    assert full.choices[0].finish_reason in ("stop", "length")
    none = env.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=16,
    )
    assert not none.choices[0].message.tool_calls and none.choices[0].message.content


def test_multi_turn_with_calls_and_results(env) -> None:
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"},
    ]
    out = env.client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert out.choices[0].message.content is not None
    tokens = httpx.post(
        env.url + "/tokenize",
        json={"model": MODEL, "messages": messages},
        headers=auth_headers(),
    ).json()
    assert tokens["count"] > 0


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None, "name"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined",
        ),
    ],
)
def test_bad_tool_choices_get_400(env, body, param, words) -> None:
    payload = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **body}
    if payload["tools"] is None:
        del payload["tools"]
    response = httpx.post(
        env.url + "/v1/chat/completions", json=payload, headers=auth_headers(), timeout=30
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param
    wait_idle(env.url)

"""OpenAI's Responses API and Anthropic's Messages API through their official clients
against a real `jvllm serve`: whole and streamed answers that agree, the event sequences,
function tools and tool results over two turns, previous_response_id and store=false,
count_tokens, each API's own error shape; and a user's tool parser loaded with
--tool-parser-plugin reading calls from chat output."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server import API_KEY, SMALL_ENGINE, ServerProcess, auth_headers

MODEL = "tiny-llama"
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
PLUGIN = Path(__file__).with_name("user_tool_parser.py")


@pytest.fixture(scope="module")
def env(checkpoints):
    args = [str(checkpoints["llama"]), "--api-key", API_KEY, "--served-model-name", MODEL]
    plugin = ["--tool-parser-plugin", str(PLUGIN), "--tool-call-parser", "line_calls"]
    server = ServerProcess(
        [*args, *SMALL_ENGINE, "--max-model-len", "1024", "--enable-auto-tool-choice", *plugin]
    )
    try:
        server.wait_ready()
        yield SimpleNamespace(
            url=server.url,
            openai=openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0),
            anthropic=anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0),
        )
    finally:
        server.stop()


def test_responses_text_whole_and_streamed_agree(env) -> None:
    kwargs = dict(
        model=MODEL, input="tell me a story", instructions="be brief", max_output_tokens=8
    )
    full = env.openai.responses.create(temperature=0, **kwargs)
    assert full.status in ("completed", "incomplete") and full.output_text
    assert full.usage.output_tokens <= 8 and full.usage.input_tokens > 0
    if full.status == "incomplete":
        assert full.incomplete_details.reason == "max_output_tokens"
    events = list(env.openai.responses.create(temperature=0, stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{full.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == full.output_text == events[-1].response.output_text


def test_responses_function_tool_and_its_output_over_two_turns(env) -> None:
    tools = [{"type": "function", "name": "get_time", "parameters": TIME}]
    kwargs = dict(model=MODEL, input="what time is it?", tools=tools, tool_choice="required")
    first = env.openai.responses.create(temperature=0, **kwargs)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_time" and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TIME)
    with env.openai.responses.stream(temperature=0, **kwargs) as stream:
        streamed = stream.get_final_response()
    (again,) = [item for item in streamed.output if item.type == "function_call"]
    assert (again.name, again.arguments) == (call.name, call.arguments)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}
    second = env.openai.responses.create(
        model=MODEL,
        input=[result],
        previous_response_id=first.id,
        tools=tools,
        tool_choice="none",
        max_output_tokens=2,
    )
    # The stored conversation came first: the prompt holds both turns.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.previous_response_id == first.id
    assert env.openai.responses.retrieve(first.id).output[0].call_id == call.call_id


def test_responses_store_false_and_bad_requests_get_openai_errors(env) -> None:
    unstored = env.openai.responses.create(
        model=MODEL, input="hi", max_output_tokens=2, store=False
    )
    with pytest.raises(openai.BadRequestError) as e:
        env.openai.responses.create(model=MODEL, input="hi", previous_response_id=unstored.id)
    assert e.value.body["code"] == "previous_response_not_found"
    bad = [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ]
    for body, param in bad:
        response = httpx.post(
            env.url + "/v1/responses",
            json={"model": MODEL, "input": "hi", **body},
            headers=auth_headers(),
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param


def test_messages_text_whole_streamed_and_stop_sequence(env) -> None:
    kwargs = dict(
        model=MODEL,
        max_tokens=12,
        system="be brief",
        messages=[{"role": "user", "content": [{"type": "text", "text": "tell me a story"}]}],
        # (The client no longer takes sampling fields; the server still does.)
        extra_body={"temperature": 0},
    )
    full = env.anthropic.messages.create(**kwargs)
    assert full.role == "assistant" and full.content[0].type == "text"
    assert full.stop_reason in ("max_tokens", "end_turn") and full.usage.output_tokens <= 12
    with env.anthropic.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == full.content[0].text
    assert final.stop_reason == full.stop_reason
    events = [e.type for e in env.anthropic.messages.create(stream=True, **kwargs)]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    stop = full.content[0].text.split()[-1]
    stopped = env.anthropic.messages.create(stop_sequences=[stop], **kwargs)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stop not in stopped.content[0].text


def test_messages_tool_use_and_tool_result(env) -> None:
    tools = [{"name": "get_time", "description": "now", "input_schema": TIME}]
    question = {"role": "user", "content": "what time is it?"}
    kwargs = dict(model=MODEL, max_tokens=40, messages=[question], tools=tools)
    full = env.anthropic.messages.create(tool_choice={"type": "tool", "name": "get_time"}, **kwargs)
    (use,) = full.content
    assert use.type == "tool_use" and use.name == "get_time" and full.stop_reason == "tool_use"
    jsonschema.validate(use.input, TIME)
    with env.anthropic.messages.stream(tool_choice={"type": "any"}, **kwargs) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(streamed.input, TIME)
    assert final.stop_reason == "tool_use"
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "12:00"}
    turns = [
        question,
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]},
    ]
    answer = env.anthropic.messages.create(
        model=MODEL, max_tokens=2, messages=turns, tools=tools, tool_choice={"type": "none"}
    )
    assert answer.content[0].type == "text"


def test_count_tokens_is_the_rendered_prompt(env) -> None:
    messages = [{"role": "user", "content": "how many tokens is this?"}]
    counted = env.anthropic.messages.count_tokens(model=MODEL, system="be brief", messages=messages)
    chat = [{"role": "system", "content": "be brief"}, *messages]
    tokens = httpx.post(
        env.url + "/tokenize", json={"model": MODEL, "messages": chat}, headers=auth_headers()
    ).json()
    assert counted.input_tokens == tokens["count"]
    tools = [{"name": "get_time", "input_schema": TIME}]
    with_tools = env.anthropic.messages.count_tokens(model=MODEL, messages=messages, tools=tools)
    assert with_tools.input_tokens > counted.input_tokens


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"max_tokens": None}, 400, "invalid_request_error"),
        ({"model": "nope"}, 404, "not_found_error"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            400,
            "invalid_request_error",
        ),
        ({"temperature": 3.0}, 400, "invalid_request_error"),
    ],
)
def test_bad_messages_get_anthropic_errors(env, body, status, kind) -> None:
    payload = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    payload = {k: v for k, v in {**payload, **body}.items() if v is not None}
    response = httpx.post(env.url + "/v1/messages", json=payload, headers={"x-api-key": API_KEY})
    assert response.status_code == status, response.text
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == kind
    wrong_key = anthropic.Anthropic(base_url=env.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong_key.messages.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}]
        )
    assert e.value.body["error"]["type"] == "authentication_error"


def test_plugin_parser_reads_calls_from_chat_output(env) -> None:
    steer = {"structured_outputs": {"regex": r'Sure\. CALL get_time \{"zone": "(UTC|CET)"\}\n'}}
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "what time is it?"}],
        tools=[{"type": "function", "function": {"name": "get_time", "parameters": TIME}}],
        temperature=0,
        max_tokens=40,
        extra_body=steer,
    )
    full = env.openai.chat.completions.create(**kwargs)
    (call,) = full.choices[0].message.tool_calls
    assert call.function.name == "get_time" and full.choices[0].message.content == "Sure. "
    assert full.choices[0].finish_reason == "tool_calls"
    chunks = list(env.openai.chat.completions.create(stream=True, **kwargs))
    deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (call.function.name, call.function.arguments)
    ]

"""A reasoning model's server end to end (`--reasoning-parser qwen3 --tool-call-parser
qwen3_coder`, a Qwen3-style chat template whose generation prompt opens `<think>`, or
closes an empty one with `enable_thinking: false`): thinking split from the answer at
`</think>` in chat completions (whole and streamed), Responses and Messages; a JSON schema
that holds only after the thought ends; and Qwen3-Coder XML calls read from the output."""

from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import openai
import pytest

from jvllm.testing import make_checkpoint
from tests.server import API_KEY, SMALL_ENGINE, ServerProcess, auth_headers

MODEL = "tiny-thinker"
QWEN3_STYLE = (
    "{% if tools %}<|system|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n"
    "{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}</function>\n"
    "</tool_call>{% endfor %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking is defined and not "
    "enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "what is six times seven?"}]
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
QWEN3_CODER_REGEX = (
    r"Let me see\.<tool_call>\n<function=get_time>\n<parameter=zone>\n(UTC|CET)\n"
    r"</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def env(tmp_path_factory, tokenizer_dir):
    from transformers import AutoTokenizer

    # A reasoning model's tokenizer: its thought markers are single (non-special) tokens.
    # (`<tool_call>` stays spelled out: llguidance reads added tokens as special ones, so
    # a regex could not write it as one token.)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_STYLE
    thinker_tokenizer = tmp_path_factory.mktemp("thinker-tokenizer")
    tokenizer.save_pretrained(thinker_tokenizer)
    path = make_checkpoint("llama", tmp_path_factory.mktemp("thinker"), thinker_tokenizer)
    parsers = ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice"]
    args = [str(path), "--api-key", API_KEY, "--served-model-name", MODEL, *SMALL_ENGINE]
    server = ServerProcess(
        [*args, *parsers, "--tool-call-parser", "qwen3_coder", "--max-model-len", "512"]
    )
    try:
        server.wait_ready()
        yield SimpleNamespace(
            url=server.url,
            client=openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0),
            end_id=tokenizer.convert_tokens_to_ids("</think>"),
        )
    finally:
        server.stop()


def raw_completion(env, max_tokens: int) -> str:
    """The model's raw text after the rendered prompt (the reference the split is read from)."""
    prompt = httpx.post(
        env.url + "/tokenize", json={"model": MODEL, "messages": MESSAGES}, headers=auth_headers()
    ).json()["tokens"]
    out = env.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].text


def test_thinking_is_split_at_the_end_marker_whole_and_streamed(env) -> None:
    raw = raw_completion(env, 12)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    message = env.client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning == message.model_extra["reasoning"]
    rebuilt = reasoning or ""
    if message.content is not None:
        rebuilt += "</think>" + message.content
    assert rebuilt == raw
    chunks = list(env.client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == (reasoning or "")
    assert "".join(d.content or "" for d in deltas) == (message.content or "")


def test_responses_and_messages_carry_the_thinking(env) -> None:
    raw = raw_completion(env, 6)
    expected = raw.partition("</think>")[0]
    response = env.client.responses.create(
        model=MODEL, input=MESSAGES[0]["content"], max_output_tokens=6, temperature=0
    )
    assert response.output[0].type == "reasoning"
    assert response.output[0].content[0].text == expected
    with env.client.responses.stream(
        model=MODEL, input=MESSAGES[0]["content"], max_output_tokens=6, temperature=0
    ) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == expected and events[-1].type == f"response.{response.status}"
    claude = anthropic.Anthropic(base_url=env.url, api_key=API_KEY, max_retries=0)
    kwargs = dict(model=MODEL, max_tokens=6, messages=MESSAGES, extra_body={"temperature": 0})
    message = claude.messages.create(**kwargs)
    assert message.content[0].type == "thinking" and message.content[0].thinking == expected
    with claude.messages.stream(**kwargs) as stream:
        assert stream.get_final_message().content[0].thinking == expected


def test_the_schema_holds_from_where_the_thought_ends(env) -> None:
    # The bias makes `</think>` the first token: a grammar in force from the start would
    # have masked it, and the answer would not parse as content.
    out = env.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        logit_bias={str(env.end_id): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
    )
    choice = out.choices[0]
    assert choice.message.model_extra["reasoning_content"] is None
    jsonschema.validate(json.loads(choice.message.content), ANSWER)
    assert choice.finish_reason == "stop"


def test_qwen3_coder_calls_when_thinking_is_off(env) -> None:
    kwargs = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=[{"type": "function", "function": {"name": "get_time", "parameters": TIME}}],
        temperature=0,
        max_tokens=120,
        extra_body={
            "chat_template_kwargs": {"enable_thinking": False},
            "structured_outputs": {"regex": QWEN3_CODER_REGEX},
        },
    )
    full = env.client.chat.completions.create(**kwargs).choices[0]
    (call,) = full.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    assert full.message.content == "Let me see." and full.finish_reason == "tool_calls"
    assert full.message.model_extra["reasoning_content"] is None
    chunks = list(env.client.chat.completions.create(stream=True, **kwargs))
    deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        ("get_time", call.function.arguments)
    ]

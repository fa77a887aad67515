"""ToolCallReader on known texts, and fed in random pieces: the streamed content and
calls always add up to those of the whole text."""

from __future__ import annotations

import json
import random

import pytest

from jvllm.server.tool_parsers.hermes import Hermes2ProToolParser
from jvllm.server.tools import ToolCallReader

HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
)
REQUIRED = json.dumps(
    [
        {"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}},
        {"name": "get_time", "parameters": {"zone": "CET"}},
    ]
)


def _hermes() -> ToolCallReader:
    return ToolCallReader("auto", parser=Hermes2ProToolParser())


def _streamed(mode: str, text: str, seed: int, function: str | None = None):
    reader = ToolCallReader(mode, function, Hermes2ProToolParser() if mode == "auto" else None)
    rng = random.Random(seed)
    content, calls, arguments, at = "", [], "", 0
    while at < len(text):
        step = rng.randint(1, 12)
        c, new, a = reader.feed(text[at : at + step])
        content, calls, arguments = content + c, calls + new, arguments + a
        at += step
    rest, more = reader.finish()
    return content + rest, [(t.name, t.arguments) for t in calls + more], arguments


def test_hermes_content_then_calls() -> None:
    content, calls = _hermes().parse_all(HERMES)
    assert content == "Let me check. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "no calls here, just < and <tool_ words",
        "broken <tool_call>\n{not json}\n</tool_call>",
        'unclosed <tool_call>\n{"name": "f"',
    ],
)
def test_hermes_without_a_valid_call_is_all_content(text) -> None:
    content, calls = _hermes().parse_all(text)
    assert (content, calls) == (text, [])


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("text", [HERMES, "plain <tool_ text", "a <tool_call>{bad}</tool_call>"])
def test_hermes_streamed_in_pieces_adds_up(seed, text) -> None:
    whole_content, whole_calls = _hermes().parse_all(text)
    content, calls, _ = _streamed("auto", text, seed)
    assert [(n, json.loads(a)) for n, a in calls] == [
        (c.name, json.loads(c.arguments)) for c in whole_calls
    ]
    assert content == (whole_content or "")


@pytest.mark.parametrize("seed", range(20))
def test_required_array_streamed_in_pieces_adds_up(seed) -> None:
    _, whole = ToolCallReader("required").parse_all(REQUIRED)
    assert [(c.name, json.loads(c.arguments)) for c in whole] == [
        ("get_weather", {"city": "Rome", "unit": "celsius"}),
        ("get_time", {"zone": "CET"}),
    ]
    content, calls, _ = _streamed("required", REQUIRED, seed)
    assert content == "" and calls == [(c.name, c.arguments) for c in whole]


@pytest.mark.parametrize("seed", range(5))
def test_named_arguments_stream_as_they_come(seed) -> None:
    text = '{"city": "Oslo", "unit": "fahrenheit"}'
    content, calls, arguments = _streamed("named", text, seed, "get_weather")
    assert content == "" and calls == [("get_weather", "")] and arguments == text
    _, (call,) = ToolCallReader("named", "get_weather").parse_all(text)
    assert (call.name, call.arguments) == ("get_weather", text)

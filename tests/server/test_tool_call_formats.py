"""Each --tool-call-parser on model outputs written for the test: content and calls of a
whole text; the same when the text arrives in random pieces; malformed calls left as
content; and calls rendered by a chat template in the model family's own format read
back as the calls the conversation held (template -> text -> parser round trip)."""

from __future__ import annotations

import json
import random

import pytest

from jvllm.server.tool_parsers import ToolParserManager
from jvllm.server.tools import ToolCallReader

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
WEATHER = ("get_weather", {"city": "Paris", "days": 3, "metric": True})
TIME = ("get_time", {"zone": "UTC"})

# (parser, model output, expected content, expected calls)
OUTPUTS = [
    (
        "hermes",
        'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3, "metric": true}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
        '"arguments": {"zone": "UTC"}}\n</tool_call>',
        "Checking. ",
        [WEATHER, TIME],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3, "metric": true}}'
        '; {"name": "get_time", "parameters": {"zone": "UTC"}}',
        None,
        [WEATHER, TIME],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_time", "arguments": {"zone": "UTC"}}',
        None,
        [TIME],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, '
        '"metric": true}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]',
        None,
        [WEATHER, TIME],
    ),
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3, "metric": true}'
        '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
        "Sure.",
        [WEATHER, TIME],
    ),
    (
        "pythonic",
        '[get_weather(city="Paris", days=3, metric=True), get_time(zone="UTC")]',
        None,
        [WEATHER, TIME],
    ),
    (
        "pythonic",
        '<|python_start|>[get_time(zone="UTC")]<|python_end|>',
        None,
        [TIME],
    ),
    (
        "qwen3_coder",
        "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
        "<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>",
        "Let me look.\n",
        [WEATHER, TIME],
    ),
]

NOT_CALLS = [
    ("hermes", 'text <tool_call>\n{"name": broken}\n</tool_call>'),
    ("llama3_json", "The answer is {not json"),
    ("llama3_json", "plain words"),
    ("mistral", "[TOOL_CALLS][{oops"),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[get_time(zone=now())]"),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC"),
]


def reader(name: str) -> ToolCallReader:
    return ToolCallReader("auto", parser=ToolParserManager.get_tool_parser(name)(TOOLS))


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(name: str, text: str, seed: int) -> tuple[str, list]:
    r, rng, at = reader(name), random.Random(seed), 0
    content, calls = "", []
    while at < len(text):
        step = rng.randint(1, 9)
        c, new, _ = r.feed(text[at : at + step])
        content, calls, at = content + c, calls + new, at + step
    rest, more = r.finish()
    return content + rest, calls + more


@pytest.mark.parametrize(("name", "text", "content", "calls"), OUTPUTS)
def test_parser_reads_content_and_calls(name, text, content, calls) -> None:
    got_content, got_calls = reader(name).parse_all(text)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    assert len({c.id for c in got_calls}) == len(got_calls)
    if name == "mistral":  # Mistral's templates take nine-character ids only
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got_calls)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("name", "text", "content", "calls"), OUTPUTS)
def test_parser_streamed_in_pieces_adds_up(name, text, content, calls, seed) -> None:
    got_content, got_calls = streamed(name, text, seed)
    assert (got_content, calls_of(got_calls)) == (content or "", calls)


@pytest.mark.parametrize(("name", "text"), NOT_CALLS)
def test_output_without_a_valid_call_is_all_content(name, text) -> None:
    assert reader(name).parse_all(text) == (text, [])
    assert streamed(name, text, 0) == (text, [])


# Each family's way of writing an assistant turn's calls, as its chat template renders
# them (Hermes's is the test tokenizer's own template).
CALL_TEMPLATES = {
    "llama3_json": (
        '{% for c in m.tool_calls %}{{ \'{"name": "\' + c.function.name + \'", "parameters": \' }}'
        "{{ c.function.arguments | tojson }}}{% if not loop.last %}; {% endif %}{% endfor %}"
    ),
    "mistral": (
        '[TOOL_CALLS][{% for c in m.tool_calls %}{"name": {{ c.function.name | tojson }}, '
        '"arguments": {{ c.function.arguments | tojson }}, "id": {{ c.id | tojson }}}'
        "{% if not loop.last %}, {% endif %}{% endfor %}]"
    ),
    "pythonic": (
        "[{% for c in m.tool_calls %}{{ c.function.name }}("
        "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}"
        "{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}"
        "{% endfor %}]"
    ),
    "qwen3_coder": (
        "{{ m.content or '' }}{% for c in m.tool_calls %}\n<tool_call>\n<function="
        "{{ c.function.name }}>\n{% for k, v in c.function.arguments.items() %}<parameter="
        "{{ k }}>\n{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}"
        "</function>\n</tool_call>{% endfor %}"
    ),
}


def _template(calls: str) -> str:
    return (
        "{% for m in messages %}<|{{ m.role }}|>\n{% if m.tool_calls %}" + calls + "{% else %}"
        "{{ m.content }}{% endif %}<|end|>\n{% endfor %}"
    )


@pytest.mark.parametrize("name", ["hermes", *CALL_TEMPLATES])
def test_calls_rendered_by_a_chat_template_read_back(name, tokenizer_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    calls = [
        {"id": "abcDEF123", "type": "function", "function": {"name": n, "arguments": a}}
        for n, a in ([("get_time", {"zone": "UTC"})] if name == "pythonic" else [WEATHER, TIME])
    ]
    question = {"role": "user", "content": "weather in paris?"}
    turn = {"role": "assistant", "content": "", "tool_calls": calls}
    template = None if name == "hermes" else _template(CALL_TEMPLATES[name])
    before = tokenizer.apply_chat_template(
        [question], tokenize=False, add_generation_prompt=True, chat_template=template
    )
    if name != "hermes":
        before += "<|assistant|>\n"
    text = tokenizer.apply_chat_template([question, turn], tokenize=False, chat_template=template)
    assert text.startswith(before)
    end = "</s>\n" if name == "hermes" else "<|end|>\n"
    output = text[len(before) :].removesuffix(end)  # what the model writes for this turn
    content, got = reader(name).parse_all(output)
    assert calls_of(got) == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert not (content or "").strip()


def test_a_plugin_file_registers_its_parser(tmp_path) -> None:
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from jvllm.server.tool_parsers import ParsedCall, ToolParser, ToolParserManager\n"
        "@ToolParserManager.register_module('shout')\n"
        "class Shout(ToolParser):\n"
        "    start = '!'\n"
        "    def parse_calls(self, text, start, final):\n"
        "        return [ParsedCall(text[start + 1 :].strip(), '{}')] if final else []\n"
    )
    with pytest.raises(ValueError, match="shout"):
        ToolParserManager.get_tool_parser("shout")
    ToolParserManager.import_tool_parser(str(plugin))
    content, calls = reader("shout").parse_all("hi !get_time")
    assert content == "hi " and [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    with pytest.raises(FileNotFoundError, match="missing.py"):
        ToolParserManager.import_tool_parser(str(tmp_path / "missing.py"))

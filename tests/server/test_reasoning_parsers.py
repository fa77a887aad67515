"""--reasoning-parser deepseek_r1 and qwen3 on model outputs written for the test: the
reasoning and content of a whole text, the same from random pieces, and whether a prompt
rendered by a reasoning model's style of chat template already ended the reasoning."""

from __future__ import annotations

import random

import pytest

from jvllm.server.reasoning import ReasoningReader, get_reasoning_parser

# (parser, model output, reasoning, content)
OUTPUTS = [
    ("deepseek_r1", "<think>\nsix times seven</think>\n\n42", "\nsix times seven", "\n\n42"),
    ("deepseek_r1", "six times seven</think>42", "six times seven", "42"),  # <think> in prompt
    ("deepseek_r1", "still thinking about <thi", "still thinking about <thi", None),  # cut off
    ("deepseek_r1", "</think>only the answer", None, "only the answer"),
    ("qwen3", "<think>a < b</think>yes, a is less", "a < b", "yes, a is less"),
    ("qwen3", "hmm </thinking> </think> ok", "hmm </thinking> ", " ok"),
    # Qwen3 may call a tool without closing its thought: the call is content.
    (
        "qwen3",
        "I should call it.<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "I should call it.",
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
    ),
    ("qwen3", "a <tool_call> mention is not a call", "a <tool_call> mention is not a call", None),
]


def parser(name: str):
    return get_reasoning_parser(name)(tokenizer=None)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), OUTPUTS)
def test_reasoning_and_content_of_a_whole_output(name, text, reasoning, content) -> None:
    assert parser(name).extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(("name", "text", "reasoning", "content"), OUTPUTS)
def test_streamed_in_pieces_adds_up(name, text, reasoning, content, seed) -> None:
    reader, rng, at = ReasoningReader(parser(name)), random.Random(seed), 0
    got_reasoning = got_content = ""
    while at < len(text):
        step = rng.randint(1, 6)
        r, c = reader.feed(text[at : at + step])
        assert not (got_content and r), "reasoning after content began"
        got_reasoning, got_content, at = got_reasoning + r, got_content + c, at + step
    r, c = reader.finish()
    assert (got_reasoning + r or None, got_content + c or None) == (reasoning, content)


def test_an_inactive_reader_passes_everything_as_content() -> None:
    reader = ReasoningReader(parser("qwen3"), active=False)
    assert reader.feed("<think>x</think>y") == ("", "<think>x</think>y")
    assert reader.finish() == ("", "")


def test_unknown_parser_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="deepseek_r1.*qwen3.*'nope'"):
        get_reasoning_parser("nope")


# Qwen3's template: `enable_thinking=False` closes an empty thought in the prompt.
QWEN3_STYLE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking is defined and "
    "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# DeepSeek-R1's template opens the thought in the prompt.
R1_STYLE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n<think>\n{% endif %}"
)


@pytest.mark.parametrize(
    ("name", "template", "kwargs", "ended"),
    [
        ("qwen3", QWEN3_STYLE, {}, False),
        ("qwen3", QWEN3_STYLE, {"enable_thinking": True}, False),
        ("qwen3", QWEN3_STYLE, {"enable_thinking": False}, True),
        ("deepseek_r1", R1_STYLE, {}, False),
    ],
)
def test_whether_a_rendered_prompt_ended_the_reasoning(
    name, template, kwargs, ended, tokenizer_dir
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [
        {"role": "user", "content": "what is 6 x 7?"},
        {"role": "assistant", "content": "42"},  # earlier turns carry no thoughts
        {"role": "user", "content": "and 6 x 8?"},
    ]
    prompt = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=template, **kwargs
    )
    assert parser(name).is_reasoning_end(prompt) is ended

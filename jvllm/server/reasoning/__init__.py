"""Reasoning parsers (`--reasoning-parser`): a reasoning model's thinking text moved out
of the content into `reasoning_content`, whole or streamed.

Owns where a choice's thinking ends and its answer begins, for the `<think>...</think>`
models: `deepseek_r1` (DeepSeek-R1 and its distills) and `qwen3` (Qwen3, QwQ). Both
strip a leading `<think>` (the chat template usually puts it in the prompt) and call
everything before `</think>` reasoning. Without `</think>`, `deepseek_r1` and `qwen3`
take all the output as reasoning (cut off while thinking); `qwen3` also ends reasoning
at a `<tool_call>` followed by `<function=` (Qwen3 may call a tool without closing its
thought). A prompt that already ended reasoning (`enable_thinking: false` in
`chat_template_kwargs`) makes all the output content. Where structured outputs begin is
the engine's (`StructuredOutputsParams.reasoning_end_token_ids`); the server passes the
end marker's ids there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar


class ReasoningParser:
    """`<think>`/`</think>` reasoning (vLLM's `BaseThinkingReasoningParser`)."""

    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        """The marker's ids as the tokenizer writes it (one id in a reasoning model's)."""
        return tuple(self.tokenizer.encode(self.end_token, add_special_tokens=False))

    def is_reasoning_end(self, prompt_text: str) -> bool:
        """Whether a prompt already closed the reasoning (the last marker in it is the end)."""
        end = prompt_text.rfind(self.end_token)
        return end >= 0 and end > prompt_text.rfind(self.start_token)

    def find_end(self, text: str) -> tuple[int, int] | None:
        """(where the reasoning ends, where the content starts) once `text` shows them."""
        at = text.find(self.end_token)
        return None if at < 0 else (at, at + len(self.end_token))

    def undecided_from(self, text: str) -> int:
        """The index from which `text` could still grow into the end marker."""
        return _partial_suffix(text, self.end_token)

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """A whole choice: (reasoning, content)."""
        reader = ReasoningReader(self)
        reasoning, content = reader.feed(text)
        more_reasoning, more_content = reader.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None


class DeepSeekR1ReasoningParser(ReasoningParser):
    pass


_FUNCTION_OPEN = re.compile(r"\s*<function[\s=]")
_TOOL_CALL = "<tool_call>"


class Qwen3ReasoningParser(ReasoningParser):
    def find_end(self, text: str) -> tuple[int, int] | None:
        end = super().find_end(text)
        call = text.find(_TOOL_CALL)
        while call >= 0 and (end is None or call < end[0]):
            if _FUNCTION_OPEN.match(text, call + len(_TOOL_CALL)):
                return call, call  # the call is content, for the tool parser
            call = text.find(_TOOL_CALL, call + 1)
        return end

    def undecided_from(self, text: str) -> int:
        held = super().undecided_from(text)
        call = text.rfind(_TOOL_CALL)
        if call >= 0 and _could_open_function(text[call + len(_TOOL_CALL) :]):
            return min(held, call)
        return min(held, _partial_suffix(text, _TOOL_CALL))


def _could_open_function(after: str) -> bool:
    rest = after.lstrip()
    return not rest or "<function".startswith(rest)


def _partial_suffix(text: str, marker: str) -> int:
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}"
        )
    return REASONING_PARSERS[name]


@dataclass
class ReasoningReader:
    """One choice's text -> (reasoning, content) deltas as it arrives. `active=False`
    (the prompt ended the reasoning, or no parser): everything is content."""

    parser: ReasoningParser
    active: bool = True
    text: str = ""
    _sent: int = 0  # characters of `text` sent, as reasoning or content
    _body: int = -1  # where the reasoning starts (after a leading `<think>`); -1: unknown
    _content_from: int = -1  # where the content starts; -1 while reasoning

    def feed(self, new_text: str) -> tuple[str, str]:
        self.text += new_text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        if not self.active:
            content, self._sent = self.text[self._sent :], len(self.text)
            return "", content
        if self._body < 0 and not self._find_body(final):
            return "", ""
        reasoning = ""
        if self._content_from < 0:
            found = self.parser.find_end(self.text[self._body :])
            if found is not None:
                end, self._content_from = self._body + found[0], self._body + found[1]
                reasoning = self.text[self._sent : end]
                self._sent = self._content_from
            else:
                held = len(self.text) if final else self.parser.undecided_from(self.text)
                reasoning = self.text[self._sent : max(held, self._sent)]
                self._sent = max(held, self._sent)
                return reasoning, ""
        content, self._sent = self.text[self._sent :], len(self.text)
        return reasoning, content

    def _find_body(self, final: bool) -> bool:
        """Skips a leading `<think>`; False while the text could still be one."""
        stripped = self.text.lstrip()
        start = self.parser.start_token
        if stripped.startswith(start):
            self._body = len(self.text) - len(stripped) + len(start)
        elif start.startswith(stripped) and not final:
            return False
        else:
            self._body = 0
        self._sent = self._body
        return True

"""A chat choice's text read into reasoning, content and tool calls, whole or streamed.

Owns the order the two readers run in: the reasoning parser first (what it calls
content goes on), then the tool-call reader on that content. Every API that answers
with an assistant turn (chat completions, Responses, Anthropic Messages) reads its
output through this one class, so they agree on what a model said.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .reasoning import ReasoningParser, ReasoningReader, get_reasoning_parser
from .tool_parsers import ToolCall
from .tools import ToolCallReader, auto_parser


@dataclass(frozen=True)
class OutputDelta:
    reasoning: str
    content: str
    calls: list[ToolCall]  # calls complete since the last delta
    arguments: str  # a named call's argument text, as it comes


@dataclass(frozen=True)
class ParsedOutput:
    reasoning: str | None
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


def reasoning_parser(name: str | None, tokenizer: Any) -> ReasoningParser | None:
    return None if name is None else get_reasoning_parser(name)(tokenizer)


class OutputReader:
    """One choice: `feed(new_text)` as it arrives, then `finish()`; or `parse_all(text)`."""

    def __init__(
        self,
        mode: str,
        function: str | None,
        tools: list[dict[str, Any]],
        tool_parser: str | None,
        reasoning: ReasoningParser | None,
        reasoning_active: bool,
    ) -> None:
        parser = auto_parser(tool_parser, tools) if mode == "auto" else None
        self.tools = ToolCallReader(mode, function, parser)
        self.has_reasoning = reasoning is not None and reasoning_active
        self.reasoning = ReasoningReader(reasoning or ReasoningParser(None), self.has_reasoning)

    @property
    def mode(self) -> str:
        return self.tools.mode

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls

    def feed(self, new_text: str) -> OutputDelta:
        reasoning, content = self.reasoning.feed(new_text)
        content, calls, arguments = self.tools.feed(content)
        return OutputDelta(reasoning, content, calls, arguments)

    def finish(self) -> OutputDelta:
        reasoning, content = self.reasoning.finish()
        content, calls, arguments = self.tools.feed(content)
        rest, more = self.tools.finish()
        return OutputDelta(reasoning, content + rest, calls + more, arguments)

    def parse_all(self, text: str) -> ParsedOutput:
        reasoning, content = self.reasoning.feed(text)
        more_reasoning, more_content = self.reasoning.finish()
        reasoning += more_reasoning
        content, calls = self.tools.parse_all(content + more_content)
        if not self.has_reasoning:
            return ParsedOutput(None, content, calls)
        # A thought cut off before its end leaves no content at all (vLLM's None).
        return ParsedOutput(reasoning or None, content or None, calls)

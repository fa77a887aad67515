"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` as vLLM serves them.

Owns what each tool_choice means for generation and for the response:
- `none`: plain content (the tools are still rendered into the prompt, as vLLM does);
- a named function: the output is that function's arguments, held to its `parameters`
  schema by the grammar;
- `required`: the output is a JSON array of `{"name", "parameters"}` calls, each held to
  its tool's schema (at most one without `parallel_tool_calls`);
- `auto` (needs `--enable-auto-tool-choice --tool-call-parser NAME`): free output, from
  which the named parser (`jvllm.server.tool_parsers`) reads the calls, the text before
  them being the content.
`ToolCallReader` turns a choice's text into content and calls, whole or as stream
deltas (each call sent once complete, a named call's arguments as they come).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from jvllm.sampling_params import StructuredOutputsParams

from .errors import APIError
from .protocol import ChatCompletionRequest
from .tool_parsers import ToolCall, ToolParser, ToolParserManager
from .tool_parsers.abstract import arguments_json, json_objects


def new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(f"chatcmpl-tool-{uuid.uuid4().hex}", name, arguments)


def auto_parser(name: str | None, tools: list[dict[str, Any]]) -> ToolParser | None:
    """The `--tool-call-parser` a request's "auto" calls are read with."""
    return None if name is None else ToolParserManager.get_tool_parser(name)(tools)


def tool_choice_mode(req: ChatCompletionRequest, auto_parser: str | None) -> str:
    """ "none", "auto", "required" or "named"; 400 for a choice the request or the
    server cannot honour."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    if not req.tools:
        if choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return "none"
    if isinstance(choice, str):
        if choice == "auto" and auto_parser is None:
            raise APIError(
                400,
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                'and --tool-call-parser; name a function or use "required"',
                param="tool_choice",
            )
        return choice
    names = [t.function.name for t in req.tools]
    if choice.function.name not in names:
        raise APIError(
            400,
            f"tool_choice names {choice.function.name!r}, which is not among the tools "
            f"({', '.join(names)})",
            param="tool_choice",
        )
    return "named"


def tool_constraint(req: ChatCompletionRequest, mode: str) -> StructuredOutputsParams | None:
    """The grammar that `required` and a named choice generate under."""
    if mode not in ("required", "named"):
        return None
    if req.response_format is not None or req.structured_outputs is not None:
        raise APIError(
            400,
            f"tool_choice {mode!r} cannot be combined with response_format or structured_outputs",
            param="tool_choice",
        )
    tools = {t.function.name: t.function.parameters or {"type": "object"} for t in req.tools or []}
    if mode == "named":
        return StructuredOutputsParams(json=tools[req.tool_choice.function.name])  # type: ignore[union-attr]
    one_of = [
        {
            "type": "object",
            "properties": {"name": {"enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in tools.items()
    ]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if not req.parallel_tool_calls:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array)


@dataclass
class ToolCallReader:
    """One choice's text -> content and tool calls. `feed(new_text)` as text arrives
    returns (content to send, calls now complete, argument text of a named call);
    `finish()` what remains. In "auto" mode `parser` reads the calls."""

    mode: str
    function: str | None = None  # the named choice's function
    parser: ToolParser | None = None
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    _content_sent: int = 0
    _scan: int = 0  # where the next unread `required` array item may start
    _start: int = -1  # where the parser found the calls to begin
    _named: ToolCall | None = None

    def feed(self, new_text: str) -> tuple[str, list[ToolCall], str]:
        self.text += new_text
        if self.mode == "none":
            return new_text, [], ""
        if self.mode == "named":
            first = []
            if self._named is None:
                self._named = new_call(self.function or "", "")
                first = [self._named]
            return "", first, new_text
        if self.mode == "required":
            return "", self._complete_array_items(), ""
        return self._auto(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest of the content and the calls not yet returned, at the end."""
        if self.mode == "named":
            if self._named is None:
                self._named = new_call(self.function or "", "")
                return "", [self._named]
            return "", []
        if self.mode == "required":
            return "", self._complete_array_items()
        if self.mode == "auto":
            content, calls, _ = self._auto(final=True)
            return content, calls
        return "", []

    def parse_all(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole choice: (content, calls)."""
        content, calls, arguments = self.feed(text)
        rest, more = self.finish()
        calls = calls + more
        if self.mode == "named":
            assert self._named is not None
            calls = [ToolCall(self._named.id, self._named.name, arguments)]
        content += rest
        return (content or None) if calls else content, calls

    def _complete_array_items(self) -> list[ToolCall]:
        """Each element of the `required` array once it parses."""
        items, self._scan = json_objects(self.text, self._scan, "[,")
        out = []
        for item in items:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                call = new_call(item["name"], arguments_json(item.get("parameters", {})))
                self.calls.append(call)
                out.append(call)
        return out

    def _auto(self, final: bool) -> tuple[str, list[ToolCall], str]:
        """Content before the calls begin (holding back what may start one), then each
        call once the parser reads it whole; with no call at the end, all is content."""
        assert self.parser is not None
        if self._start < 0:
            self._start = self.parser.find_start(self.text)
        if self._start < 0:
            end = len(self.text) if final else self.parser.undecided_from(self.text)
            content = self.text[self._content_sent : end]
            self._content_sent = max(self._content_sent, end)
            return content, [], ""
        content = self.text[self._content_sent : self._start]
        self._content_sent = max(self._content_sent, self._start)
        parsed = self.parser.parse_calls(self.text, self._start, final)
        out = [
            ToolCall(self.parser.new_call_id(), p.name, p.arguments)
            for p in parsed[len(self.calls) :]
        ]
        self.calls += out
        if final and not self.calls:  # nothing parsed: the whole text is content
            content += self.text[self._content_sent :]
            self._content_sent = len(self.text)
        return content, out, ""

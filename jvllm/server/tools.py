"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` as vLLM serves them.

Owns what each tool_choice means for generation and for the response:
- `none`: plain content (the tools are still rendered into the prompt, as vLLM does);
- a named function: the output is that function's arguments, held to its `parameters`
  schema by the grammar;
- `required`: the output is a JSON array of `{"name", "parameters"}` calls, each held to
  its tool's schema (at most one without `parallel_tool_calls`);
- `auto` (needs `--enable-auto-tool-choice --tool-call-parser hermes`): free output,
  from which Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
  blocks are parsed, the text before them being the content.
`ToolCallReader` turns a choice's text into content and calls, whole or as stream
deltas (each call sent once complete, a named call's arguments as they come).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from jvllm.sampling_params import StructuredOutputsParams

from .errors import APIError
from .protocol import ChatCompletionRequest

TOOL_CALL_PARSERS = ("hermes",)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


def new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(f"chatcmpl-tool-{uuid.uuid4().hex}", name, arguments)


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
    `finish()` what remains."""

    mode: str
    function: str | None = None  # the named choice's function
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    _content_sent: int = 0
    _scan: int = 0  # where the next unread call may start
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
        return self._hermes(final=False)

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
            content, calls, _ = self._hermes(final=True)
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
        """Each element of the `required` array once it parses (json.raw_decode)."""
        decoder, out = json.JSONDecoder(), []
        while True:
            i = self._scan
            while i < len(self.text) and self.text[i] in " \n\t[,":
                i += 1
            try:
                item, end = decoder.raw_decode(self.text, i)
            except json.JSONDecodeError:
                return out
            self._scan = end
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
                call = new_call(item["name"], arguments)
                self.calls.append(call)
                out.append(call)

    def _hermes(self, final: bool) -> tuple[str, list[ToolCall], str]:
        """Content before the first `<tool_call>` (holding back what may start one), then
        each closed block that parses as {"name", "arguments"}."""
        out: list[ToolCall] = []
        start = self.text.find(_OPEN)
        if start < 0:
            end = len(self.text) if final else _safe_end(self.text)
            content = self.text[self._content_sent : end]
            self._content_sent = max(self._content_sent, end)
            return content, out, ""
        content = self.text[self._content_sent : start] if not self.calls else ""
        self._content_sent = max(self._content_sent, start)
        self._scan = max(self._scan, start)
        while True:
            open_at = self.text.find(_OPEN, self._scan)
            close_at = self.text.find(_CLOSE, open_at + len(_OPEN)) if open_at >= 0 else -1
            if close_at < 0:
                break
            body = self.text[open_at + len(_OPEN) : close_at]
            self._scan = close_at + len(_CLOSE)
            call = _hermes_call(body)
            if call is not None:
                self.calls.append(call)
                out.append(call)
        if final and not self.calls:  # nothing parsed: the whole text is content
            content += self.text[self._content_sent :]
            self._content_sent = len(self.text)
        return content, out, ""


def _safe_end(text: str) -> int:
    """How much of `text` cannot be the start of a `<tool_call>` still arriving."""
    for keep in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


def _hermes_call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return new_call(data["name"], text)

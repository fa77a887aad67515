"""Hermes calls (NousResearch; Qwen2.5 and many fine-tunes): content, then one
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block per call."""

from __future__ import annotations

import json

from .abstract import ParsedCall, ToolParser, ToolParserManager, arguments_json

_CLOSE = "</tool_call>"


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    start = "<tool_call>"

    def parse_calls(self, text: str, start: int, final: bool) -> list[ParsedCall]:
        """Each closed block that parses as {"name", "arguments"}; others are skipped."""
        calls, at = [], start
        while True:
            open_at = text.find(self.start, at)
            close_at = text.find(_CLOSE, open_at + len(self.start)) if open_at >= 0 else -1
            if close_at < 0:
                return calls
            at = close_at + len(_CLOSE)
            try:
                data = json.loads(text[open_at + len(self.start) : close_at])
            except json.JSONDecodeError:
                continue
            if isinstance(data, dict) and isinstance(data.get("name"), str):
                calls.append(ParsedCall(data["name"], arguments_json(data.get("arguments", {}))))

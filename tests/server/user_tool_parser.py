"""A user's own tool-call parser, loaded with `--tool-parser-plugin` by the server tests:
calls are lines `CALL <name> <json arguments>` after the content."""

from __future__ import annotations

import json

from jvllm.server.tool_parsers import ParsedCall, ToolParser, ToolParserManager


@ToolParserManager.register_module("line_calls")
class LineCallsToolParser(ToolParser):
    start = "CALL "

    def parse_calls(self, text: str, start: int, final: bool) -> list[ParsedCall]:
        lines = text[start:].split("\n")
        complete = lines if final else lines[:-1]  # the last line may still grow
        calls = []
        for line in complete:
            name, _, arguments = line.removeprefix("CALL ").partition(" ")
            try:
                calls.append(ParsedCall(name, json.dumps(json.loads(arguments))))
            except json.JSONDecodeError:
                break
        return calls

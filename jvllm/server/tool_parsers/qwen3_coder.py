"""Qwen3-Coder's XML calls: after the content, per call

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each is converted to the type the tool's schema declares
for it (a string stays as written; numbers, booleans, null, objects and arrays are read
as JSON, then as a Python literal, and stay text if neither reads).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from .abstract import ParsedCall, ToolParser, ToolParserManager

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


@ToolParserManager.register_module("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    start = "<tool_call>"

    def parse_calls(self, text: str, start: int, final: bool) -> list[ParsedCall]:
        """Every `<function=...>` block closed so far, with its parameters."""
        calls = []
        for match in _FUNCTION.finditer(text, start):
            name = match.group(1).strip()
            arguments = {
                key.strip(): self._value(name, key.strip(), _strip_newline(raw))
                for key, raw in _PARAMETER.findall(match.group(2))
            }
            calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
        return calls

    def _value(self, function: str, parameter: str, raw: str) -> Any:
        kind = self.parameter_type(function, parameter)
        if kind == "string":
            return raw
        if raw.lower() == "null":
            return None
        for read in (json.loads, ast.literal_eval):
            try:
                return read(raw)
            except (ValueError, SyntaxError):
                continue
        return raw


def _strip_newline(raw: str) -> str:
    """The value between its tags, without the one newline each side the format adds."""
    return raw.removeprefix("\n").removesuffix("\n")

"""Pythonic calls (Llama 3.2 and 4, ToolACE): the whole output is a Python list of calls,
`[get_weather(city="Paris"), get_time(zone="UTC")]`, keyword arguments literal values;
Llama 4 may wrap it in `<|python_start|>`/`<|python_end|>`. The list is read once it
closes; output that does not parse as one is content (vLLM's `pythonic`)."""

from __future__ import annotations

import ast
import json
from typing import Any

from .abstract import ParsedCall, ToolParser, ToolParserManager

_OPEN, _CLOSE = "<|python_start|>", "<|python_end|>"


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):
    def find_start(self, text: str) -> int:
        at = len(text) - len(text.lstrip())
        return at if text.startswith(("[", _OPEN), at) else -1

    def undecided_from(self, text: str) -> int:
        rest = text.lstrip()
        return 0 if not rest or _OPEN.startswith(rest) else len(text)

    def parse_calls(self, text: str, start: int, final: bool) -> list[ParsedCall]:
        source = text[start:].strip().removeprefix(_OPEN).removesuffix(_CLOSE).strip()
        if not source.endswith("]"):
            return []
        try:
            tree = ast.parse(source, mode="eval").body
        except SyntaxError:
            return []
        if not isinstance(tree, ast.List):
            return []
        calls = [_call(node) for node in tree.elts]
        return [] if any(c is None for c in calls) else calls  # type: ignore[misc]


def _call(node: ast.expr) -> ParsedCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    if name is None:
        return None
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def _dotted(node: ast.expr) -> str | None:
    """`f` or `module.f` as a name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None

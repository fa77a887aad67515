"""Llama 3.1-3.3's JSON calls: the whole output is `{"name": ..., "parameters": {...}}`
(`"arguments"` is taken too), optionally after `<|python_tag|>`, several apart by `;`.
Output that does not begin that way is content (vLLM's `llama3_json`)."""

from __future__ import annotations

from .abstract import ParsedCall, ToolParser, ToolParserManager, arguments_json, json_objects

_PYTHON_TAG = "<|python_tag|>"


@ToolParserManager.register_module(["llama3_json", "llama4_json"])
class Llama3JsonToolParser(ToolParser):
    def find_start(self, text: str) -> int:
        at = len(text) - len(text.lstrip())
        return at if text.startswith(("{", _PYTHON_TAG), at) else -1

    def undecided_from(self, text: str) -> int:
        # Until the first non-space text shows whether the output is a call, hold it all.
        rest = text.lstrip()
        return 0 if not rest or _PYTHON_TAG.startswith(rest) else len(text)

    def parse_calls(self, text: str, start: int, final: bool) -> list[ParsedCall]:
        if text.startswith(_PYTHON_TAG, start):
            start += len(_PYTHON_TAG)
        values, _ = json_objects(text, start, ";")
        calls = []
        for v in values:
            if not isinstance(v, dict) or not isinstance(v.get("name"), str):
                break
            arguments = v.get("parameters", v.get("arguments", {}))
            calls.append(ParsedCall(v["name"], arguments_json(arguments)))
        return calls

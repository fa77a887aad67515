"""Mistral's calls after `[TOOL_CALLS]`: a JSON array of `{"name", "arguments"}` (tokenizers
before v11), or `name[ARGS]{...}` per call, each after its own `[TOOL_CALLS]` (v11 on).
Call ids are nine letters and digits, as Mistral's templates require."""

from __future__ import annotations

import json

from .abstract import (
    ParsedCall,
    ToolParser,
    ToolParserManager,
    alphanumeric_id,
    arguments_json,
    json_objects,
)

_ARGS = "[ARGS]"


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    start = "[TOOL_CALLS]"

    def new_call_id(self) -> str:
        return alphanumeric_id()

    def parse_calls(self, text: str, start: int, final: bool) -> list[ParsedCall]:
        body = text[start + len(self.start) :]
        if body.lstrip().startswith("["):
            at = len(body) - len(body.lstrip()) + 1
            values, _ = json_objects(body, at, ",")
            return [
                ParsedCall(v["name"], arguments_json(v.get("arguments", {})))
                for v in values
                if isinstance(v, dict) and isinstance(v.get("name"), str)
            ]
        return _args_calls(body.split(self.start))


def _args_calls(segments: list[str]) -> list[ParsedCall]:
    """`name[ARGS]{json}` (or `name{json}`) segments, each complete once its JSON parses."""
    calls = []
    for segment in segments:
        split = segment.find(_ARGS)
        if split < 0:
            split = segment.find("{")
            name, raw = segment[:split], segment[split:]
        else:
            name, raw = segment[:split], segment[split + len(_ARGS) :]
        if split < 0 or not name.strip():
            break
        try:
            arguments, _ = json.JSONDecoder().raw_decode(raw.strip())
        except json.JSONDecodeError:
            break
        calls.append(ParsedCall(name.strip(), arguments_json(arguments)))
    return calls

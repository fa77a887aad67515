"""The tool-call parser interface, and the registry `--tool-call-parser` names come from.

Owns what every parser answers about a choice's text: where its calls start
(`find_start`; the text before is content), how much of the text's end could still
grow into that start (`undecided_from`; a stream holds it back), and the calls that are
complete so far (`parse_calls`, in order; calls once returned stay the same as more text
arrives). Driving a parser over a stream is `ToolCallReader`'s (`jvllm.server.tools`);
each format is a module beside this one.

A user's own parser (`--tool-parser-plugin FILE`) is a file that subclasses `ToolParser`
and registers it with `@ToolParserManager.register_module("name")`, as in vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import secrets
import string
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str


class ToolParser:
    """Reads calls from free output. Subclasses set `start` (the text that opens the
    calls) or override `find_start`, and implement `parse_calls`."""

    start: ClassVar[str] = ""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        # name -> the function's definition ({"name", "description", "parameters"}).
        self.tools = {t["function"]["name"]: t["function"] for t in tools or []}

    def find_start(self, text: str) -> int:
        """Where the calls begin in `text`; -1 while none has begun."""
        return text.find(self.start) if self.start else -1

    def undecided_from(self, text: str) -> int:
        """The index from which `text` could still become the start of a call (its
        longest suffix that is a proper prefix of `start`); len(text) if none."""
        for keep in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def parse_calls(self, text: str, start: int, final: bool) -> list[ParsedCall]:
        """The complete calls in `text[start:]`, in order (`final`: no more text comes)."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def parameter_type(self, function: str, parameter: str) -> str | None:
        """The JSON schema type a function's parameter declares, if any."""
        schema = (self.tools.get(function) or {}).get("parameters") or {}
        prop = (schema.get("properties") or {}).get(parameter) or {}
        kind = prop.get("type")
        return kind if isinstance(kind, str) else None


def arguments_json(arguments: Any) -> str:
    """Arguments as OpenAI's JSON text (a string is taken to be JSON already)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def json_objects(text: str, at: int, separators: str) -> tuple[list[Any], int]:
    """The JSON values that follow each other in `text` from `at`, apart by any of
    `separators` (and whitespace); returns them and where the first incomplete one starts."""
    decoder, out = json.JSONDecoder(), []
    while True:
        i = at
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return out, at
        out.append(value)
        at = end


def alphanumeric_id(length: int = 9) -> str:
    """Mistral's call ids: nine letters and digits."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(length))


class ToolParserManager:
    """Parser classes by name (vLLM's `ToolParserManager`)."""

    tool_parsers: ClassVar[dict[str, type[ToolParser]]] = {}

    @classmethod
    def register_module(
        cls, name: str | list[str], force: bool = True
    ) -> Callable[[type[ToolParser]], type[ToolParser]]:
        names = [name] if isinstance(name, str) else list(name)

        def register(parser: type[ToolParser]) -> type[ToolParser]:
            if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
                raise TypeError(f"a tool parser must subclass ToolParser, got {parser!r}")
            for n in names:
                if not force and n in cls.tool_parsers:
                    raise KeyError(f"tool parser {n!r} is already registered")
                cls.tool_parsers[n] = parser
            return parser

        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.tool_parsers:
            raise ValueError(
                f"--tool-call-parser must be one of {sorted(cls.tool_parsers)} (or a name a "
                f"--tool-parser-plugin registers), got {name!r}"
            )
        return cls.tool_parsers[name]

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Runs a plugin file, whose `register_module` calls add its parsers."""
        path = Path(plugin_path)
        if not path.is_file():
            raise FileNotFoundError(f"--tool-parser-plugin {plugin_path!r} is not a file")
        module_name = f"jvllm_tool_parser_plugin_{path.stem}"
        if module_name in sys.modules:
            return
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)

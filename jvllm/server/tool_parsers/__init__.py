"""Tool-call parsers for `tool_choice: "auto"`, by `--tool-call-parser` name: hermes,
llama3_json (llama4_json), mistral, pythonic, qwen3_coder; `--tool-parser-plugin` adds a
user's own (see `abstract.py`)."""

from . import hermes, llama3_json, mistral, pythonic, qwen3_coder  # noqa: F401 (registers)
from .abstract import ParsedCall, ToolCall, ToolParser, ToolParserManager

__all__ = ["ParsedCall", "ToolCall", "ToolParser", "ToolParserManager"]

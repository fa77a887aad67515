"""OpenAI's Responses API (`POST /v1/responses`): the request body, the response object
and its output items, and the bounded store behind `previous_response_id`.

Owns the shapes (OpenAI's names: `input`, `instructions`, `max_output_tokens`, function
tools as `{"type": "function", "name", "parameters"}`, output items `message`,
`function_call` and `reasoning`) and turning `input` items into chat messages. Running
a request is `serving_responses.py`'s.
"""

from __future__ import annotations

import collections
import threading
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from .errors import APIError
from .protocol import MAX_BODY_BYTES, MAX_MESSAGES, MAX_TOOLS, Int64, StopString, Strict

# Responses kept for `previous_response_id` and GET /v1/responses/{id}; oldest dropped.
STORE_SIZE = 1024


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None


class ResponsesRequest(Strict):
    """POST /v1/responses (fields OpenAI has and vLLM's sampling extras)."""

    model: str | None = None
    input: (
        Annotated[str, Field(max_length=MAX_BODY_BYTES)]
        | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]
    ) = Field(description="A string, or a list of messages and function_call(_output) items")
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    seed: Int64 | None = None
    stop: list[StopString] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    user: str | None = None

    def tool_choice_echo(self) -> str | dict[str, Any]:
        """tool_choice as the response object repeats it (OpenAI's default: "auto")."""
        if isinstance(self.tool_choice, FunctionChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"

    def text_echo(self) -> dict[str, Any]:
        """`text` as the response object repeats it (plain text unless a format was set)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return {"format": {"type": "text"}}
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    """The `response` object (the body, and inside lifecycle events)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[dict[str, Any]] = Field(default_factory=list)
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    store: bool = True
    background: bool = False
    usage: ResponseUsage | None = None
    user: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [part] if status != "in_progress" else [],
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as chat messages: easy messages and `message` items (developer as
    system), a `function_call` item joining the assistant turn before it, a
    `function_call_output` item as a tool message; `reasoning` items are dropped."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, i))
        elif kind == "function_call":
            call = {
                "id": _text(item, "call_id", i),
                "type": "function",
                "function": {
                    "name": _text(item, "name", i),
                    "arguments": _text(item, "arguments", i),
                },
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item, "output", i)
            out.append(
                {"role": "tool", "tool_call_id": _text(item, "call_id", i), "content": output}
            )
        elif kind != "reasoning":
            raise APIError(
                400,
                f"input[{i}].type {kind!r} is not accepted: message, function_call, "
                "function_call_output or reasoning",
                param=f"input[{i}].type",
            )
    return out


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise APIError(
            400,
            f"input[{i}].role {role!r} is not accepted: user, system, developer or assistant",
            param=f"input[{i}].role",
        )
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
                raise APIError(
                    400,
                    f"input[{i}].content parts must be input_text or output_text",
                    param=f"input[{i}].content",
                )
            texts.append(_text(part, "text", i))
        content = "".join(texts)
    if not isinstance(content, str):
        raise APIError(400, f"input[{i}].content must be a string or a list of text parts")
    return {"role": "system" if role == "developer" else role, "content": content}


def _text(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"input[{i}].{key} must be a string", param=f"input[{i}].{key}")
    return value


class ResponseStore:
    """The last STORE_SIZE stored responses, each with its whole conversation."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._items: collections.OrderedDict[str, tuple[ResponseObject, list[dict]]]
        self._items = collections.OrderedDict()

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response.id] = (response, conversation)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[ResponseObject, list[dict[str, Any]]] | None:
        with self._lock:
            return self._items.get(response_id)

"""The event sequence of a streamed Responses API answer (OpenAI's event names).

Owns numbering the events (`sequence_number`) and the life of each output item: an item
opens (`response.output_item.added`, and `response.content_part.added` for a message or
reasoning item) when its first text arrives, takes deltas (`response.output_text.delta`,
`response.reasoning_text.delta`, `response.function_call_arguments.delta`), and closes
with its `.done` events and `response.output_item.done` when an item of another kind
begins or the output ends. The lifecycle events around them and the final response are
`serving_responses.py`'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .output_reader import OutputDelta
from .responses_protocol import (
    ResponseObject,
    call_item,
    message_item,
    new_id,
    reasoning_item,
)


class ResponseEvents:
    """The stream's events, numbered; items open when their first text arrives and
    close when the next kind of item begins or the output ends."""

    def __init__(self, in_progress: Callable[[], ResponseObject]) -> None:
        self.in_progress = in_progress  # the response object lifecycle events carry
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # completed items, in output order
        self.open: dict[str, Any] | None = None  # the item being written
        self.text = ""

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def lifecycle(self, kind: str) -> bytes:
        return self.event(kind, response=self.in_progress().model_dump(mode="json"))

    def deltas(self, delta: OutputDelta) -> list[bytes]:
        out: list[bytes] = []
        if delta.reasoning:
            out += self._write("reasoning", delta.reasoning)
        if delta.content:
            out += self._write("message", delta.content)
        for call in delta.calls:
            out += self._close()
            item = call_item(new_id("fc"), call.id, call.name, "", "in_progress")
            out += self._add(item)
            if call.arguments:
                out += self._write("function_call", call.arguments)
        if delta.arguments:
            out += self._write("function_call", delta.arguments)
        return out

    def close_all(self) -> list[bytes]:
        out = self._close()
        if not self.items:  # nothing at all was generated: an empty message
            out += self._write("message", "") + self._close()
        return out

    def _write(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            out += self._add(_new_item(kind))
        self.text += text
        item, index = self.open, len(self.items)
        assert item is not None
        ids = {"item_id": item["id"], "output_index": index}
        if kind == "function_call":
            return out + [self.event("response.function_call_arguments.delta", delta=text, **ids)]
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra = {"logprobs": []} if kind == "message" else {}
        return out + [self.event(name, content_index=0, delta=text, **ids, **extra)]

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self.open, self.text = item, ""
        index = len(self.items)
        out = [self.event("response.output_item.added", output_index=index, item=item)]
        if item["type"] in ("message", "reasoning"):
            part_type = "output_text" if item["type"] == "message" else "reasoning_text"
            part = {"type": part_type, "text": ""}
            if part_type == "output_text":
                part |= {"annotations": [], "logprobs": []}
            out.append(self._part_event("added", item, index, part))
        return out

    def _part_event(self, when: str, item: dict, index: int, part: dict) -> bytes:
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return self.event(f"response.content_part.{when}", part=part, **ids)

    def _close(self) -> list[bytes]:
        item, index, text = self.open, len(self.items), self.text
        if item is None:
            return []
        self.open = None
        ids = {"item_id": item["id"], "output_index": index}
        kind = item["type"]
        if kind == "function_call":
            done = call_item(item["id"], item["call_id"], item["name"], text, "completed")
            out = [self.event("response.function_call_arguments.done", arguments=text, **ids)]
        elif kind == "message":
            done = message_item(item["id"], text, "completed")
            out = [
                self.event(
                    "response.output_text.done", content_index=0, text=text, logprobs=[], **ids
                )
            ]
            out.append(self._part_event("done", item, index, done["content"][0]))
        else:
            done = reasoning_item(item["id"], text, "completed")
            out = [self.event("response.reasoning_text.done", content_index=0, text=text, **ids)]
            out.append(self._part_event("done", item, index, done["content"][0]))
        self.items.append(done)
        return out + [self.event("response.output_item.done", output_index=index, item=done)]


def _new_item(kind: str) -> dict[str, Any]:
    if kind == "message":
        return message_item(new_id("msg"), "", "in_progress")
    assert kind == "reasoning"
    return reasoning_item(new_id("rs"), "", "in_progress")

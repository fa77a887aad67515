"""OpenAI's error envelope, and the one exception type handlers raise to produce it.

Owns what a client sees when something goes wrong: `{"error": {"message", "type",
"param", "code"}}` with the right HTTP status. Messages are cleaned so that no
traceback, object repr or memory address ever leaves the server, and capped in
length because they may quote user input.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse

# OpenAI's `type` for each status we send.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}
_MAX_MESSAGE_CHARS = 500
_ADDRESS = re.compile(r"\s*\bat 0x[0-9a-fA-F]+")


class APIError(Exception):
    """An error with an HTTP status that handlers raise; the app renders the envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def envelope(self) -> dict[str, Any]:
        return error_envelope(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.envelope(), status_code=self.status, headers=self.headers)


def clean_message(message: str) -> str:
    """Drops memory addresses and tracebacks, and caps the length."""
    message = message.split("Traceback (most recent call last)")[0]
    message = _ADDRESS.sub("", message).strip()
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[: _MAX_MESSAGE_CHARS - 3] + "..."
    return message or "invalid request"


def error_envelope(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": clean_message(message),
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def sse_error(error: APIError) -> bytes:
    """The envelope as one server-sent event, for errors after a stream began."""
    return f"data: {json.dumps(error.envelope())}\n\n".encode()


def from_validation_error(error: ValidationError, model: type[BaseModel]) -> APIError:
    """The first few pydantic errors as `loc: msg` (never the offending input itself).

    A field that takes a union of types fails once per member. Those errors collapse
    into one: a member whose type matched but whose value broke a limit (too long,
    out of range) explains best; if no member's type matched, the line names the
    accepted forms (the field's description)."""
    specific: dict[str, str] = {}
    mismatch: dict[str, str] = {}
    for detail in error.errors(include_url=False, include_input=False):
        loc = _union_loc(detail["loc"])
        key = ".".join(str(p) for p in loc) or "body"
        if len(loc) == len(detail["loc"]) or not detail["type"].endswith("_type"):
            specific.setdefault(key, detail["msg"])
        else:
            field = model.model_fields.get(str(loc[0])) if len(loc) == 1 else None
            accepted = f" ({field.description})" if field and field.description else ""
            mismatch.setdefault(key, f"Input does not match any accepted form{accepted}")
    parts = {**mismatch, **specific}
    shown = list(parts.items())[:3]
    message = "; ".join(f"{loc}: {msg}" for loc, msg in shown)
    if len(parts) > len(shown):
        message += f" (and {len(parts) - len(shown)} more)"
    return APIError(400, message, param=shown[0][0], code="invalid_value")


# Tags pydantic puts in an error location for the union member that failed.
_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _union_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """Cuts a location at its first union-member tag (`str`, `list[int]`, `constrained-str`)."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and (not part.isidentifier() or part in _MEMBER_TAGS):
            return loc[:i]
    return loc

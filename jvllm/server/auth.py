"""API-key check, as ASGI middleware in front of the router.

Owns one decision: does this HTTP request carry `Authorization: Bearer <key>` (or, as
Anthropic's clients send it, `x-api-key: <key>` alone)? It is
default-deny: every path needs the key except an exact allow-list (health, metrics,
version, the OpenAPI document). It reads the decoded path the router itself matches
(`scope["path"]` less any `--root-path`, through Starlette's own function), never the
Host header or the raw URL, so `//v1/...`, `/health/../v1`,
absolute-form targets and Host tricks cannot slip a routed path past it (a path that
is not exactly on the list needs the key, even if it then 404s). The comparison is
constant-time.
"""

from __future__ import annotations

import hmac

# The router's own path function: the allow-list must match exactly what it routes.
from starlette._utils import get_route_path as route_path
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_envelope
from .messages_protocol import MESSAGES_PATHS, anthropic_error

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS):
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._key = api_key.encode()
        self._open = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in self._open or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        message = "Missing or invalid API key: send Authorization: Bearer <key>"
        anthropic = route_path(scope) in MESSAGES_PATHS
        response = JSONResponse(
            anthropic_error(401, message) if anthropic else error_envelope(401, message),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        values = [v for k, v in scope["headers"] if k.lower() == b"authorization"]
        keys = [v for k, v in scope["headers"] if k.lower() == b"x-api-key"]
        # Two keys are ambiguous: refuse rather than pick one.
        if len(values) + len(keys) != 1:
            return False
        if values:
            return hmac.compare_digest(values[0], self._expected)
        return hmac.compare_digest(keys[0], self._key)

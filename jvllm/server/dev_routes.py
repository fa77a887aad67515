"""The development routes of a training job (vLLM's, behind `VLLM_SERVER_DEV_MODE=1` or
`--enable-dev-routes`): sleep and wake-up, pause and resume, the prefix-cache reset,
`collective_rpc`, and new weights from a checkpoint directory.

Owns the HTTP side of each: query and body parsing, the status codes (400 for a bad
value, 409 for an engine that is not in the state the call needs) and the JSON
answers. What each does is `jvllm.weight_sync.EngineControl`'s (run on the engine thread
through `AsyncLLM.call`) and `AsyncLLM`'s pause. Without the flag the routes do not
exist (404); with it they sit behind the API key like every other non-open route.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax
from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine.pause import check_pause_mode
from jvllm.weight_sync import control_of

from .errors import APIError
from .serving import ServingContext, parse_body

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def dev_mode_enabled(flag: bool) -> bool:
    """`--enable-dev-routes`, or vLLM's environment variable set to 1."""
    return flag or os.environ.get(DEV_MODE_ENV, "0") == "1"


class CollectiveRPCRequest(BaseModel):
    method: str
    timeout: float | None = None
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class UpdateWeightsRequest(BaseModel):
    model_path: str  # a checkpoint directory on the server's machine
    weight_version: str | int | None = None


def _query_bool(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() not in ("true", "false", "1", "0"):
        raise APIError(400, f"{name} must be true or false, got {value!r}", param=name)
    return value.lower() in ("true", "1")


async def _engine_call(engine: AsyncLLM, fn: Any) -> Any:
    """`fn(engine)` on the engine thread; its errors as 400 (bad value) or 409 (state)."""
    try:
        return await engine.call(fn)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise APIError(400, str(e)) from None
    except RuntimeError as e:
        raise APIError(409, str(e), code="conflict") from None


def dev_routes(ctx: ServingContext) -> list[Route]:
    engine = ctx.engine

    async def sleep(request: Request) -> Response:
        raw = request.query_params.get("level", "1")
        if raw not in ("0", "1", "2"):
            raise APIError(400, f"level must be 0, 1 or 2, got {raw!r}", param="level")
        mode = request.query_params.get("mode", "abort")
        try:
            check_pause_mode(mode)
        except ValueError as e:
            raise APIError(400, str(e), param="mode") from None
        if mode == "keep" and raw != "0":
            raise APIError(
                400,
                f"mode=keep keeps requests whose KV blocks level {raw} drops; use abort or wait",
                param="mode",
            )
        await engine.pause_generation(mode=mode, clear_cache=False)
        await _engine_call(engine, lambda e: control_of(e).sleep(int(raw)))
        return Response(status_code=200)

    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        await _engine_call(engine, lambda e: control_of(e).wake_up(tags))
        if tags is None or "scheduling" in tags:
            await engine.resume_generation()
        return Response(status_code=200)

    async def is_sleeping(request: Request) -> Response:
        asleep = await engine.call(lambda e: control_of(e).is_sleeping())
        return JSONResponse({"is_sleeping": asleep})

    async def reset_prefix_cache(request: Request) -> Response:
        done = await engine.call(lambda e: control_of(e).reset_prefix_cache())
        if not done:
            raise APIError(409, "requests hold KV blocks; pause first", code="conflict")
        return Response(status_code=200)

    async def collective_rpc(request: Request) -> Response:
        req = await parse_body(request, CollectiveRPCRequest, ctx.max_body_bytes)
        call = lambda e: control_of(e).collective_rpc(
            req.method, req.timeout, tuple(req.args), req.kwargs
        )
        results = await _engine_call(engine, call)
        return JSONResponse({"results": [_jsonable(r) for r in results]})

    async def pause(request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        clear_cache = _query_bool(request, "clear_cache", True)
        try:
            check_pause_mode(mode)
        except ValueError as e:
            raise APIError(400, str(e), param="mode") from None
        await engine.pause_generation(mode=mode, clear_cache=clear_cache)
        return JSONResponse({"status": "paused"})

    async def resume(request: Request) -> Response:
        await engine.resume_generation()
        return JSONResponse({"status": "resumed"})

    async def is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": await engine.is_paused()})

    async def update_weights(request: Request) -> Response:
        req = await parse_body(request, UpdateWeightsRequest, ctx.max_body_bytes)

        def swap(e: Any) -> int:
            control = control_of(e)
            control.start_weight_update()
            try:
                return control.memory.update_weights(req.model_path)
            finally:
                control.finish_weight_update(req.weight_version)

        count = await _engine_call(engine, swap)
        return JSONResponse({"status": "updated", "num_tensors": count})

    async def weight_info(request: Request) -> Response:
        return JSONResponse(await engine.call(_weight_info))

    return [
        Route("/sleep", sleep, methods=["POST"]),
        Route("/wake_up", wake_up, methods=["POST"]),
        Route("/is_sleeping", is_sleeping, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/collective_rpc", collective_rpc, methods=["POST"]),
        Route("/pause", pause, methods=["POST"]),
        Route("/resume", resume, methods=["POST"]),
        Route("/is_paused", is_paused, methods=["GET"]),
        Route("/update_weights", update_weights, methods=["POST"]),
        Route("/weight_info", weight_info, methods=["GET"]),
    ]


def _weight_info(engine: Any) -> dict[str, Any]:
    """The weights' version, tensor and parameter counts and dtypes (engine thread)."""
    control = control_of(engine)
    if hasattr(control, "weight_info"):  # the engine runs in engine-core processes
        return control.weight_info()
    leaves = jax.tree.leaves(engine.runner.model.params)
    return {
        "weight_version": control.get_weight_version(),
        "num_tensors": len(leaves),
        "num_parameters": sum(math.prod(x.shape) for x in leaves),
        "dtypes": sorted({str(x.dtype) for x in leaves}),
        "is_sleeping": control.is_sleeping(),
    }


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value

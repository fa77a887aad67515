"""What the completions and chat handlers share: the model check, the room a request
leaves for max_tokens, SamplingParams from a request (the model's generation_config defaults
filling what it leaves unset), and submitting prompts to the engine (logged with
`--enable-log-requests`).

Owns turning engine and validation exceptions into API errors (400, 404, 503) before
any response has started, so a bad request never reaches the engine half-submitted.
Checks that need the model (vocabulary, empty prompts, context length) are the
engine's (`jvllm.engine.validation`): its `InvalidRequestError` becomes a 400 with
that error's `param`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from jvllm.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    QueueFullError,
    RequestAbortedError,
    RequestStream,
)
from jvllm.engine.validation import InvalidRequestError
from jvllm.generation_config import RequestDefaults
from jvllm.lora.request import LoRARequest
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

from .errors import APIError, from_validation_error
from .lora import ServedLoRAs
from .protocol import SamplingRequest
from .responses import Usage
from .responses_protocol import ResponseStore
from .streaming import ClientDisconnected, final_outputs, until_disconnected
from .structured import constraint_arguments

logger = logging.getLogger("jvllm.server")
M = TypeVar("M", bound=BaseModel)
# Seconds a client is told to wait when the queue is full.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Prompt:
    text: str | None  # None for a token prompt: the engine validates its ids first
    token_ids: list[int]
    # Image URLs of the messages' image_url parts: the engine's processor loads them and
    # expands their placeholders in `text` (token_ids then count no image tokens).
    images: tuple[str, ...] = ()

    def engine_input(self) -> dict[str, Any]:
        if self.images:
            return {"prompt": self.text, "multi_modal_data": {"image": list(self.images)}}
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


@dataclass
class ServingContext:
    """Everything a handler needs besides its request."""

    engine: AsyncLLM
    served_model_names: list[str]
    model_path: str
    is_demo: bool = False
    max_body_bytes: int = 4 << 20
    defaults: RequestDefaults = field(default_factory=RequestDefaults)
    chat_template: str | None = None  # None: the tokenizer's
    response_role: str = "assistant"
    log_requests: bool = False
    max_log_len: int | None = None  # prompt characters and ids a request log line shows
    return_tokens_as_token_ids: bool = False
    tool_call_parser: str | None = None  # set with --enable-auto-tool-choice: "auto" works
    reasoning_parser: str | None = None  # --reasoning-parser: thinking text apart from content
    response_store: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses
    loras: ServedLoRAs | None = None  # LoRA adapters served by name (--enable-lora)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if requested is None:
            return self.served_model_names[0]
        if self.loras is not None and self.loras.get(requested) is not None:
            return requested
        if requested not in self.served_model_names:
            raise APIError(
                404,
                f"The model `{requested}` does not exist; this server serves "
                f"{', '.join(self.served_model_names)}",
                param="model",
                code="model_not_found",
            )
        return requested

    def max_tokens_for(self, prompt: Prompt, requested: int | None, explicit: bool) -> int:
        """`requested` if it fits the context; the room left when not given explicitly.
        A prompt with no room at all is the engine's to refuse."""
        n = len(prompt.token_ids)
        limit = self.engine.max_model_len
        if not explicit and "max_tokens" in self.defaults.sampling:
            requested = self.defaults.sampling["max_tokens"]
        if n >= limit:
            return requested or 1
        if requested is None or (not explicit and n + requested > limit):
            return limit - n
        if n + requested > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens, but you requested "
                f"{n + requested} tokens ({n} in the prompt, {requested} to generate)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a request's (checked) model name chooses; None: the base model."""
        return self.loras.get(model) if self.loras is not None else None

    async def submit(
        self,
        prefix: str,
        prompts: list[Prompt],
        params: list[SamplingParams],
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestStream]:
        """Adds every prompt (with `lora_request`'s adapter), or none: a failure aborts
        those already added."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                if self.log_requests:
                    self._log_request(rid, prompt, p)
                stream = await self.engine.add_request(
                    rid, prompt.engine_input(), p, priority, lora_request
                )
                streams.append(stream)
        except BaseException as e:
            for stream in streams:
                stream.close()
            raise engine_error(e) from None
        return streams

    def _log_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        n = self.max_log_len
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
            request_id,
            None if prompt.text is None else prompt.text[:n],
            params,
            prompt.token_ids[:n],
        )

    def prompt_text(self, prompt: Prompt) -> str:
        """A prompt's text; a token prompt's decoded (once the engine accepted its ids)."""
        return self.tokenizer.decode(prompt.token_ids) if prompt.text is None else prompt.text

    def token_text(self, token_id: int, text: str) -> str:
        """How a logprobs entry names a token (`--return-tokens-as-token-ids`)."""
        return f"token_id:{token_id}" if self.return_tokens_as_token_ids else text


async def collect(request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
    """The final output of each stream; None if the client left first (the requests are
    then aborted). Engine failures become API errors."""
    try:
        return await until_disconnected(request.receive, final_outputs(streams))
    except ClientDisconnected:
        return None
    except Exception as e:
        raise engine_error(e) from None
    finally:
        for stream in streams:
            stream.close()


def engine_error(e: BaseException) -> BaseException:
    """The API error for an exception from AsyncLLM (others pass through)."""
    if isinstance(e, QueueFullError):
        return APIError(
            503,
            "The server is at capacity (the request queue is full); retry later",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    if isinstance(e, RequestAbortedError):
        return APIError(503, f"The request was aborted: {e}", code="aborted")
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), param=e.param, code=e.code)
    if isinstance(e, ValueError):
        return APIError(400, str(e), code="invalid_value")
    return e


def stream_error(e: Exception) -> APIError:
    """The error event for an exception raised after a stream began."""
    error = engine_error(e)
    if isinstance(error, APIError):
        return error
    logger.error("error while streaming a response", exc_info=e)
    return APIError(500, "Internal error while streaming", code="internal_error")


def sampling_params(
    req: SamplingRequest, max_tokens: int, defaults: RequestDefaults, **extra: Any
) -> SamplingParams | BeamSearchParams:
    """SamplingParams from the shared request fields, the model's defaults filling those
    left unset (BeamSearchParams with `use_beam_search`); 400 names the bad field."""
    constraints = constraint_arguments(req)
    if req.use_beam_search:
        return beam_search_params(req, max_tokens, {**constraints, **extra})
    kwargs: dict[str, Any] = dict(
        **constraints,
        n=req.n,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        seed=req.seed,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        # As vLLM's server: a response that is not streamed asks for its final output
        # only (AsyncLLM wakes its reader once, not every step).
        output_kind=RequestOutputKind.CUMULATIVE if req.stream else RequestOutputKind.FINAL_ONLY,
        **extra,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is None:
            value = defaults.sampling.get(name)
        if value is not None:
            kwargs[name] = value
    try:
        params = SamplingParams(**kwargs)
        defaults.check_logprobs(params)
        return params
    except ValueError as e:
        message = str(e).removeprefix("SamplingParams.")
        raise APIError(400, message, param=message.split(" ")[0], code="invalid_value") from None


# Fields a beam search cannot honour, with the values that leave them off.
_NOT_WITH_BEAM_SEARCH = {
    "top_p": (None, 1.0),
    "top_k": (None, -1, 0),
    "min_p": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "stop": (None, []),
    "stop_token_ids": (None, []),
    "min_tokens": (0,),
    "logit_bias": (None, {}),
}


def beam_search_params(
    req: SamplingRequest, max_tokens: int, extra: dict[str, Any]
) -> BeamSearchParams:
    """vLLM's `use_beam_search`: `n` beams; sampling knobs a beam search cannot honour
    are refused by name rather than ignored."""
    for name, off in _NOT_WITH_BEAM_SEARCH.items():
        if getattr(req, name) not in off:
            raise APIError(400, f"{name} cannot be combined with use_beam_search", param=name)
    for name, value in extra.items():
        if value is not None:
            raise APIError(400, f"{name} cannot be combined with use_beam_search", param=name)
    try:
        return BeamSearchParams(
            beam_width=req.n,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            temperature=req.temperature or 0.0,
            length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as e:
        message = str(e).removeprefix("BeamSearchParams.")
        field = {"beam_width": "n"}.get(message.split(" ")[0], message.split(" ")[0])
        raise APIError(400, message, param=field, code="invalid_value") from None


def usage(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt + completion
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=total)


async def parse_body(request: Request, model: type[M], max_bytes: int) -> M:
    """Reads (capped), decodes and validates a JSON body: 413 or 400 on failure."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise _too_large(max_bytes) if declared.isdigit() else APIError(400, "bad Content-Length")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        detail = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise APIError(400, f"The body is not valid JSON: {detail}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "The body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"The body must be a JSON object, got {_json_type(data)}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e, model) from None


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The body is larger than {max_bytes} bytes", code="body_too_large")


def _json_type(value: object) -> str:
    names = {str: "a string", list: "an array", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def now() -> int:
    return int(time.time())

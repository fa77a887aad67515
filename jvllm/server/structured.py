"""Constrained decoding fields of a request: `response_format` (OpenAI's), vLLM's
`structured_outputs`, `logit_bias`, `allowed_token_ids` and `bad_words`, as
SamplingParams arguments; legacy `guided_*` fields are refused naming their replacement.

Owns the 400s for what a request body can get wrong here (both constraint fields at
once, a logit_bias key that is not a token id); the grammar itself is compiled, and
its errors reported, when the request is added (`AsyncLLM.add_request`).
"""

from __future__ import annotations

from typing import Any

from jvllm.sampling_params import StructuredOutputsParams

from .errors import APIError
from .protocol import LEGACY_GUIDED, SamplingRequest


def constraint_arguments(req: SamplingRequest) -> dict[str, Any]:
    """SamplingParams keyword arguments for the request's biases, bans and constraint."""
    for name, replacement in LEGACY_GUIDED.items():
        if getattr(req, name) is not None:
            raise APIError(400, f"{name} is no longer supported; use {replacement}", param=name)
    kwargs: dict[str, Any] = {}
    if req.logit_bias:
        kwargs["logit_bias"] = _logit_bias(req.logit_bias)
    if req.allowed_token_ids is not None:
        kwargs["allowed_token_ids"] = req.allowed_token_ids
    if req.bad_words:
        kwargs["bad_words"] = req.bad_words
    spec = structured_outputs(req)
    if spec is not None:
        kwargs["structured_outputs"] = spec
    return kwargs


def structured_outputs(req: SamplingRequest) -> StructuredOutputsParams | None:
    fmt, body = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and body is not None:
        raise APIError(
            400, "give response_format or structured_outputs, not both", param="response_format"
        )
    try:
        if body is not None:
            return StructuredOutputsParams(
                json=body.json_,
                regex=body.regex,
                choice=body.choice,
                grammar=body.grammar,
                json_object=body.json_object,
            )
    except ValueError as e:
        raise APIError(400, str(e), param="structured_outputs") from None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(
            400,
            'response_format of type "json_schema" needs json_schema.schema',
            param="response_format",
        )
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise APIError(
                400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            )
        if not -100.0 <= value <= 100.0:
            raise APIError(
                400, f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias"
            )
        out[int(key)] = value
    return out

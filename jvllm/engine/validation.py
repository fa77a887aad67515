"""Request validation against the model: the one place these checks live.

Owns the checks that need the model (every token id inside the vocabulary, a prompt
that holds a token, a prompt short enough to leave room for one generated token) and
the exception they raise. `SamplingParams` checks its own knobs; the LLM engine calls
`validate_request` before a request enters it; the server maps `InvalidRequestError`
to a 400 whose `param` is the field named here; the scheduler only asserts what this
module guaranteed. Host only: imports nothing of jvllm but `SamplingParams`.
"""

from __future__ import annotations

from collections.abc import Sequence

from jvllm.sampling_params import SamplingParams


class InvalidRequestError(ValueError):
    """A request the model cannot serve; `param` names the bad field, `code` the reason."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Every id in [0, vocab_size), or InvalidRequestError naming `param`."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"{param} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
            param,
        )


def validate_request(
    text: str | None,
    ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
) -> None:
    """Whether a tokenized prompt (`text`: None for a token prompt) and its parameters
    fit the model; raises InvalidRequestError otherwise."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"params must be SamplingParams, got {type(params).__name__}", "params"
        )
    if text == "":
        raise InvalidRequestError("prompt is empty: it must hold at least one character", "prompt")
    if not ids:
        raise InvalidRequestError("prompt is empty: it must hold at least one token", "prompt")
    check_token_ids(ids, vocab_size, "prompt")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {len(ids)} tokens but max_model_len is {max_model_len}: "
            "it must be shorter, to leave room for at least one generated token",
            "prompt",
            code="context_length_exceeded",
        )
    check_token_ids(params.stop_token_ids or (), vocab_size, "stop_token_ids")
    check_token_ids(list(params.logit_bias or ()), vocab_size, "logit_bias")
    check_token_ids(params.allowed_token_ids or (), vocab_size, "allowed_token_ids")


def check_priority(priority: int, scheduling_policy: str) -> None:
    """A request's priority: an int, and other than 0 only under the priority policy."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority must be an int, got {priority!r}", "priority")
    if priority != 0 and scheduling_policy != "priority":
        raise InvalidRequestError(
            f"got priority {priority}, but scheduling_policy is {scheduling_policy!r}; "
            "start the engine with scheduling_policy='priority' to use priorities",
            "priority",
        )

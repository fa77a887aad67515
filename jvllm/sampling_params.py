"""SamplingParams: how one request's tokens are chosen and when it stops.

Owns validation of every user-facing sampling knob (vLLM's names and defaults).
Checks that need the model (vocabulary size, context length) live in the engine.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json as jsonlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Largest number of top logprobs a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# Top logprobs the sampler computes per row: MAX_LOGPROBS for users, and the
# (1 + number of EOS ids) * beam_width candidates a beam proposes each step.
NUM_TOP_CANDIDATES = 32
# Widest beam search (`BeamSearchParams.beam_width`).
MAX_BEAM_WIDTH = 8
# Greedy sampling is used below this temperature (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


# The sampler's per-request constants, one float64 field each (top_k 0 for off,
# want_logprobs 1.0 or 0.0): `SamplingParams.sampler_constants` is one such record, and
# the sampler's `SamplingMetadata` has a column of each name.
SAMPLER_CONSTANTS = np.dtype(
    [
        (name, np.float64)
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "want_logprobs",
        )
    ]
)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrains a request's output to a JSON schema, any JSON object, a regex, one of
    a list of strings, or a grammar (Lark, or GBNF as llama.cpp writes it): exactly
    one of them (vLLM's `StructuredOutputsParams`)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # The constraint starts after these tokens (a reasoning model's `</think>`): the
    # server sets them with --reasoning-parser, as vLLM starts the grammar where
    # reasoning ends. Not part of the grammar, so not of `cache_key`.
    reasoning_end_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        ends = self.reasoning_end_token_ids
        if ends is not None and (
            not isinstance(ends, tuple) or not ends or not all(isinstance(t, int) for t in ends)
        ):
            raise ValueError(
                "StructuredOutputsParams.reasoning_end_token_ids must be a non-empty tuple of "
                "token ids or None"
            )
        kinds = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "StructuredOutputsParams takes exactly one of json, regex, choice, grammar "
                f"and json_object, got {kinds or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError("StructuredOutputsParams.json must be a JSON schema (str or dict)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("StructuredOutputsParams.choice must be a list of non-empty strings")
        if self.json_object not in (None, True, False):
            raise ValueError("StructuredOutputsParams.json_object must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @functools.cached_property
    def cache_key(self) -> str:
        """Equal for specs that compile to the same grammar (serialised once per spec)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict | list | tuple):
            value = jsonlib.dumps(value, sort_keys=True)
        return f"{self.kind}:{value}"


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class RequestOutputKind(enum.IntEnum):
    """What each of a request's outputs holds (vLLM's): everything so far (CUMULATIVE),
    what is new since the last output (DELTA: new token ids, logprobs and text, text
    that could still turn out to start a stop string held back until it cannot), or
    only the finished result (FINAL_ONLY: one output per request)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters, validated on construction."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Added to the logits before sampling, by token id; -100 all but bans, +100 all but
    # forces (OpenAI's range). The raw logprobs returned do not include it, as in vLLM.
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words never generated: a word's last token is banned wherever the output so far
    # ends with the rest of it (with and without a leading space, as vLLM tokenizes it).
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @functools.cached_property
    def uses_penalties(self) -> bool:
        """Cached, as `sampler_constants`: asked of every row each step."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @functools.cached_property
    def sampler_constants(self) -> bytes:
        """This request's `SAMPLER_CONSTANTS` record, as bytes: a step joins its rows'
        records and reads them as one structured array (`np.frombuffer`), 20x faster
        than converting each row's numbers. Cached: asked of every row each step, and a
        request's parameters do not change once it is submitted (`clone` makes new ones)."""
        values = (
            self.temperature,
            self.top_p,
            max(self.top_k, 0),  # -1 (off) on the host is 0 on the device
            self.min_p,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.logprobs is not None,
        )
        return np.array(values, SAMPLER_CONSTANTS).tobytes()

    def clone(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def _validate(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(
                f"SamplingParams.{name} must be {expected}, got {getattr(self, name)!r}"
            )

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise bad("top_k", "-1 (disabled) or an integer >= 1")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2.0 <= value <= 2.0:
                raise bad(name, "in [-2, 2]")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a finite number > 0")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"None or an integer in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        if isinstance(self.output_kind, bool) or self.output_kind not in tuple(RequestOutputKind):
            raise bad("output_kind", "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        self.output_kind = RequestOutputKind(self.output_kind)
        self._validate_biases(bad)

    def _validate_biases(self, bad: Callable[[str, str], ValueError]) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                not _token_id(t) or not _finite(v) or not -100.0 <= v <= 100.0
                for t, v in self.logit_bias.items()
            ):
                raise bad("logit_bias", "a dict of token id -> bias in [-100, 100]")
            self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list | tuple) or not ids or not all(map(_token_id, ids)):
                raise bad("allowed_token_ids", "a non-empty list of token ids")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, list | tuple) or any(
                not isinstance(w, str) or not w.strip() for w in words
            ):
                raise bad("bad_words", "a list of non-blank strings")
            self.bad_words = list(words) or None
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "StructuredOutputsParams or None")


@dataclass(frozen=True)
class BeamSearchParams:
    """One beam search request (vLLM's `BeamSearchParams`), run by `LLM.beam_search`.

    Follows Transformers' `generate(num_beams=beam_width, do_sample=False)`: scores are
    cumulative log-probabilities divided by `generated_length ** length_penalty`, and
    `early_stopping` is its rule (False: stop once no running beam can beat the worst of
    `beam_width` finished ones at the current length; True: stop at `beam_width` finished;
    "never": as False, but judged at max_tokens when length_penalty > 0).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(
                f"BeamSearchParams.{name} must be {expected}, got {getattr(self, name)!r}"
            )

        width = self.beam_width
        if isinstance(width, bool) or not isinstance(width, int) or not 0 < width <= MAX_BEAM_WIDTH:
            raise bad("beam_width", f"an integer in [1, {MAX_BEAM_WIDTH}]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if not _finite(self.temperature) or self.temperature != 0.0:
            raise bad("temperature", "0 (beam search here is deterministic; sample with n instead)")
        if not _finite(self.length_penalty):
            raise bad("length_penalty", "a finite number")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise bad("early_stopping", 'False, True or "never"')
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool")


def _token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

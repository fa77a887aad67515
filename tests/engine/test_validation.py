"""The request validator: each bad request raises InvalidRequestError naming its field."""

from __future__ import annotations

import pytest

from jvllm.engine.validation import InvalidRequestError, check_token_ids, validate_request
from jvllm.sampling_params import SamplingParams

VOCAB, MAX_LEN = 100, 8


@pytest.mark.parametrize(
    "text, ids, params, param, match",
    [
        ("", [1], SamplingParams(), "prompt", "prompt is empty"),
        (None, [], SamplingParams(), "prompt", "prompt is empty"),
        (None, [1, 100], SamplingParams(), "prompt", r"outside the vocabulary \[0, 100\): \[100\]"),
        (None, [-1], SamplingParams(), "prompt", "outside the vocabulary"),
        ("x", list(range(8)), SamplingParams(), "prompt", "8 tokens but max_model_len is 8"),
        (None, [1], SamplingParams(stop_token_ids=[100]), "stop_token_ids", "outside"),
        (None, [1], {"temperature": 0}, "params", "params must be SamplingParams, got dict"),
    ],
)
def test_bad_requests_name_their_field(text, ids, params, param, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        validate_request(text, ids, params, VOCAB, MAX_LEN)
    assert info.value.param == param and isinstance(info.value, ValueError)


def test_context_length_has_its_own_code():
    with pytest.raises(InvalidRequestError) as info:
        validate_request(None, [1] * MAX_LEN, SamplingParams(), VOCAB, MAX_LEN)
    assert info.value.code == "context_length_exceeded"


def test_good_request_passes():
    validate_request("hi", [1] * (MAX_LEN - 1), SamplingParams(stop_token_ids=[99]), VOCAB, MAX_LEN)
    check_token_ids([0, 99], VOCAB, "tokens")

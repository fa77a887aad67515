"""Property-based fuzzing from /openapi.json with schemathesis (when it is installed):
valid and invalid requests generated for every documented operation never get a 5xx,
and the server is idle and healthy afterwards."""

from __future__ import annotations

import httpx
import pytest

from tests.server import API_KEY, SMALL_ENGINE, ServerProcess, auth_headers, wait_idle

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

EXAMPLES_PER_OPERATION = 40


@pytest.fixture(scope="module")
def server(checkpoints):
    # Short generations: fuzzed max_tokens would otherwise fill the whole context.
    args = [str(checkpoints["llama"]), "--api-key", API_KEY, *SMALL_ENGINE]
    proc = ServerProcess([*args, "--max-model-len", "64", "--max-request-body-bytes", "65536"])
    try:
        proc.wait_ready()
        yield proc.url
    finally:
        proc.stop()


def fuzz(operation, base_url: str, failures: list[str]) -> None:
    """Sends generated requests, valid and invalid, to one operation; records any 5xx."""
    modes = schemathesis.GenerationMode
    strategy = operation.as_strategy(generation_mode=modes.POSITIVE) | operation.as_strategy(
        generation_mode=modes.NEGATIVE
    )

    @hypothesis.settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(case=strategy)
    def check(case) -> None:
        response = case.call(base_url=base_url, headers=auth_headers(), timeout=30)
        if response.status_code >= 500:
            failures.append(f"{operation.label}: {response.status_code} {response.text[:200]}")

    check()


def test_no_5xx_for_generated_requests(server):
    schema = schemathesis.openapi.from_url(server + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 7
    failures: list[str] = []
    for operation in operations:
        fuzz(operation, server, failures)
    assert not failures, failures[:5]
    assert httpx.get(server + "/health").status_code == 200
    assert wait_idle(server, timeout=30)["vllm:kv_cache_usage_perc"] == 0

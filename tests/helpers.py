"""Helpers shared by the end-to-end tests: prompts, a mix of sampling parameters covering
the sampler's paths, and logprob comparison. Transformers' greedy reference is
`jvllm.testing`'s (`hf_greedy`, the one the pytest plugin's HfRunner uses)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from jvllm import SamplingParams
from jvllm.testing.hf_runner import hf_greedy

__all__ = [
    "approx_logprobs",
    "hf_greedy",
    "mixed_params",
    "prompts",
    "require_installed",
    "token_prompts",
]

PROMPT_LENGTHS = [1, 2, 7, 15, 16, 17, 33, 64, 100, 150, 222, 300]


def prompts(seed: int = 0, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(6, 512, size=n)] for n in lengths]


def token_prompts(ps: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in ps]


def mixed_params(eos: int) -> list[SamplingParams]:
    """One SamplingParams per prompt of `prompts()`, covering the sampler's paths."""
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.9, top_p=0.8, seed=1, max_tokens=20),
        SamplingParams(temperature=0.7, top_k=5, seed=2, max_tokens=17, logprobs=3),
        SamplingParams(
            temperature=0.8, seed=3, repetition_penalty=1.4, frequency_penalty=0.5, max_tokens=30
        ),
        SamplingParams(temperature=0.0, presence_penalty=1.0, max_tokens=21),
        SamplingParams(temperature=1.0, seed=4, min_tokens=6, max_tokens=12),
        SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=15),
        SamplingParams(temperature=0.0, stop_token_ids=[eos, 7, 8, 9, 10, 11], max_tokens=40),
    ]
    return [kinds[i % len(kinds)] for i in range(len(prompts()))]


def approx_logprobs(positions: list | None) -> list | None:
    """Per position: the (token id, rank) pairs exactly, the logprobs to 1e-5."""
    if positions is None:
        return None
    return [
        [(t, lp.rank, pytest.approx(lp.logprob, abs=1e-5)) for t, lp in entry.items()]
        for entry in positions
    ]


def require_installed(name: str) -> None:
    """Skip the calling test module unless package `name` is installed, without importing
    it: llm-compressor patches Transformers, configures logging and loads pandas, pyarrow
    and datasets as it imports, so the tests run it in subprocesses only."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed", allow_module_level=True)

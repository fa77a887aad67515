"""Speculative decoding, the host's part: who gets drafts, verifying them, the counters.

Owns choosing which sequences a proposer drafts for and how many tokens each may take
(never past max_tokens or max_model_len), reading a verified row's outcome, and vLLM's
spec_decode_* counters. The drafts ride in the next decode row (the scheduler's
lookahead slots); the target scores every position of the row in one step, and the
sampler draws each position's token exactly as a step without drafts would (the same
processors, the same per-request seed and output index). A draft is kept while it
equals the token drawn at its position, and the first token that differs (or the one
after the last draft) is kept too. So greedy and seeded outputs are token for token those
of decoding without speculation, and each kept draft is one step saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jvllm.config import SpeculativeConfig
from jvllm.engine.ngram_proposer import NgramProposer
from jvllm.engine.request import Request


def verify(drafts: Sequence[int], sampled: np.ndarray) -> list[int]:
    """The tokens a row verifying `drafts` emits, given the 1 + k tokens drawn at its
    positions: the drafts while they match, then the first drawn token that did not
    match (or, all matching, the one drawn after the last draft)."""
    accepted = 0
    while accepted < len(drafts) and int(sampled[accepted]) == drafts[accepted]:
        accepted += 1
    return [int(t) for t in sampled[: accepted + 1]]


class Speculator:
    """Drafts for the engine's sequences and counts how they fare."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        assert config.method == "ngram", config
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
        # Request id -> its tokens so far as one array (capacity max_model_len) and how
        # many are filled: each step appends what is new instead of copying the sequence.
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}
        self.num_drafts = 0  # rows that verified at least one draft token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def propose(self, request: Request, eligible: bool) -> None:
        """Sets the request's drafts for its next decode row; none when not `eligible`
        (a grammar, a beam) or when one more emitted token reaches a length limit."""
        request.spec_token_ids = []
        if not eligible:
            return
        params = request.sampling_params
        num_out = len(request.output_token_ids)
        # A row with k drafts emits up to k + 1 tokens and computes k + 1 positions.
        room = min(
            (params.max_tokens or self.max_model_len) - num_out,
            self.max_model_len - request.num_tokens,
        )
        if room <= 1:
            return
        request.spec_token_ids = self.proposer.propose(self._sequence(request), room - 1)

    def _sequence(self, request: Request) -> np.ndarray:
        buf, filled = self._tokens.get(request.request_id, (None, 0))
        if buf is None:
            buf = np.empty(self.max_model_len, np.int32)
            filled = request.num_prompt_tokens
            buf[:filled] = request.prompt_token_ids
        n = request.num_tokens
        buf[filled:n] = request.output_token_ids[filled - request.num_prompt_tokens :]
        self._tokens[request.request_id] = (buf, n)
        return buf[:n]

    def forget(self, request_id: str) -> None:
        """Drops a finished request's tokens."""
        self._tokens.pop(request_id, None)

    def observe(self, num_drafts: int, emitted: Sequence[int]) -> None:
        accepted = len(emitted) - 1
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    def metrics(self) -> dict[str, Any]:
        """vLLM's names; the per-position counts are a list, position 0 first."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }


def no_spec_metrics() -> dict[str, Any]:
    return {
        "spec_decode_num_drafts": 0,
        "spec_decode_num_draft_tokens": 0,
        "spec_decode_num_accepted_tokens": 0,
        "spec_decode_num_accepted_tokens_per_pos": [],
    }

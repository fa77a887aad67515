"""Speculative decoding, the host's part: who gets drafts, verifying them, the counters.

Owns choosing which sequences a proposer drafts for and how many tokens each may take
(never past max_tokens or max_model_len), asking the proposer (n-gram lookup here, or
the runner's draft model or EAGLE head), reading a verified row's outcome, and vLLM's
spec_decode_* counters. The drafts ride in the next decode row (the scheduler's lookahead
slots); the target scores every position of the row in one step. A proposer on the
device leaves its drafts there until that step's forward is queued (`spec_in_flight.py`).
An EAGLE head (method "eagle", "eagle3") or an MTP layer ("deepseek_mtp") also needs
the rows that take no drafts (prefill chunks, sequences at their limit): its proposal
program rewrites each row's last entry, from the token after it. For n-gram drafts the
sampler draws each position's token exactly as a step without drafts would
(the same processors, the same per-request seed and output index), so greedy and seeded
outputs are token for token those of decoding without speculation; a draft model's or
EAGLE head's tokens go through the sampler's rejection rule with their distribution q.
Either way a draft is kept while it equals the token the sampler chose at its position,
and the first token that differs (or the one after the last draft) is kept too: each
kept draft is one step saved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from jvllm.config import SpeculativeConfig
from jvllm.engine.metrics import SpecDecodeStats
from jvllm.engine.ngram_proposer import NgramProposer
from jvllm.engine.request import Request
from jvllm.engine.spec_in_flight import ProposalInFlight
from jvllm.engine.step_io import (
    PLACEHOLDER_TOKEN,
    DraftModel,
    DraftRow,
    ScheduledRequest,
    SchedulerOutput,
)


class StepSequence(NamedTuple):
    """One sequence of the step just committed, for `Speculator.propose`."""

    request: Request
    seed: int
    feature_row: int  # the logits row its newest token came from (or its chunk's last)
    sampled: bool  # False: a prefill chunk short of the prompt's end (no drafts)


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

    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        draft_model: DraftModel | None = None,
        block_table: Callable[[str], list[int]] | None = None,
    ) -> None:
        """`draft_model` (the runner) and `block_table` (a request's block table) for
        methods "draft_model", "eagle", "eagle3" and "deepseek_mtp"; n-gram lookup needs neither."""
        self.config = config
        self.max_model_len = max_model_len
        self.draft_model = draft_model
        self.block_table = block_table
        self.proposer = None
        if config.method == "ngram":
            self.proposer = NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
        else:
            assert draft_model is not None and block_table is not None, config
        # Request id -> its tokens so far as one array (capacity max_model_len) and how
        # many are filled: each step appends what is new instead of copying the sequence.
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}
        # Requests holding a draft model's drafts: their q rows are the latest proposal's.
        self._holding: dict[str, Request] = {}
        # The latest proposal on the device, its drafts read only once a step needs them.
        self.in_flight: ProposalInFlight | None = None
        # True: read each device proposal at once, as before drafts stayed on the
        # device (a baseline for bench/spec_decode.py; outputs are the same).
        self.wait_for_proposals = False
        self.num_drafts = 0  # rows that verified at least one draft token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def room(self, request: Request) -> int:
        """Draft tokens the request's next row may verify: a row with k drafts emits up
        to k + 1 tokens and computes k + 1 positions."""
        params = request.sampling_params
        left = min(
            (params.max_tokens or self.max_model_len) - len(request.output_token_ids),
            self.max_model_len - request.num_tokens,
        )
        return max(0, min(left - 1, self.config.num_speculative_tokens))

    def propose(self, sequences: Sequence[StepSequence]) -> None:
        """Sets the drafts of each sampled sequence for its next decode row (none where a
        length limit is one token away). Callers leave out grammars and beams, and
        prefill chunks short of the prompt's end where `wants_every_row` is False."""
        if self.proposer is not None:
            for seq in sequences:
                request = seq.request
                room = self.room(request)
                request.spec_token_ids = (
                    self.proposer.propose(self._sequence(request), room) if room else []
                )
            return
        self._propose_on_device(sequences)

    @property
    def wants_every_row(self) -> bool:
        """An EAGLE head rewrites every row's last entry, drafts or none."""
        return self.config.method in ("eagle", "eagle3", "deepseek_mtp")

    def _propose_on_device(self, sequences: Sequence[StepSequence]) -> None:
        assert self.draft_model is not None and self.block_table is not None
        # A new proposal replaces the device's q rows: older drafts lose theirs.
        for request in self._holding.values():
            request.spec_token_ids, request.spec_q_row = [], -1
        self._holding, self.in_flight = {}, None
        rows, requests = [], []
        for seq in sequences:
            request = seq.request
            room = self.room(request) if seq.sampled else 0
            if not room and not self.wants_every_row:
                continue
            computed = request.num_computed_tokens
            if self.wants_every_row:  # from the token after the computed ones
                token, position = request.get_token_ids(computed, computed + 1)[0], computed - 1
            else:
                token, position = request.output_token_ids[-1], request.num_tokens - 1
            rows.append(
                DraftRow(
                    token_id=token,
                    position=position,
                    block_table=self.block_table(request.request_id),
                    num_tokens=room,
                    seed=seq.seed,
                    step_index=len(request.output_token_ids),
                    temperature=request.sampling_params.temperature,
                    feature_row=seq.feature_row,
                )
            )
            requests.append(request)
        if not rows:
            return
        k = self.config.num_speculative_tokens
        self.in_flight = flight = ProposalInFlight(self.draft_model.propose(rows), k)
        for index, (request, row) in enumerate(zip(requests, rows, strict=True)):
            if row.num_tokens:  # its values stay on the device (`spec_in_flight`)
                request.spec_token_ids = [PLACEHOLDER_TOKEN] * row.num_tokens
                request.spec_q_row = index * k
                self._holding[request.request_id] = request
                flight.rows[request.request_id] = index
        if self.wait_for_proposals:
            flight.pending.result()

    def feed(self, sched: SchedulerOutput) -> SchedulerOutput:
        """The step with where its draft tokens are on the device (a device proposer's)."""
        return sched if self.in_flight is None else self.in_flight.feed(sched)

    def resolve(self, rows: Sequence[ScheduledRequest]) -> None:
        """The drafts' values into the rows carrying them, once their forward is queued."""
        if self.in_flight is not None:
            self.in_flight.resolve(rows)

    def drafts_of(self, request: Request) -> list[int]:
        """The drafts a request holds for its next row (waits for a device proposal)."""
        n = len(request.spec_token_ids)
        if self.in_flight is None or not n:
            return list(request.spec_token_ids)
        return self.in_flight.drafts(request.request_id, n)

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
        self._holding.pop(request_id, None)

    def observe(self, num_drafts: int, emitted: Sequence[int]) -> None:
        accepted = len(emitted) - 1
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_pos),
        )

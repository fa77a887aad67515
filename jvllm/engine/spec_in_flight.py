"""The last proposal of a proposer on the device, while its drafts are not yet read.

Owns the engine's record of a dispatched proposal (draft model, EAGLE-1/3 head, MTP
layer, Medusa heads): which proposal row holds each request's drafts, so that the next
step's decode rows, scheduled with `PLACEHOLDER_TOKEN` in their draft positions, name
where the forward finds them on the device (`SchedulerOutput.draft_sources`), and so
that the drafts' values reach the rows once the forward is queued (for the sampler's
rows, penalties over the drafts, and verification at commit). The host thus schedules
and packs step N + 1 while the proposal after step N runs, and reads the drafts while
N + 1's forward runs. Not owned: choosing who drafts and how many (`spec_decode.py`),
placing drafts in rows (the scheduler), the device side (`runner/draft_feed.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jvllm.engine.step_io import PendingProposal, ScheduledRequest, SchedulerOutput


class ProposalInFlight:
    """One dispatched proposal of `k` drafts a row and the requests holding its drafts."""

    def __init__(self, pending: PendingProposal, k: int) -> None:
        self.pending = pending
        self.k = k
        self.rows: dict[str, int] = {}  # request id -> its proposal row

    def feed(self, sched: SchedulerOutput) -> SchedulerOutput:
        """`sched` with `draft_sources`: for each draft token its rows carry, in row
        order, its flat index `proposal row * k + j` in the proposal's drafts."""
        sources: list[int] = []
        for row in sched.scheduled:
            n = row.num_spec_tokens
            if n:
                base = self.rows[row.request_id] * self.k
                sources += range(base, base + n)
        if not sources:
            return sched
        return dataclasses.replace(sched, draft_sources=np.array(sources, np.int32))

    def resolve(self, rows: Sequence[ScheduledRequest]) -> None:
        """Writes the drafts' values over the placeholders of the rows carrying them
        (waits for the proposal; the forward reading them is queued already)."""
        host = None
        for row in rows:
            n = row.num_spec_tokens
            if not n:
                continue
            if host is None:
                host = self.pending.result()  # [S, k] int32
            row.token_ids[-n:] = host[self.rows[row.request_id], :n].tolist()

    def drafts(self, request_id: str, n: int) -> list[int]:
        """A request's first `n` drafts (waits for the proposal)."""
        return self.pending.result()[self.rows[request_id], :n].tolist()

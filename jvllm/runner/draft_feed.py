"""Draft tokens that stay on the device between a proposal and the step verifying them.

Owns the runner's half of feeding a proposer's drafts (draft model, EAGLE-1/3 head,
MTP layer, Medusa heads) into the next step without the host reading them first:
`PendingDrafts` (a proposal's `[S, k]` draft tokens, their host copy started at once
and waited for only when asked), `place_drafts` (the step's scheduled drafts, in row
order, gathered from the last proposal into the `last_sampled` buffer that the
forward's placeholder tokens read) and `feed_draft_tokens` (the packed batch's
`prev_index` pointing each draft position at its place there). The forward then
resolves draft tokens on the device exactly as it resolves an overlapped decode row's
token (`input_batch.unpack`). Not owned: which drafts a row takes (the scheduler),
which proposal row holds a request's drafts (the engine's `spec_in_flight`), the
proposal program itself (`drafter.py`, `step_programs.py`).

No row of a speculating step feeds back the previous step's samples (the scheduler
has them before it schedules the step, with async scheduling too: `engine/spec_step.py`),
so `last_sampled` is free until its sampler replaces it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.runner.input_batch import BatchShape, StepRow, _packed_sizes


class PendingDrafts:
    """A dispatched proposal's draft tokens `[S, k]` int32, still on the device."""

    def __init__(self, drafts: jax.Array | np.ndarray, limits: Sequence[int]) -> None:
        self.drafts = drafts
        self.limits = list(limits)  # row i's real drafts: drafts[i, :limits[i]]
        self._host: np.ndarray | None = None
        if isinstance(drafts, jax.Array):
            drafts.copy_to_host_async()  # under way while the host schedules the next step

    def result(self) -> np.ndarray:
        """The drafts on the host `[S, k]` int32 (waits for the proposal, once)."""
        if self._host is None:
            self._host = np.asarray(self.drafts)
        return self._host

    def tolist(self) -> list[list[int]]:
        """Each row's drafts (waits)."""
        host = self.result()
        return [host[i, :n].tolist() for i, n in enumerate(self.limits)]


def _place(drafts: jax.Array, sources: jax.Array) -> jax.Array:
    """`[R]` int32: entry j is flat draft `sources[j]` of `drafts` `[S, k]` (0 where -1)."""
    flat = drafts.reshape(-1)
    return jnp.where(sources >= 0, flat[jnp.maximum(sources, 0)], 0).astype(jnp.int32)


def place_drafts_fn(sharding: Any) -> Callable[[jax.Array, np.ndarray], jax.Array]:
    """The placing program, its output placed as the sampler's `last_sampled` is (so the
    forward that reads it keeps one program per bucket); one compilation per proposal
    row bucket."""
    return jax.jit(_place, out_shardings=sharding)


def padded_sources(sources: np.ndarray, num_rows: int) -> np.ndarray:
    """`sources` (flat draft indices of the step's drafts in row order) padded with -1
    to `num_rows` (the `last_sampled` buffer's length)."""
    assert len(sources) <= num_rows, (len(sources), num_rows)
    out = np.full(num_rows, -1, np.int32)  # [R]
    out[: len(sources)] = sources
    return out


def feed_draft_tokens(
    packed: np.ndarray, shape: BatchShape, rows: Sequence[StepRow], offset: int = 0
) -> None:
    """Points the packed batch's `prev_index` at each row's draft positions (the last
    `num_spec_tokens` of its tokens): the step's j-th draft in row order reads entry
    `offset` + j of `last_sampled`, where `place_drafts` put it. In place."""
    spec = np.fromiter((r.num_spec_tokens for r in rows), np.int64, len(rows))
    total = int(spec.sum())
    if not total:
        return
    lens = np.fromiter((len(r.token_ids) for r in rows), np.int64, len(rows))
    ends = np.cumsum(lens)  # [n]: one past each row's last token
    within = np.arange(total) - np.repeat(np.cumsum(spec) - spec, spec)
    token_index = np.repeat(ends - spec, spec) + within  # [total]: the drafts' tokens
    at = int(sum(_packed_sizes(shape)[:7]))  # the prev_index segment
    packed[at + token_index] = np.arange(offset, offset + total, dtype=np.int32)

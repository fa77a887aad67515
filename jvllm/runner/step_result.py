"""What one dispatched step hands back: the pending device outputs and their host copies.

Owns the one sync of a step (`PendingStep.result()`) and the shapes of what the engine
reads from it; not the programs that produce it (`model_runner`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from jvllm.engine.step_io import PromptLogprobs, StepResult
from jvllm.layers import sampler


def split_by_row(per_token: np.ndarray, lengths: Sequence[int]) -> list[np.ndarray]:
    """Cuts a `[T, ...]` per-token array into each row's `[n, ...]` slice."""
    bounds = np.cumsum([0, *lengths])
    return [per_token[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@dataclass(frozen=True)
class PendingStep:
    """A dispatched step whose outputs are still device arrays."""

    out: sampler.SamplerOutput  # [S]-padded device arrays
    prompt_logprobs: tuple[jax.Array, ...] | None  # [T, K], [T, K], [T], [T] when asked
    row_lengths: tuple[int, ...]  # new tokens per real row
    num_sampled: int  # real logits rows: one per row, 1 + k for a row verifying k drafts

    def result(self) -> StepResult:
        """Waits for the step and brings its outputs to the host (the one sync)."""
        out, scored = jax.device_get((self.out, self.prompt_logprobs))
        n = self.num_sampled
        per_row = None
        if scored is not None:
            parts = [split_by_row(np.asarray(a), self.row_lengths) for a in scored]
            per_row = [PromptLogprobs(*row) for row in zip(*parts, strict=True)]
        return StepResult(
            out.token_ids[:n], out.logprobs[:n], out.top_ids[:n], out.top_logprobs[:n], per_row
        )

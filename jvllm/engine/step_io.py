"""What crosses the engine/runner boundary in one step, and the runner's protocol.

Owns the types both sides read: the scheduler's decision (`SchedulerOutput`; its rows,
`StepRows` of `ScheduledRequest`s with steady decode rows as columns, are defined in
`step_rows.py` and re-exported here), the sampler's view of a row (`SamplingRow`), the step's
sampling inputs (`StepSampling`) and the host copies of what the device sampled
(`StepResult`); and `StepRunner`, the calls the engine makes on the device side. It
imports no jax (numpy only), so the engine stays host-only and the runner needs
nothing else of the engine.

One step, as `LLMEngine.step` makes it:

    schedule() -> SchedulerOutput
    runner.forward(SchedulerOutput)       # queues the model; returns at once
    runner.sample(StepSampling) -> PendingResult   # queues the sampler
    PendingResult.result() -> StepResult  # the step's one sync (the commit)

The two runner calls are apart so that the host can prepare a step's sampling inputs
while its forward runs (vLLM's `execute_model` / `sample_tokens`): a row whose bans
or grammar need the token the previous step sampled gets its sampling row only after
that step is committed, between the two calls.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from jvllm.engine.step_rows import (  # noqa: F401  (the boundary's row types, re-exported)
    PLACEHOLDER_TOKEN,
    RowColumns,
    ScheduledRequest,
    StepRows,
)
from jvllm.sampling_params import SAMPLER_CONSTANTS, SamplingParams

if TYPE_CHECKING:
    from jvllm.lora.peft_adapter import LoRAModel


class MultiModalFeature(NamedTuple):
    """One image of a request: where its placeholder tokens sit in the prompt, the
    processor's pixels, and a hash of their content (the encoder cache's key)."""

    identifier: str  # hex digest of the processed pixels
    offset: int  # the position of its first placeholder token
    length: int  # its placeholder tokens: the embeddings the encoder gives it
    pixel_values: np.ndarray  # [1, 3, H, W] float32 (Qwen2.5-VL: [1, P, C * tps * patch^2])
    # Qwen2.5-VL: the image's tokens as a (t, h, w) grid after patch merging (M-RoPE's
    # positions, the encoder's program); None for a fixed-size image (LLaVA).
    token_grid: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    step_id: int  # consecutive; update_from_output() commits steps in this order
    # Running requests first, then newly admitted ones (the scheduler's: `StepRows`).
    scheduled: Sequence[ScheduledRequest]
    blocks_to_copy: list[tuple[int, int]]  # (src, dst), applied before this step's forward
    preempted_request_ids: list[str]
    num_scheduled_tokens: int
    # Applied before the copies and the forward, swap-outs first.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    # Every row's block table as row `table_row` of this int32 array (zero past each
    # table's end); valid until the next schedule().
    block_tables: np.ndarray | None = None  # [max_num_seqs, max_blocks_per_seq] int32
    # With LoRA: each row's adapter slot on the device (0: the base model), set by the
    # engine (`engine/lora_slots.py`) once the slots hold the step's adapters.
    lora_slots: np.ndarray | None = None  # [len(scheduled)] int32
    # A vision-language model's step: request id -> its images whose placeholder tokens
    # the row holds (some of them), set by the engine (`engine/multimodal.py`).
    mm_features: dict[str, tuple[MultiModalFeature, ...]] | None = None
    # With a proposer on the device: the flat index, in the last proposal's drafts, of
    # each draft token the step's rows carry, in row order (their token_ids hold
    # PLACEHOLDER_TOKEN there until the engine reads the proposal), set by the engine
    # (`engine/spec_in_flight.py`); the forward reads the drafts on the device.
    draft_sources: np.ndarray | None = None  # [total draft tokens] int32

    @functools.cached_property
    def columns(self) -> RowColumns:
        """`scheduled` as columns, taken once however many read them."""
        return RowColumns.of(self.scheduled)


@dataclass
class KVIOOps:
    """Work for the KV tier below the host tier (`jvllm.kv_offload.fs_worker`), done on
    threads of its own: host blocks to save under a key (their content is what this
    step's swap-outs write), keys to read into host blocks, keys to delete."""

    writes: list[tuple[int, str]] = field(default_factory=list)  # (host block, key)
    reads: list[tuple[str, int]] = field(default_factory=list)  # (key, host block)
    deletes: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.writes or self.reads or self.deletes)


class KVIODone(NamedTuple):
    """One finished read or write of the tier below the host tier."""

    key: str
    is_read: bool
    ok: bool  # False: the read missed (file gone, torn or altered) or the write was dropped


class KVTransfer(Protocol):
    """The runner side of the tier below the host tier (`FsKVWorker`)."""

    def submit(self, ops: KVIOOps) -> list[KVIODone]:
        """Queues the step's work, before its swaps; returns what finished since."""
        ...

    def drain(self) -> list[KVIODone]:
        """Finishes every write and read asked so far; returns what finished since."""
        ...


class SamplingRow(NamedTuple):
    """One batch row as the sampler sees it: the request's parameters, its resolved
    seed, how many tokens it has generated so far, and its token history."""

    params: SamplingParams
    seed: int  # resolved per sequence by the engine, in [0, 2**32)
    step_index: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Tokens that may not be sampled this step (EOS and stop ids before min_tokens).
    banned_token_ids: Sequence[int] = ()
    # The latest output token is still on the device (not in output_token_ids): it is
    # the row's input token, and the sampler adds it to the penalty history there.
    pending_output: bool = False
    # Speculative decoding with a draft model: the draft token proposed for this
    # position and the row of the proposal's probabilities q that it was drawn from
    # (-1: none; the sampler then draws as usual).
    draft_token_id: int = -1
    draft_q_row: int = -1


@dataclass(frozen=True)
class SamplingColumns:
    """A step's sampling rows as columns: every row's request constants, seed and step
    index, gathered from the engine's persistent batch (`engine/sampling_batch.py`);
    only the rows that need more (bans, penalties, logit bias, drafts, a pending
    output) carry a whole `SamplingRow` in `special`, whose scalars the columns repeat."""

    constants: np.ndarray  # [R] SAMPLER_CONSTANTS records
    seeds: np.ndarray  # [R] int64, each in [0, 2**32)
    step_index: np.ndarray  # [R] int64: tokens the row's sequence generated before it
    special: dict[int, SamplingRow]  # sampling row -> its whole row

    def __len__(self) -> int:
        return len(self.seeds)

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow]) -> SamplingColumns:
        """The columns of whole rows (each row with more than its scalars is special)."""
        n = len(rows)
        constants = np.frombuffer(b"".join(map(_ROW_CONSTANTS, rows)), SAMPLER_CONSTANTS)
        flat = itertools.chain.from_iterable(map(_SEED_AND_STEP, rows))
        seed_step = np.fromiter(flat, np.int64, 2 * n).reshape(n, 2)  # [n, 2]
        special = {i: row for i, row in enumerate(rows) if _needs_whole_row(row)}
        return cls(constants.copy(), seed_step[:, 0], seed_step[:, 1], special)


def _needs_whole_row(row: SamplingRow) -> bool:
    return bool(
        row.banned_token_ids
        or row.params.logit_bias
        or row.params.uses_penalties
        or row.pending_output
        or row.draft_q_row >= 0
        or row.draft_token_id >= 0
    )


_ROW_CONSTANTS = operator.attrgetter("params.sampler_constants")
_SEED_AND_STEP = operator.attrgetter("seed", "step_index")


@dataclass(frozen=True)
class StepSampling:
    """What the sampler needs for the step whose forward was queued last."""

    # One per scheduled row that samples nothing too (an idle row); a row verifying k
    # draft tokens takes 1 + k consecutive ones, one per position it scores.
    rows: SamplingColumns
    # i32[len(rows), ceil(V / 32)]: bit t of a row allows token t; None: all allowed.
    token_bitmask: np.ndarray | None = None
    # Per scheduled row and new token, the next prompt token to score (prompt
    # logprobs); any id where none is wanted. None: no row scores its prompt.
    prompt_targets: Sequence[Sequence[int]] | None = None


class PromptLogprobs(NamedTuple):
    """Scores of one row's new positions under the next token's distribution."""

    top_ids: np.ndarray  # [n, K] int32, best first
    top_logprobs: np.ndarray  # [n, K] float32
    target_logprobs: np.ndarray  # [n] float32: logprob of the given next token
    target_ranks: np.ndarray  # [n] int32: 1 + tokens scored above it


@dataclass(frozen=True)
class StepResult:
    """Host copies of one step's sampler output, one entry per sampling row."""

    token_ids: np.ndarray  # [R] int32
    logprobs: np.ndarray  # [R] float32
    top_ids: np.ndarray  # [R, K] int32
    top_logprobs: np.ndarray  # [R, K] float32
    prompt_logprobs: list[PromptLogprobs] | None  # per row, when prompt logprobs were asked


class PendingResult(Protocol):
    """A queued step; `result()` waits for the device and copies its outputs out."""

    def result(self) -> StepResult: ...


class DraftRow(NamedTuple):
    """One sequence a proposer drafts for: from its newest token, `num_tokens` more."""

    token_id: int
    # A draft model's first step: token_id's own (the sequence's length - 1); an EAGLE
    # head's: the one before, whose entry pairs with token_id.
    position: int
    block_table: Sequence[int]  # covers position + num_tokens - 1 (lookahead slots)
    num_tokens: int
    seed: int
    step_index: int  # output tokens so far: the first draft's output index
    temperature: float
    feature_row: int = 0  # EAGLE: the step's logits row that token_id was drawn from


class PendingProposal(Protocol):
    """A dispatched proposal (`jvllm.runner.draft_feed.PendingDrafts`)."""

    def result(self) -> np.ndarray:
        """Waits for it: row i's drafts are `[i, :num_tokens]` of this `[S, k]` int32."""


class DraftModel(Protocol):
    """The runner's side of a draft model (`jvllm.runner.ModelRunner.propose`)."""

    def propose(self, rows: Sequence[DraftRow]) -> PendingProposal: ...


class StepRunner(Protocol):
    """What the engine needs from the device side (`jvllm.runner.ModelRunner`)."""

    @property
    def num_compilations(self) -> int: ...

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(src, dst) whole-block copies, queued before the step's forward."""

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device, host) block copies, queued before anything this step writes."""

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host, device) block copies, queued before the step's forward."""

    def forward(self, scheduled: SchedulerOutput) -> None:
        """Queues the model over the step's rows; returns without waiting."""

    def sample(self, sampling: StepSampling) -> PendingResult:
        """Queues the sampler over the logits of the forward queued last."""

    @property
    def lora_module_shapes(self) -> dict[tuple[int, str], tuple[int, int]]:
        """(layer, module) -> (in, out) features of every layer an adapter may target."""
        ...

    def set_lora(self, slot: int, model: LoRAModel | None) -> None:
        """Writes an adapter (None: zeros) into device slot `slot` (1..max_loras),
        queued after every step dispatched before."""


class PooledRows(NamedTuple):
    """Host copies of a pooling step's outputs, per scheduled row over its new tokens:
    the output rows (hidden states, or a classifier's logits) of its first token, their
    sum and its last token's. The engine folds a chunked prompt's steps together."""

    first: np.ndarray  # [S, D] float32
    total: np.ndarray  # [S, D] float32
    last: np.ndarray  # [S, D] float32


class PendingPooling(Protocol):
    """A queued pooling step; `result()` waits for the device and copies its rows out."""

    def result(self) -> PooledRows: ...


class PoolingStepRunner(Protocol):
    """What the pooling engine needs from the device side (`PoolingRunner`)."""

    @property
    def num_compilations(self) -> int: ...

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None: ...

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None: ...

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None: ...

    def pool(self, scheduled: SchedulerOutput) -> PendingPooling:
        """Queues the model over the step's rows (their K/V written for later chunks)
        and the per-row reductions of its outputs; returns without waiting."""

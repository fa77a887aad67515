"""The sampler's per-row arrays: `SamplingMetadata` and how the host fills them.

Owns `SamplingMetadata` (a pytree passed into the jitted sampler; every field is data,
none static) and `make_sampling_metadata()`, which packs one step's `SamplingRow`s
into padded numpy arrays: the per-row scalars, the flat logit-bias list and the flat
penalty-history list. Does not own what is done with them on the device
(`sampling.py`), nor resolving seeds (the engine) or choosing S (the runner).

Logit biases and bans of the whole batch share one flat list of F (row, token, value)
entries, at least MIN_BIAS_ENTRIES long, and the penalty histories of the whole batch
one flat list of E (row, token, is-output) entries, at least MIN_PENALTY_ENTRIES long:
biases and penalties of any value, on any rows, with histories of any length up to
those sizes in all, reuse the program warm-up compiled.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np

from jvllm.engine.step_io import SamplingColumns, SamplingRow
from jvllm.sampling_params import SAMPLER_CONSTANTS

# The runner builds these on the host as numpy; inside jit they are jax arrays.
Array = jax.Array | np.ndarray

_U32_MAX = 2**32 - 1


# The flat bias list is this long or a larger power of two: every step of a batch
# whose rows bias or ban up to this many tokens in all runs the warmed-up program.
MIN_BIAS_ENTRIES = 1024


# Likewise for the penalty histories (prompt ids once each, output ids once per
# occurrence) of every penalised row of a step.
MIN_PENALTY_ENTRIES = 8192


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling arrays for one step; every field is data, none static."""

    temperature: Array  # f32[S]; < SAMPLING_EPS means greedy
    top_p: Array  # f32[S]; 1.0 = off
    top_k: Array  # i32[S]; 0 = off
    min_p: Array  # f32[S]; 0.0 = off
    presence_penalty: Array  # f32[S]
    frequency_penalty: Array  # f32[S]
    repetition_penalty: Array  # f32[S]; 1.0 = off
    seeds: Array  # u32[S]
    step_index: Array  # i32[S]; tokens the row's request has generated so far
    # Flat [E] list of penalty history entries: row, token (-1 = padding), and whether
    # the token is an output (frequency and presence count outputs only).
    penalty_rows: Array  # i32[E]
    penalty_token_ids: Array  # i32[E]
    penalty_is_output: Array  # bool[E]
    # Flat [F] list of additive logit biases (-inf bans): row, token (-1 = padding), value.
    bias_rows: Array  # i32[F]
    bias_token_ids: Array  # i32[F]
    bias_values: Array  # f32[F]
    want_logprobs: Array  # bool[S]; the row's request asked for logprobs
    # bool[S]; the row's last input token is an output the host has not seen yet (it is
    # still on the device): penalties count it on top of the history entries.
    pending_output: Array
    # i32[S]; a draft model's token for this position and its row of the draft
    # probabilities passed to sample() (-1 = none).
    draft_token_ids: Array
    draft_q_rows: Array
    # i32[1]: how many rows are in use, the first ones; the rest are padding (grouped
    # sampling skips their groups). One element, not a scalar: a multi-host step places
    # every field as a process-local array.
    used_rows: Array


def penalty_entries_needed(rows: Sequence[SamplingRow]) -> int:
    """The history entries `make_sampling_metadata` lists for these rows' penalties."""
    return sum(len(_penalty_entries(row)[0]) for row in rows if row.params.uses_penalties)


def _penalty_entries(row: SamplingRow) -> tuple[list[int], list[bool]]:
    # Repetition only asks whether an id occurred, so prompt ids are deduplicated and
    # dropped when an output repeats them; outputs keep one entry per occurrence because
    # the frequency penalty counts them.
    outputs = list(row.output_token_ids)
    prompt_only = sorted(set(row.prompt_token_ids) - set(outputs))
    return prompt_only + outputs, [False] * len(prompt_only) + [True] * len(outputs)


def bias_entries_needed(rows: Sequence[SamplingRow]) -> int:
    """The entries the rows' logit biases and bans fill in the flat bias list."""
    return sum(len(r.banned_token_ids) + len(r.params.logit_bias or ()) for r in rows)


def make_sampling_metadata(
    rows: Sequence[SamplingRow] | SamplingColumns, num_rows: int
) -> SamplingMetadata:
    """Pack rows (whole rows, or the engine's columns) into numpy arrays padded to
    num_rows; padding rows are greedy, unpenalised.

    The bias list is MIN_BIAS_ENTRIES long and the penalty list MIN_PENALTY_ENTRIES, or
    each the next power of two that holds its entries."""
    columns = rows if isinstance(rows, SamplingColumns) else SamplingColumns.from_rows(rows)
    n = len(columns)
    if n > num_rows:
        raise ValueError(f"got {n} rows but num_rows={num_rows}; num_rows must be >= it")
    special = columns.special
    constants = columns.constants  # [n] structured: the rows' request constants by name
    biased = [i for i, r in special.items() if r.banned_token_ids or r.params.logit_bias]
    needed = bias_entries_needed([special[i] for i in biased])
    num_bias = max(MIN_BIAS_ENTRIES, 1 << max(needed - 1, 0).bit_length())
    # `SamplingParams.uses_penalties` of each row, read from its constants at once.
    penalised = np.flatnonzero(
        (constants["presence_penalty"] != 0.0)
        | (constants["frequency_penalty"] != 0.0)
        | (constants["repetition_penalty"] != 1.0)
    ).tolist()
    if missing := [i for i in penalised if i not in special]:
        raise ValueError(f"row {missing[0]} uses penalties but has no SamplingRow in special")
    histories = [_penalty_entries(special[i]) for i in penalised]
    num_history = sum(len(ids) for ids, _ in histories)
    num_penalty = max(MIN_PENALTY_ENTRIES, 1 << max(num_history - 1, 0).bit_length())
    # Most steps bias and penalise nothing: their flat lists are all padding, shared.
    penalty = _padding_lists(num_penalty, (np.int32, np.int32, bool), (0, -1, False))
    if penalised:
        penalty = tuple(a.copy() for a in penalty)
    bias = _padding_lists(num_bias, (np.int32, np.int32, np.float32), (0, -1, 0.0))
    if biased:
        bias = tuple(a.copy() for a in bias)
    md = SamplingMetadata(
        temperature=np.zeros(num_rows, np.float32),
        top_p=np.ones(num_rows, np.float32),
        top_k=np.zeros(num_rows, np.int32),
        min_p=np.zeros(num_rows, np.float32),
        presence_penalty=np.zeros(num_rows, np.float32),
        frequency_penalty=np.zeros(num_rows, np.float32),
        repetition_penalty=np.ones(num_rows, np.float32),
        seeds=np.zeros(num_rows, np.uint32),
        step_index=np.zeros(num_rows, np.int32),
        penalty_rows=penalty[0],
        penalty_token_ids=penalty[1],
        penalty_is_output=penalty[2],
        bias_rows=bias[0],
        bias_token_ids=bias[1],
        bias_values=bias[2],
        want_logprobs=np.zeros(num_rows, bool),
        pending_output=np.zeros(num_rows, bool),
        draft_token_ids=np.full(num_rows, -1, np.int32),
        draft_q_rows=np.full(num_rows, -1, np.int32),
        used_rows=np.array([n], np.int32),
    )
    _fill_scalars(md, columns)
    _fill_biases(md, special, biased)
    _fill_penalty_histories(md, penalised, histories)
    return md


@functools.cache
def _padding_lists(
    size: int, dtypes: tuple[type, ...], fills: tuple[int | float | bool, ...]
) -> tuple[np.ndarray, ...]:
    """A flat list of `size` padding entries, one read-only array per field."""
    arrays = tuple(np.full(size, fill, dtype) for dtype, fill in zip(dtypes, fills, strict=True))
    for array in arrays:
        array.flags.writeable = False
    return arrays


def _fill_scalars(md: SamplingMetadata, columns: SamplingColumns) -> None:
    """Per-row scalars: the columns as they are, and the special rows' own integers."""
    n = len(columns)
    if not n:
        return
    seeds, steps = columns.seeds, columns.step_index
    bad = np.flatnonzero((seeds < 0) | (seeds > _U32_MAX))
    if bad.size:
        raise ValueError(f"row {bad[0]}: seed must be in [0, 2**32), got {seeds[bad[0]]}")
    bad = np.flatnonzero(steps < 0)
    if bad.size:
        raise ValueError(f"row {bad[0]}: step_index must be >= 0, got {steps[bad[0]]}")
    md.seeds[:n] = seeds
    md.step_index[:n] = steps
    for i, row in columns.special.items():
        md.pending_output[i] = row.pending_output
        md.draft_token_ids[i] = row.draft_token_id
        md.draft_q_rows[i] = row.draft_q_row
    for name in SAMPLER_CONSTANTS.names:
        getattr(md, name)[:n] = columns.constants[name]


def _fill_biases(md: SamplingMetadata, rows: dict[int, SamplingRow], biased: list[int]) -> None:
    """The biased rows' logit_bias entries, then their bans (-inf), into the flat list."""
    at = 0
    for i in biased:
        row = rows[i]
        bias = row.params.logit_bias or {}
        ids = [*bias, *row.banned_token_ids]
        end = at + len(ids)
        md.bias_rows[at:end] = i
        md.bias_token_ids[at:end] = ids
        md.bias_values[at : at + len(bias)] = list(bias.values())
        md.bias_values[at + len(bias) : end] = -np.inf
        at = end


def _fill_penalty_histories(
    md: SamplingMetadata, penalised: list[int], histories: list[tuple[list[int], list[bool]]]
) -> None:
    """The penalised rows' histories, one after another, into md's flat penalty list."""
    at = 0
    for i, (ids, is_output) in zip(penalised, histories, strict=True):
        if any(t < 0 for t in ids):
            raise ValueError(f"row {i}: token ids must be >= 0 (-1 is padding)")
        md.penalty_rows[at : at + len(ids)] = i
        md.penalty_token_ids[at : at + len(ids)] = ids
        md.penalty_is_output[at : at + len(ids)] = is_output
        at += len(ids)

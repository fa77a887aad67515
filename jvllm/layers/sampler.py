"""Sampler: turns one step's logits into token ids and logprobs, on device.

Owns `SamplingMetadata` (the per-row sampling arrays, a pytree passed into the jitted
step), `sample()` (penalties, logit biases and bans, greedy, temperature, min_p, top_k,
top_p, seeded draws, raw logprobs), `make_sampling_metadata()`, which packs host-side
`SamplingParams` into padded numpy arrays, and `apply_token_bitmask()`, the packed
allowed-token masks of structured outputs and `allowed_token_ids`.

Does not own: resolving a request's seed (the engine), choosing the bucket sizes S and
P (the runner), moving the arrays to the device (the runner), or slicing the top
logprobs down to what each request asked for (the engine).

Every sampling knob is an array, never a static argument: new temperatures or seeds
reuse the compiled program; only the shapes S, V, E and F select one. Logit biases and
bans of the whole batch share one flat list of F (row, token, value) entries, at least
MIN_BIAS_ENTRIES long, and the penalty histories of the whole batch one flat list of E
(row, token, is-output) entries, at least MIN_PENALTY_ENTRIES long: biases and
penalties of any value, on any rows, with histories of any length up to those sizes in
all, reuse the program warm-up compiled.

Speculative decoding with a draft distribution (`rejection_sample`): a row whose
position holds a draft token d drawn from q accepts d with probability
min(1, p(d) / q(d)), p being the row's target distribution after every processor, and
otherwise draws from the normalised residual max(p - q, 0), so the token is distributed
as p exactly. A rejected d has no residual mass, so a row kept its draft exactly when
its token equals the draft.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jvllm.sampling_params import NUM_TOP_CANDIDATES, SAMPLING_EPS, SamplingRow

# The runner builds these on the host as numpy; inside jit they are jax arrays.
Array = jax.Array | np.ndarray
T = TypeVar("T")

_U32_MAX = 2**32 - 1
# The flat bias list is this long or a larger power of two: every step of a batch
# whose rows bias or ban up to this many tokens in all runs the warmed-up program.
MIN_BIAS_ENTRIES = 1024
# Likewise for the penalty histories (prompt ids once each, output ids once per
# occurrence) of every penalised row of a step.
MIN_PENALTY_ENTRIES = 8192
# Logits per row that top_k/top_p read through `lax.top_k` before falling back to a
# bisection over the whole vocabulary.
TOP_CANDIDATES = 64
# On XLA:CPU the sampler takes its rows in groups of this many, one group after the
# other and only as many groups as the step has rows (`sample`'s `group_rows`): one
# compiled program then serves every row count, and each group's [G, V] intermediates
# stay in the caches.
GROUP_ROWS_CPU = 16


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


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]; raw log_softmax at the sampled token
    top_ids: jax.Array  # i32[S, K], K = min(NUM_TOP_CANDIDATES, V)
    top_logprobs: jax.Array  # f32[S, K]


def sample(
    logits: jax.Array,
    md: SamplingMetadata,
    last_input: jax.Array | None = None,
    draft_probs: jax.Array | None = None,
    group_rows: int | None = None,
    bitmask: jax.Array | None = None,
) -> SamplerOutput:
    """Choose one token per row; jit-compatible, no branching on parameter values.

    `last_input` `[S]` is each row's last input token (needed where `pending_output`).
    `draft_probs` `[Q, V]`: a draft model's proposal distributions, indexed by
    `md.draft_q_rows`; rows with a draft token are decided by `rejection_sample`.
    Row i's token depends only on logits[i] and row i's parameters, seed and step index,
    never on the other rows or on how many padding rows the batch carries.
    `group_rows` (a divisor of S): the rows go in groups of this many, one group after
    the other, and only the groups that hold one of the `md.used_rows` rows in use
    (`GROUP_ROWS_CPU`): the same outputs for those rows, zeros for the rest.
    `bitmask` `i32[S, ceil(V/32)]`: each row's allowed tokens (`apply_token_bitmask`),
    applied to the logits first, raw logprobs included; a group whose masks allow every
    token skips it.
    """
    logits = logits.astype(jnp.float32)  # [S, V]
    if last_input is None:
        last_input = jnp.zeros(logits.shape[0], jnp.int32)
    if group_rows is not None:
        return _sample_in_groups(logits, md, last_input, draft_probs, group_rows, bitmask)
    return _sample_rows(logits, md, last_input, draft_probs, bitmask)


def _sample_in_groups(
    logits: jax.Array,
    md: SamplingMetadata,
    last_input: jax.Array,
    draft_probs: jax.Array | None,
    size: int,
    bitmask: jax.Array | None,
) -> SamplerOutput:
    """`_sample_rows` over groups of `size` rows, as many as hold the rows in use."""
    num_rows, vocab = logits.shape
    if num_rows % size:
        raise ValueError(f"group_rows={size} must divide the {num_rows} logits rows")

    def group(lo: jax.Array) -> SamplerOutput:
        return _sample_rows(
            lax.dynamic_slice_in_dim(logits, lo, size),
            _group_metadata(md, lo, size),
            lax.dynamic_slice_in_dim(last_input, lo, size),
            draft_probs,
            None if bitmask is None else lax.dynamic_slice_in_dim(bitmask, lo, size),
        )

    num_top = min(NUM_TOP_CANDIDATES, vocab)
    zeros = SamplerOutput(
        jnp.zeros(num_rows, jnp.int32),
        jnp.zeros(num_rows, jnp.float32),
        jnp.zeros((num_rows, num_top), jnp.int32),
        jnp.zeros((num_rows, num_top), jnp.float32),
    )
    return over_groups(group, size, jnp.minimum(md.used_rows[0], num_rows), zeros)


def over_groups(group: Callable[[jax.Array], T], size: int, used: jax.Array, init: T) -> T:
    """`init` (a pytree of `[N, ...]` arrays) with rows `lo` to `lo + size` replaced by
    `group(lo)`, for lo = 0, size, 2 size, ... while below `used`: one group after the
    other (one compiled body), none past the rows in use."""

    def body(g: jax.Array, outs: T) -> T:
        lo = g * size
        put = lambda whole, part: lax.dynamic_update_slice_in_dim(whole, part, lo, 0)
        return jax.tree.map(put, outs, group(lo))

    return lax.fori_loop(0, (used + size - 1) // size, body, init)


# SamplingMetadata's fields that hold one entry per row.
_ROW_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(SamplingMetadata)
    if not f.name.startswith(("penalty_", "bias_")) and f.name != "used_rows"
)


def _group_metadata(md: SamplingMetadata, lo: jax.Array, size: int) -> SamplingMetadata:
    """Rows `lo` to `lo + size` of md: their per-row columns, and the flat penalty and
    bias lists with other rows' entries made padding (token -1) and rows renumbered."""
    columns = {name: lax.dynamic_slice_in_dim(getattr(md, name), lo, size) for name in _ROW_FIELDS}
    penalty_rows = md.penalty_rows - lo
    penalty_in = (penalty_rows >= 0) & (penalty_rows < size)
    bias_rows = md.bias_rows - lo
    bias_in = (bias_rows >= 0) & (bias_rows < size)
    return dataclasses.replace(
        md,
        **columns,
        penalty_rows=jnp.where(penalty_in, penalty_rows, 0),
        penalty_token_ids=jnp.where(penalty_in, md.penalty_token_ids, -1),
        bias_rows=jnp.where(bias_in, bias_rows, 0),
        bias_token_ids=jnp.where(bias_in, md.bias_token_ids, -1),
        used_rows=jnp.full(1, size, jnp.int32),
    )


def _sample_rows(
    logits: jax.Array,
    md: SamplingMetadata,
    last_input: jax.Array,
    draft_probs: jax.Array | None,
    bitmask: jax.Array | None = None,
) -> SamplerOutput:
    """`sample` of every row at once."""
    if bitmask is not None:
        masked = jnp.any(bitmask != -1)
        logits = lax.cond(masked, apply_token_bitmask, lambda lg, _: lg, logits, bitmask)
    penalised = _bias(apply_penalties(logits, md, last_input), md)  # [S, V]
    greedy = md.temperature < SAMPLING_EPS  # [S]
    greedy_ids = argmax_rows(penalised)  # [S]

    def mixed() -> jax.Array:
        return jnp.where(greedy, greedy_ids, _draw(filter_logits(penalised, md), md))

    # An all-greedy batch (common: temperature=0 evals) skips filtering and the draws.
    token_ids = lax.cond(jnp.all(greedy), lambda: greedy_ids, mixed)  # [S]
    if draft_probs is not None:
        drafted = md.draft_q_rows >= 0  # [S]

        def verified() -> jax.Array:
            p = target_probs(penalised, md)  # [S, V]
            q = draft_probs[jnp.maximum(md.draft_q_rows, 0)]  # [S, V]
            keys = jax.vmap(_row_key)(md.seeds, md.step_index)
            decided = rejection_sample(p, q, jnp.maximum(md.draft_token_ids, 0), keys)
            return jnp.where(drafted, decided, token_ids)

        # A greedy row's verdict is its argmax whatever the draft (p and q are one-hot,
        # the residual of a wrong draft is p): only sampled rows need the rejection rule.
        token_ids = lax.cond(jnp.any(drafted & ~greedy), verified, lambda: token_ids)
    num_top = min(NUM_TOP_CANDIDATES, logits.shape[-1])

    def with_logprobs() -> tuple[jax.Array, jax.Array, jax.Array]:
        raw_logprobs = jax.nn.log_softmax(logits, axis=-1)  # [S, V]
        chosen = jnp.take_along_axis(raw_logprobs, token_ids[:, None], axis=-1)[:, 0]  # [S]
        top_logprobs, top_ids = lax.top_k(raw_logprobs, num_top)
        return chosen, top_ids.astype(jnp.int32), top_logprobs

    def without() -> tuple[jax.Array, jax.Array, jax.Array]:
        rows = logits.shape[0]
        zeros = jnp.zeros((rows, num_top), jnp.float32)
        return jnp.zeros(rows, jnp.float32), jnp.zeros((rows, num_top), jnp.int32), zeros

    # A batch in which nobody asked for logprobs skips the log-softmax and the top-k.
    logprobs, top_ids, top_logprobs = lax.cond(jnp.any(md.want_logprobs), with_logprobs, without)
    return SamplerOutput(token_ids, logprobs, top_ids, top_logprobs)


def argmax_rows(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32 (the first index of each row's maximum, or of
    its first NaN), as two plain reductions: XLA:CPU lowers argmax to a variadic
    (value, index) reduce that it does not vectorise, 1.3 against 0.4 ms for [64, 8192]
    float32 (`bench/sampler.py`)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def apply_penalties(logits: jax.Array, md: SamplingMetadata, last_input: jax.Array) -> jax.Array:
    """Repetition (prompt + output), then frequency and presence (output only)."""
    active = jnp.any(
        (md.repetition_penalty != 1.0)
        | (md.frequency_penalty != 0.0)
        | (md.presence_penalty != 0.0)
    )
    return lax.cond(active, _penalise, lambda lg, *_: lg, logits, md, last_input)


def _bias(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Adds each bias entry to its row's logit (logit_bias; -inf for bad words and the
    EOS and stop ids min_tokens holds back). A scatter of F entries, no pass over [S, V]."""
    vocab = logits.shape[-1]
    ids = jnp.where(md.bias_token_ids >= 0, md.bias_token_ids, vocab)  # padding -> V, dropped
    return logits.at[md.bias_rows, ids].add(md.bias_values, mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Sets to -inf every token whose bit is 0 in its row of `bitmask` `i32[S, ceil(V/32)]`
    (bit j of word w is token 32 w + j; -1 everywhere allows all)."""
    num_rows, vocab = logits.shape
    bits = jnp.arange(32, dtype=jnp.int32)  # [32]
    allowed = (bitmask[:, :, None] >> bits) & 1  # [S, W, 32]
    allowed = allowed.reshape(num_rows, -1)[:, :vocab]  # [S, V]
    return jnp.where(allowed.astype(bool), logits, -jnp.inf)


def _penalise(logits: jax.Array, md: SamplingMetadata, last_input: jax.Array) -> jax.Array:
    """Counts md's history entries (token -1 = padding) per row and applies the penalties."""
    num_rows, vocab = logits.shape
    # The output token still on the device joins its row's history as one more entry.
    rows = jnp.concatenate([md.penalty_rows, jnp.arange(num_rows, dtype=jnp.int32)])  # [N]
    pending = jnp.where(md.pending_output, last_input, -1)  # [S]
    token_ids = jnp.concatenate([md.penalty_token_ids, pending])  # [N = E + S]
    is_output = jnp.concatenate([md.penalty_is_output, md.pending_output])
    valid = token_ids >= 0  # [N]
    # Padding goes to index V, which mode="drop" discards (-1 would wrap to V - 1).
    ids = jnp.where(valid, token_ids, vocab)  # [N]
    counted = (valid & is_output).astype(jnp.float32)  # [N]
    output_counts = jnp.zeros_like(logits).at[rows, ids].add(counted, mode="drop")  # [S, V]
    seen = jnp.zeros(logits.shape, bool).at[rows, ids].set(True, mode="drop")  # [S, V]
    rep = md.repetition_penalty[:, None]  # [S, 1]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency_penalty[:, None] * output_counts
    return logits - md.presence_penalty[:, None] * (output_counts > 0)


def filter_logits(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Temperature, then min_p, top_k, top_p; dropped tokens become -inf.

    Greedy rows are scaled by 1 (their result is not used). The sort behind top_k/top_p
    runs only when some sampled row enables one of them.
    """
    num_rows, vocab = logits.shape
    greedy = md.temperature < SAMPLING_EPS  # [S]
    temperature = jnp.where(greedy, 1.0, md.temperature)  # [S]
    scaled = logits / temperature[:, None]  # [S, V]
    # prob < min_p * max_prob  <=>  logit - max_logit < log(min_p); log(0) = -inf keeps all.
    row_max = jnp.max(scaled, axis=-1, keepdims=True)  # [S, 1]
    scaled = jnp.where(scaled - row_max < jnp.log(md.min_p)[:, None], -jnp.inf, scaled)
    top_k = jnp.where((md.top_k <= 0) | (md.top_k > vocab), vocab, md.top_k)  # [S]
    needs_sort = jnp.any(~greedy & ((top_k < vocab) | (md.top_p < 1.0)))
    threshold = lax.cond(
        needs_sort,
        _top_k_top_p_threshold,
        lambda *_: jnp.full((num_rows,), -jnp.inf, jnp.float32),
        scaled,
        top_k,
        md.top_p,
    )  # [S]
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def _top_k_top_p_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Smallest logit each row keeps under top_k and then top_p (ties at it are kept): as
    if the row were sorted, the first top_k positions form the set, and top_p keeps its
    shortest prefix whose mass before the last token is short of top_p.

    No full sort: XLA:CPU sorts [48, 8192] in about 60 ms. The best TOP_CANDIDATES
    logits (`lax.top_k`) settle every row whose top_k is at most that many or whose
    top_p mass is reached among them; any other row's threshold is found by bisection
    over the float order (`_bisect_threshold`), run only when some row needs it.
    """
    vocab = scaled.shape[-1]
    num_cand = min(TOP_CANDIDATES, vocab)
    # The barrier keeps XLA from folding the slices below into the top_k, which turns it
    # into a full sort of [S, V] again on XLA:CPU (jax 0.10).
    cand = lax.optimization_barrier(lax.top_k(scaled, num_cand)[0])  # [S, C], descending
    row_max = cand[:, :1]  # [S, 1]
    cand_w = jnp.exp(cand - row_max)  # [S, C]
    in_set = jnp.arange(num_cand)[None, :] < top_k[:, None]  # [S, C]
    k_in_cand = top_k <= num_cand  # [S]
    wide_k = ~k_in_cand & (top_k < vocab)  # the k-th logit lies past the candidates
    kth_cand = jnp.take_along_axis(cand, jnp.clip(top_k - 1, 0, num_cand - 1)[:, None], -1)
    kth_wide, total_wide = lax.cond(
        jnp.any(wide_k),
        _wide_top_k,
        lambda *_: (jnp.full(top_k.shape, -jnp.inf), jnp.ones(top_k.shape)),
        scaled,
        row_max,
        top_k,
    )
    kth = jnp.where(k_in_cand, kth_cand[:, 0], jnp.where(wide_k, kth_wide, -jnp.inf))  # [S]
    total = jnp.where(
        k_in_cand,
        jnp.sum(jnp.where(in_set, cand_w, 0.0), axis=-1),
        jnp.where(wide_k, total_wide, jnp.sum(jnp.exp(scaled - row_max), axis=-1)),
    )  # [S]: the set's unnormalised mass
    mass_before = jnp.cumsum(cand_w, axis=-1) - cand_w  # [S, C]
    keep = in_set & ((mass_before < (top_p * total)[:, None]) | (top_p[:, None] >= 1.0))
    num_keep = jnp.sum(keep, axis=-1)  # [S], >= 1: a prefix of the candidates
    settled = k_in_cand | (num_keep < num_cand)
    by_cand = jnp.take_along_axis(cand, (num_keep - 1)[:, None], axis=-1)[:, 0]

    def by_mass() -> jax.Array:
        # The smallest logit t with less than top_p of the set's mass above it.
        keys, weights = _order_keys(scaled), jnp.exp(scaled - row_max)  # [S, V]
        limit = top_p * total

        def holds(t: jax.Array) -> jax.Array:
            return jnp.sum(jnp.where(keys > t[:, None], weights, 0.0), axis=-1) < limit

        return _key_value(_bisect_threshold(keys, holds))

    past = lax.cond(jnp.any(~settled & (top_p < 1.0)), by_mass, lambda: kth)
    wide = jnp.where(top_p < 1.0, jnp.maximum(past, kth), kth)
    return jnp.where(settled, by_cand, wide)


def _wide_top_k(
    scaled: jax.Array, row_max: jax.Array, top_k: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The k-th largest logit of each row (the smallest t with fewer than k logits above
    it) and the mass of exactly k tokens from the top, ties at the k-th included only as
    far as the set has room: `[S]` each."""
    keys = _order_keys(scaled)  # [S, V]
    kth = _key_value(_bisect_threshold(keys, lambda t: jnp.sum(keys > t[:, None], axis=-1) < top_k))
    above = scaled > kth[:, None]  # [S, V]
    ties = top_k - jnp.sum(above, axis=-1)  # [S], >= 1
    weights = jnp.where(above, jnp.exp(scaled - row_max), 0.0)
    return kth, jnp.sum(weights, axis=-1) + ties * jnp.exp(kth - row_max[:, 0])


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values (-inf lowest): a negative float's
    bits are flipped, a positive one's sign bit set."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    sign = bits >> 31
    return jnp.where(sign == 1, ~bits, bits | jnp.uint32(0x80000000))


def _key_value(key: jax.Array) -> jax.Array:
    """The float32 whose `_order_keys` key is `key`."""
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _bisect_threshold(keys: jax.Array, holds: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Per row, the smallest key t (uint32 [S]) at which `holds(t)` (bool [S], false
    below some key and true from it on) is true, searched between each row's smallest
    and largest key: 32 halvings cover the whole uint32 range."""
    lo, hi = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)

    def halve(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = holds(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    return lax.fori_loop(0, 32, halve, (lo, hi))[1]


def target_probs(penalised: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Each row's distribution after every processor: softmax of the filtered logits, or
    one-hot at the argmax for greedy rows. `[S, V]` float32."""
    greedy = md.temperature < SAMPLING_EPS
    probs = jax.nn.softmax(filter_logits(penalised, md), axis=-1)
    one_hot = jax.nn.one_hot(argmax_rows(penalised), penalised.shape[-1])
    return jnp.where(greedy[:, None], one_hot, probs)


# Folded into a row's key for the accept/reject uniform (the draws keep the plain key).
_ACCEPT_TAG = 0x5EC


def _row_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), step)


def rejection_sample(
    p: jax.Array, q: jax.Array, draft_ids: jax.Array, keys: jax.Array, residual: bool = True
) -> jax.Array:
    """Speculative sampling's decision per row: `draft_ids[i]`, drawn from `q[i]`, is kept
    with probability min(1, p(d) / q(d)); otherwise a token is drawn from the residual
    max(p - q, 0), renormalised (from p itself, were p and q equal). The result is
    distributed as p. `residual=False` draws the replacement from p instead, which is
    biased towards the draft (tests use it to show a test can tell the difference).

    p, q `[S, V]` probabilities; draft_ids `[S]`; keys `[S]` one PRNG key per row.
    """
    rows = jnp.arange(p.shape[0])
    p_d, q_d = p[rows, draft_ids], q[rows, draft_ids]  # [S]
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, _ACCEPT_TAG)))(keys)
    accept = u * q_d < p_d  # u < p(d) / q(d), without dividing by a zero q(d)
    weights = jnp.maximum(p - q, 0.0) if residual else p
    weights = jnp.where(jnp.sum(weights, axis=-1, keepdims=True) > 0, weights, p)
    replacement = argmax_rows(weights / _exponentials(keys, p.shape[-1]))
    return jnp.where(accept, draft_ids.astype(jnp.int32), replacement)


def inverse_cdf_draw(weights: jax.Array, key: jax.Array) -> jax.Array:
    """A token drawn from one row's unnormalised `weights [V]` by inverting their
    cumulative sum at one uniform draw: one random number a row, where a Gumbel-max draw
    takes one a vocabulary entry. The threshold is scaled by the total, so rounding never
    lands past the last token with weight."""
    cdf = jnp.cumsum(weights)
    threshold = jax.random.uniform(key, dtype=cdf.dtype) * cdf[-1]
    return jnp.minimum(jnp.sum(cdf <= threshold), weights.shape[-1] - 1).astype(jnp.int32)


def _draw(filtered: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Gumbel-max from softmax(filtered), one independent key per row (`_exponentials`)."""
    keys = jax.vmap(_row_key)(md.seeds, md.step_index)
    weights = jnp.exp(filtered - jnp.max(filtered, axis=-1, keepdims=True))  # dropped: 0
    noise = _exponentials(keys, filtered.shape[-1])
    return argmax_rows(weights / noise)


def _exponentials(keys: jax.Array, vocab: int) -> jax.Array:
    """`[S, V]` Exp(1) noise, row i's from `keys[i]` alone: E = -log U, with U the uniforms
    of `jax.random.gumbel` (its default mode). For weights w >= 0, argmax(w / E) is the
    Gumbel-max argmax(log w - log E) of the same draw, one log an entry fewer (on XLA:CPU
    2.9 against 4.9 ms at 64 rows of 8192)."""
    tiny = jnp.finfo(jnp.float32).tiny

    def row(key: jax.Array) -> jax.Array:
        return -jnp.log(jax.random.uniform(key, (vocab,), jnp.float32, tiny, 1.0))  # > 0

    return jax.vmap(row)(keys)


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


def make_sampling_metadata(rows: Sequence[SamplingRow], num_rows: int) -> SamplingMetadata:
    """Pack rows into numpy arrays padded to num_rows; padding rows are greedy, unpenalised.

    The bias list is MIN_BIAS_ENTRIES long and the penalty list MIN_PENALTY_ENTRIES, or
    each the next power of two that holds its entries."""
    if len(rows) > num_rows:
        raise ValueError(f"got {len(rows)} rows but num_rows={num_rows}; num_rows must be >= it")
    n = len(rows)
    # Every row's request constants (`SamplingParams.sampler_constants`), as [n, 8].
    constants = np.frombuffer(b"".join(map(_ROW_CONSTANTS, rows)), np.float64).reshape(n, 8)
    biased = [i for i, r in enumerate(rows) if r.banned_token_ids or r.params.logit_bias]
    needed = bias_entries_needed([rows[i] for i in biased])
    num_bias = max(MIN_BIAS_ENTRIES, 1 << max(needed - 1, 0).bit_length())
    # `SamplingParams.uses_penalties` of each row, read from its constants at once.
    penalties = constants[:, 4:7]
    penalised = np.flatnonzero((penalties != (0.0, 0.0, 1.0)).any(axis=1)).tolist()
    histories = [_penalty_entries(rows[i]) for i in penalised]
    num_history = sum(len(ids) for ids, _ in histories)
    num_penalty = max(MIN_PENALTY_ENTRIES, 1 << max(num_history - 1, 0).bit_length())
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
        penalty_rows=np.zeros(num_penalty, np.int32),
        penalty_token_ids=np.full(num_penalty, -1, np.int32),
        penalty_is_output=np.zeros(num_penalty, bool),
        bias_rows=np.zeros(num_bias, np.int32),
        bias_token_ids=np.full(num_bias, -1, np.int32),
        bias_values=np.zeros(num_bias, np.float32),
        want_logprobs=np.zeros(num_rows, bool),
        pending_output=np.zeros(num_rows, bool),
        draft_token_ids=np.full(num_rows, -1, np.int32),
        draft_q_rows=np.full(num_rows, -1, np.int32),
        used_rows=np.array([n], np.int32),
    )
    _fill_scalars(md, rows, constants)
    _fill_biases(md, rows, biased)
    _fill_penalty_histories(md, penalised, histories)
    return md


def _fill_scalars(md: SamplingMetadata, rows: Sequence[SamplingRow], constants: np.ndarray) -> None:
    """Per-row scalars: each row's request constants (`constants`, the rows'
    `SamplingParams.sampler_constants` as [rows, 8]) and its own five integers, each
    kind gathered in one pass (the per-step host cost at hundreds of rows)."""
    n = len(rows)
    if not n:
        return
    flat = itertools.chain.from_iterable(map(_ROW_INTS, rows))
    own = np.fromiter(flat, np.int64, 5 * n).reshape(n, 5)
    seeds, steps = own[:, 0], own[:, 1]
    bad = np.flatnonzero((seeds < 0) | (seeds > _U32_MAX))
    if bad.size:
        raise ValueError(f"row {bad[0]}: seed must be in [0, 2**32), got {seeds[bad[0]]}")
    bad = np.flatnonzero(steps < 0)
    if bad.size:
        raise ValueError(f"row {bad[0]}: step_index must be >= 0, got {steps[bad[0]]}")
    md.seeds[:n] = seeds
    md.step_index[:n] = steps
    md.pending_output[:n] = own[:, 2]
    md.draft_token_ids[:n] = own[:, 3]
    md.draft_q_rows[:n] = own[:, 4]
    columns = (
        md.temperature,
        md.top_p,
        md.top_k,
        md.min_p,
        md.presence_penalty,
        md.frequency_penalty,
        md.repetition_penalty,
        md.want_logprobs,
    )
    for j, column in enumerate(columns):
        column[:n] = constants[:, j]


_ROW_INTS = operator.attrgetter(
    "seed", "step_index", "pending_output", "draft_token_id", "draft_q_row"
)
_ROW_CONSTANTS = operator.attrgetter("params.sampler_constants")


def _fill_biases(md: SamplingMetadata, rows: Sequence[SamplingRow], biased: list[int]) -> None:
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

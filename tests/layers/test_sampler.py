"""Tests for jvllm.layers.sampler against numpy (and torch for logprobs) references."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import pytest
import torch

from jvllm.engine.step_io import SamplingRow
from jvllm.layers.sampler import (
    MIN_BIAS_ENTRIES,
    MIN_PENALTY_ENTRIES,
    SamplerOutput,
    SamplingMetadata,
    apply_penalties,
    apply_token_bitmask,
    argmax_rows,
    filter_logits,
    make_sampling_metadata,
    penalty_entries_needed,
    sample,
)
from jvllm.layers.sampler.draws import RACE_BLOCK, blocked_race, row_key
from jvllm.sampling_params import NUM_TOP_CANDIDATES, SamplingParams

sample_jit = jax.jit(sample)
penalties_jit = jax.jit(apply_penalties)
filter_jit = jax.jit(filter_logits)


def _row(
    seed: int = 0,
    step: int = 0,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    **params: Any,
) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, step, list(prompt), list(output))


def _logits(rows: int, vocab: int, seed: int = 0, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


# ---- numpy references ---------------------------------------------------------------


def np_penalise(
    logits: np.ndarray,  # [V]
    prompt: Sequence[int],
    output: Sequence[int],
    rep: float,
    freq: float,
    pres: float,
) -> np.ndarray:
    vocab = logits.shape[-1]
    seen = np.zeros(vocab, bool)
    seen[list(prompt) + list(output)] = True
    counts = np.bincount(np.asarray(output, np.int64), minlength=vocab).astype(np.float32)
    rep = np.float32(rep)
    out = np.where(seen, np.where(logits > 0, logits / rep, logits * rep), logits)
    out = out - np.float32(freq) * counts
    return out - np.float32(pres) * (counts > 0)


def np_distribution(
    logits: np.ndarray,  # [V]
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> np.ndarray:  # [V]
    """The renormalised distribution a sampled row draws from, in float64."""
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    allowed = probs >= min_p * probs.max()
    order = np.argsort(-scaled)
    if top_k > 0:
        allowed &= np.isin(np.arange(len(scaled)), order[:top_k])
    probs = np.where(allowed, probs, 0.0)
    probs /= probs.sum()
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep_sorted = (mass_before < top_p) & allowed[order]
    allowed_final = np.zeros_like(allowed)
    allowed_final[order[keep_sorted]] = True
    probs = np.where(allowed_final, probs, 0.0)
    return probs / probs.sum()


FILTER_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=1.7),
    dict(top_k=1),
    dict(top_k=5),
    dict(top_p=0.5),
    dict(top_p=0.9),
    dict(min_p=0.1),
    dict(min_p=0.3, temperature=0.7),
    dict(top_k=6, top_p=0.8),
    dict(top_k=8, top_p=0.95, min_p=0.05, temperature=0.8),
]


# ---- penalties ----------------------------------------------------------------------


def test_penalties_match_numpy() -> None:
    vocab = 40
    rows = [
        _row(prompt=[1, 2, 3, 3], output=[3, 4, 4, 4], repetition_penalty=1.3),
        _row(prompt=[5, 6], output=[6, 7, 7], frequency_penalty=0.7),
        _row(prompt=[8], output=[8, 9, 9], presence_penalty=-1.2),
        _row(
            prompt=[0, 10, 11],
            output=[11, 12, 12],
            repetition_penalty=0.8,
            frequency_penalty=-0.4,
            presence_penalty=1.5,
        ),
        _row(prompt=[1, 2], output=[3]),  # no penalties: untouched
        _row(prompt=[13, 14], output=[], repetition_penalty=2.0),  # prompt only
    ]
    md = make_sampling_metadata(rows, num_rows=8)
    logits = _logits(8, vocab, seed=1)
    got = np.asarray(penalties_jit(logits, md, np.zeros(8, np.int32)))
    for i, row in enumerate(rows):
        p = row.params
        want = np_penalise(
            logits[i],
            row.prompt_token_ids,
            row.output_token_ids,
            p.repetition_penalty,
            p.frequency_penalty,
            p.presence_penalty,
        )
        # XLA may divide by r as a multiply by 1/r: allow that one rounding, nothing more.
        np.testing.assert_allclose(got[i], want, rtol=0, atol=1e-6, err_msg=f"row {i}")
    np.testing.assert_array_equal(got[len(rows) :], logits[len(rows) :])  # padding rows


def test_a_pending_output_token_is_penalised_like_a_known_one() -> None:
    """The overlapped engine's newest token is still on the device: the row's last input
    token joins its history there, with the same result as a host-side history."""
    known = [
        _row(prompt=[1, 2], output=[3, 5], repetition_penalty=1.3, frequency_penalty=0.5),
        _row(prompt=[7], output=[7, 8], presence_penalty=0.9),
    ]
    pending = [
        row._replace(output_token_ids=row.output_token_ids[:-1], pending_output=True)
        for row in known
    ]
    logits = _logits(8, 16, seed=2)
    want = penalties_jit(logits, make_sampling_metadata(known, 8), np.zeros(8, np.int32))
    last_input = np.array([5, 8, 0, 0, 0, 0, 0, 0], np.int32)
    got = penalties_jit(logits, make_sampling_metadata(pending, 8), last_input)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_greedy_with_penalties_takes_argmax_of_penalised_logits() -> None:
    vocab = 16
    logits = np.zeros((2, vocab), np.float32)
    logits[:, 3] = 5.0
    logits[:, 4] = 4.0
    rows = [_row(temperature=0, output=[3], presence_penalty=2.0), _row(temperature=0, output=[3])]
    md = make_sampling_metadata(rows, 2)
    assert np.asarray(sample_jit(logits, md).token_ids).tolist() == [4, 3]


def test_rows_without_penalties_leave_logits_untouched() -> None:
    rows = [_row(temperature=0), _row(seed=3, temperature=1.0)]
    assert penalty_entries_needed(rows) == 0
    md = make_sampling_metadata(rows, 2)
    assert md.penalty_token_ids.tolist() == [-1] * MIN_PENALTY_ENTRIES
    logits = _logits(2, 32)
    got = penalties_jit(logits, md, np.zeros(2, np.int32))
    np.testing.assert_array_equal(np.asarray(got), logits)
    assert int(sample_jit(logits, md).token_ids[0]) == int(np.argmax(logits[0]))


# ---- greedy and logprobs ------------------------------------------------------------


def test_greedy_is_argmax_and_padding_rows_are_greedy() -> None:
    logits = _logits(6, 100, seed=2)
    rows = [_row(temperature=0.0), _row(temperature=1e-6, top_k=3, top_p=0.2)]
    md = make_sampling_metadata(rows, 6)
    np.testing.assert_array_equal(np.asarray(sample_jit(logits, md).token_ids), logits.argmax(-1))


def test_argmax_rows_is_numpys_argmax_with_ties_infinities_and_nans() -> None:
    rng = np.random.default_rng(5)
    x = rng.integers(-3, 4, size=(9, 257)).astype(np.float32)  # many ties at the maximum
    x[1] = -np.inf  # every entry -inf: the first index
    x[2, [7, 200]] = np.inf
    x[3, [5, 100]] = np.nan  # the first NaN wins, as in numpy
    x[4, -1] = 1e30  # the last index
    x[5] = 0.0
    got = np.asarray(jax.jit(argmax_rows)(x))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax_rows)(x[0])), np.argmax(x[0]))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_raw_log_softmax(temperature: float) -> None:
    logits = _logits(5, 64, seed=3, scale=4.0)
    rows = [
        _row(
            seed=i,
            temperature=temperature,
            top_k=4,
            repetition_penalty=1.5,
            frequency_penalty=1.0,
            prompt=[1, 2],
            output=[int(logits[i].argmax())],
            logprobs=5 if i == 2 else None,  # one row asking computes them for every row
        )
        for i in range(5)
    ]
    out = sample_jit(logits, make_sampling_metadata(rows, 5))
    ref = torch.log_softmax(torch.from_numpy(logits), dim=-1)
    ids = torch.from_numpy(np.array(out.token_ids)).long()
    np.testing.assert_allclose(out.logprobs, ref.gather(1, ids[:, None])[:, 0], atol=1e-5)
    ref_top = torch.topk(ref, NUM_TOP_CANDIDATES, dim=-1)
    assert out.top_ids.shape == (5, NUM_TOP_CANDIDATES)
    np.testing.assert_array_equal(out.top_ids, ref_top.indices.numpy())
    np.testing.assert_allclose(out.top_logprobs, ref_top.values.numpy(), atol=1e-5)


# ---- filtering and sampling distribution ----------------------------------------------


@pytest.mark.parametrize("params", FILTER_CASES, ids=str)
def test_filter_keeps_exactly_the_numpy_allowed_set(params: dict) -> None:
    logits = _logits(4, 50, seed=4)
    md = make_sampling_metadata([_row(**params)] * 4, 4)
    got = np.asarray(filter_jit(logits, md))
    for i in range(4):
        want = np_distribution(logits[i], **params) > 0
        np.testing.assert_array_equal(np.isfinite(got[i]), want, err_msg=f"row {i}")


def np_kept_by_sort(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The tokens top_k then top_p keep, from a full sort (float64): the first top_k
    sorted positions form the set, top_p keeps its shortest prefix whose mass before the
    last token is short of top_p, and every token tied with the last one kept stays."""
    order = np.sort(scaled.astype(np.float64))[::-1]
    k = len(order) if top_k <= 0 else min(top_k, len(order))
    weights = np.exp(order[:k] - order[0])
    mass_before = np.cumsum(weights) - weights
    num_keep = k if top_p >= 1.0 else int(np.sum(mass_before < top_p * weights.sum()))
    return scaled >= order[num_keep - 1]


def test_filter_past_the_top_candidates_matches_a_full_sort() -> None:
    """Rows whose top_k exceeds the candidates lax.top_k reads, or whose top_p nucleus
    reaches past them (a flat distribution), take the bisection path; ties at the
    threshold (logits rounded to a coarse grid) and -inf logits (min_p) included."""
    vocab, rng = 400, np.random.default_rng(11)
    cases = [
        dict(top_k=100),
        dict(top_k=399),
        dict(top_k=300, top_p=0.5),
        dict(top_p=0.9),
        dict(top_p=0.3),
        dict(top_k=50, top_p=0.99),
        dict(top_k=70, top_p=0.9, min_p=0.2),
        dict(top_p=0.95, min_p=0.05),
    ]
    for scale, grid in [(0.05, 0.0), (1.0, 0.0), (4.0, 0.0), (1.0, 0.25)]:
        logits = (rng.standard_normal((len(cases), vocab)) * scale).astype(np.float32)
        if grid:
            logits = np.round(logits / grid) * grid  # many exact ties
        rows = [_row(**params) for params in cases]
        got = np.asarray(filter_jit(logits, make_sampling_metadata(rows, len(rows))))
        for i, params in enumerate(cases):
            scaled = logits[i].astype(np.float64)
            min_p = params.get("min_p", 0.0)
            scaled = np.where(np.exp(scaled - scaled.max()) < min_p, -np.inf, scaled)
            want = np_kept_by_sort(scaled, params.get("top_k", -1), params.get("top_p", 1.0))
            np.testing.assert_array_equal(
                np.isfinite(got[i]), want, err_msg=f"scale {scale} grid {grid} {params}"
            )


@pytest.mark.parametrize("params", FILTER_CASES, ids=str)
def test_sampled_frequencies_match_numpy_distribution(params: dict) -> None:
    num, vocab = 4000, 12
    logits = np.tile(_logits(1, vocab, seed=5, scale=1.5), (num, 1))
    rows = [_row(seed=s, step=s % 7, **params) for s in range(num)]
    tokens = np.asarray(sample_jit(logits, make_sampling_metadata(rows, num)).token_ids)
    want = np_distribution(logits[0], **params)
    assert np.all(want[tokens] > 0), "sampled a token outside the allowed set"
    freq = np.bincount(tokens, minlength=vocab) / num
    # Deterministic seeds, so this 5-sigma bound never flakes; it catches a wrong scale.
    bound = 5 * np.sqrt(want * (1 - want) / num) + 2 / num
    assert np.all(np.abs(freq - want) <= bound), (freq, want)


@pytest.mark.slow
@pytest.mark.parametrize("num, group_rows", [(512, None), (200, 40)])
def test_the_draw_races_blocks_then_entries_with_jax_gumbel_noise(num: int, group_rows):
    """A sampled row's token is a Gumbel-max over its blocks of 256 entries (log of
    each block's float64 softmax mass plus `jax.random.gumbel` of the row's key), then
    over the winning block's entries (noise from the key folded with 1), token for
    token; the same when the rows go in groups (`group_rows`: 200 rows, five groups of
    40); vocabs of whole blocks, of one partial block, and of several and a part."""
    draw = jax.jit(functools.partial(sample, group_rows=group_rows))
    for vocab, scale in ((8192, 1.0), (40, 3.0), (1000, 2.0)):
        logits = _logits(num, vocab, seed=vocab, scale=scale)
        rows = [_row(seed=7 * i, step=i % 9, temperature=0.8) for i in range(num)]
        tokens = np.asarray(draw(logits, make_sampling_metadata(rows, num)).token_ids)
        seeds, steps = np.arange(num) * 7, np.arange(num) % 9
        blocks = -(-vocab // RACE_BLOCK)

        def noise(seed: jax.Array, step: jax.Array, blocks: int = blocks) -> tuple:
            key = jax.random.fold_in(jax.random.key(seed), step)
            entry_key = jax.random.fold_in(key, 1)
            return (
                jax.random.gumbel(key, (blocks,), mode="low"),
                jax.random.gumbel(entry_key, (RACE_BLOCK,), mode="low"),
            )

        block_noise, entry_noise = (np.asarray(a) for a in jax.vmap(noise)(seeds, steps))
        scaled = logits.astype(np.float64) / 0.8
        weights = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
        weights = np.pad(weights, ((0, 0), (0, blocks * RACE_BLOCK - vocab)))
        by_block = weights.reshape(num, blocks, RACE_BLOCK)
        with np.errstate(divide="ignore"):  # padding and empty blocks: log 0 = -inf
            block = np.argmax(np.log(by_block.sum(-1)) + block_noise, axis=-1)
            entries = np.log(by_block[np.arange(num), block]) + entry_noise
        np.testing.assert_array_equal(tokens, block * RACE_BLOCK + np.argmax(entries, axis=-1))


def test_blocked_race_never_draws_a_token_without_weight() -> None:
    """Zero-weight tokens (dropped by a filter, a whole empty block, past a partial
    block) are never drawn; a row of one token gives it whatever the key."""
    rng = np.random.default_rng(3)
    rows, vocab = 256, 700  # three blocks of 256, the last one partly padding
    weights = np.exp(rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    weights[:, :5] = 0.0
    weights[:, 600:] = 0.0
    weights[::4, 256:512] = 0.0
    weights[1::4, rng.choice(vocab, 300, replace=False)] = 0.0
    weights[2::4, :] = np.where(rng.random(vocab) < 0.99, 0.0, weights[2::4, :])  # sparse
    keys = jax.vmap(row_key)(np.arange(rows), np.zeros(rows, np.int32))
    tokens = np.asarray(jax.jit(blocked_race)(weights, keys))
    assert np.all(weights[np.arange(rows), tokens] > 0)
    one = np.zeros((rows, vocab), np.float32)
    one[:, 517] = 0.25
    np.testing.assert_array_equal(np.asarray(jax.jit(blocked_race)(one, keys)), 517)


def test_blocked_race_gives_a_row_the_same_token_in_any_batch() -> None:
    """Bit for bit the same token for a row alone, in batches of other sizes, in any
    position, jitted or not: its sums never depend on the other rows."""
    rng = np.random.default_rng(4)
    weights = np.exp(rng.normal(size=(48, 8192)) * 4).astype(np.float32)
    keys = jax.vmap(row_key)(rng.integers(0, 2**31, 48), np.arange(48))
    whole = np.asarray(jax.jit(blocked_race)(weights, keys))
    for size in (1, 5, 16):
        for lo in range(0, 48 - size + 1, 11):
            part = np.asarray(blocked_race(weights[lo : lo + size], keys[lo : lo + size]))
            np.testing.assert_array_equal(part, whole[lo : lo + size])
    order = rng.permutation(48)
    shuffled = np.asarray(jax.jit(blocked_race)(weights[order], keys[order]))
    np.testing.assert_array_equal(shuffled, whole[order])


def _mixed_rows(num: int, vocab: int) -> list[SamplingRow]:
    """Rows of every kind: each filter, greedy, penalties with their histories, a
    pending output, logit biases, bans, logprobs, and draft tokens with q rows."""
    rng = np.random.default_rng(num)
    rows = []
    for i in range(num):
        params: dict[str, Any] = dict(FILTER_CASES[i % len(FILTER_CASES)])
        if i % 7 == 3:
            params = dict(temperature=0.0)
        if i % 5 < 2:  # strong enough that another row's history would show
            params |= dict(repetition_penalty=3.0, frequency_penalty=1.5, presence_penalty=1.0)
        if i % 4 == 2:
            params["logit_bias"] = {int(t): float(rng.normal()) for t in rng.choice(vocab, 3)}
        if i % 3 == 0:
            params["logprobs"] = 2
        prompt, output = rng.integers(0, vocab, 20).tolist(), rng.integers(0, vocab, i % 6).tolist()
        bans = rng.integers(0, vocab, 2).tolist() if i % 6 == 5 else ()
        draft = (int(rng.integers(vocab)), i // 2) if i % 2 else (-1, -1)
        rows.append(
            SamplingRow(
                SamplingParams(**params), 31 * i, i % 5, prompt, output, bans, i % 8 == 0, *draft
            )
        )
    return rows


@pytest.mark.slow
def test_grouped_rows_give_each_row_what_the_whole_batch_gives_it() -> None:
    """Sampling in groups of rows (`group_rows`, as on CPU devices) gives every row in
    use the token the whole batch at once gives it, and every row that asked for
    logprobs the same logprobs, whatever its filters, penalties, biases, bans, pending
    output, draft or token bitmask (applied in the groups, as `apply_token_bitmask`
    before the whole batch); the rows past those in use come back zero, their groups
    not run."""
    num, used, vocab = 96, 83, 300
    logits = _logits(num, vocab, seed=11, scale=2.5)
    md = make_sampling_metadata(_mixed_rows(used, vocab), num)
    rng = np.random.default_rng(1)
    last_input = rng.integers(0, vocab, num).astype(np.int32)
    q = np.random.default_rng(2).dirichlet(np.ones(vocab), used).astype(np.float32)
    bitmask = np.full((num, -(-vocab // 32)), -1, np.int32)
    bitmask[4:used:9] = rng.integers(-(2**31), 2**31, (len(range(4, used, 9)), bitmask.shape[1]))
    whole = sample_jit(np.asarray(jax.jit(apply_token_bitmask)(logits, bitmask)), md, last_input, q)
    asked = np.flatnonzero(md.want_logprobs)
    assert 0 < len(asked) < used
    for size in (16, 32, 48):  # six groups of 16 (one partly padding, one not run) ...
        grouped = jax.jit(functools.partial(sample, group_rows=size))(
            logits, md, last_input, q, bitmask=bitmask
        )
        runs = -(-used // size) * size  # rows of the groups that ran
        for name, a, b in zip(SamplerOutput._fields, grouped, whole, strict=True):
            a, b = np.asarray(a), np.asarray(b)
            rows = slice(0, used) if name == "token_ids" else asked
            np.testing.assert_allclose(a[rows], b[rows], rtol=1e-6, err_msg=name)
            assert not a[runs:].any(), name
    with pytest.raises(ValueError, match="must divide the 96 logits rows"):
        jax.jit(functools.partial(sample, group_rows=40))(logits, md, last_input, q)


def test_one_seed_across_steps_matches_distribution() -> None:
    num, vocab = 4000, 10
    logits = np.tile(_logits(1, vocab, seed=6), (num, 1))
    rows = [_row(seed=123, step=s, temperature=0.9) for s in range(num)]
    tokens = np.asarray(sample_jit(logits, make_sampling_metadata(rows, num)).token_ids)
    want = np_distribution(logits[0], temperature=0.9)
    freq = np.bincount(tokens, minlength=vocab) / num
    assert np.all(np.abs(freq - want) <= 5 * np.sqrt(want * (1 - want) / num) + 2 / num)


def test_sampled_tokens_stay_in_allowed_set_in_a_mixed_batch() -> None:
    vocab, num = 30, 64
    logits = _logits(num, vocab, seed=7)
    rows = [_row(seed=1000 + i, **FILTER_CASES[i % len(FILTER_CASES)]) for i in range(num)]
    tokens = np.asarray(sample_jit(logits, make_sampling_metadata(rows, num)).token_ids)
    for i, token in enumerate(tokens):
        assert np_distribution(logits[i], **FILTER_CASES[i % len(FILTER_CASES)])[token] > 0


# ---- determinism --------------------------------------------------------------------


@pytest.mark.slow
def test_row_token_ignores_other_rows_and_padding() -> None:
    vocab = 200
    target = _logits(1, vocab, seed=8, scale=0.5)[0]
    cases = [dict(temperature=1.0), dict(top_p=0.9), dict(top_k=50, min_p=0.01)]
    for params in cases:
        tokens = set()
        for others, num_rows, other_params in [
            (0, 1, {}),
            (3, 4, dict(temperature=0)),
            (3, 8, dict(top_k=2, top_p=0.3)),
            (5, 16, dict(temperature=2.0, repetition_penalty=1.2)),
        ]:
            rows = [_row(seed=42, step=9, **params)]
            rows += [_row(seed=o, step=o, prompt=[1], **other_params) for o in range(others)]
            logits = _logits(num_rows, vocab, seed=num_rows)
            logits[0] = target
            md = make_sampling_metadata(rows, num_rows)
            tokens.add(int(sample_jit(logits, md).token_ids[0]))
        assert len(tokens) == 1, (params, tokens)


def test_step_index_and_seed_select_different_streams() -> None:
    vocab, num = 1000, 64
    logits = np.zeros((num, vocab), np.float32)  # uniform: every draw is pure noise

    def draw(rows: list[SamplingRow]) -> np.ndarray:
        return np.asarray(sample_jit(logits, make_sampling_metadata(rows, num)).token_ids)

    by_step = draw([_row(seed=5, step=s) for s in range(num)])
    assert len(set(by_step.tolist())) > num * 0.9
    by_seed = draw([_row(seed=s, step=0) for s in range(num)])
    assert len(set(by_seed.tolist())) > num * 0.9
    again = draw([_row(seed=5, step=s) for s in range(num)])
    np.testing.assert_array_equal(by_step, again)
    shifted = draw([_row(seed=5, step=s + 1) for s in range(num)])
    np.testing.assert_array_equal(shifted[:-1], by_step[1:])
    assert np.mean(shifted != by_step) > 0.9


# ---- compilation --------------------------------------------------------------------


def test_new_parameter_values_do_not_recompile() -> None:
    traces = []

    def counted(logits: jax.Array, md: SamplingMetadata) -> SamplerOutput:
        traces.append(1)  # runs once per trace, i.e. once per compiled program
        return sample(logits, md)

    fn = jax.jit(counted)
    logits = _logits(4, 32)
    batches = [
        [_row(temperature=0)] * 4,
        [_row(seed=1, temperature=0.3, top_k=3)],
        [_row(seed=2**32 - 1, step=77, top_p=0.5, min_p=0.2)],
        [_row(seed=9, prompt=[1], output=[2, 2], repetition_penalty=1.1, presence_penalty=1.0)],
        [_row(seed=3, temperature=1.9, frequency_penalty=-2.0, output=[5, 6, 7])],
    ]
    for rows in batches:
        fn(logits, make_sampling_metadata(rows, 4)).token_ids.block_until_ready()
    assert len(traces) == 1
    assert fn._cache_size() == 1


# ---- host-side packing --------------------------------------------------------------


def test_make_sampling_metadata_packs_and_pads() -> None:
    rows = [
        _row(seed=7, step=3, temperature=0.5, top_k=-1, top_p=0.9, min_p=0.1),
        _row(seed=8, prompt=[4, 4, 5, 6], output=[6, 9, 9], frequency_penalty=0.5),
    ]
    assert penalty_entries_needed(rows) == 5  # prompt deduplicated, minus ids in the output
    md = make_sampling_metadata(rows, num_rows=4)
    dtypes = {f.name: getattr(md, f.name).dtype for f in dataclasses.fields(md)}
    assert dtypes["seeds"] == np.uint32 and dtypes["penalty_is_output"] == np.bool_
    assert dtypes["top_k"] == np.int32 and dtypes["temperature"] == np.float32
    assert md.top_k.tolist() == [0, 0, 0, 0]
    assert md.temperature.tolist() == [0.5, 1.0, 0.0, 0.0]  # padding rows are greedy
    assert md.seeds.tolist() == [7, 8, 0, 0] and md.step_index.tolist() == [3, 0, 0, 0]
    # One flat list for the batch: only row 1 has penalties; padding after its entries.
    assert len(md.penalty_token_ids) == MIN_PENALTY_ENTRIES
    assert md.penalty_rows[:5].tolist() == [1] * 5
    assert md.penalty_token_ids[:6].tolist() == [4, 5, 6, 9, 9, -1]
    assert md.penalty_is_output[:6].tolist() == [False, False, True, True, True, False]
    assert md.repetition_penalty.tolist() == [1.0] * 4


def test_sampling_metadata_columns_match_each_rows_params() -> None:
    """Every per-row column, from the params' cached constants and the rows' own
    integers, equals the value read off that row (hundreds of distinct params)."""
    rng = np.random.default_rng(3)
    rows = []
    for i in range(300):
        params = SamplingParams(
            temperature=float(rng.choice([0.0, 0.7, 1.3])),
            top_p=float(rng.uniform(0.1, 1.0)),
            top_k=int(rng.choice([-1, 1, 50])),
            min_p=float(rng.uniform(0.0, 0.5)),
            presence_penalty=float(rng.uniform(-2, 2)),
            frequency_penalty=float(rng.uniform(-2, 2)),
            repetition_penalty=float(rng.uniform(0.5, 2)),
            logprobs=None if i % 3 else 2,
        )
        pending, draft, q_row = bool(i % 2), int(rng.integers(-1, 9)), int(rng.integers(-1, 9))
        rows.append(SamplingRow(params, i * 11, i, (1,), (2,), (), pending, draft, q_row))
    md = make_sampling_metadata(rows, num_rows=320)
    f32 = np.float32
    for i, r in enumerate(rows):
        p = r.params
        assert md.temperature[i] == f32(p.temperature) and md.top_p[i] == f32(p.top_p)
        assert md.top_k[i] == max(p.top_k, 0) and md.min_p[i] == f32(p.min_p)
        assert md.presence_penalty[i] == f32(p.presence_penalty)
        assert md.frequency_penalty[i] == f32(p.frequency_penalty)
        assert md.repetition_penalty[i] == f32(p.repetition_penalty)
        assert md.want_logprobs[i] == (p.logprobs is not None)
        assert (md.seeds[i], md.step_index[i], md.pending_output[i]) == (
            i * 11,
            i,
            r.pending_output,
        )
        assert (md.draft_token_ids[i], md.draft_q_rows[i]) == (r.draft_token_id, r.draft_q_row)
    # A clone is a new request's parameters: its own constants, not the original's.
    clone = rows[0].params.clone(temperature=0.25)
    md = make_sampling_metadata([rows[0]._replace(params=clone)], num_rows=1)
    assert md.temperature.tolist() == [0.25]


@pytest.mark.parametrize(
    ("rows", "num_rows", "match"),
    [
        ([_row()] * 3, 2, "num_rows"),
        ([_row(seed=2**32)], 1, "seed"),
        ([_row(seed=-1)], 1, "seed"),
        ([_row(step=-1)], 1, "step_index"),
        ([_row(prompt=[-1], repetition_penalty=1.1)], 1, "token ids"),
    ],
)
def test_make_sampling_metadata_rejects(rows: list[SamplingRow], num_rows: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_sampling_metadata(rows, num_rows)


def test_penalty_histories_of_any_length_share_one_program_up_to_the_list() -> None:
    """Histories from 1 to thousands of tokens, on any rows, fill one flat list of
    MIN_PENALTY_ENTRIES: one compiled sampler. Past it the list doubles (one more)."""
    fn = jax.jit(lambda logits, md: sample(logits, md))  # a cache of its own
    logits = _logits(4, 64)
    rng = np.random.default_rng(5)
    for length in (1, 7, 100, 1000, MIN_PENALTY_ENTRIES // 4 - 10):
        rows = [
            _row(seed=i, output=rng.integers(0, 64, length).tolist(), frequency_penalty=0.3)
            for i in range(4)
        ]
        md = make_sampling_metadata(rows, 4)
        assert len(md.penalty_token_ids) == MIN_PENALTY_ENTRIES
        got = np.asarray(penalties_jit(logits, md, np.zeros(4, np.int32)))
        for i, row in enumerate(rows):
            want = np_penalise(logits[i], [], row.output_token_ids, 1.0, 0.3, 0.0)
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-3)
        fn(logits, md).token_ids.block_until_ready()
    assert fn._cache_size() == 1
    long_rows = [_row(output=[1] * (MIN_PENALTY_ENTRIES // 2 + 1), presence_penalty=1.0)] * 2
    assert len(make_sampling_metadata(long_rows, 4).penalty_token_ids) == 2 * MIN_PENALTY_ENTRIES


def test_banned_tokens_are_never_chosen_but_keep_raw_logprobs() -> None:
    logits = _logits(3, 50, seed=9)
    top = logits.argmax(-1)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=1), 0, 0, (), (), [int(top[0])]),
        SamplingRow(SamplingParams(temperature=1.0), 5, 0, (), (), [int(top[1]), 3]),
        _row(temperature=0.0),
    ]
    md = make_sampling_metadata(rows, 4)
    out = sample_jit(np.pad(logits, ((0, 1), (0, 0))), md)
    assert out.token_ids[0] == np.argsort(-logits[0])[1]  # the runner-up
    assert out.token_ids[1] not in (top[1], 3) and out.token_ids[2] == top[2]
    assert out.top_ids[0, 0] == top[0]  # logprobs stay those of the raw logits


def test_logit_bias_adds_to_the_logits_it_names_and_nothing_else() -> None:
    logits = _logits(3, 40, seed=4)
    bias = {5: 3.5, 17: -2.0, 39: 100.0}
    rows = [
        _row(temperature=0.0, logprobs=1, logit_bias=bias),
        _row(temperature=0.0),
        _row(temperature=0.0, logit_bias={int(logits[2].argmax()): -100.0}),
    ]
    md = make_sampling_metadata(rows, 3)
    assert md.bias_token_ids.shape == (MIN_BIAS_ENTRIES,)  # one width for every step
    out = sample_jit(logits, md)
    want = logits.copy()
    for token, value in bias.items():
        want[0, token] += value
    want[2, logits[2].argmax()] -= 100.0
    np.testing.assert_array_equal(np.asarray(out.token_ids), want.argmax(-1))
    assert out.token_ids[0] == 39 and out.token_ids[1] == logits[1].argmax()
    np.testing.assert_allclose(  # raw logprobs: the bias is not in them (vLLM's default)
        np.asarray(out.logprobs)[0], torch.log_softmax(torch.tensor(logits[0]), -1)[39], rtol=1e-5
    )


def test_bias_list_grows_past_its_minimum_in_powers_of_two() -> None:
    wide = {t: 1.0 for t in range(300)}
    rows = [_row(logit_bias=wide) for _ in range(4)]  # 1200 entries
    md = make_sampling_metadata(rows, 4)
    assert md.bias_token_ids.shape == (2048,)
    assert (md.bias_rows[:1200] == np.repeat(np.arange(4), 300)).all()
    logits = _logits(4, 400, seed=1)
    got = np.asarray(
        sample_jit(logits, dataclasses.replace(md, temperature=np.zeros(4, np.float32))).token_ids
    )
    want = logits.copy()
    want[:, :300] += 1.0
    np.testing.assert_array_equal(got, want.argmax(-1))


@pytest.mark.parametrize("vocab", [31, 32, 33, 100])
def test_token_bitmask_keeps_exactly_the_set_bits(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    allowed = rng.random((3, vocab)) < 0.3
    allowed[:, 0] = True
    words = -(-vocab // 32)
    bits = np.zeros((3, words * 32), bool)
    bits[:, :vocab] = allowed
    bitmask = np.packbits(bits, axis=1, bitorder="little").view("<i4").astype(np.int32)
    logits = _logits(3, vocab, seed=vocab)
    got = np.asarray(jax.jit(apply_token_bitmask)(logits, bitmask))
    np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))
    everything = np.full((3, words), -1, np.int32)
    np.testing.assert_array_equal(np.asarray(apply_token_bitmask(logits, everything)), logits)


def test_no_logprobs_requested_skips_them_without_changing_tokens() -> None:
    logits = _logits(4, 40, seed=2)
    rows = [_row(seed=i, temperature=0.9) for i in range(4)]
    plain = sample_jit(logits, make_sampling_metadata(rows, 4))
    rows[1] = _row(seed=1, temperature=0.9, logprobs=2)
    asked = sample_jit(logits, make_sampling_metadata(rows, 4))
    np.testing.assert_array_equal(np.asarray(plain.token_ids), np.asarray(asked.token_ids))
    assert not np.asarray(plain.top_logprobs).any() and np.asarray(asked.top_logprobs).all()


def _speculative_draws(
    p: np.ndarray, q: np.ndarray, n: int, residual: bool
) -> tuple[np.ndarray, np.ndarray]:
    """n seeded runs of one speculative position: the drafts d ~ q and what
    rejection_sample made of them."""
    import jax.numpy as jnp

    from jvllm.layers.sampler import rejection_sample

    keys = jax.vmap(jax.random.key)(jnp.arange(n, dtype=jnp.uint32))
    draw = lambda k: jax.random.categorical(jax.random.fold_in(k, 7), jnp.log(q))
    drafts = jax.vmap(draw)(keys)
    tiled_p, tiled_q = jnp.tile(p, (n, 1)), jnp.tile(q, (n, 1))
    return np.asarray(drafts), np.asarray(
        rejection_sample(tiled_p, tiled_q, drafts, keys, residual)
    )


@pytest.mark.slow
def test_rejection_sampling_follows_the_target_distribution():
    """Chi-square against the exact target p over 20 000 seeded draws (significance
    1e-3); the same draws without the residual correction are rejected, so the test
    can tell the difference."""
    from scipy.stats import chisquare

    p = np.array([0.05, 0.4, 0.1, 0.25, 0.15, 0.05], np.float32)
    q = np.array([0.3, 0.1, 0.3, 0.1, 0.1, 0.1], np.float32)  # the draft disagrees
    n = 20_000
    for residual, should_fit in ((True, True), (False, False)):
        _, tokens = _speculative_draws(p, q, n, residual)
        counts = np.bincount(tokens, minlength=len(p))
        pvalue = chisquare(counts, n * p).pvalue
        assert (pvalue > 1e-3) == should_fit, (residual, counts, pvalue)
    # A draft from the target's own distribution is always kept.
    drafts, tokens = _speculative_draws(p, p, 500, True)
    assert (tokens == drafts).all()
    # A draft the target gives no mass is never kept; the residual is the target.
    target = np.array([0, 0.5, 0, 0.5, 0, 0], np.float32)
    drafts, tokens = _speculative_draws(target, np.eye(6, dtype=np.float32)[0], 500, True)
    assert (drafts == 0).all() and set(tokens.tolist()) == {1, 3}

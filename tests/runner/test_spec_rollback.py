"""Correcting a speculative step scheduled before the last verdict, on the device
(`runner/spec_rollback.py`): the verdict equals the host's `spec_decode.verify`, and a
batch packed at the optimistic lengths, rolled back by the device's rejected counts,
is the batch the host packs once it knows the verdict."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.engine.spec_decode import verify
from jvllm.engine.step_io import PLACEHOLDER_TOKEN
from jvllm.runner.draft_feed import feed_draft_tokens, padded_sources
from jvllm.runner.drafter import ProposalInputs
from jvllm.runner.input_batch import BatchShape, _packed_sizes, pack_rows, unpack
from jvllm.runner.spec_rollback import (
    device_verdict,
    feed_buffer,
    proposal_from_verdict,
    roll_back_rows,
)
from tests.runner.test_input_batch import Row

K = 3  # drafts a row at most


def _step_n(rng: np.random.Generator, num_rows: int) -> tuple[list[int], list[int], list[int]]:
    """Step N's logits rows: (sampled, drafted, each row's draft count), drafts sharing
    a random prefix with the drawn tokens so that every accepted count occurs."""
    sampled, drafted, counts = [], [], []
    for _ in range(num_rows):
        k = int(rng.integers(0, K + 1))
        drawn = [int(t) for t in rng.integers(1, 50, k + 1)]
        kept = int(rng.integers(0, k + 1))
        drafts = drawn[:kept] + [d + 50 for d in drawn[kept:k]]  # differs after `kept`
        sampled += drawn
        drafted += drafts + [0]
        counts.append(k)
    return sampled, drafted, counts


def test_device_verdict_is_the_hosts():
    rng = np.random.default_rng(0)
    verdict = jax.jit(device_verdict, static_argnums=4)
    for _ in range(40):
        sampled, drafted, counts = _step_n(rng, int(rng.integers(1, 7)))
        first = np.cumsum([0, *(1 + k for k in counts)])[:-1]
        pad, pad_rows = 32 - len(sampled), 8 - len(counts)  # the buckets: one program
        accepted, rejected, last = verdict(
            jnp.asarray(sampled + [0] * pad, jnp.int32),
            jnp.asarray(drafted + [0] * pad, jnp.int32),
            jnp.asarray([*first, *[0] * pad_rows], jnp.int32),
            jnp.asarray(counts + [0] * pad_rows, jnp.int32),
            K,
        )
        for r, (f, k) in enumerate(zip(first, counts, strict=True)):
            emitted = verify(drafted[f : f + k], np.asarray(sampled[f : f + 1 + k]))
            assert int(accepted[r]) == len(emitted) - 1
            assert int(rejected[r]) == k - len(emitted) + 1
            assert int(last[r]) == emitted[-1]


def _rows(rng, rejected, block_size):
    """Step N + 1's rows at the optimistic lengths and as the host packs them knowing
    the verdict: rows continuing a row of step N (a placeholder token, then drafts) and
    prompt chunks."""
    optimistic, known = [], []
    for _ in range(int(rng.integers(1, 7))):
        start = int(rng.integers(0, 30))
        table = [int(b) for b in rng.permutation(np.arange(1, 60))[:12]]
        if rng.random() < 0.3:  # a prompt chunk: nothing of step N in it
            ids = [int(t) for t in rng.integers(1, 100, int(rng.integers(1, 5)))]
            optimistic.append(Row(ids, start, table))
            known.append(Row(ids, start, table))
            continue
        prev, k = int(rng.integers(0, len(rejected))), int(rng.integers(0, K + 1))
        ids = [PLACEHOLDER_TOKEN] + [int(t) for t in rng.integers(1, 100, k)]
        optimistic.append(Row(ids, start + int(rejected[prev]), table, prev, k))
        known.append(Row(ids, start, table, prev, k))
    return optimistic, known


def test_rolled_back_batch_is_the_one_packed_knowing_the_verdict():
    rng = np.random.default_rng(1)
    block_size, shape = 4, BatchShape(32, 8, 12, num_logits=32)
    roll_back = jax.jit(roll_back_rows, static_argnums=3)
    for _ in range(40):
        rejected = rng.integers(0, K + 1, 8).astype(np.int32)  # [R]: step N's rows
        last = jnp.asarray(rng.integers(1, 100, 8), jnp.int32)  # [R]: their last tokens
        optimistic, known = _rows(rng, rejected, block_size)
        packed = pack_rows(optimistic, shape, block_size)
        inp = unpack(jnp.asarray(packed), shape, last)
        at = int(sum(_packed_sizes(shape)[:7]))  # the prev_index segment
        prev_index = jnp.asarray(packed[at : at + shape.num_tokens])  # [T]
        got = roll_back(inp, prev_index, jnp.asarray(rejected), block_size)
        want = unpack(jnp.asarray(pack_rows(known, shape, block_size)), shape, last)
        for a, b in (
            (got.token_ids, want.token_ids),
            (got.positions, want.positions),
            (got.logits_indices, want.logits_indices),
            (got.attn.slot_mapping, want.attn.slot_mapping),
            (got.attn.query_start_loc, want.attn.query_start_loc),
            (got.attn.seq_lens, want.attn.seq_lens),
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_first_tokens_and_drafts_fed_from_one_buffer():
    rng = np.random.default_rng(2)
    num_rows, shape = 24, BatchShape(32, 8, 12, num_logits=32)  # R: the buffers' length
    for _ in range(30):
        last = rng.integers(1, 100, num_rows).astype(np.int32)  # [R]: step N's rows
        drafts = rng.integers(100, 200, (6, K)).astype(np.int32)  # [S, k]: the proposal
        rows, want, sources = [], [], []
        for _ in range(int(rng.integers(1, 7))):
            table, start = list(range(1, 13)), int(rng.integers(0, 30))
            if rng.random() < 0.3:  # a prompt chunk
                ids = [int(t) for t in rng.integers(1, 100, int(rng.integers(1, 5)))]
                rows.append(Row(ids, start, table))
                want += ids
                continue
            prev, held, n = (int(rng.integers(0, m)) for m in (8, 6, K + 1))
            rows.append(Row([PLACEHOLDER_TOKEN] * (1 + n), start, table, prev, n))
            want += [int(last[prev]), *drafts[held, :n]]
            sources += range(held * K, held * K + n)
        packed = pack_rows(rows, shape, 4)
        feed_draft_tokens(packed, shape, rows, offset=num_rows)
        where = padded_sources(np.array(sources, np.int32), num_rows)  # [R]
        fed = feed_buffer(jnp.asarray(last), jnp.asarray(drafts), jnp.asarray(where))
        inp = unpack(jnp.asarray(packed), shape, fed)
        assert np.asarray(inp.token_ids)[: len(want)].tolist() == want


def _proposal(values: list[tuple[int, int, int, int]]) -> ProposalInputs:
    """Proposal rows from (token, position, output index, feature row) each."""
    tokens, positions, steps, features = (
        jnp.asarray(c, jnp.int32) for c in zip(*values, strict=True)
    )
    zeros = jnp.zeros(len(values), jnp.int32)
    return ProposalInputs(tokens, positions, zeros, zeros, zeros, steps, zeros, features)


def test_proposal_rows_from_the_verdict_are_the_hosts():
    rng = np.random.default_rng(3)
    verdict = jax.jit(device_verdict, static_argnums=4)
    for _ in range(20):
        sampled, drafted, counts = _step_n(rng, 8)  # step N's rows
        first = np.cumsum([0, *(1 + k for k in counts)])[:-1]  # [R]
        pad = 32 - len(sampled)
        accepted, rejected, last = verdict(
            *(jnp.asarray(a + [0] * pad, jnp.int32) for a in (sampled, drafted)),
            jnp.asarray(first, jnp.int32),
            jnp.asarray(counts, jnp.int32),
            K,
        )
        source = rng.permutation(np.r_[np.arange(8), -1, -1]).astype(np.int32)  # [S]
        base = rng.integers(0, 40, 10)  # [S]: where step N's row began (its first token)
        outputs = rng.integers(0, 20, 10)  # [S]: output tokens before step N
        optimistic, known = [], []  # (token, position, step, feature row) per row
        for i, r in enumerate(source):
            if r < 0:  # a prompt chunk's last entry: nothing of step N to correct
                optimistic.append(
                    (int(rng.integers(1, 100)), int(base[i]), 0, int(rng.integers(0, 30)))
                )
                known.append(optimistic[-1])
                continue
            f, k = int(first[r]), counts[r]
            emitted = verify(drafted[f : f + k], np.asarray(sampled[f : f + 1 + k]))
            optimistic.append((PLACEHOLDER_TOKEN, int(base[i]) + k, outputs[i] + k + 1, f + k))
            n = len(emitted)
            known.append((emitted[-1], int(base[i]) + n - 1, outputs[i] + n, f + n - 1))

        got = proposal_from_verdict(
            _proposal(optimistic),
            jnp.asarray(source),
            accepted,
            rejected,
            last,
            jnp.asarray(first, jnp.int32),
        )
        want = _proposal(known)
        for field in ("tokens", "positions", "steps", "feature_rows"):
            np.testing.assert_array_equal(
                np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
            )

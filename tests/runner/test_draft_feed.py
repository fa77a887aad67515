"""Draft tokens fed to the forward on the device (`runner/draft_feed.py`): rows packed
with placeholder drafts, the proposal's drafts placed into `last_sampled` by the
step's `draft_sources`, read back by `unpack` as the tokens a host-packed batch holds."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jvllm.runner.draft_feed import _place, feed_draft_tokens, padded_sources
from jvllm.runner.input_batch import BatchShape, pack_rows, unpack
from tests.runner.test_input_batch import Row


def test_drafts_placed_on_the_device_are_the_rows_tokens():
    rng = np.random.default_rng(0)
    k, num_rows = 3, 32  # drafts a proposal row; the last_sampled buffer's length
    for _ in range(50):
        drafts = rng.integers(1, 100, (6, k)).astype(np.int32)  # [S, k]: one proposal
        rows, want, sources = [], [], []
        for _ in range(int(rng.integers(1, 6))):
            start = int(rng.integers(0, 30))
            if rng.random() < 0.5:  # a prompt chunk, or a decode row without drafts
                ids = [int(t) for t in rng.integers(1, 100, int(rng.integers(1, 5)))]
                rows.append(Row(ids, start, [1, 2, 3, 4, 5]))
                want += ids
                continue
            held, n = int(rng.integers(0, 6)), int(rng.integers(1, k + 1))
            token = int(rng.integers(1, 100))
            rows.append(Row([token] + [0] * n, start, [1, 2, 3, 4, 5], num_spec_tokens=n))
            want += [token, *drafts[held, :n]]
            sources += range(held * k, held * k + n)
        shape = BatchShape(32, 8, 5, num_logits=32)
        packed = pack_rows(rows, shape, 8)
        feed_draft_tokens(packed, shape, rows)
        where = padded_sources(np.array(sources, np.int32), num_rows)  # [R]
        placed = _place(jnp.asarray(drafts), jnp.asarray(where))
        inp = unpack(packed, shape, placed)
        assert list(np.asarray(inp.token_ids)[: len(want)]) == want
        # Everything else is what the host packed.
        plain = unpack(pack_rows(rows, shape, 8), shape, np.zeros(num_rows, np.int32))
        for field in ("positions", "logits_indices"):
            assert (np.asarray(getattr(inp, field)) == np.asarray(getattr(plain, field))).all()
        assert (np.asarray(inp.attn.slot_mapping) == np.asarray(plain.attn.slot_mapping)).all()

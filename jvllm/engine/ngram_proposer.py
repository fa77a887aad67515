"""N-gram prompt lookup: draft tokens for speculative decoding from a request's own text.

Owns one rule: find the longest suffix of the sequence (prompt + output), between
`prompt_lookup_min` and `prompt_lookup_max` tokens, that occurred earlier in it, and
propose the tokens that followed its latest earlier occurrence. Answers that quote or
edit their prompt hit often. Host only, numpy: one pass over the positions that hold
the sequence's last token, then a few over the surviving candidates.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        assert 1 <= lookup_min <= lookup_max and num_speculative_tokens >= 1
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Up to `min(k, max_tokens)` draft tokens to follow `token_ids` (int array);
        [] when no suffix of at least lookup_min tokens repeats."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        n = len(token_ids)
        if k < 1 or n <= self.lookup_min:
            return []
        # Candidates: ends of earlier n-grams, i.e. positions i < n - 1 holding the last
        # token; a candidate survives length m while token_ids[i - m + 1 : i + 1] matches.
        ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
        best_len, best_end = 0, -1
        length = 1
        while ends.size:
            if length >= self.lookup_min:
                best_len, best_end = length, int(ends[-1])  # the latest occurrence
            if length == self.lookup_max:
                break
            ends = ends[ends >= length]  # room for one more token before the match
            ends = ends[token_ids[ends - length] == token_ids[n - 1 - length]]
            length += 1
        if best_len < self.lookup_min:
            return []
        return token_ids[best_end + 1 : best_end + 1 + k].tolist()

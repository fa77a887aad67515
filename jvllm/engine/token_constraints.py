"""Per-sequence token constraints the host works out: bad words, allowed-token masks.

Owns tokenizing `SamplingParams.bad_words` (vLLM's rule: each word as written, and with
one leading space when that tokenizes differently), which tokens a sequence's bad words
ban at its next position, and packing `allowed_token_ids` into the sampler's bitmask
layout (bit j of int32 word w is token 32 w + j). The sampler applies both on device;
grammars are `structured_output.py`'s. Host only, numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


def pack_allowed(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """`i32[bitmask_width(V)]` with exactly the bits of `token_ids` set."""
    bits = np.zeros(bitmask_width(vocab_size) * 32, bool)
    bits[np.asarray(token_ids, np.int64)] = True
    # Little-endian bit order within each byte, bytes little-endian within each word.
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


class BadWords:
    """The token sequences of one request's bad words; `banned(output)` is what may not
    come next. A one-token word is always banned; a longer word's last token is banned
    where the output so far ends with the word's other tokens (outputs only, as vLLM)."""

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        self.always = sorted({seq[0] for seq in sequences if len(seq) == 1})
        self.sequences = [tuple(seq) for seq in sequences if len(seq) > 1]

    @classmethod
    def from_words(cls, tokenizer: Any, words: Sequence[str]) -> BadWords:
        sequences: list[list[int]] = []
        for word in words:
            plain = list(tokenizer.encode(word, add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            sequences += [ids for ids in (plain, spaced) if ids and ids not in sequences]
        return cls(sequences)

    @property
    def needs_history(self) -> bool:
        """Whether the ban depends on the latest output tokens (a multi-token word)."""
        return bool(self.sequences)

    def banned(self, output_token_ids: Sequence[int]) -> list[int]:
        out = list(self.always)
        num_out = len(output_token_ids)
        for seq in self.sequences:
            prefix = len(seq) - 1
            if num_out >= prefix and tuple(output_token_ids[num_out - prefix :]) == seq[:-1]:
                out.append(seq[-1])
        return out

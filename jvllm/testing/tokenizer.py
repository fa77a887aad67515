"""A small byte-level BPE tokenizer trained on the fly for tests, saved with a chat
template; random words, so it needs no corpus package."""

from __future__ import annotations

import random
from pathlib import Path

from jvllm.demo.tokenizer import train_tokenizer

_WORDS = tuple(
    (
        "the quick brown fox jumps over a lazy dog while paged attention keeps every "
        "block of the cache busy and continuous batching schedules new requests at each "
        "step so that prefill and decode share one token budget hello world how are you "
        "today tell me a story about mountains rivers cities numbers 0 1 2 3 4 5 6 7 8 9 "
        "JAX XLA GPU kernel Triton tensor parallel mesh shard server client request "
        "response stream token model weights layer head norm rotary embedding vocabulary "
    ).split()
)


def _corpus(seed: int = 0, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        out.append(" ".join(words) + rng.choice([".", "!", "?", ",", ""]))
    # Every printable ASCII character appears, so any ASCII text round-trips.
    out.append("".join(chr(c) for c in range(32, 127)))
    return out


def make_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Path:
    """Trains and saves a tokenizer (BOS-prefixed, EOS `</s>`, chat template) to out_dir:
    the demo model's recipe (`jvllm.demo.tokenizer`) on a random-word corpus."""
    out = Path(out_dir)
    train_tokenizer(out, _corpus(), vocab_size)
    return out

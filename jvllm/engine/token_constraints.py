"""Per-sequence token constraints the host works out: bad words, allowed-token masks,
grammar matchers, and the step inputs they make.

Owns `Constraints` (what limits one sequence's next token), building them for a request
(`constraints_for`: bad words tokenized by vLLM's rule, each word as written and with one
leading space when that tokenizes differently; `allowed_token_ids` packed into the
sampler's bitmask layout, bit j of int32 word w being token 32 w + j; a grammar matcher
per sibling), which tokens bad words ban at a sequence's next position, and a step's
sampling rows with its token bitmask (`step_sampling`). The sampler applies bans and
masks on device; grammars themselves are `structured_output.py`'s. Host only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jvllm.engine.step_io import SamplingRow
from jvllm.engine.structured_output import GrammarCompiler, GrammarMatcher, fill_bitmasks
from jvllm.sampling_params import SamplingParams

# Rows that do not sample this step (a prompt chunk short of its end) still fill a row.
IDLE_ROW = SamplingRow(SamplingParams(temperature=0.0), 0, 0, (), ())


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


@dataclass
class Constraints:
    """What limits a sequence's next token beyond its SamplingParams' scalars."""

    bad_words: BadWords | None = None
    allowed_mask: np.ndarray | None = None  # i32[W], pack_allowed
    grammar: GrammarMatcher | None = None

    @property
    def needs_latest_token(self) -> bool:
        """The next row's bans or mask depend on the token sampled last."""
        return self.grammar is not None or (
            self.bad_words is not None and self.bad_words.needs_history
        )

    @property
    def masks(self) -> bool:
        return self.grammar is not None or self.allowed_mask is not None


def constraints_for(
    params: SamplingParams, tokenizer: Any, vocab_size: int, compiler: GrammarCompiler
) -> Callable[[int], Constraints | None]:
    """Each sibling's Constraints (its own grammar matcher; the rest shared), by index."""
    bad_words = allowed = compiled = None
    if params.bad_words:
        bad_words = BadWords.from_words(tokenizer, params.bad_words)
    if params.allowed_token_ids:
        allowed = pack_allowed(params.allowed_token_ids, vocab_size)
    if params.structured_outputs is not None:
        # Compiled already when the server or LLM asked first; waits otherwise.
        compiled = compiler.compile(params.structured_outputs).result()
    if bad_words is None and allowed is None and compiled is None:
        return lambda index: None
    spec = params.structured_outputs
    starts_after = (spec.reasoning_end_token_ids or ()) if spec is not None else ()
    return lambda index: Constraints(
        bad_words, allowed, compiled.matcher(starts_after) if compiled is not None else None
    )


def step_sampling(
    states: Sequence[Any],
    rows: Sequence[Any],
    eos_token_ids: frozenset[int],
    any_masked: bool,
    compiler: GrammarCompiler,
    vocab_size: int,
) -> tuple[list[SamplingRow], np.ndarray | None]:
    """The step's sampling rows (each state's `sampling_row`; 1 + k consecutive ones for
    a row verifying k draft tokens), and its token bitmask `i32[sampling rows, W]` where
    some row's constraints mask tokens (`any_masked` says whether any live one does)."""
    sampling_rows: list[SamplingRow] = []
    masked: list[tuple[int, Constraints]] = []
    for state, row in zip(states, rows, strict=True):
        if not row.samples or state.finished:  # finished: dropped at commit, unseen
            sampling_rows += [IDLE_ROW] * (1 + row.num_spec_tokens)
            continue
        if any_masked and state.constraints.masks:
            masked += [
                (len(sampling_rows) + j, state.constraints) for j in range(1 + row.num_spec_tokens)
            ]
        if not row.num_spec_tokens:
            sampling_rows.append(state.sampling_row(eos_token_ids, row))
            continue
        # Position j scores drafts[j] (the bonus token after the last), its history
        # holding the drafts before it.
        drafts = list(row.token_ids[-row.num_spec_tokens :])
        q_row = state.request.spec_q_row
        for j in range(1 + row.num_spec_tokens):
            draft = (drafts[j], q_row + j if q_row >= 0 else -1) if j < len(drafts) else None
            sampling_rows.append(state.sampling_row(eos_token_ids, row, drafts[:j], draft))
    if not masked:
        return sampling_rows, None
    bitmask = np.full((len(sampling_rows), bitmask_width(vocab_size)), -1, np.int32)
    grammars = [(c.grammar, i) for i, c in masked if c.grammar is not None]
    if grammars:
        fill_bitmasks(compiler.executor, grammars, bitmask)
    for i, c in masked:
        if c.allowed_mask is not None:
            bitmask[i] &= c.allowed_mask
    return sampling_rows, bitmask

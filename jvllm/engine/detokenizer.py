"""Incremental detokenization and stop-string detection for one sequence.

Owns turning a growing list of output token ids into text deltas without
re-decoding the whole output each step, holding back incomplete UTF-8 (a
trailing U+FFFD) until the next token completes it. A few prompt tokens seed the
window so that tokenizers which mark word starts (SentencePiece's leading space)
decode the first output token with its space. Tokens whose text is a standalone
piece (`token_pieces.py`) skip the tokenizers library's `DecodeStream` while its state
would just advance past them (most tokens of most outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers.decoders import DecodeStream

from jvllm.engine.token_pieces import token_pieces

# Prompt tokens kept as decoding context.
_CONTEXT_TOKENS = 5


def _stream_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind a fast tokenizer that cleans up no spaces (whose decode
    is the backend's), or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", None) is False:
        return backend
    return None


def build_token_pieces(tokenizer: Any) -> None:
    """Builds the tokenizer's standalone-piece table now (at start-up) rather than when
    its first request arrives, which would stall every running sequence that step."""
    backend = _stream_backend(tokenizer)
    if backend is not None:
        token_pieces(tokenizer, backend)


def decoder(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """`(ids, skip_special_tokens) -> text`, as `tokenizer.decode` gives it. For a fast
    tokenizer that cleans up no spaces, Transformers' decode is its Rust backend's plus
    Python argument handling that costs several times the decode itself (two calls per
    token and sequence each step), so the backend is called directly."""
    backend = _stream_backend(tokenizer)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def stop_token_text_skipped(params: Any, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """The tokens whose text is left out when they end an output (vLLM's detokenizer
    skips a stop-terminated output's last token): its stop_token_ids and, unless
    ignore_eos, the EOS ids; none with include_stop_str_in_output."""
    if params.include_stop_str_in_output:
        return frozenset()
    eos = frozenset() if params.ignore_eos else eos_token_ids
    return frozenset(params.stop_token_ids) | eos


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str],
        include_stop_str_in_output: bool,
        min_tokens: int = 0,
    ) -> None:
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        # As vLLM: no stop string ends the output before min_tokens tokens (the first
        # min_tokens appends decode without checking).
        self._unchecked = min_tokens if stop else 0
        self.output_text = ""
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._backend = _stream_backend(tokenizer)
        if self._backend is not None:
            # The tokenizers library's own incremental decoder: one call per token (the
            # same prefix/read-offset rule as below, in Rust); the context's text is
            # not output.
            self._skip_special = skip_special_tokens
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            seeded = self._stream.step(self._backend, context) if context else None
            table = token_pieces(tokenizer, self._backend)
            self._pieces = table.pieces if table is not None else []
            self._num_pieces = len(self._pieces)
            # The stream's state is its last emission, whose text is non-empty and
            # ends in a whole character: a standalone token then adds its piece.
            self._clean = seeded is not None and table is not None
            self._emitted = seeded is not None or not context  # no tokens held back
            self._behind: int | None = None  # a standalone token the stream has not seen
            return
        self._decode_ids = decoder(tokenizer)
        self._skip_special = skip_special_tokens
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self._skip_special)

    def append(self, token_id: int) -> str | None:
        """Adds one token; returns the stop string it completed, if any."""
        unchecked = self._unchecked
        if unchecked:
            self._unchecked = unchecked - 1
        if self._backend is None:
            return self._append_by_offsets(token_id, unchecked)
        piece = self._pieces[token_id] if self._clean and 0 <= token_id < self._num_pieces else ""
        if piece:
            # The stream would emit the piece and hold just this token: it catches up
            # from there when a token needs it (`_stream_step`).
            self._behind = token_id
            delta: str | None = piece
        else:
            delta = self._stream_step(token_id)
            if delta is None:
                return None  # nothing printable yet (or a partial UTF-8 sequence)
        before = self.output_text
        self.output_text = before + delta
        return self._check_stop(len(before)) if self._stop and not unchecked else None

    def _stream_step(self, token_id: int) -> str | None:
        """`DecodeStream.step` of the token, after the standalone tokens it skipped."""
        if self._behind is not None:
            # The state the stream would have after those tokens: holding the last of
            # them, its text emitted.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            self._stream.step(self._backend, [self._behind])
            self._behind = None
        delta = self._stream.step(self._backend, token_id)
        emitted_before, self._emitted = self._emitted, delta is not None
        # Clean again once a standalone token is emitted with nothing held before it.
        self._clean = (
            delta is not None
            and emitted_before
            and 0 <= token_id < self._num_pieces
            and bool(self._pieces[token_id])
        )
        return delta

    def _append_by_offsets(self, token_id: int, unchecked: int) -> str | None:
        """`append` for a tokenizer without a Rust backend that decodes alone."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # nothing printable yet (or a partial UTF-8 sequence)
        before = len(self.output_text)
        self.output_text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return None if unchecked else self._check_stop(before)

    def _check_stop(self, before: int) -> str | None:
        for stop in self._stop:
            # A stop string may straddle the old text and the new delta.
            idx = self.output_text.find(stop, max(0, before - len(stop) + 1))
            if idx >= 0:
                end = idx + len(stop) if self._include_stop else idx
                self.output_text = self.output_text[:end]
                return stop
        return None


class TokenIdsOnly:
    """In place of `IncrementalDetokenizer` where the front end detokenizes (an engine
    core's, `engine/core/detokenizing.py`): no text, and so no stop string."""

    output_text = ""

    def append(self, token_id: int) -> None:
        return None

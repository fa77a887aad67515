"""Structured outputs: grammars compiled by llguidance, one matcher per sequence.

Owns turning `StructuredOutputsParams` into an llguidance grammar (JSON schema, any
JSON object, regex, choice, Lark or GBNF grammar), compiling it against the model's
tokenizer on a thread pool (`GrammarCompiler.compile`, cached per spec, so the server
awaits it on the event loop and the engine thread finds it compiled), the matcher each
constrained sequence advances with its committed tokens, and filling the packed
allowed-token bitmask of many matchers in parallel. The sampler applies the bitmask on
device (`jvllm.layers.sampler.apply_token_bitmask`).

Thread safety: `GrammarCompiler` may be called from any thread; a `GrammarMatcher`
belongs to the engine thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import json
import logging
import multiprocessing
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from jvllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger("jvllm.structured_output")

# Distinct specs whose compiled grammar is kept (least recently used dropped first).
CACHE_SIZE = 256
# Specs larger than this (characters) are turned into grammars in a child process: the
# library's schema conversion holds the GIL (~0.1 s for a 1 MB schema), which would
# stall the engine thread; matcher construction releases it and stays on a thread.
LARGE_SPEC_CHARS = 16384
# JSON output without free whitespace: a model cannot pad it out forever (vLLM's
# `disable_any_whitespace` default for its guidance backend is the opposite).
_JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_source(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for `spec`; ValueError names what cannot be read."""
    from llguidance import LLMatcher, grammar_from

    try:
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if spec.json_object:
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if spec.regex is not None:
            return LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return grammar_from("choice", json.dumps(spec.choice))
        assert spec.grammar is not None
        return grammar_from("grammar", spec.grammar)
    except Exception as e:  # the library's parse errors are not all ValueErrors
        raise ValueError(f"structured_outputs.{spec.kind} is invalid: {e}") from None


class CompiledGrammar:
    """A validated grammar: a template matcher that every sequence's matcher copies."""

    def __init__(self, template: Any) -> None:
        self._template = template

    def matcher(self, starts_after: tuple[int, ...] = ()) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), starts_after)


class GrammarMatcher:
    """One sequence's position in its grammar. With `starts_after` (a reasoning end
    marker's ids), the grammar holds only from the token after that marker: until then
    every token is allowed and the matcher only watches for it."""

    def __init__(self, matcher: Any, starts_after: tuple[int, ...] = ()) -> None:
        self._m = matcher
        self._waiting_for = starts_after
        self._recent: tuple[int, ...] = ()  # the last len(starts_after) tokens

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token."""
        return not self._waiting_for

    def accept(self, token: int) -> None:
        """Advances past a sampled token; a token the grammar refuses (sampled where
        the mask left nothing allowed) ends in an error state, which `is_stopped` reports."""
        if self._waiting_for:
            self._recent = (*self._recent, token)[-len(self._waiting_for) :]
            if self._recent == self._waiting_for:
                self._waiting_for = ()
            return
        if not self._m.consume_token(token):
            logger.warning("grammar refused token %d: %s", token, self._m.get_error())

    @property
    def is_stopped(self) -> bool:
        """Nothing but EOS may follow (the grammar is complete), or it failed."""
        return self.active and bool(self._m.is_stopped())


def fill_bitmasks(
    executor: Any, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray
) -> None:
    """Each (matcher, row) writes bitmask[row] (`i32[S, W]`), spread over threads; rows
    of matchers not yet active are left as they are."""
    assert bitmask.dtype == np.int32 and bitmask.flags.c_contiguous
    pairs = [(m._m, i) for m, i in rows if m.active]
    if pairs:
        row_bytes = bitmask.shape[1] * 4
        executor.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, row_bytes, len(bitmask))


class GrammarCompiler:
    """Compiles specs against one tokenizer, `max_workers` at a time, caching the results."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], max_workers: int = 2
    ) -> None:
        # A private copy: Rust tokenizers are not safe to share across threads.
        self._hf_tokenizer = copy.deepcopy(tokenizer)
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, "jvllm-grammar")
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # held ~1 s while the first compile builds it
        self._cache: collections.OrderedDict[str, concurrent.futures.Future[CompiledGrammar]]
        self._cache = collections.OrderedDict()
        self._tokenizer: Any = None
        self._executor: Any = None
        self._process_pool: concurrent.futures.ProcessPoolExecutor | None = None

    @property
    def executor(self) -> Any:
        """llguidance's thread pool for filling many sequences' masks at once."""
        with self._lock:
            if self._executor is None:
                from llguidance import LLExecutor

                self._executor = LLExecutor()
            return self._executor

    def compile(self, spec: StructuredOutputsParams) -> concurrent.futures.Future[CompiledGrammar]:
        """The compiled grammar of `spec`, now or later; its exception, a ValueError,
        names the problem."""
        key = spec.cache_key
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._compile, spec)
                self._cache[key] = future
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return future

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        from llguidance import LLMatcher

        if len(spec.cache_key) > LARGE_SPEC_CHARS:
            source = self._processes().submit(grammar_source, spec).result()
        else:
            source = grammar_source(spec)
        matcher = LLMatcher(self._llg_tokenizer(), source, log_level=0)
        if matcher.is_error():
            error = matcher.get_error()
            raise ValueError(f"structured_outputs.{spec.kind} cannot be compiled: {error}")
        return CompiledGrammar(matcher)

    def _processes(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._process_pool is None:
                # spawn: forking a process that runs XLA's threads is not safe.
                context = multiprocessing.get_context("spawn")
                self._process_pool = concurrent.futures.ProcessPoolExecutor(1, context)
            return self._process_pool

    def _llg_tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos
                    )
                except Exception as e:
                    raise ValueError(
                        f"structured outputs are not available with this tokenizer: {e}"
                    ) from None
            return self._tokenizer

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._process_pool is not None:
            self._process_pool.shutdown(wait=False, cancel_futures=True)

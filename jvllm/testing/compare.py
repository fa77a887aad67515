"""Comparing two engines' greedy outputs, as vLLM's model tests do: `check_outputs_equal`
(token for token) and `check_logprobs_close` (vLLM's near-tie rule).

Owns the rule, the per-prompt verdicts (`Divergence`) and the failure message; the
runners that produce the outputs live in `hf_runner.py` and `jvllm_runner.py`, the
pytest wiring in `pytest_plugin.py`, the command line in `compare_cli.py`. Imports
neither torch nor jax.

The rule (vLLM's `check_logprobs_close`): greedy outputs are compared token by token;
at the first position where they differ, the divergence is accepted as a near-tie when
each side's token is among the other side's top-k logprobs there, and the comparison of
that prompt stops (the two continuations are conditioned on different tokens from then
on). Otherwise it is a real divergence and the check fails.

Outputs are tuples as vLLM's runners return them: `(token ids, text)` or
`(token ids, text, logprobs)`, where logprobs hold one `{token id: logprob}` dict per
output token (a float, or an object with `.logprob` such as `jvllm.outputs.Logprob`).
Tuples from this package's runners are `Sample`s, which also carry the tokenizer (for
each token's text) and how many leading ids are the prompt's.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Short, varied prompts; vLLM's example prompts are longer than a CPU run needs.
EXAMPLE_PROMPTS = (
    "The quick brown fox jumps over the lazy dog while",
    "Paged attention keeps every block of the cache busy because",
    "Tell me a story about mountains and rivers.",
    "hello world how are you today",
    "A tensor parallel mesh shards each layer of the model over",
    "Continuous batching schedules new requests at each step so that",
    "The server streams every token of the response to the client",
    "0 1 2 3 4 5 6 7 8 9",
)


class Sample(tuple):
    """One prompt's result: a plain tuple to unpack and compare as vLLM's tests do, plus
    what a failure message needs (the tokenizer, to show each token's text, and how many
    leading token ids are the prompt's)."""

    tokenizer: Any
    num_prompt_tokens: int

    def __new__(cls, fields: Sequence[Any], tokenizer: Any = None, num_prompt_tokens: int = 0):
        sample = super().__new__(cls, fields)
        sample.tokenizer = tokenizer
        sample.num_prompt_tokens = num_prompt_tokens
        return sample


@dataclass(frozen=True)
class Divergence:
    """Where two outputs of one prompt first differ, and what each side thought there."""

    prompt_index: int
    position: int  # among the compared output tokens
    names: tuple[str, str]
    tokens: tuple[int | None, int | None]  # each side's token there; None: it had ended
    token_texts: tuple[str | None, str | None]
    texts: tuple[str, str]  # each side's whole output text
    # Each side's top-k {token id: logprob} at that position; None where not recorded.
    logprobs: tuple[dict[int, float] | None, dict[int, float] | None]

    @property
    def near_tie(self) -> bool:
        """vLLM's rule: each side's token is among the other side's top-k."""
        (lp0, lp1), (t0, t1) = self.logprobs, self.tokens
        return lp0 is not None and lp1 is not None and t0 in lp1 and t1 in lp0

    def message(self) -> str:
        n0, n1 = self.names
        width = max(len(n0), len(n1), 5)
        lines = [
            f"prompt {self.prompt_index}: {n0} and {n1} differ at output token "
            f"{self.position} (the {self.position} before it are equal)",
            f"  {'':{width}}  {'token':>7}  {'text':16}  {'logprob in ' + n0:>22}  "
            f"{'logprob in ' + n1:>22}",
        ]
        for name, token, text in zip(self.names, self.tokens, self.token_texts, strict=True):
            shown = "(ended)" if token is None else repr(text) if text is not None else "?"
            lines.append(
                f"  {name:{width}}  {'-' if token is None else token:>7}  {shown:16}  "
                f"{_logprob_of(self.logprobs[0], token):>22}  "
                f"{_logprob_of(self.logprobs[1], token):>22}"
            )
        lines.append(f"  verdict: {self._verdict()}")
        lines += [f"  {n0} text: {self.texts[0]!r}", f"  {n1} text: {self.texts[1]!r}"]
        return "\n".join(lines)

    def _verdict(self) -> str:
        lp0, lp1 = self.logprobs
        if self.tokens == (None, None):
            return "equal token ids, different texts (detokenization)"
        if lp0 is None or lp1 is None:
            return (
                "logprobs not recorded (generate_greedy); generate_greedy_logprobs and "
                "check_logprobs_close tell a near-tie from a bug"
            )
        if self.near_tie:
            return "a near-tie: each token is in the other side's top-k (accepted)"
        (n0, n1), (t0, t1) = self.names, self.tokens
        missing = [f"{n1}'s token is not in {n0}'s top-{len(lp0)}"] if t1 not in lp0 else []
        missing += [f"{n0}'s token is not in {n1}'s top-{len(lp1)}"] if t0 not in lp1 else []
        return "a real divergence: " + "; ".join(missing)


def _logprob_of(logprobs: dict[int, float] | None, token: int | None) -> str:
    if logprobs is None or token is None:
        return "-"
    if token in logprobs:
        return f"{logprobs[token]:.4f}"
    return f"< {min(logprobs.values()):.4f} (not top-{len(logprobs)})"


def _as_floats(position: dict[int, Any] | None) -> dict[int, float] | None:
    if position is None:
        return None
    return {int(t): float(getattr(v, "logprob", v)) for t, v in position.items()}


def _token_text(samples: tuple[Any, Any], token: int | None, logprobs: Sequence[Any]) -> str | None:
    """A token's text: by either side's tokenizer, else a Logprob's decoded_token."""
    if token is None:
        return None
    for sample in samples:
        tokenizer = getattr(sample, "tokenizer", None)
        if tokenizer is not None:
            return tokenizer.decode([token])
    for position in logprobs:
        decoded = getattr((position or {}).get(token), "decoded_token", None)
        if decoded is not None:
            return decoded
    return None


def first_difference(ids_0: Sequence[int], ids_1: Sequence[int]) -> int | None:
    """The first index where the two differ (a length difference counts); None if equal."""
    for i, (a, b) in enumerate(zip(ids_0, ids_1, strict=False)):
        if a != b:
            return i
    return None if len(ids_0) == len(ids_1) else min(len(ids_0), len(ids_1))


def _output_ids(sample: Any) -> list[int]:
    """A sample's output token ids (a runner's ids may start with the prompt's)."""
    return list(sample[0])[getattr(sample, "num_prompt_tokens", 0) :]


def _output_logprobs(sample: Any) -> list[Any] | None:
    return list(sample[2]) if len(sample) > 2 and sample[2] is not None else None


def _divergence(
    index: int, samples: tuple[Any, Any], names: tuple[str, str], at: int, skip: int = 0
) -> Divergence:
    """The Divergence of one prompt's two samples at output position `at` (after skipping
    `skip` leading tokens of the first)."""
    ids = (_output_ids(samples[0])[skip:], _output_ids(samples[1]))
    lp0, lp1 = _output_logprobs(samples[0]), _output_logprobs(samples[1])
    lps = (None if lp0 is None else lp0[skip:], lp1)
    tokens = (ids[0][at] if at < len(ids[0]) else None, ids[1][at] if at < len(ids[1]) else None)
    raw = [lp[at] if lp is not None and at < len(lp) else None for lp in lps]
    texts = (_token_text(samples, tokens[0], raw), _token_text(samples, tokens[1], raw))
    return Divergence(
        prompt_index=index,
        position=at,
        names=names,
        tokens=tokens,
        token_texts=texts,
        texts=(samples[0][1], samples[1][1]),
        logprobs=(_as_floats(raw[0]), _as_floats(raw[1])),
    )


def _shown(text: str) -> str:
    """A text without a trailing incomplete UTF-8 sequence (decoded as U+FFFD), which an
    incremental detokenizer (vLLM's, jvllm's) holds back and a one-shot decode shows."""
    return text.rstrip("\ufffd")


def compare_outputs(
    outputs_0_lst: Sequence[Any], outputs_1_lst: Sequence[Any], name_0: str, name_1: str
) -> list[Divergence]:
    """Every prompt whose token ids differ, or, with equal ids, whose texts differ (up to
    a trailing incomplete character)."""
    if len(outputs_0_lst) != len(outputs_1_lst):
        raise ValueError(
            f"{len(outputs_0_lst)} outputs of {name_0}, {len(outputs_1_lst)} of {name_1}"
        )
    found = []
    for index, pair in enumerate(zip(outputs_0_lst, outputs_1_lst, strict=True)):
        ids = [_output_ids(s) for s in pair]
        at = first_difference(*ids)
        if at is None and _shown(pair[0][1]) != _shown(pair[1][1]):
            at = len(ids[0])  # equal tokens, different text: a detokenization difference
        if at is not None:
            found.append(_divergence(index, pair, (name_0, name_1), at))
    return found


def compare_logprobs(
    outputs_0_lst: Sequence[Any],
    outputs_1_lst: Sequence[Any],
    name_0: str,
    name_1: str,
    num_outputs_0_skip_tokens: int = 0,
) -> list[Divergence]:
    """The first differing token of every prompt whose outputs differ over their common
    length (near-ties included: see `Divergence.near_tie`)."""
    if len(outputs_0_lst) != len(outputs_1_lst):
        raise ValueError(
            f"{len(outputs_0_lst)} outputs of {name_0}, {len(outputs_1_lst)} of {name_1}"
        )
    if num_outputs_0_skip_tokens < 0:
        raise ValueError(f"num_outputs_0_skip_tokens must be >= 0, got {num_outputs_0_skip_tokens}")
    found = []
    for index, pair in enumerate(zip(outputs_0_lst, outputs_1_lst, strict=True)):
        if len(pair[0]) != 3 or len(pair[1]) != 3:
            raise ValueError(
                f"prompt {index}: outputs must be (token ids, text, logprobs) tuples, got "
                f"{len(pair[0])} and {len(pair[1])} fields"
            )
        ids_0, ids_1 = _output_ids(pair[0])[num_outputs_0_skip_tokens:], _output_ids(pair[1])
        n = min(len(ids_0), len(ids_1))  # vLLM's rule compares the common length
        at = first_difference(ids_0[:n], ids_1[:n])
        if at is not None:
            names = (name_0, name_1)
            found.append(_divergence(index, pair, names, at, num_outputs_0_skip_tokens))
    return found


def check_outputs_equal(
    *, outputs_0_lst: Sequence[Any], outputs_1_lst: Sequence[Any], name_0: str, name_1: str
) -> None:
    """Asserts both lists of (token ids, text) are equal, prompt by prompt; the message
    names every differing prompt, its first differing token, both tokens and texts."""
    found = compare_outputs(outputs_0_lst, outputs_1_lst, name_0, name_1)
    messages = _prompt_mismatches(outputs_0_lst, outputs_1_lst, name_0, name_1)
    messages += [d.message() for d in found]
    if messages:
        raise AssertionError("\n".join(messages))


def _prompt_mismatches(
    outputs_0_lst: Sequence[Any], outputs_1_lst: Sequence[Any], name_0: str, name_1: str
) -> list[str]:
    """Prompts the two sides tokenized differently (their ids lead each output's ids)."""
    messages = []
    for index, (s0, s1) in enumerate(zip(outputs_0_lst, outputs_1_lst, strict=True)):
        p0 = list(s0[0])[: getattr(s0, "num_prompt_tokens", 0)]
        p1 = list(s1[0])[: getattr(s1, "num_prompt_tokens", 0)]
        if p0 != p1 and p0 and p1:
            messages.append(f"prompt {index}: tokenized differently: {name_0} {p0}, {name_1} {p1}")
    return messages


def check_logprobs_close(
    *,
    outputs_0_lst: Sequence[Any],
    outputs_1_lst: Sequence[Any],
    name_0: str,
    name_1: str,
    num_outputs_0_skip_tokens: int = 0,
    warn_on_mismatch: bool = True,
) -> None:
    """vLLM's check: greedy outputs agree token for token up to a near-tie (each side's
    token among the other's top-k logprobs), after which a prompt is not compared
    further. Near-ties warn (unless `warn_on_mismatch` is off); anything else fails with
    the prompt, the position, both tokens and texts, and both sides' logprobs of both."""
    found = compare_logprobs(
        outputs_0_lst, outputs_1_lst, name_0, name_1, num_outputs_0_skip_tokens
    )
    failed = [d for d in found if not d.near_tie]
    if warn_on_mismatch:
        for d in found:
            if d.near_tie:
                warnings.warn(d.message(), stacklevel=2)
    if failed:
        raise AssertionError("\n".join(d.message() for d in failed))
